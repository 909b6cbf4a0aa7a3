"""Cross-rank merge: planted stragglers and mismatches in synthetic logs are diagnosed exactly,
the fast reader agrees with cpio.read, and on a real 4-rank gloo run the rank that sleeps
before its collectives is named, with no false mismatch over every wrapped op."""

import json
import os
import warnings

import numpy as np
import pytest

from commpatch import analysis
from commpatch import io as cpio
from commpatch.testing import PATTERN, make_log, write_rank_files
from tests.multiproc import run_ranks


def test_planted_straggler_and_mismatch_are_found_exactly():
    k = 7  # the 8th collective: a broadcast in PATTERN
    df = make_log(4, 6, p2p=True, straggler=2, mismatch=(1, k), seed=3)
    cr = analysis.cross_rank(df)
    assert len(cr.collectives) == 6 * len(PATTERN)
    assert (cr.collectives["straggler"] == 2).all()
    assert (cr.collectives["skew_us"] > 1500).all()  # 2 ms delay, give or take the jitter
    top = cr.ranks.iloc[0]
    assert top["rank"] == 2 and top["last_count"] == 6 * len(PATTERN) and top["last_share"] == 1.0
    assert top["wait_share"] == 0.0 and (cr.ranks["wait_share"].iloc[1:] > 0.5).all()
    m = cr.mismatches
    assert m[["kind", "group", "coll_seq", "step", "op", "affected"]].to_dict("records") == [
        dict(kind="bytes", group="0", coll_seq=k, step=1, op=PATTERN[k % len(PATTERN)][0], affected=1)
    ]
    nbytes = PATTERN[k % len(PATTERN)][1]
    assert m["detail"].iloc[0] == f"{nbytes} on rank(s) 0,2,3; {2 * nbytes} on rank(s) 1"
    # p2p calls advance group_seq on two ranks only; they must not misalign the collectives
    assert cr.p2p["matched"].all() and len(cr.p2p) == 6 * 4


def test_missing_collective_is_reported_at_its_first_occurrence():
    df = make_log(4, 3, missing=(3, 4))  # rank 3 skips the step's last all_reduce (1 KiB)
    m = analysis.mismatches(df)
    first = m.iloc[0]
    assert (first["kind"], first["coll_seq"]) == ("bytes", 4)  # from there on rank 3 is one behind
    assert "on rank(s) 3" in first["detail"]
    # the very last collective: nothing shifts; rank 3's log ends there, which the logs alone cannot
    # tell from a rank that skipped it and stopped (issue 24.7): matching stops at its end, said so
    tail = analysis.cross_rank(make_log(4, 3, missing=(3, 14)))
    assert tail.mismatches.empty
    assert tail.log_ends.to_dict("records") == [
        dict(group="0", ranks="3 (#14)", last_coll_seq=13, group_last=14, unmatched=1)
    ]
    # a member that never issues a group's collectives while its log goes on: missing
    df = make_log(4, 3)
    df = df[~((df["rank"] == 3) & (df["op"] == "broadcast"))].reset_index(drop=True)
    df["group"] = df["group"].cat.add_categories(["g"])
    df.loc[df["op"] == "broadcast", "group"] = "g"
    df["group_seq"] = df.groupby(["rank", "group"], observed=True).cumcount()
    m = analysis.mismatches(df)
    assert m[["kind", "group", "coll_seq"]].values.tolist() == [["missing", "g", 0]]
    assert m["detail"].iloc[0] == "no record on rank(s) 3 (recorded by 0,1,2)"


def test_no_false_alarm_without_faults_and_missing_files_are_not_errors():
    df = make_log(4, 3, p2p=True, straggler=None)
    assert analysis.mismatches(df).empty
    cr = analysis.cross_rank(df[df["rank"] != 1])  # rank 1's file not given
    assert cr.mismatches[cr.mismatches["kind"] != "p2p_unmatched"].empty
    assert cr.missing_logs == [1]


def test_p2p_pairs_and_unmatched_send():
    df = make_log(2, 2, p2p=True)
    pairs = analysis.match_p2p(df)
    assert len(pairs) == 4 and pairs["matched"].all() and not pairs["bytes_mismatch"].any()
    assert set(zip(pairs["src"], pairs["dst"])) == {(0, 1), (1, 0)}
    lost = df.drop(df.index[(df["op"] == "recv") & (df["rank"] == 1)][-1:])
    m = analysis.mismatches(lost)
    assert m["kind"].tolist() == ["p2p_unmatched"]
    assert m["detail"].iloc[0] == "send #2 0->1 has no matching receive"


def test_arrival_matrix_bins():
    df = make_log(4, 10, straggler=1)
    a = analysis.arrival_matrix(df, bins=5)
    assert a.shape == (4, 5) and a.index.tolist() == [0, 1, 2, 3]
    assert a.loc[1].min() > 1000 and a.drop(index=1).to_numpy().max() < 1000


def test_arrow_reader_matches_the_pandas_fallback(tmp_path, monkeypatch):
    write_rank_files(str(tmp_path), 3, 2, p2p=True)
    seen = []
    fast = cpio.read(str(tmp_path), progress=lambda done, total: seen.append((done, total)))
    monkeypatch.setattr(cpio.writer, "_pyarrow", lambda: None)
    slow = cpio.read(str(tmp_path))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert list(fast.columns) == list(slow.columns) and (fast.dtypes == slow.dtypes).all()
    for col in fast.columns:
        a, b = fast[col], slow[col]
        if a.dtype.name == "category":
            assert a.astype(str).tolist() == b.astype(str).tolist(), col
            assert list(a.cat.categories) == list(b.cat.categories), col
        else:
            assert np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=a.dtype.kind == "f"), col


def test_read_logs_accepts_files_without_newer_columns(tmp_path):
    df = make_log(2, 1)
    old = df.drop(columns=[c for c in ("module", "phase", "bucket", "bucket_params") if c in df.columns])
    old.to_csv(tmp_path / "rank0.csv", index=False)
    back = cpio.read(str(tmp_path / "rank0.csv"))
    assert list(back.columns) == list(df.columns) and len(back) == len(df)


def test_a_schema_3_file_gets_own_time_from_its_durations_and_old_timing_names(tmp_path):
    df = make_log(2, 1)
    old = df.drop(columns=["own_us"]).assign(
        timing=np.where(np.arange(len(df)) == 0, "cuda_event", df["timing"].astype(str))
    )
    old.to_csv(tmp_path / "rank0.csv", index=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # derived, not filled: nothing to warn about
        back = cpio.read(str(tmp_path / "rank0.csv"))
    assert back["timing"].iloc[0] == "device_event" and "cuda_event" not in back["timing"].cat.categories
    host = back["timing"] == "host"  # synchronous calls: never queued, own time = duration
    assert np.allclose(back.loc[host, "own_us"], back.loc[host, "duration_us"], equal_nan=True)
    assert back.attrs["filled_columns"] == []


# ---- a real 4-rank gloo run -------------------------------------------------------------
SLEEPER = 2
SLEEP_S = 0.08


def straggler_job(rank, world_size, out_dir):
    """Steps in which one rank sleeps before its collectives, then every wrapped op once (over
    which no mismatch may be reported). Recording starts after a barrier: process start-up
    skew (seconds under load) must not count as straggling."""
    import time

    import torch
    import torch.distributed as dist

    import commpatch
    from tests import workers

    dist.barrier()
    commpatch.enable(output="none")
    for _ in range(4):
        commpatch.step()
        for numel in (1024, 16):
            if rank == SLEEPER:
                time.sleep(SLEEP_S)
            dist.all_reduce(torch.ones(numel))
        if rank == SLEEPER:
            time.sleep(SLEEP_S)
        dist.broadcast(torch.ones(8), src=0)
    commpatch.step()
    for _name, _op, call, *_ in workers.scenarios(rank, world_size):
        try:
            call()
        except Exception:  # noqa: BLE001 - ops gloo does not support raise on every rank alike
            pass
    commpatch.disable()
    return commpatch.export_csv(os.path.join(out_dir, "rank{rank}.csv"))


@pytest.fixture(scope="module")
def gloo_logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo4")
    run_ranks(straggler_job, 4, timeout=150, out_dir=str(out))
    return str(out)


@pytest.mark.slow
def test_real_run_names_the_sleeping_rank(gloo_logs, capsys):
    from commpatch import cli

    assert cli.main(["report", gloo_logs, "--format", "json", "--fail-on-mismatch", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["errors"] == []
    ranks = rep["sections"]["ranks"]
    assert ranks[0]["rank"] == SLEEPER and ranks[0]["last_count"] >= 12
    assert ranks[0]["late_us"] > 12 * 0.5 * SLEEP_S * 1e6  # 12 sleeps, minus scheduling noise
    others = [r for r in ranks if r["rank"] != SLEEPER]
    assert all(r["wait_share"] > ranks[0]["wait_share"] for r in others)
    assert sum(s["straggler"] == SLEEPER for s in rep["sections"]["skew"]) >= 8  # of the top 10
    assert cli.main(["report", gloo_logs, "--no-progress"]) == 0
    text = capsys.readouterr().out
    ranks_table = text.split("stragglers first")[1].splitlines()
    assert ranks_table[3].split()[0] == str(SLEEPER)  # first row under the header


@pytest.mark.slow
def test_real_run_every_op_matches_across_ranks(gloo_logs):
    df = cpio.read(gloo_logs)
    cr = analysis.cross_rank(df)
    assert cr.mismatches.empty, cr.mismatches.to_dict("records")
    assert cr.collectives["missing"].sum() == 0
    p2p = df["op"].isin(analysis.P2P_OPS)
    assert p2p.any() and cr.p2p["matched"].all()
    # every non-p2p call is in exactly one matched collective
    assert cr.collectives["ranks"].sum() == int((~p2p).sum())


@pytest.mark.slow
def test_real_run_trace_has_one_event_per_row(gloo_logs, tmp_path):
    from commpatch.render import trace

    df = cpio.read(gloo_logs)
    path = trace.write_chrome_trace(df, str(tmp_path / "trace.json"))  # strict JSON: no NaN
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(df)
    assert sum(e["args"].get("duration_unknown", False) for e in slices) == int(df["duration_us"].isna().sum())


def test_logs_that_end_early_make_no_mismatch():
    """Issue 24.7: a log cut short (a torn tail, a disk that filled, a rank that stopped) ends its
    rank's matching; the report says so instead of 'missing ... no record on rank 1'."""
    from commpatch.render import text as report

    df = make_log(4, 6, p2p=True)
    cut = (df["rank"] == 1) & (df["seq"] > 20)
    cut |= (df["rank"] == 2) & (df["seq"] > 30)
    cr = analysis.cross_rank(df[~cut].reset_index(drop=True))
    assert cr.mismatches.empty, cr.mismatches.to_dict("records")
    assert cr.log_ends.to_dict("records") == [
        dict(group="0", ranks="1 (#15), 2 (#23)", last_coll_seq=14, group_last=29, unmatched=15)
    ]
    rep = report.build_report(df[~cut].reset_index(drop=True))
    assert rep.errors == []
    ends = [f.text for f in rep.findings if f.kind == "ends"]
    assert ends == [
        "the logs end at different points: in group 0 the log of rank(s) 1 (#15), 2 (#23) ends before "
        "the others' last collective #30; matching stops at each log's end (a log cut short or a rank "
        "that stopped), no mismatch is inferred after it."
    ], ends
    assert any(n.startswith("group 0: the log of rank(s) 1 (#15), 2 (#23) ends before") for n in rep.notes)
    # collectives before the end are still checked: a size mismatch there is found
    bad = make_log(4, 6, mismatch=(1, 7))
    bad = bad[~((bad["rank"] == 1) & (bad["seq"] > 20))].reset_index(drop=True)
    assert analysis.mismatches(bad)[["kind", "coll_seq"]].values.tolist() == [["bytes", 7]]


@pytest.mark.slow
def test_real_log_that_ends_early_makes_no_mismatch(tmp_path, capsys):
    """Issue 24.7 on a real DDP job: rank 1's binary log holds only its first 60% of rows (what a
    disk that filled, or a rank that died, leaves): no 'missing' error, the report says where the
    logs end."""
    from commpatch import cli
    from commpatch.data.logfile import _FRAME, MAGIC, ROWS
    from commpatch.data.schema import ROW
    from tests.analysis_workers import ddp_job

    run_ranks(ddp_job, 2, timeout=150, out=str(tmp_path), steps=12)
    for csv in tmp_path.glob("*.csv"):
        csv.unlink()
    path = tmp_path / "rank1.cplog"
    data = path.read_bytes()
    # the rows after the first 60% never reached the file (its frames as a write failure leaves them)
    frames, pos = [], len(MAGIC)
    while pos < len(data):
        kind, length = _FRAME.unpack_from(data, pos)
        frames.append((kind, data[pos + _FRAME.size : pos + _FRAME.size + length]))
        pos += _FRAME.size + length
    budget = int(sum(len(p) for k, p in frames if k == ROWS) // ROW.size * 0.6)
    out = bytearray(MAGIC)
    for kind, payload in frames:
        if kind == ROWS:
            keep = min(budget, len(payload) // ROW.size)
            budget -= keep
            payload = payload[: keep * ROW.size]
        out += _FRAME.pack(kind, len(payload)) + payload
    path.write_bytes(bytes(out))
    assert cli.main(["report", str(tmp_path), "--format", "json", "--fail-on-mismatch", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["errors"] == [] and rep["sections"]["mismatches"] == []
    ends = [f["text"] for f in rep["findings"] if f["kind"] == "ends"]
    assert len(ends) == 1 and "the log of rank(s) 1 (#" in ends[0], rep["findings"]
