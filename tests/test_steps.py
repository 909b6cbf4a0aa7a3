"""Steps without code change (issue 15): counted by DDP's forward, the optimizer, or
commpatch.step(); the zero-code DDP demo (findings, CSVs, trace, plots); the ground-truth benchmark
(DDP at 1 and 2 processes with no_sync() steps) runs and its figures exist (its bounds are checked
by `python benchmarks/steps_ground_truth.py`, not here: timing ratios on a shared 2-core machine)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import commpatch
from commpatch import analysis
from tests import steps_workers
from tests.multiproc import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_steps_counted_by_root_forwards_then_the_optimizer_then_the_user():
    from tests.torch_compat import fsdp2_cpu_unsupported

    for res in run_ranks(steps_workers.step_sources, 2, timeout=150):
        # with no optimizer, each root forward after the first opens a step, nested units counting once
        if fsdp2_cpu_unsupported() is None:
            assert res["fsdp2"] == [(0, "none"), (1, "forward"), (2, "forward")]
            assert res["fsdp1"] == [(3, "forward"), (4, "forward"), (5, "forward")]
            first = 6
        else:  # FSDP2 cannot run on CPU with this torch: FSDP1 first
            assert "fsdp2" not in res
            assert res["fsdp1"] == [(0, "none"), (1, "forward"), (2, "forward")]
            first = 3
        assert res["ddp"] == [(first, "forward"), (first + 1, "forward"), (first + 2, "forward")]
        # the first optimizer.step() ends its step (opened by its forward); from then on each step of
        # the first optimizer ends a step, the second optimizer of the same iteration does not count
        assert res["optimizer"] == [(first + 3, "forward"), (first + 4, "optimizer"), (first + 5, "optimizer")]
        assert res["user"] == [(100, "user")]  # commpatch.step() overrides from then on


def test_zero_code_ddp_demo(tmp_path, capsys):
    """`make demo`: DDP on 2 ranks, rank 1 slow, no commpatch code in the job; it writes a run
    directory of its own, deletes nothing, and is the latest run by its start time (issue 23.10)."""
    from commpatch import cli
    from commpatch.testing import write_rank_files

    out = tmp_path / "logs"
    mine = out / "20200101-000000-host-1"  # a user's earlier run (CSV files: its name's time)
    write_rank_files(str(mine), 2, 3)
    kept = sorted(os.listdir(mine))
    res = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "demo.py"),
            "--out",
            str(out),
            "--steps",
            "12",
            "--slow-ms",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(tmp_path),
        env=dict(os.environ, COMMPATCH_SUMMARY="1"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "commpatch summary, rank 0 of 2" in res.stderr and "commpatch summary, rank 1 of 2" in res.stderr, (
        res.stderr[:1500]
    )
    text = res.stdout
    shown = text[text.index("commpatch report: ") : text.index("\ntimeline for ui.perfetto.dev")]
    assert shown.splitlines()[2] == "Headline:" and max(map(len, shown.splitlines())) <= 120  # for people
    findings = text[text.index("Findings:") : text.index("\n\n", text.index("Findings:"))]
    findings = " ".join(findings.split())  # the sentences, their wrapped lines joined
    assert "10 steady-state step(s) of 12, counted by each optimizer.step()" in findings, findings
    assert "steady-state step: median" in findings and "exposed" in findings, findings
    assert "set-up (step 0" in findings and "(largest: ddp_" in findings, findings  # DDP's own set-up calls
    assert "rank 1 arrived last in" in findings and "the straggler" in findings, findings
    runs = [d for d in os.listdir(out) if d != mine.name]
    assert len(runs) == 1 and runs[0].startswith("demo-"), runs  # a run directory of its own
    assert sorted(os.listdir(mine)) == kept  # nothing of the user's deleted
    os.utime(mine)  # touched (converted, copied): still older
    assert cli.main(["report", str(out), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = " ".join(lines[: next(i for i, line in enumerate(lines) if line.startswith("==="))])  # the title
    assert first.startswith(f"commpatch report: run {runs[0]} (the latest of 2 in {out}; 1 other(s)): "), first
    df = commpatch.read_csv(str(out))
    assert set(df["step_source"].astype(str)) == {"none", "optimizer"}
    buckets = df[(df["op"] == "ddp_bucket_allreduce") & (df["step"] > 0)].groupby(["rank", "step"]).size()
    assert len(buckets) == 22 and (buckets == 3).all()  # after the rebuild: 3 gradient buckets per step
    names = set(os.listdir(out / runs[0]))
    assert {"rank0.csv", "rank1.csv", "trace.json", "report.html"} <= names
    if importlib.util.find_spec("matplotlib") is not None:
        assert set(os.listdir(out / runs[0] / "plots")) == {
            "bandwidth_vs_size.png",
            "comm_per_step.png",
            "skew_heatmap.png",
        }


def test_hand_written_data_parallel_loop_gets_steps_from_its_pattern(tmp_path, capsys):
    """No optimizer, no DDP: the report numbers the iterations of the all-reduce pattern. The
    parameters' broadcast before the loop is step 0 (set-up), the 8 iterations are steps 1-8
    (7 steady: the last has no next step to time it), numbered alike on both ranks."""
    from commpatch import cli, io

    models = run_ranks(steps_workers.hand_written_dp, 2, timeout=120, out=str(tmp_path), iterations=8)
    assert models[0] == models[1]  # the same update on both ranks
    assert cli.main(["report", str(tmp_path), "--format", "json", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["findings"][0]["text"].startswith(
        "7 steady-state step(s) of 9, steps found from the repeating pattern of collectives (period 4 calls;"
    ), rep["findings"][0]
    assert [s["stage"] for s in rep["sections"]["steps"]] == ["setup"] + ["steady"] * 7 + ["end"]
    assert "set-up (step 0: the calls before the repeating pattern starts)" in rep["findings"][2]["text"]
    df = analysis.with_pattern_steps(io.read(str(tmp_path)))
    per_rank = [part.sort_values("seq")[["op", "bytes", "step"]].to_numpy().tolist() for _, part in df.groupby("rank")]
    assert per_rank[0] == per_rank[1]  # the same call is the same step on both ranks
    assert [s for op, _, s in per_rank[0] if op == "broadcast"] == [0] * 4
    assert [s for op, _, s in per_rank[0] if op == "all_reduce"] == [i for i in range(1, 9) for _ in range(4)]


@pytest.mark.slow
def test_ground_truth_benchmark_runs(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import steps_ground_truth as bench
    finally:
        sys.path.pop(0)
    args = bench.argparse.Namespace(
        sizes=[1, 2], rounds=3, k=3, hidden=128, batch=16, timeout=150, dir=str(tmp_path), plain=False
    )
    rows = bench.measure(args)
    assert [r["world_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["source"] == "optimizer" and r["steps"] >= 4
        for key in (
            "truth_share",
            "exposed_share",
            "comm_share",
            "log_step_ms",
            "truth_step_ms",
            "finalize_us",
            "pack_us",
        ):
            assert r[key] == r[key], key  # a number, not NaN
        assert 0 <= r["exposed_share"] <= r["comm_share"] <= 1 and r["finalize_us"] >= 0 and r["pack_us"] > 0
    assert rows[0]["log_efficiency"] == pytest.approx(1.0) and rows[0]["truth_efficiency"] == pytest.approx(1.0)
    # DDP's finalize: its end noted once per synchronised backward, on the row of its last bucket, and
    # counted in the step's figures (finalize after the last all-reduce <= exposed <= under way)
    for n in (1, 2):
        df = commpatch.read_csv(str(tmp_path / f"w{n}"))
        # the findings say what the figures leave out of DDP's synchronisation
        overhead = [
            f.text for f in analysis.findings.findings(df, analysis.per_step(df, by_rank=False)) if f.kind == "overhead"
        ]
        assert len(overhead) == 1 and "DDP's packing of gradients into its buckets" in overhead[0]
        assert "DDP's forward bookkeeping" in overhead[0]
        buckets = df[df["op"] == "ddp_bucket_allreduce"]
        noted = buckets[buckets["sync_end_us"].notna()]
        assert df.loc[df["op"] != "ddp_bucket_allreduce", "sync_end_us"].isna().all()
        per_backward = buckets.groupby(["rank", "step"])
        assert (noted.groupby(["rank", "step"]).size() == 1).all() and len(noted) == per_backward.ngroups
        assert (noted.set_index(["rank", "step"])["bucket"] == per_backward["bucket"].max()).all()
        assert (noted["sync_end_us"] > 0).all()
        ps = analysis.per_step(df)
        synced = ps[(ps["stage"] == "steady") & (ps["calls"] > 0)]
        assert len(synced) >= 4 * n and (synced["ddp_finalize_us"] >= 0).all()
        assert (synced["ddp_finalize_us"] <= synced["exposed_us"]).all()
        assert (synced["exposed_us"] <= synced["busy_us"]).all()


def test_durations_that_complete_after_the_file_is_retired_are_kept(tmp_path):
    """destroy_process_group() retires the rank's file; a duration that completes later opens a
    sink of no rows, folded into the earlier one when the log is read (the summary at exit)."""
    import torch
    import torch.distributed as dist

    from commpatch import session
    from tests.fakepg import fake_world

    with fake_world(2):
        commpatch.enable(output=str(tmp_path / "rank{rank}.csv"))
        dist.all_reduce(torch.ones(4), async_op=True)
        log = session.default().log
        log.flush()
        seq = int(commpatch.log()["seq"].iloc[-1])
    log.done[seq] = 7_000  # ns, completed after the file was retired
    log.flush()
    assert len(log.sinks()) == 2
    df = log.to_dataframe()
    assert len(df) == 1 and df["duration_us"].iloc[0] == 7.0


def test_pipeline_p2p_without_durations_is_unknown_not_zero(tmp_path, capsys):
    """A GPipe job's steps hold only gloo point-to-point calls. torch 2.4's schedule sends them in
    batch_isend_irecv, whose works have no future and no single wait: no duration, and the findings
    say its communication is unknown, never 0%. Newer torch calls isend / irecv, timed at the
    Work.wait() on each: their steps' communication and exposed time (the thread's waits) are
    measured. The same with the DuckDB engine."""
    from commpatch import cli
    from tests.analysis_workers import pipeline_job

    p2p = set()
    for rank, df in enumerate(run_ranks(pipeline_job, 2, timeout=150)):
        commpatch.export_csv(str(tmp_path / f"rank{rank}.csv"), df=df)
        p2p |= set(df["op"].astype(str)) & {"isend", "irecv", "batch_isend_irecv"}
    # torch >= 2.5's pipelining calls isend / irecv; torch 2.4's, batch_isend_irecv (one row per batch)
    ops = "batch_isend_irecv" if p2p == {"batch_isend_irecv"} else "irecv, isend"
    assert p2p in ({"batch_isend_irecv"}, {"isend", "irecv"}), p2p
    from commpatch.analysis import engine as duckdb_engine

    engines = ["pandas"] + (["duckdb"] if duckdb_engine.available() else [])
    for engine in engines:
        assert cli.main(["report", str(tmp_path), "--format", "json", "--engine", engine, "--no-progress"]) == 0
        rep = json.loads(capsys.readouterr().out)
        overhead = [f["text"] for f in rep["findings"] if f["kind"] == "overhead"]
        steady = [s for s in rep["sections"]["steps"] if s["stage"] == "steady"]
        assert len(steady) == 6, steady
        if ops == "batch_isend_irecv":
            assert (
                len(overhead) == 1
                and "its communication is unknown: none of its 4 calls per step has a duration" in overhead[0]
                and "0%" not in overhead[0]
            ), (engine, overhead)
            assert all(
                s["comm_share"] is None and s["exposed_share"] is None and s["unmeasured"] == 4 for s in steady
            ), steady
            assert engine != "pandas" or "(batch_isend_irecv; gloo's batch_isend_irecv gives no" in overhead[0]
        else:
            assert all(
                s["unmeasured"] == 0 and 0 < s["comm_share"] and 0 <= s["exposed_share"] <= s["comm_share"]
                for s in steady
            ), steady
            assert not any("unknown" in o for o in overhead), (engine, overhead)


def test_gradient_accumulation_numbers_steps_as_the_job_does(tmp_path, capsys):
    """Issue 23.7: two forwards per optimizer.step() (the first under no_sync()): the first
    iteration's second forward opens a step before the optimizer is seen; the findings name one
    source. Issue 32: that first optimizer step was split over steps 0-1 and every later step
    numbered one more than the job's: the k-th optimizer step's rows are step k-1, the first is set-up."""
    from commpatch import cli
    from commpatch.analysis import engine as duckdb_engine
    from tests.analysis_workers import ddp_job

    errors = run_ranks(ddp_job, 2, timeout=150, out=str(tmp_path), steps=12, accumulate=2)
    assert errors == [{}, {}], errors  # commpatch's internal errors per rank
    df = commpatch.read_csv(str(tmp_path))
    table = analysis.per_step(df, by_rank=False)
    assert table["step"].tolist() == list(range(12))  # 12 optimizer steps
    assert table.loc[table["stage"] == "setup", "step"].tolist() == [0]
    # every step holds one optimizer step's bucket all-reduces (its synchronised micro-batch's; the
    # first iteration's buckets are DDP's first-iteration ones, before its rebuild)
    buckets = df[df["op"] == "ddp_bucket_allreduce"].groupby(["rank", "step"]).size()
    by_rank = df.groupby(["rank", "op"], observed=True).size()  # what each rank recorded, where it fails
    assert len(buckets) == 2 * 12 and buckets.drop(index=0, level="step").nunique() == 1, (buckets, by_rank)
    steady = table[table["stage"] == "steady"]
    assert len(steady) == 10 and set(steady["step_source"]) == {"optimizer"}  # 1 set-up, 1 end
    engines = ["pandas"] + (["duckdb"] if duckdb_engine.available() else [])
    for engine in engines:
        assert cli.main(["report", str(tmp_path), "--engine", engine, "--no-progress"]) == 0
        out = capsys.readouterr().out.replace("\n  ", " ")  # a finding wrapped to 120 columns: its next lines
        assert (
            "- 10 steady-state step(s) of 12, counted by each optimizer.step() (counted automatically); step 0 "
            "is set-up and the last one is not timed."
        ) in out, out[:600]
        assert "forward of the DDP" not in out
