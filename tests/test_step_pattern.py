"""Steps from a repeating pattern of collectives (issue 15): a rank with no step boundary gets
its iterations numbered offline (analysis.pattern), seen by per_step, the findings, the report
(pandas and DuckDB engines) and --compare; what has steps, or no clear pattern, is left alone."""

import io
import json
import warnings

import numpy as np
import pandas as pd

import commpatch
from commpatch import analysis, cli
from commpatch.analysis import engine, findings
from commpatch.analysis.pattern import Found, StepPatternWarning, with_pattern_steps
from commpatch.data.ops import describe_op
from commpatch.data.schema import DERIVED_FROM_OP, SCHEMA
from commpatch.testing import make_log

AR, BC, AG, RS = "all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"
# one iteration: 7 calls; its first call (all_reduce 4096) occurs twice, so the iterations are found
# from the first call that occurs once (all_reduce 256), less its offset in the block
BLOCK = [(AR, 4096), (AR, 256), (AG, 8192), (AR, 4096), (RS, 2048), (AR, 64), ("barrier", 0)]
PREFIX = [(BC, 4096), (BC, 256), (BC, 64)]


def rank_log(rank, calls, starts=(), world=2, seed=0):
    """A rank's log of ``calls`` (op, bytes) with no step boundary: 1 ms of compute before the
    calls at ``starts`` (where iterations begin), 10 us before the others, jittered durations."""
    rng = np.random.default_rng(seed + rank)
    n = len(calls)
    dur = rng.uniform(20, 80, n)
    idle = np.where(np.isin(np.arange(n), list(starts)), 1000.0, 10.0) + rng.uniform(0, 5, n)
    start_us = np.cumsum(idle) + np.r_[0, np.cumsum(dur)[:-1]]
    ops = [op for op, _ in calls]
    cols = {
        "seq": np.arange(n),
        "op": ops,
        "rank": rank,
        "world_size": world,
        "group": "0",
        "group_size": world,
        "group_ranks": " ".join(map(str, range(world))),
        "group_seq": np.arange(n),
        "backend": "gloo",
        "device": "cpu",
        "dtype": "float32",
        "bytes": [b for _, b in calls],
        "numel": [b // 4 for _, b in calls],
        "peer": -1,
        "async_op": False,
        "start_ns": (1e15 + start_us * 1e3).astype(np.int64),
        "host_us": dur,
        "duration_us": dur,
        "own_us": dur,
        "timing": "host",
        "status": "ok",
        "step": 0,
        "step_source": "none",
        "pid": 100 + rank,
        "bucket": -1,
        "tensors": 1,
    }
    for i, name in enumerate(DERIVED_FROM_OP):
        cols[name] = [describe_op(op)[i] for op in ops]
    defaults = {"category": "", "int64": 0, "float64": np.nan, "bool": False}
    df = pd.DataFrame({c.name: cols.get(c.name, defaults[c.dtype]) for c in SCHEMA})
    for c in SCHEMA:
        df[c.name] = df[c.name].astype(c.dtype)
    return analysis.add_bandwidth(df)


def looped(prefix, block, iterations, extra_every=0, extra=(AR, 4)):
    """(calls, iteration of each call: 0 for the prefix, then 1, 2, ...; where iterations start)."""
    calls, truth, starts = list(prefix), [0] * len(prefix), []
    for i in range(1, iterations + 1):
        starts.append(len(calls))
        calls += block
        truth += [i] * len(block)
        if extra_every and i % extra_every == 0:
            calls.append(extra)
            truth.append(i)
    return calls, np.array(truth), starts


def pattern_log(iterations=40):
    """Two ranks running the same 7-call pattern; rank 1 has one more set-up call."""
    frames, truths = [], []
    for rank, prefix in ((0, PREFIX), (1, PREFIX + [(AR, 8)])):
        calls, truth, starts = looped(prefix, BLOCK, iterations)
        frames.append(rank_log(rank, calls, starts))
        truths.append(truth)
    return pd.concat(frames, ignore_index=True).astype({c.name: c.dtype for c in SCHEMA}), np.concatenate(truths)


def test_a_period_after_a_set_up_prefix_is_numbered_alike_on_every_rank(tmp_path, capsys):
    df, truth = pattern_log()
    out = with_pattern_steps(df)
    assert out.attrs["step_pattern"] == {0: Found(7, 40, 1.0, 3), 1: Found(7, 40, 1.0, 4)}
    assert (out["step"].to_numpy() == truth).all()  # set-up is step 0; iteration k is step k on both ranks
    assert set(out["step_source"].astype(str)) == {"pattern"}
    assert (df["step"] == 0).all() and set(df["step_source"].astype(str)) == {"none"}  # the input is not modified
    assert with_pattern_steps(out) is out  # found once: per_step, report, scaling reuse it

    table = analysis.per_step(df, by_rank=False)  # per_step finds them itself on a raw frame
    assert table["stage"].tolist() == ["setup"] + ["steady"] * 39 + ["end"]
    assert (table.loc[table["stage"] == "steady", "calls"] == 7).all()
    assert set(table["step_source"]) == {"pattern"}
    text = [f.text for f in findings.findings(out, analysis.per_step(out, by_rank=False))]
    assert text[0].startswith(
        "39 steady-state step(s) of 41, steps found from the repeating pattern of collectives (period 7 calls;"
    ), text[0]

    # a log with recorded steps, or a user's constant step, is not touched
    stepped = make_log(2, 5)
    assert with_pattern_steps(stepped) is stepped
    user = df.assign(step=5, step_source=pd.Categorical(["user"] * len(df)))
    assert (with_pattern_steps(user)["step"] == 5).all()

    # the report (pandas and DuckDB engines) and --compare see the same steps
    run, again = tmp_path / "run", tmp_path / "again"
    for directory in (run, again):
        directory.mkdir()
        for rank, part in df.groupby("rank"):
            commpatch.export_csv(str(directory / f"rank{rank}.csv"), df=part.reset_index(drop=True))
    engines = ["pandas"] + (["duckdb"] if engine.available() else [])
    for name in engines:
        assert cli.main(["report", str(run), "--format", "json", "--engine", name, "--no-progress"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert "steps found from the repeating pattern of collectives (period 7 calls" in rep["findings"][0]["text"]
        steps = rep["sections"]["steps"]
        assert [s["step"] for s in steps] == list(range(41)) and {s["step_source"] for s in steps} == {"pattern"}
        # --steps A:B: the reader keeps a rank with no step boundary whole, the window is cut on the steps found
        for window, kept in ((":10", range(10)), ("5:10", range(5, 10))):
            assert (
                cli.main(
                    [
                        "report",
                        str(run),
                        "--steps",
                        window,
                        "--format",
                        "csv",
                        "--section",
                        "steps",
                        "--engine",
                        name,
                        "--no-progress",
                    ]
                )
                == 0
            )
            assert pd.read_csv(io.StringIO(capsys.readouterr().out))["step"].tolist() == list(kept)
    sliced = commpatch.io.read(str(run), steps=(5, 10))
    assert len(sliced) == len(df) and sliced.attrs["stepless_ranks"] == [0, 1]  # read whole, cut after
    # a log with steps cut to its set-up (step 0: 5 iterations before the first optimizer step, a
    # pattern of its own) is not a stepless log
    logged = tmp_path / "logged"
    logged.mkdir()
    counted = df.assign(step=np.maximum(truth - 5, 0), step_source=np.where(truth > 5, "optimizer", "none"))
    for rank, part in counted.groupby("rank"):
        commpatch.export_csv(str(logged / f"rank{rank}.csv"), df=part.reset_index(drop=True))
    sliced = commpatch.io.read(str(logged), steps=(0, 1))
    assert len(sliced) == (counted["step"] == 0).sum() and sliced.attrs["stepless_ranks"] == []
    assert (
        cli.main(["report", str(logged), "--steps", ":1", "--format", "csv", "--section", "steps", "--no-progress"])
        == 0
    )
    assert pd.read_csv(io.StringIO(capsys.readouterr().out))[["step", "step_source"]].values.tolist() == [[0, "none"]]
    assert cli.main(["report", "--compare", str(run), str(again), "--format", "json", "--no-progress"]) == 0
    assert [r["steps"] for r in json.loads(capsys.readouterr().out)["scaling"]] == [39, 39]


def test_an_extra_call_joins_its_iteration_and_repeated_layers_are_not_iterations():
    # a logged loss every 10th iteration: 10 iterations plus it is an exact period too (71 calls),
    # but iterations start after equal compute: the 7-call iteration is the step, the extra call joins it
    calls, truth, starts = looped(PREFIX, BLOCK, 40, extra_every=10)
    out = with_pattern_steps(rank_log(0, calls, starts))
    found = out.attrs["step_pattern"][0]
    assert (found.period, found.steps) == (7, 40) and 0.9 < found.match < 0.92  # 8 positions per extra call
    assert (out["step"].to_numpy() == truth).all()
    sizes = out.groupby("step").size()
    assert sizes[10] == sizes[40] == 8 and sizes[11] == 7

    # 24 identical layers (2 all-reduces each) and a head: the layer's 2 calls repeat in 92% of
    # the positions, but only the whole iteration starts after the compute
    layers = [(AR, 1024), (AR, 32)] * 24 + [(AR, 4000), (AR, 16)]
    calls, truth, starts = looped([(BC, 1 << 16)], layers, 10)
    out = with_pattern_steps(rank_log(0, calls, starts))
    assert out.attrs["step_pattern"][0].period == 50 and (out["step"].to_numpy() == truth).all()

    # no call occurs once in the iteration: every period from the first, a partial last one its own step
    calls, truth, starts = looped([(BC, 8)], [(AR, 64), (AR, 64), (AG, 256), (AG, 256)], 10)
    out = with_pattern_steps(rank_log(0, calls + [(AR, 64), (AR, 64)], starts + [len(calls)]))
    assert out.attrs["step_pattern"][0] == Found(4, 11, 1.0, 1)
    assert out["step"].tolist() == truth.tolist() + [11, 11]


def test_no_clear_pattern_is_refused_with_one_warning(tmp_path, capsys):
    rng = np.random.default_rng(3)
    keys = [(AR, 4), (AR, 64), (AG, 256), (BC, 16), ("barrier", 0)]
    aperiodic = [rank_log(r, [keys[k] for k in rng.integers(0, len(keys), 300)], world=3) for r in (0, 1)]
    short = rank_log(2, BLOCK[:4], world=3)
    df = pd.concat([*aperiodic, short], ignore_index=True).astype({c.name: c.dtype for c in SCHEMA})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = with_pattern_steps(df)
    assert len(record) == 1 and record[0].category is StepPatternWarning, [str(r.message) for r in record]
    message = str(record[0].message)
    assert "no clear repeating pattern" in message and "rank 0: the best period (" in message, message
    assert "rank 1: the best period (" in message and "of the calls (under 90%)" in message, message
    assert "rank 2: 4 call(s): too few to repeat" in message, message
    assert (out["step"] == 0).all() and set(out["step_source"].astype(str)) == {"none"}
    assert all(isinstance(why, str) for why in out.attrs["step_pattern"].values())
    text = findings.findings(out, analysis.per_step(out, by_rank=False))[0].text
    assert text.startswith("no step boundary in the log") and "no clear repeating pattern" in text, text
    for rank, part in df.groupby("rank"):  # the report, either engine: one warning for all ranks
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=part.reset_index(drop=True))
    for name in ["pandas"] + (["duckdb"] if engine.available() else []):
        assert cli.main(["report", str(tmp_path), "--engine", name, "--no-progress"]) == 0
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "no clear repeating pattern" in line]
        assert len(lines) == 1 and lines[0].startswith("commpatch report: warning: no step boundary"), err
        assert "rank 2: 4 call(s): too few to repeat" in lines[0]
