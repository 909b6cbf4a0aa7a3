"""The kill matrix: however a 2-rank gloo job ends, every row of a call that returned before the
end is on disk and readable, and the process ends with the status, and about as fast, as without
commpatch. Every scenario runs at once (plain and instrumented), in real processes, bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import commpatch
from commpatch.data.schema import compact_ranks, printable_name
from tests.durable_worker import CALLS
from tests.multiproc import default_signals
from tests.torch_compat import destroy_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mode -> signals the test sends once both ranks are ready (and 1 s has passed), with the gap
SCENARIOS = {
    "exit": (),
    "exception": (),
    "os_exit": (),
    "sigint": (signal.SIGINT,),
    "sigterm": (signal.SIGTERM,),
    "sigterm_twice": (signal.SIGTERM, signal.SIGTERM),
    "hang": (signal.SIGTERM,),
    "sighup": (signal.SIGHUP,),
    "sigusr1": (signal.SIGUSR1,),
    "sigabrt": (signal.SIGABRT,),
    "sigsegv": (signal.SIGSEGV,),
    "sigkill": (signal.SIGKILL,),
    "user_handler": (signal.SIGTERM,),
}


def _launch(tmp, mode, plain):
    out = tmp / ("plain" if plain else "cp") / mode
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")}
    env["PYTHONPATH"] = ROOT
    procs = []
    for rank in range(2):
        cmd = [
            sys.executable,
            "-m",
            "tests.durable_worker",
            "--rank",
            str(rank),
            "--store",
            str(out / "store"),
            "--out",
            str(out),
            "--mode",
            "hang" if mode == "hang" else mode,
        ]
        procs.append(
            subprocess.Popen(
                cmd + (["--plain"] if plain else []),
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=default_signals,
            )
        )
    return out, procs


BATCH = 6  # scenarios run at once (4 processes each, with the plain reference): 44 torch
# processes started together on a 2-core machine did not all start within the deadline


def _run_batch(runs: dict, results: dict) -> None:
    """Runs the scenarios ``runs`` {(mode, plain): (out, procs)} to their end (signalled once both
    ranks are ready), filling ``results``; their processes are killed whatever happens."""
    deadline = time.time() + 150
    signalled = {}
    try:
        while len(results.keys() & runs.keys()) < len(runs) and time.time() < deadline:
            for key, (out, procs) in runs.items():
                if key in results:
                    continue
                mode, _ = key
                sigs = SCENARIOS[mode]
                ready = [out / f"ready{r}" for r in range(2)]
                if sigs and key not in signalled and all(p.exists() for p in ready):
                    if time.time() - max(p.stat().st_mtime for p in ready) >= 1.0:
                        for i, sig in enumerate(sigs):
                            if i:
                                time.sleep(0.01)
                            for proc in procs:
                                if proc.poll() is None:
                                    proc.send_signal(sig)
                        signalled[key] = time.time()
                if all(p.poll() is not None for p in procs):
                    ended = time.time()
                    results[key] = (
                        out,
                        [p.returncode for p in procs],
                        ended - signalled.get(key, ended),
                        [p.stderr.read().decode(errors="replace")[-2000:] for p in procs],
                    )
            time.sleep(0.05)
    finally:  # also when pytest's timeout interrupts: no process left behind
        for _out, procs in runs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """{(mode, plain): (out dir, [returncode per rank], [seconds from the signal to the exit])}"""
    tmp = tmp_path_factory.mktemp("kill")
    keys = [(mode, plain) for mode in sorted(SCENARIOS) for plain in (True, False)]
    results = {}
    for i in range(0, len(keys), BATCH):
        _run_batch({key: _launch(tmp, *key) for key in keys[i : i + BATCH]}, results)
    missing = sorted(set(keys) - set(results))
    assert not missing, f"scenarios that did not end in time: {missing}"
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one runs the whole matrix (its fixture)
@pytest.mark.parametrize("mode", sorted(SCENARIOS))
def test_rows_survive_and_the_exit_is_unchanged(matrix, mode):
    plain_out, plain_codes, plain_s, _ = matrix[(mode, True)]
    out, codes, seconds, stderr = matrix[(mode, False)]
    assert codes == plain_codes, (codes, plain_codes, stderr)
    assert seconds <= plain_s + 1.0, (seconds, plain_s)
    runs = [d for d in out.iterdir() if d.is_dir()]
    assert len(runs) == 1, runs  # one run directory, agreed by the ranks
    df = commpatch.read_csv(str(runs[0]))
    for rank in (0, 1):
        rows = df[df["rank"] == rank].sort_values("seq")
        ops = rows["op"].astype(str)
        first = rows[ops == "all_reduce"].head(CALLS)
        assert len(first) == CALLS, (rank, len(first))
        assert first["seq"].tolist() == list(range(CALLS))  # every call, in order, once
        assert (first["bytes"] == 64 * 4).all() and (first["group_ranks"] == "0 1").all()
        assert first["duration_us"].notna().all() and (first["status"] == "ok").all()
        assert first["start_ns"].is_monotonic_increasing


# ---- where the files go ----------------------------------------------------------------------


def _spawned_rank(rank, world_size, out):
    """A rank started by torch.multiprocessing (spawn, fork or forkserver) from a parent where
    commpatch is enabled: it initialises its own group, so it writes its own file."""
    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))  # a no-op if inherited enabled
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size)
    for _ in range(5):
        dist.all_reduce(torch.ones(2))
    destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_every_rank_writes_its_own_file_whatever_starts_it(tmp_path, method):
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, torch.multiprocessing as mp, commpatch\n"
        "from tests.test_durable import _spawned_rank\n"
        "if __name__ == '__main__':\n"
        f"    commpatch.enable(output=sys.argv[1] + '/parent{{rank}}.csv')\n"
        f"    mp.start_processes(_spawned_rank, args=(2, sys.argv[1]), nprocs=2, start_method={method!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")}
    env["PYTHONPATH"] = ROOT
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    logs = sorted(f for f in os.listdir(tmp_path) if f.endswith(".cplog"))
    # one file per rank, none for the parent (it recorded nothing); forked ranks inherit the
    # parent's settings (its output template), spawned ones start afresh
    prefix = "parent" if method == "fork" else "rank"
    assert logs == [f"{prefix}0.cplog", f"{prefix}1.cplog"], logs
    df = commpatch.read_csv(str(tmp_path))
    assert sorted(df.groupby("rank").size().to_dict().items()) == [(0, 5), (1, 5)]
    assert df.groupby("rank")["pid"].nunique().eq(1).all() and df["pid"].nunique() == 2


def _short_rank(rank, world_size, out):
    """A job shorter than one flush interval that disables commpatch and returns: its process
    (a multiprocessing child: forkserver, as run_ranks starts it) ends in os._exit, past atexit."""
    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    for _ in range(5):
        dist.all_reduce(torch.ones(2))
    commpatch.disable()
    return os.getpid()


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_multiprocessing_child_that_ends_at_once_keeps_every_row_and_its_csv(tmp_path, method):
    """A rank of ``mp.Process`` / ``torch.multiprocessing.start_processes(start_method='fork')``
    ends in os._exit: its exit still writes the rows the flusher had not (here all of them) and
    the CSV beside its log."""
    from tests.multiproc import run_ranks

    pids = run_ranks(_short_rank, 2, timeout=60, out=str(tmp_path), start_method=method)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("rank")) == [
        "rank0.cplog",
        "rank0.csv",
        "rank1.cplog",
        "rank1.csv",
    ]
    for r in range(2):
        df = commpatch.read_csv(str(tmp_path / f"rank{r}.cplog"))
        assert len(df) == 5 and (df["rank"] == r).all() and (df["pid"] == pids[r]).all()
        assert commpatch.read_csv(str(tmp_path / f"rank{r}.csv"))["seq"].tolist() == df["seq"].tolist()


def test_reinitialising_with_another_rank_starts_a_new_file(tmp_path):
    import torch
    import torch.distributed as dist

    from commpatch import session as _session

    commpatch.enable(output=str(tmp_path / "rank{rank}.csv"))
    for rank in (0, 1):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{rank}", rank=0, world_size=1)
        _session.default().log.rank = -1 if rank == 0 else _session.default().log.rank
        dist.all_reduce(torch.ones(2))
        first = _session.default().log.sink.path
        destroy_process_group()
        if rank == 0:
            assert first == str(tmp_path / "rank0.cplog")
    names = sorted(os.listdir(tmp_path))
    assert "rank0.cplog" in names and "rank0.1.cplog" in names  # a new file, the first kept as it was
    assert len(commpatch.log()) == 2


def test_an_output_without_rank_in_a_multi_rank_job_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(commpatch.ConfigError, match=r"no \{rank\} in a 4-rank job"):
        commpatch.enable(output=str(tmp_path / "all.csv"))
    assert os.listdir(tmp_path) == []


def test_report_on_a_directory_of_runs_reads_the_latest_and_says_so(tmp_path, capsys):
    from commpatch import cli, testing

    for i, run in enumerate(("20260101-000000-a-1", "20260102-000000-a-2")):
        testing.write_rank_files(str(tmp_path / run), world_size=2 + i, steps=2)
        os.utime(tmp_path / run, (1e9 + i, 1e9 + i))
    assert cli.main(["report", str(tmp_path), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "reading the latest, 20260102-000000-a-2" in captured.err
    assert "the other run(s): 20260101-000000-a-1" in captured.err
    assert "3 rank(s)" in captured.out


def test_group_members_cost_the_same_at_1024_ranks(tmp_path):
    """The group table is stored once: CSV bytes per row at 1,024 ranks within 1.2x of 2 ranks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sizes = {}
    for world in (2, 1024):
        commpatch.reset()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        commpatch.enable(output="none")
        sub = dist.new_group(list(range(0, world, 2)))
        for _ in range(500):
            dist.all_reduce(torch.ones(2))
            dist.all_reduce(torch.ones(2), group=sub)
        df = commpatch.log()
        commpatch.disable()
        destroy_process_group()
        path = commpatch.export_csv(str(tmp_path / f"w{world}.csv"), df=df)
        sizes[world] = os.path.getsize(path) / len(df)
        assert set(df["group_ranks"].astype(str)) == {compact_ranks(range(world)), compact_ranks(range(0, world, 2))}
    assert compact_ranks(range(1024)) == "0-1023" and compact_ranks(range(0, 1024, 2)) == "0-1022:2"
    assert sizes[1024] <= 1.2 * sizes[2], sizes


@pytest.mark.parametrize("name", ["x\udcff", 'comma, "quote"\nnewline', "日本語", "", "\x00nul"])
def test_any_tag_string_round_trips_or_is_escaped(tmp_path, name):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        commpatch.enable(output=str(tmp_path / "rank{rank}.csv"))
        with commpatch.tag(name):
            dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2))
        df = commpatch.log()
    finally:
        commpatch.disable()
        destroy_process_group()
    expected = printable_name(name)
    assert expected == name or "\\" in expected
    assert df["tag"].astype(str).tolist() == [expected, ""]
    from commpatch import session

    session.write_at_exit()
    for f in ("rank0.cplog", "rank0.csv"):
        back = commpatch.read_csv(str(tmp_path / f))
        assert back["tag"].astype(str).tolist() == [expected, ""], f


def test_reinitialising_without_a_file_keeps_each_rows_rank():
    """Output 'none': rows after a re-init under another rank carry the new rank (a new in-memory
    log is started, as a new file is with an output)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    commpatch.enable(output="none")
    for rank in (0, 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        dist.all_reduce(torch.ones(2))
        destroy_process_group()
    assert commpatch.log()["rank"].tolist() == [0, 1]
