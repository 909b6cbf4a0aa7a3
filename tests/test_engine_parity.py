"""Both engines give the same report: the full JSON of `commpatch.open(path, engine=...)` (every
section, finding, headline and advice, key by key) is equal for pandas and DuckDB on logs with a
straggler, point-to-point calls, mismatches, a skipped collective, several groups (binary logs),
one rank, steps found from the pattern after a set-up broadcast, DDP buckets and small messages
(the advice rules that read rows), hangs (1,024 ranks too), and a real 2-rank gloo run.

The only difference by design: beyond ``engine.ADVICE_ROWS`` steady-state calls the DuckDB engine
leaves the small-message advice out, and its report says so (a finding of kind "engine"). Floats are compared to a relative 1e-12: the same math,
summed in another order (pandas: pairwise over the rows in memory; DuckDB: each figure in a
fixed order, so that its own results are the same from one run to the next)."""

from __future__ import annotations

import math
import warnings

import pytest

import commpatch
from commpatch.analysis import engine
from commpatch.testing import write_binary_run, write_rank_files

pytestmark = pytest.mark.skipif(not engine.available(), reason="needs duckdb (commpatch[scale])")

FLOAT_RTOL = 1e-12  # the same sums in another order (see the module docstring)
# the sections' figures go through pandas' to_json, which writes 10 decimals: two values a few ulps
# apart (57.022177738850 and ...849) can come out a unit of the 10th decimal apart
FLOAT_ATOL = 1.5e-10


def differences(a, b, path: str = "") -> list[str]:
    """Every key path where the pandas report ``a`` and the DuckDB report ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in {'pandas' if k in a else 'duckdb'}" for k in sorted(a.keys() ^ b.keys())]
        return out + [d for k in a if k in b for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        out = [f"{path}: {len(a)} items against {len(b)}"] if len(a) != len(b) else []
        return out + [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=FLOAT_RTOL, abs_tol=FLOAT_ATOL)
        return [] if same else [f"{path}: {a!r} against {b!r}"]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} against {b!r}"]


def reports(path) -> tuple[dict, dict]:
    out = []
    for name in ("pandas", "duckdb"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a refused pattern warns alike on both)
            with commpatch.open(path, engine=name) as run:
                assert run.engine == name
                out.append(run.to_dict())
    return out[0], out[1]


def assert_same_report(path) -> tuple[dict, dict]:
    pandas, duckdb = reports(path)
    assert not any(f["kind"] == "engine" for f in pandas["findings"] + duckdb["findings"])  # nothing left out
    assert differences(pandas, duckdb) == []
    return pandas, duckdb


LOGS = {
    "straggler, p2p and a size mismatch": dict(world_size=4, steps=8, p2p=True, straggler=3, mismatch=(1, 9)),
    "a straggler the advice names": dict(world_size=4, steps=12, straggler=1, straggler_delay_us=8000.0),
    "a skipped collective": dict(world_size=4, steps=6, missing=(2, 7), seed=2),
    "one rank": dict(world_size=1, steps=6),
}


@pytest.mark.parametrize("case", list(LOGS))
def test_the_engines_report_the_same_on_synthetic_logs(tmp_path, case):
    write_rank_files(str(tmp_path), **LOGS[case])
    pandas, _ = assert_same_report(str(tmp_path))
    kinds = {f["kind"] for f in pandas["findings"]}
    assert {"steps", "setup"} <= kinds, kinds  # the set-up finding is in both (it was the pandas path's only)
    if case == "a straggler the advice names":
        assert [a["rule"] for a in pandas["advice"]] == ["straggler"]


def test_the_engines_report_the_same_on_unmeasured_calls_and_ddp_buckets(tmp_path):
    """Calls without a duration (named in the overhead finding) and DDP's bucket all-reduce (the
    finding says what its figures leave out): facts of the rows the engine reads in SQL."""
    import numpy as np

    from commpatch.testing import rank_logs

    pattern = (
        ("ddp_bucket_allreduce", 1 << 22, "float32"),
        ("broadcast", 1 << 16, "float32"),
        ("all_reduce", 64, "float32"),
    )
    for rank, frame in enumerate(rank_logs(4, 8, pattern=pattern)):
        unmeasured = (frame["op"] == "broadcast").to_numpy()
        for column in ("duration_us", "host_us", "own_us"):
            frame[column] = np.where(unmeasured, np.nan, frame[column])
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=frame)
    pandas, _ = assert_same_report(str(tmp_path))
    overhead = [f["text"] for f in pandas["findings"] if f["kind"] == "overhead"]
    assert len(overhead) == 1 and "calls per step have no duration (broadcast)" in overhead[0], overhead
    assert "DDP's copy of each gradient into its bucket" in overhead[0]


@pytest.mark.parametrize("packing", ["timed", "not timed"])
def test_the_engines_give_the_same_grad_copy_advice(tmp_path, packing):
    """DDP buckets with a 5 ms finalize after the last all-reduce: gradient_as_bucket_view advice,
    whose evidence quotes the packing's time per step (40 us a bucket, 2 buckets). The engine staged
    the bucket rows without pack_us and quoted 0 us (a real DDP hang once showed 42 against 0);
    a log without the packing timed says so in both, never 0."""
    import numpy as np

    from commpatch.testing import rank_logs

    pattern = (("ddp_bucket_allreduce", 1 << 22, "float32"), ("ddp_bucket_allreduce", 1 << 20, "float32"))
    for rank, frame in enumerate(rank_logs(2, 10, pattern=pattern)):
        frame["async_op"] = True
        frame["bucket"] = frame.groupby("step").cumcount()
        frame["bucket_params"] = 3
        frame["pack_us"] = 40.0 if packing == "timed" else np.nan
        frame["sync_end_us"] = frame["duration_us"] + 5000.0
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=frame)
    pandas, _ = assert_same_report(str(tmp_path))
    advice = [a for a in pandas["advice"] if a["rule"] == "ddp_grad_copy"]
    assert len(advice) == 1, pandas["advice"]
    if packing == "timed":
        assert advice[0]["evidence"]["pack_us"] == 80.0 and "the packing, 80 us," in advice[0]["text"]
    else:
        assert advice[0]["evidence"]["pack_us"] is None and "the packing, not timed," in advice[0]["text"]  # JSON: null


def test_the_engines_report_the_same_slow_bus_bandwidth(tmp_path):
    """all_gather of 1 MiB three times slower than all_reduce of the same size: the bandwidth finding."""
    from commpatch.testing import rank_logs

    pattern = (("all_reduce", 1 << 20, "float32"), ("all_gather_into_tensor", 1 << 20, "float32"))
    for rank, frame in enumerate(rank_logs(4, 8, pattern=pattern)):
        slow = (frame["op"] == "all_gather_into_tensor").to_numpy()
        for column in ("duration_us", "host_us", "own_us"):
            frame.loc[slow, column] *= 3
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=frame)
    pandas, _ = assert_same_report(str(tmp_path))
    bandwidth = [f["text"] for f in pandas["findings"] if f["kind"] == "bandwidth"]
    assert len(bandwidth) == 1 and bandwidth[0].startswith("all_gather of <= 1.05 MB messages"), bandwidth


def test_the_engines_report_the_same_on_binary_logs_of_several_groups(tmp_path):
    write_binary_run(str(tmp_path), 16, 400, straggler=5, straggler_delay_us=3000.0, mismatch=(3, 7))
    pandas, _ = assert_same_report(str(tmp_path))
    assert len(pandas["sections"]["mismatches"]) == 1 and len(pandas["sections"]["p2p"]) > 1


def test_the_engines_report_the_same_on_steps_found_from_the_pattern(tmp_path):
    """No step boundary: steps from the repeating pattern, a set-up prefix of broadcasts (step 0)."""
    from tests.test_step_pattern import pattern_log

    df, _ = pattern_log()
    for rank, part in df.groupby("rank"):
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=part.reset_index(drop=True))
    pandas, _ = assert_same_report(str(tmp_path))
    setup = [f["text"] for f in pandas["findings"] if f["kind"] == "setup"]
    assert len(setup) == 1 and "set-up (step 0: the calls before the repeating pattern starts)" in setup[0]


def test_the_engines_report_the_same_on_a_real_gloo_run(tmp_path):
    from tests import steps_workers
    from tests.multiproc import run_ranks

    run_ranks(steps_workers.hand_written_dp, 2, timeout=120, out=str(tmp_path), iterations=8)
    pandas, _ = assert_same_report(str(tmp_path))
    assert "set-up (step 0: the calls before the repeating pattern starts)" in str(pandas["findings"])


def test_differences_can_fail():
    assert differences({"a": [1.0, "x"]}, {"a": [1.0 + 1e-9, "x"]}) == ["/a[0]: 1.0 against 1.000000001"]
    assert differences({"a": 1}, {"a": 1.0, "b": 2}) == ["/b: only in duckdb", "/a: 1 against 1.0"]
    assert differences([1], [1, 2]) == [": 1 items against 2"]


def test_the_engine_gives_the_same_report_from_one_run_to_the_next(tmp_path):
    """DuckDB adds a group's values on several threads in whatever order they come: its double sums
    varied in the last bits from one run to the next (3 distinct reports of 3 on these logs)."""
    write_binary_run(str(tmp_path), 8, 5000)
    texts = set()
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with commpatch.open(str(tmp_path), engine="duckdb") as run:
                texts.add(run.json())
    assert len(texts) == 1


# ---- the advice rules that read rows (advice.ROW_RULES) -----------------------------------------
def _export(df, directory) -> None:
    for rank, part in df.groupby("rank"):
        commpatch.export_csv(str(directory / f"rank{rank}.csv"), df=part.reset_index(drop=True))


def test_the_engines_give_the_same_ddp_and_small_message_advice(tmp_path):
    """One DDP bucket holding every gradient with a long finalize, then many small all_reduce calls:
    the three rules that read rows advise, and the engine feeds them the same rows (issue 32, item 6)."""
    from tests.test_advice import MIB, _calls_log, _ddp_log

    _export(_ddp_log([(8 * MIB, 30_000.0, 10_000.0, 16)], finalize_us=3000.0), tmp_path / "ddp")
    pandas, _ = assert_same_report(str(tmp_path / "ddp"))
    assert {a["rule"] for a in pandas["advice"]} == {"ddp_bucket_size", "ddp_grad_copy"}
    _export(_calls_log([64] * 20 + [MIB] * 3), tmp_path / "calls")
    pandas, _ = assert_same_report(str(tmp_path / "calls"))
    assert [a["rule"] for a in pandas["advice"]] == ["small_messages"]


def test_the_engine_says_when_it_leaves_the_small_message_advice_out(tmp_path, monkeypatch):
    from tests.test_advice import MIB, _calls_log

    _export(_calls_log([64] * 20 + [MIB] * 3), tmp_path)
    monkeypatch.setattr(engine, "ADVICE_ROWS", 100)
    pandas, duckdb = reports(str(tmp_path))
    said = [f["text"] for f in duckdb["findings"] if f["kind"] == "engine"]
    assert len(said) == 1 and "the advice on small messages (" in said[0] and "more than the 100 it reads" in said[0]
    assert [a["rule"] for a in pandas["advice"]] == ["small_messages"] and duckdb["advice"] == []


# ---- hangs, and a straggler, at 1,024 ranks ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.offline
def test_the_engines_name_the_same_straggler_at_a_collectives_place(tmp_path):
    """Rank 1 issues the first of each step's 5 collectives 0.4 ms late, among collectives a random
    rank holds up by up to 0.3 ms: the step's longest hold-up names no one, the first collective's
    does; both engines give the same verdict, finding, headline and advice (the DuckDB engine
    computes the evidence in SQL)."""
    from commpatch.testing import make_log

    df = make_log(2, 30, jitter_us=300.0, seed=1)
    first = df.groupby(["rank", "step"])["start_ns"].transform("min") == df["start_ns"]
    df.loc[(df["rank"] == 1) & first, "start_ns"] += 400_000
    for r, frame in df.groupby("rank", observed=True):
        commpatch.export_csv(str(tmp_path / f"rank{r}.csv"), df=frame.reset_index(drop=True))
    pandas, _ = assert_same_report(str(tmp_path))
    s = pandas["headline"]["straggler"]
    assert s["verdict"] == "straggler" and s["rank"] == 1 and s["measure"] == "position", s
    assert s["at"] == {"group": "0", "position": 1, "op": "all_reduce"}, s
    said = [f["text"] for f in pandas["findings"] if f["kind"] == "straggler"][0]
    assert "per step at the step's 1st collective of group 0 (all_reduce)" in said, said
    assert [a["rule"] for a in pandas["advice"]] == ["straggler"], pandas["advice"]


def test_the_engines_name_the_same_hang_and_straggler_at_1024_ranks(tmp_path):
    """1,024 ranks, rank 5 a straggler (every call 3 ms late), then rank 9 never issues a world
    all_reduce the others wait in (inflight records, every rank alive 60 s later): the same hang
    finding and table, straggler and advice from both engines (one run: each costs minutes here)."""
    write_binary_run(str(tmp_path), 1024, 100, straggler=5, straggler_delay_us=3000.0, mismatch=None, hang=9)
    pandas, _ = assert_same_report(str(tmp_path))
    first = pandas["findings"][0]
    assert first["kind"] == "hang" and first["text"].startswith("hang: ranks 0-8 10-1023 wait in all_reduce #")
    assert "rank 9 never issued it" in first["text"] and pandas["headline"]["hang"]["verdict"] == "hang"
    assert [r["missing"] for r in pandas["sections"]["hangs"]] == ["9"]
    assert pandas["headline"]["straggler"]["rank"] == 5


def test_the_engines_report_the_same_real_ddp_hang(tmp_path):
    """A real 2-rank gloo DDP job whose rank 1 stops before a step (tests/hang_worker.py): the bucket
    rank 0 waits in, named alike by both engines."""
    from tests.test_hangs import _run_until_hang

    _run_until_hang(tmp_path, "ddp", 2)
    pandas, _ = assert_same_report(str(tmp_path))
    assert pandas["findings"][0]["text"].startswith("hang: rank 0 waits in ddp_bucket_allreduce #")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.offline
def test_the_engine_names_the_hang_straggler_and_mismatch_at_4096_ranks(tmp_path):
    """4,096 ranks of 60 rows (TP-8, DP-512 and world groups, p2p): rank 5 a straggler (every call
    3 ms late), rank 11's 7th call moving twice the bytes, rank 9 never issuing a world all_reduce
    the others wait in: the DuckDB engine gives the same findings as at 1,024 ranks (findings, not
    time: benchmarks/merge_scale.py measures the time)."""
    write_binary_run(str(tmp_path), 4096, 60, straggler=5, straggler_delay_us=3000.0, mismatch=(11, 7), hang=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with commpatch.open(str(tmp_path), engine="duckdb") as run:
            report = run.to_dict()
    assert not any(f["kind"] == "engine" for f in report["findings"])  # nothing left out
    first = report["findings"][0]
    assert first["kind"] == "hang" and first["text"].startswith("hang: ranks 0-8 10-4095 wait in all_reduce #")
    assert "rank 9 never issued it" in first["text"] and report["headline"]["hang"]["verdict"] == "hang"
    assert [r["missing"] for r in report["sections"]["hangs"]] == ["9"]
    assert report["headline"]["straggler"]["rank"] == 5
    assert any(m["kind"] == "bytes" and "on rank(s) 11" in m["detail"] for m in report["sections"]["mismatches"]), (
        report["sections"]["mismatches"]
    )
    assert report["sections"]["ranks"][0]["rank"] == 5
