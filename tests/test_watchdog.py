"""The hang watchdog: a real 2-rank gloo hang, and the dump's content and rules in one process."""

import os
import threading
import time

import pytest

import commpatch
from commpatch import session as _session
from commpatch import watchdog
from commpatch.data.ops import OP_CODE
from commpatch.record import state as _runtime
from tests.fakepg import fake_world
from tests.multiproc import run_ranks

THRESHOLD_S = 0.5


def _hang_worker(rank, world_size, out_dir):
    """Rank 1 skips a barrier; rank 0 hangs in it until its dump exists and rank 1 leaves."""
    import torch
    import torch.distributed as dist

    commpatch.enable(output=os.path.join(out_dir, "rank{rank}.csv"), watchdog=THRESHOLD_S)
    t = torch.ones(4)
    dist.all_reduce(t)
    dump_path = os.path.join(out_dir, "hang_rank0.txt")
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(dump_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    try:
        dist.barrier()  # THE HUNG CALL
    except RuntimeError as exc:  # peer gone or the group's timeout
        error = str(exc)
    else:
        error = None
    with open(dump_path) as f:
        return f.read(), error, t.tolist(), os.path.exists(os.path.join(out_dir, "hang_rank1.txt"))


@pytest.mark.slow
def test_hung_barrier_is_dumped_with_its_group_and_the_calling_line(tmp_path):
    dump, error, reduced, rank1_dumped = run_ranks(_hang_worker, 2, timeout=120, pg_timeout=20, out_dir=str(tmp_path))[
        0
    ]
    assert error is not None, "the barrier should have failed once rank 1 left"
    assert reduced == [2.0] * 4
    assert "rank 0 pid" in dump
    stuck = [ln for ln in dump.splitlines() if ln.startswith("[STUCK]")]
    assert len(stuck) == 1 and " barrier " in stuck[0]
    assert "group=0 (ranks 0 1; size 2; gloo)" in stuck[0]
    assert "dist.barrier()  # THE HUNG CALL" in dump
    assert f"{__file__}" in dump and "in _hang_worker" in dump
    # the completed all_reduce before it, decoded from the log
    assert "all_reduce" in dump.split("recorded call(s)")[1]
    assert not rank1_dumped, "rank 1 had nothing in flight"


# ---- one process: the rules of the dump, with a simulated stuck call ---------------------


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    with fake_world(8):
        yield


class StuckThread:
    """A thread parked inside a function, registered in LOG.pending as if in a collective."""

    seqs = iter(range(10**9, 2 * 10**9))

    def __init__(self, op="all_reduce", numel=6, age_s=10.0, issue_stack=None):
        self.release, self.ready = threading.Event(), threading.Event()
        self.seq = next(self.seqs)
        self.entry = (OP_CODE[op], 0, numel, None, time.perf_counter_ns() - int(age_s * 1e9), issue_stack)
        self.thread = threading.Thread(target=self.parked_in_a_collective, name="trainer")

    def parked_in_a_collective(self):
        entry = list(self.entry)
        entry[3] = threading.get_ident()
        _session.default().log.pending[self.seq] = tuple(entry)
        self.ready.set()
        self.release.wait(30)  # the line the dump must show
        _session.default().log.pending.pop(self.seq, None)

    def __enter__(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(10)


def _dog(output):
    """A watchdog that is never started: tests call check() themselves (no waiting on time)."""
    return watchdog.Watchdog(_session.default().log, THRESHOLD_S, output)


def test_dump_lists_the_call_its_stack_and_the_last_rows_once_per_stuck_call(tmp_path, capsys):
    import torch
    import torch.distributed as dist

    commpatch.enable(output=str(tmp_path / "logs" / "rank{rank}.csv"))
    for _ in range(30):
        dist.all_reduce(torch.ones(3))
    dist.all_gather_into_tensor(torch.ones(16), torch.ones(2))
    dog = _dog(str(tmp_path / "logs" / "rank{rank}.csv"))
    with StuckThread(op="reduce_scatter_tensor", numel=6):
        dump = dog.check()
        assert dog.check() is None, "a stuck call is dumped once"
    assert dump is not None
    assert capsys.readouterr().err == dump
    with open(tmp_path / "logs" / "hang_rank0.txt") as f:
        assert f.read() == dump
    stuck = [ln for ln in dump.splitlines() if ln.startswith("[STUCK]")]
    assert len(stuck) == 1 and "reduce_scatter_tensor  seq=1" in stuck[0] and "  group=0 (ranks" in stuck[0]
    # numbered in its group as on every rank and in the report, from 1: the 32nd, after the 31 calls above
    assert "  collective #32 of group 0  " in stuck[0]
    assert "numel=6" in stuck[0] and "thread 'trainer'" in stuck[0]
    assert "self.release.wait(30)  # the line the dump must show" in dump
    tail = dump.split("recorded call(s) on this rank")[1].splitlines()[2:-1]
    assert len(tail) == watchdog.LAST_ROWS
    assert "all_gather_into_tensor" in tail[-1] and " 16 " in tail[-1] and " 64 " in tail[-1]
    assert all("all_reduce" in ln for ln in tail[:-1])


def test_the_last_rows_survive_a_flush_that_takes_one_row(tmp_path):
    """The flusher may collect between any two calls: the watchdog's last rows keep what earlier
    flushes took (they once kept only the last flush's rows, one row when it took one)."""
    import torch
    import torch.distributed as dist

    commpatch.enable(output=str(tmp_path / "rank{rank}.csv"))
    log = _session.default().log
    for _ in range(30):
        dist.all_reduce(torch.ones(3))
    log.flush()
    dist.all_gather_into_tensor(torch.ones(16), torch.ones(2))
    log.flush()
    rows = log.recent_rows()
    assert len(rows) >= 31
    assert [OP_CODE["all_reduce"]] * 30 + [OP_CODE["all_gather_into_tensor"]] == rows["op"][-31:].tolist()
    assert (rows["seq"][1:] == rows["seq"][:-1] + 1).all()


def test_async_call_shows_where_it_was_issued_and_output_none_writes_to_cwd(tmp_path, monkeypatch, capsys):
    """An async call whose completion never comes (its future callback is never attached)."""
    import torch
    import torch.distributed as dist

    from commpatch.data.schema import T_FUTURE

    monkeypatch.chdir(tmp_path)
    commpatch.enable(output="none", watchdog=600)
    monkeypatch.setattr(_session.default().timing, "future", lambda *args: T_FUTURE)
    work = dist.all_reduce(torch.ones(3), async_op=True)  # ISSUED HERE
    work.wait()
    dump = _dog("").check(now_ns=time.perf_counter_ns() + 10**10)
    assert "[STUCK] all_reduce" in dump and "issued from (async call" in dump
    assert "in test_async_call_shows_where_it_was_issued" in dump
    assert "work = dist.all_reduce(torch.ones(3), async_op=True)  # ISSUED HERE" in dump
    assert (tmp_path / "hang_rank0.txt").read_text() == dump
    _session.default().log.pending.clear()
    capsys.readouterr()


def test_a_young_call_is_not_stuck_and_a_finished_one_is_forgotten(capsys):
    commpatch.enable(output="none")
    dog = _dog("")
    with StuckThread(age_s=0):
        assert dog.check() is None
    assert not dog.reported
    capsys.readouterr()


def test_enable_starts_the_thread_and_disable_stops_it():
    commpatch.enable(output="none")
    assert not watchdog.running(), "off by default"
    commpatch.disable()
    commpatch.enable(output="none", watchdog=30)
    assert watchdog.running()
    commpatch.disable()
    assert not watchdog.running()


def test_the_thread_itself_writes_the_dump(tmp_path, capsys):
    commpatch.enable(output=str(tmp_path / "rank{rank}.csv"), watchdog=0.2)
    with StuckThread(age_s=0):
        deadline = time.monotonic() + 30
        while not (tmp_path / "hang_rank0.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "[STUCK] all_reduce" in (tmp_path / "hang_rank0.txt").read_text()
    capsys.readouterr()


@pytest.fixture
def no_output_at_exit():
    """The test breaks its output directory: the exit writer must not try it after the test."""
    yield
    _runtime.STATE.settings = {}


@pytest.mark.faults
@pytest.mark.usefixtures("no_output_at_exit")
def test_an_unwritable_dump_file_still_reaches_stderr_with_one_warning(tmp_path, capsys):
    commpatch.enable(output=str(tmp_path / "logs" / "rank{rank}.csv"))  # creates nothing yet
    (tmp_path / "logs").write_text("a file where the directory should go")
    dog = _dog(str(tmp_path / "logs" / "rank{rank}.csv"))
    with pytest.warns(RuntimeWarning, match="watchdog") as record:
        with StuckThread():
            assert dog.check() is not None
        with StuckThread(op="broadcast"):
            assert dog.check() is not None, "a second stuck call is a second dump"
    assert len([w for w in record if "commpatch" in str(w.message)]) == 1
    assert capsys.readouterr().err.count("[STUCK]") == 2
    assert _runtime.ERRORS == {"watchdog.file": 2}
