"""Clock alignment across hosts (issue 25), piece by piece: the measured intervals in the log, the
alignment of a rank's issue times, the straggler verdict against the offsets' uncertainty, and the
exchange itself in real gloo ranks. The end-to-end test with shifted clocks on two torchrun nodes
is tests/test_multihost.py."""

from __future__ import annotations

import glob
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from commpatch.analysis.stragglers import verdict
from commpatch.data import logfile
from commpatch.data.clock import CLOCK_ATTR, rank_clock
from commpatch.data.frame import parse_log, parsed_clock
from commpatch.io import read
from commpatch.io.reader import one_run
from commpatch.render import text as report
from commpatch.testing import make_log
from tests.conftest import ROOT
from tests.torch_compat import file_store_exchange_unsupported

from .clock_workers import exchange_job, tcp_exchange
from .multiproc import free_port, run_ranks

FILE_STORE = pytest.mark.skipif(
    file_store_exchange_unsupported() is not None, reason=str(file_store_exchange_unsupported())
)


def test_rank_clock_bounds_interpolates_and_says_unknown():
    s = 1_000_000_000
    # two rounds 0.1 s apart: the second's interval narrower; the first tightened by it, widened by the
    # drift allowed meanwhile (50 us)
    c = rank_clock(
        1, 2, [(100 * s, -3 * s - 400_000, -3 * s + 400_000), (100 * s + s // 10, -3 * s - 50_000, -3 * s + 30_000)]
    )
    info = c.summary()
    assert info["status"] == "measured" and info["measurements"] == 2
    assert c.half == (90_000, 40_000) and c.mid[0] == -3 * s - 10_000
    assert info["uncertainty_us"] == max(c.half) / 1e3
    shift = c.shift(np, np.array([90 * s, 100 * s + s // 20, 120 * s], np.int64))
    assert shift[0] == round(c.mid[0]) and shift[2] == round(c.mid[1])  # constant outside
    assert min(c.mid) <= shift[1] <= max(c.mid)  # interpolated between
    # disjoint intervals (a stepped clock): each kept as measured
    c = rank_clock(1, 2, [(0, 0, 10), (1000, 5 * s, 5 * s + 10)])
    assert c.half == (5.0, 5.0)
    # rank 0 on this machine (same boot id) and every interval holding 0: one wall clock, offset 0 exactly
    c = rank_clock(2, 4, [(0, -5000, 7000, 1), (s, -6000, 1000, 1)])
    zero = dict(offset_us=0.0, uncertainty_us=0.0, min_offset_us=0.0, max_offset_us=0.0, jumps=0)
    assert c.summary() == dict(status="same_machine", **zero, inconsistent=0, measurements=2)
    assert not c.shift(np, np.array([5], np.int64)).any()
    # ... also when an interval excludes 0, or a round says another machine (issue 33: a per-process
    # clock shim, or answers rewritten through the store): never shifted, those rounds counted
    c = rank_clock(2, 4, [(0, -5000, 7000, 1), (s, 2000, 9000, 1), (2 * s, 3 * s, 3 * s + 9, 0)])
    assert c.summary() == dict(status="same_machine", **zero, inconsistent=2, measurements=3)
    assert not c.shift(np, np.array([5, 3 * s], np.int64)).any()
    assert rank_clock(2, 4, [(0, -5000, 7000, 0)]).summary()["status"] == "measured"  # another machine
    assert rank_clock(0, 4, []).summary() == dict(status="reference", **zero, inconsistent=0, measurements=0)
    # another machine whose offset jumps by 3 s between rounds beyond their intervals (a stepped clock or a
    # tampered exchange): applied as measured, counted, and the uncertainty covers the jump
    c = rank_clock(1, 2, [(0, -100, 100, 0), (s, -50, 60, 0), (2 * s, 3 * s - 100, 3 * s + 100, 0)])
    info = c.summary()
    assert info["jumps"] == 1 and c.jumps[0][0] == 2 * s and abs(c.jumps[0][1] - 3 * s) < 1000
    assert info["min_offset_us"] < 1 and info["max_offset_us"] > 2.9e6 and info["uncertainty_us"] > 3e6
    # drift within DRIFT between rounds is no jump
    assert rank_clock(1, 2, [(0, -100, 100, 0), (100 * s, 40_000, 50_000, 0)]).summary()["jumps"] == 0
    unknown = rank_clock(3, 4, []).summary()
    assert (
        unknown["status"] == "unmeasured" and math.isnan(unknown["offset_us"]) and math.isnan(unknown["uncertainty_us"])
    )


def _log(rank: int, offsets=(), extra=()) -> bytes:
    frames = [logfile.MAGIC, logfile.meta("header", version=1, schema=1, rank=rank, world_size=2, pid=1)]
    frames += [logfile.meta("rank0_offset", at=a, lo=lo, hi=hi) for a, lo, hi in offsets] + list(extra)
    return b"".join(frames)


def test_the_log_records_intervals_and_skips_bad_ones():
    parsed = parse_log(
        _log(
            1,
            [(5, -10, 20)],
            [
                logfile.meta("rank0_offset", at=6, lo=30, hi=20),
                logfile.meta("rank0_offset", at=7, lo="x", hi=20),
                logfile.meta("rank0_offset", at=8, lo=0, hi=20, same=2),
            ],
        )
    )
    # an empty interval, a non-number, a flag out of range
    assert parsed.rank0_offsets == [(5, -10, 20, 0)] and parsed.bad_records == 3
    assert parsed_clock(parsed).summary()["offset_us"] == 0.005


def test_the_verdict_weighs_the_clocks_uncertainty():
    steps = pd.DataFrame(
        {
            "step": np.arange(30),
            "stage": ["setup"] + ["steady"] * 28 + ["end"],
            "step_us": [10_000.0] * 29 + [np.nan],
            "ranks": 2,
        }
    )
    late = np.r_[0.0, np.random.default_rng(3).normal(3000, 200, 29)]  # rank 1: 3 ms late every step
    arrivals = pd.DataFrame(
        {
            "step": np.repeat(np.arange(30), 2),
            "rank": np.tile([0, 1], 30),
            "held_us": np.column_stack([np.zeros(30), late]).ravel(),
            "collectives": 2,
        }
    )

    def clock(u1):
        return {
            0: dict(status="reference", offset_us=0.0, uncertainty_us=0.0, measurements=0),
            1: dict(
                status="measured" if not math.isnan(u1) else "unmeasured",
                offset_us=-1e6,
                uncertainty_us=u1,
                measurements=1,
            ),
        }

    assert verdict(arrivals, steps)["straggler"]  # no clock information: as before
    assert verdict(arrivals, steps, clock(100.0))["straggler"]
    v = verdict(arrivals, steps, clock(4000.0))  # within +/-4 ms: no evidence
    assert not v["straggler"] and v["reason"] == "clock" and v["clock_us"] == 4000.0
    measured = clock(100.0)
    measured[2] = dict(status="unmeasured", offset_us=math.nan, uncertainty_us=math.nan, measurements=0)
    three = pd.concat([arrivals, arrivals[arrivals["rank"] == 0].assign(rank=2)], ignore_index=True)
    v = verdict(three, steps, measured)  # rank 2's clock unknown
    assert not v["straggler"] and v["reason"] == "clock" and math.isnan(v["clock_us"])
    # worded in the report
    df = make_log(2, 12, straggler=1, straggler_delay_us=3000.0, seed=2)
    df.attrs[CLOCK_ATTR] = clock(5000.0)
    rep = report.build_report(df)
    text = [f.text for f in rep.findings if f.kind == "straggler"][0]
    assert "no straggler" in text and "within the uncertainty of the clocks' offsets (+/-5 ms)" in text, text
    assert [f.text for f in rep.findings if f.kind == "clock"] == [
        "Clocks: the wall clocks of rank(s) 1 differ from rank 0's (the most: rank 1, 1 s ahead, measured to "
        "+/-5 ms); issue times are aligned to rank 0's clock (largest uncertainty +/-5 ms)."
    ]
    assert rep.sections["clock"]["status"].tolist() == ["reference", "measured"]
    df.attrs[CLOCK_ATTR] = clock(100.0)
    text = [f.text for f in report.build_report(df).findings if f.kind == "straggler"][0]
    assert "the straggler" in text, text


def test_one_run_is_read_from_every_host_directory(tmp_path):
    for host, names in (("a", ["20260101-000000-a-1", "20260101-000100-a-2"]), ("b", ["20260101-000100-a-2"])):
        for name in names:
            d = tmp_path / host / name
            d.mkdir(parents=True)
            (d / "rank0.csv").write_text("x\n")
    chosen = one_run([str(tmp_path / "a"), str(tmp_path / "b")])
    assert {os.path.basename(v) for v in chosen.values()} == {"20260101-000100-a-2"}
    (tmp_path / "b" / "20260101-000200-b-3").mkdir()
    (tmp_path / "b" / "20260101-000200-b-3" / "rank1.csv").write_text("x\n")
    chosen = one_run([str(tmp_path / "a"), str(tmp_path / "b")])  # b's latest is not a's: the common one
    assert {os.path.basename(v) for v in chosen.values()} == {"20260101-000100-a-2"}


@pytest.mark.slow
@FILE_STORE
def test_the_exchange_in_real_ranks_bounds_a_shared_clock(tmp_path):
    """4 gloo ranks on one machine (one wall clock: the true offset is 0): every rank but 0 writes
    intervals that hold 0, measured beside the job's collectives (through a clone of the process
    group's store, a FileStore here), whose results are unchanged and whose rows hold only the
    job's calls (nothing on the user's groups)."""
    calls = run_ranks(exchange_job, 4, timeout=180, out=str(tmp_path), seconds=3.0)
    for path in sorted(glob.glob(str(tmp_path / "rank*.cplog"))):
        with open(path, "rb") as f:
            parsed = parse_log(f.read(), path)
        rank = parsed.header["rank"]
        df = read(path)
        assert df["op"].astype(str).value_counts().to_dict() == {"all_reduce": calls[rank], "barrier": 1}
        if rank == 0:
            assert parsed.rank0_offsets == []
            continue
        assert len(parsed.rank0_offsets) >= 2, parsed.rank0_offsets  # at the first call, then 2 s later
        for _, lo, hi, same in parsed.rank0_offsets:
            assert lo <= 0 <= hi and same == 1
        assert parsed_clock(parsed).summary()["status"] == "same_machine"


@pytest.mark.slow
def test_the_exchange_over_a_tcp_store():
    """Rank 0's thread serves 3 ranks through a TCPStore (rank 0 holds the server): two rounds each,
    every interval holding 0 (one machine)."""
    results = run_ranks(tcp_exchange, 4, timeout=120, port=free_port(), seconds=4.0)
    for rank, (noted, rounds, error) in enumerate(results):
        assert error == "" and rounds >= 2, (rank, rounds, error)
        assert (noted == []) == (rank == 0)
        for _, lo, hi, same in noted:
            assert lo <= 0 <= hi and same


@pytest.mark.parametrize("prefixed", [False, True], ids=["tcp_store", "prefix_store"])
def test_a_rank_whose_thread_starts_later_is_measured_and_stop_ends_both_threads(prefixed):
    """Rank 1's first collective (and so its thread) comes 1 s after rank 0's: rank 0 serves it in a
    later round instead of waiting for it (and marking it gone); stop() ends both threads at once,
    though each is blocked in the store (rank 1 waiting for its next turn, minutes away). Through
    the exchange's own client of the TCPStore, found under the process group's prefix store too
    (its keys are the TCPStore's own)."""
    import time

    import torch.distributed as dist

    from commpatch.record.clocksync import ClockSync, connection
    from commpatch.record.storeclient import StoreClient

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False)
    stores = [dist.PrefixStore("default_pg", s) for s in (server, client)] if prefixed else [server, client]
    noted = []

    def sync(rank, note):
        store, connect = connection(stores[rank])
        assert isinstance(store, StoreClient) and connect() is store and store.port == port
        return ClockSync(store, rank, 2, note, generation="late", connect=connect)

    first = sync(0, lambda *a: None)
    time.sleep(1.0)
    second = sync(1, lambda *a: noted.append(a))
    deadline = time.monotonic() + 20
    while not noted and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert second.thread.is_alive() and first.thread.is_alive()
    second.stop(join_s=5)
    first.stop(join_s=5)
    assert not second.thread.is_alive() and not first.thread.is_alive()
    assert noted and all(lo <= 0 <= hi and same for _, lo, hi, same in noted), noted
    assert first.gone == set() and first.error == second.error == ""
    assert server.check(["commpatch/clock/late/ready/1"])  # torch's own client finds the exchange's keys


STORE_DIES = """
import os, signal, subprocess, sys, time
import torch.distributed as dist
from commpatch.record.clocksync import ClockSync
port, how = int(sys.argv[1]), sys.argv[2]
host = subprocess.Popen([sys.executable, "-c", f"import torch.distributed as d, time; "
    f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); print(1, flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE)
host.stdout.readline()
store = dist.TCPStore("127.0.0.1", port, 2, False)
connect = store.clone if how == "torch_clone" else None
sync = ClockSync(store, 1, 2, lambda *a: None, generation="dies", connect=connect)
time.sleep(0.5)  # its thread waits in the store for its first turn (rank 0 has no exchange here)
host.kill()
host.wait()
for _ in range(100):
    if not sync.thread.is_alive():
        break
    time.sleep(0.05)
print("ended:", not sync.thread.is_alive(), "error:", sync.error, flush=True)
"""


@pytest.mark.parametrize("how", ["own_client", "torch_clone"])
def test_the_stores_host_dying_prints_nothing_into_the_job(how):
    """Issue 33: the store's host dies (SIGKILL) while a rank's exchange thread waits in the store.
    Through the exchange's own client: the thread ends, its reason kept, and the rank's stderr holds
    nothing. Through torch's C++ client (a clone of the store, as before; the control that shows
    the test can fail): torch's warning with its stack frames."""
    import subprocess
    import sys

    import torch.distributed as dist

    if how == "torch_clone" and not hasattr(dist.TCPStore, "clone"):
        pytest.skip("this torch has no Store.clone(): the control needs it")
    done = subprocess.run(
        [sys.executable, "-c", STORE_DIES, str(free_port()), how], capture_output=True, text=True, timeout=120
    )
    assert "ended: True" in done.stdout, (done.stdout, done.stderr)
    if how == "own_client":
        assert "error: Connection" in done.stdout, done.stdout  # ConnectionError or ConnectionResetError
        assert done.stderr == "", done.stderr
    else:
        assert "TCPStore.cpp" in done.stderr and "frame #" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("other_machine", [False, True], ids=["same_machine", "other_machine"])
def test_answers_rewritten_through_the_store_make_no_straggler(tmp_path, other_machine):
    """Issue 33: a process that can reach the job's TCPStore answers rank 1's exchange for rank 0,
    rank 0's clock +3 s, from the second round on (the first is honest). Before: the report blamed
    rank 1 as a ~3 s straggler with no clock warning. Now: on rank 0's machine (same boot id) rank 1
    is never shifted (offset 0, the forged rounds counted); on another machine (rank 1's boot id
    taken as another's) the jump between rounds is reported and covered by the uncertainty. No
    straggler either way, and the Clocks table shows the offsets applied."""
    import multiprocessing as mp
    import time

    from tests.clock_workers import rewrite_answers, tcp_job, warm

    port = free_port()
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(warm)
        attack = pool.apply_async(rewrite_answers, (port, 1, 3_000_000_000, time.time() + 60))
        run_ranks(
            tcp_job, 2, timeout=180, out=str(tmp_path), port=port, seconds=4.0, boot_id="x" if other_machine else ""
        )
        written = attack.get(timeout=90)
    assert written, "the attacker found no exchange key"
    with open(tmp_path / "rank1.cplog", "rb") as f:
        parsed = parse_log(f.read())
    assert len(parsed.rank0_offsets) >= 2, parsed.rank0_offsets
    forged = [o for o in parsed.rank0_offsets if o[1] > 2e9]  # the rounds the attacker answered
    assert forged, parsed.rank0_offsets
    df = read(str(tmp_path))
    rep = report.build_report(df)
    (text,) = [f.text for f in rep.findings if f.kind == "straggler"]
    assert "the straggler" not in text, text
    (clocks,) = [f.text for f in rep.findings if f.kind == "clock"]
    row = rep.sections["clock"].set_index("rank").loc[1]
    if other_machine:
        assert row["status"] == "measured" and row["jumps"] >= 1, row
        assert row["max_offset_us"] > 2e6 and row["uncertainty_us"] > 2e6, row
        assert "jumped between rounds" in clocks, clocks
    else:
        assert row["status"] == "same_machine" and row["offset_us"] == 0 == row["max_offset_us"], row
        assert "run on rank 0's machine" in clocks and "not applied" in clocks, clocks


def test_the_verdict_of_a_result_is_computed_once_per_steps_table():
    """``stragglers.of``: findings, headline and advice ask for the same result's verdict: computed
    once (2 s each at 16,384 ranks), a copy each time; a new steps table or new arrivals are judged
    anew."""
    import types

    from commpatch.analysis import stragglers

    steps = pd.DataFrame(
        {"step": np.arange(30), "stage": ["setup"] + ["steady"] * 28 + ["end"], "step_us": 10_000.0, "ranks": 2}
    )
    late = np.r_[0.0, np.random.default_rng(3).normal(3000, 200, 29)]
    arrivals = pd.DataFrame(
        {
            "step": np.repeat(np.arange(30), 2),
            "rank": np.tile([0, 1], 30),
            "held_us": np.column_stack([np.zeros(30), late]).ravel(),
            "collectives": 2,
        }
    )
    cross = types.SimpleNamespace(step_arrivals=arrivals)
    calls = []
    original = stragglers.verdict
    try:
        stragglers.verdict = lambda *a: calls.append(a) or original(*a)
        first = stragglers.of(cross, steps)
        first["rank"] = "changed by a caller"
        again = stragglers.of(cross, steps)
        assert len(calls) == 1 and again["rank"] == 1 and again["straggler"]
        cross.step_arrivals = arrivals.assign(held_us=arrivals["held_us"][::-1].to_numpy())  # rank 0 late now
        assert stragglers.of(cross, steps)["rank"] == 0 and len(calls) == 2
        assert stragglers.of(cross, steps.copy())["rank"] == 0 and len(calls) == 3
    finally:
        stragglers.verdict = original


STOPPED_AT_DESTROY = """
import sys, time
import torch.distributed as dist
from commpatch.record.clocksync import ClockSync
from commpatch.session import Session


class SlowClone:
    # the thread's cloned store on a loaded machine: its wait comes back 0.5 s after the key is set
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait(self, keys, timeout):
        self.inner.wait(keys, timeout)
        time.sleep(0.5)


store = dist.FileStore(sys.argv[1], 2)
session = Session()
session.clock = ClockSync(store, 1, 2, lambda *a: None, generation="g", connect=lambda: SlowClone(store.clone()))
time.sleep(0.3)  # rank 1's thread waits in the store for rank 0's answer (no rank 0 here)
thread = session.clock.thread
session._on_destroy()  # destroy_process_group(): the clock stopped, not waited for
print("in the store after destroy:", thread.is_alive())
session.write_at_exit()  # the process's end
print("in the store at the end of the exit:", thread.is_alive())
"""


@FILE_STORE
def test_a_clock_stopped_by_destroy_process_group_is_joined_at_exit(tmp_path):
    """destroy_process_group() stops the clock thread without waiting for it (the job goes on); the
    exit then waited only for a clock still running, so a thread that destroy had stopped could still
    be inside its cloned store (a C++ call) when the interpreter finalized: coming back, a daemon
    thread is ended by pthread_exit inside pybind11's GIL guard and the process aborted ("terminate
    called without an active exception", exit status -6: once in a suite run, in
    tests/test_metrics.py's 2-rank job, which destroys its group and exits). The exit now joins it."""
    script = tmp_path / "job.py"
    script.write_text(STOPPED_AT_DESTROY)
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == [
        "in the store after destroy: True",
        "in the store at the end of the exit: False",
    ], p.stdout + p.stderr[-3000:]
