"""Bounded memory: rows streamed to the per-rank file in chunks, the hard cap without a file,
fork safety, and the rows of crashed / interrupted runs on disk."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist

import commpatch
from commpatch import _session
from commpatch._log import CHUNK


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def _calls(n):
    t = torch.ones(2)
    for i in range(n):
        if i % 7 == 0:
            dist.all_reduce(t, async_op=True).wait()    # some rows resolve late
        else:
            dist.all_reduce(t)


def test_rows_stream_to_the_file_and_memory_stays_bounded(tmp_path):
    max_rows = CHUNK
    n = 5 * CHUNK + 123
    out = tmp_path / "rank{rank}.csv"
    commpatch.enable(output=str(out), max_rows=max_rows)
    peak = 0
    t = torch.ones(2)
    for i in range(n):
        dist.all_reduce(t, async_op=(i % 7 == 0))
        peak = max(peak, len(_session.LOG))
    assert peak <= max_rows + CHUNK, peak               # checked every CHUNK calls
    assert _session.LOG.flushed >= n - max_rows - CHUNK
    on_disk = commpatch.read_csv(str(tmp_path / "rank0.csv"))
    assert len(on_disk) == _session.LOG.flushed        # the file is readable mid-run
    df = commpatch.log()                               # file + memory
    assert len(df) == n and df["seq"].is_unique and (np.diff(df["seq"]) == 1).all()
    assert (np.diff(df["group_seq"]) == 1).all()       # continuous across flushes
    assert df.loc[df["async_op"], "timing"].eq("future").all()
    assert df["duration_us"].notna().all()


def test_exit_appends_the_tail_once(tmp_path):
    out = tmp_path / "rank{rank}.csv"
    commpatch.enable(output=str(out), max_rows=CHUNK)
    _calls(2 * CHUNK + 50)
    from commpatch import export

    export.write_at_exit(reason="destroy_process_group")
    export.write_at_exit()                              # a second call must not duplicate rows
    df = commpatch.read_csv(str(tmp_path / "rank0.csv"))
    assert len(df) == 2 * CHUNK + 50 and df["seq"].is_unique


def test_hard_cap_without_a_file_counts_dropped_rows():
    commpatch.enable(output="none", max_rows=CHUNK)
    with pytest.warns(RuntimeWarning, match="dropped"):
        _calls(3 * CHUNK)
    df = commpatch.log()
    assert len(df) + df.attrs["dropped_rows"] == 3 * CHUNK
    assert df.attrs["dropped_rows"] >= CHUNK
    assert (np.diff(df["group_seq"]) == 1).all()


def test_streaming_needs_csv(tmp_path):
    with pytest.raises(commpatch.ConfigError, match="COMMPATCH_MAX_ROWS.*csv"):
        commpatch.enable(output=str(tmp_path / "r.parquet"), max_rows=10)


@pytest.mark.parametrize("env, value", [("COMMPATCH_MAX_ROWS", "-1"), ("COMMPATCH_MAX_ROWS", "lots")])
def test_bad_max_rows(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(commpatch.ConfigError, match=env):
        commpatch.enable(output="none")


FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys, time, torch, torch.distributed as dist, commpatch
    from commpatch import export

    def worker(q):                     # a DataLoader-like worker (fork start method)
        q.put(len(commpatch.log()))    # the parent's rows are not the child's
        q.put(export.write_at_exit())  # what its exit would do: write nothing
        time.sleep(60)                 # then the parent terminates it (SIGTERM, our handler runs)

    if __name__ == "__main__":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
        commpatch.enable(output=sys.argv[1])
        for _ in range(20):
            dist.all_reduce(torch.ones(2))
        q = multiprocessing.get_context("fork").Queue()
        p = multiprocessing.get_context("fork").Process(target=worker, args=(q,))
        p.start()
        assert q.get(timeout=30) == 0, "the child sees the parent's rows"
        assert q.get(timeout=30) is None, "the child wrote a file"
        p.terminate()
        p.join(30)
        assert p.exitcode == -15, p.exitcode
        dist.all_reduce(torch.ones(2))
""")


def test_forked_child_neither_rewrites_nor_corrupts_the_parents_file(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FORK_SCRIPT)
    out = tmp_path / "out.csv"
    res = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=90,
                         env={k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")})
    assert res.returncode == 0, res.stderr[-2000:]
    df = commpatch.read_csv(str(out))
    assert len(df) == 21 and (df["pid"] != 0).all() and df["pid"].nunique() == 1


CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch, torch.distributed as dist, commpatch
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
    commpatch.enable(output=sys.argv[1])
    for _ in range(30):
        dist.all_reduce(torch.ones(2))
    mode = sys.argv[2]
    if mode == "exception":
        raise RuntimeError("the training loop crashed")
    if mode == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    if mode == "destroy_then_kill":
        dist.destroy_process_group()
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("mode, code", [("exception", 1), ("sigint", 1), ("destroy_then_kill", -signal.SIGKILL)])
def test_rows_reach_disk_when_the_job_dies(tmp_path, mode, code):
    script = tmp_path / "job.py"
    script.write_text(CRASH_SCRIPT)
    out = tmp_path / "out.csv"
    res = subprocess.run([sys.executable, str(script), str(out), mode], capture_output=True, text=True, timeout=90,
                         env={k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")})
    assert res.returncode == code, res.stderr[-2000:]
    assert len(commpatch.read_csv(str(out))) == 30


EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, commpatch
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    commpatch.enable(output=sys.argv[1], max_rows=int(sys.argv[2]))
    t = torch.ones(2)
    for _ in range(int(sys.argv[3])):
        dist.all_reduce(t)
""")


@pytest.mark.parametrize("max_rows", [0, CHUNK])
def test_large_log_is_written_at_interpreter_exit(tmp_path, max_rows):
    """Regression: at exit, thread pools refuse work; a large frame must still be converted."""
    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    out = tmp_path / "out.csv"
    n = 2 * CHUNK + 1000
    res = subprocess.run([sys.executable, str(script), str(out), str(max_rows), str(n)], capture_output=True,
                         text=True, timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")})
    assert res.returncode == 0 and "internal error" not in res.stderr, res.stderr[-2000:]
    assert len(commpatch.read_csv(str(out))) == n
