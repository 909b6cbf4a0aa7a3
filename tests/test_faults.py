"""Storage faults, made for real (issue 24): a full disk (a small tmpfs, filled then freed), a
read-only one, a slow one (an LD_PRELOAD shim built here with gcc that delays every write to a
``.cplog`` by 2 s), a run directory removed mid-run, a re-enabled session killed with SIGKILL,
planted links at the watchdog's dump, and bad output templates. Every job runs beside the same
job without commpatch: same exit status, its results checked by itself, every row written
before the fault readable after it. Needs root for tmpfs mounts (skipped otherwise)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import commpatch
from commpatch.data import logfile
from commpatch.data.ops import OP_NAMES
from commpatch.data.schema import ROW, row_dtype
from commpatch.record import sinks
from commpatch.record import state as _runtime
from commpatch.record.log import CHUNK
from commpatch.record.rows import SEQ, peek_seq

from .faults import build_shim
from .torch_compat import destroy_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_REDUCE = OP_NAMES.index("all_reduce")


# ---- helpers --------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs (16 MB), mounted for the test; ``remount(options)`` changes it (ro / rw)."""
    mnt = tmp_path / "mnt"
    with _mounted(mnt):

        def remount(options: str) -> None:
            subprocess.run(["mount", "-o", f"remount,{options}", str(mnt)], check=True)

        yield mnt, remount


@contextlib.contextmanager
def _mounted(mnt):
    """A 16 MB tmpfs at ``mnt`` while in the block (skips the test where none can be mounted): a
    disk filled there fills 16 MB, never the machine's."""
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs (a real full / read-only disk)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return build_shim("slowwrite", tmp_path_factory.mktemp("shim"))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH") and k not in ("SHIM_LOG", "LD_PRELOAD")}
    env["PYTHONPATH"] = ROOT
    env["PYTHONWARNINGS"] = "default"
    env.update(extra)
    return env


def run_job(out, mode, *, plain=False, calls=2000, world=2, env=None, timeout=120, extra=()):
    """The 2-rank job of tests/faults/job.py: [(returncode, json result or None, stderr)] per rank."""
    os.makedirs(out, exist_ok=True)
    store = os.path.join(os.path.dirname(str(out).rstrip("/")), f"store-{uuid.uuid4().hex}")
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable,
            "-m",
            "tests.faults.job",
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--store",
            store,
            "--out",
            str(out),
            "--mode",
            mode,
            "--calls",
            str(calls),
            *extra,
        ] + (["--plain"] if plain else [])
        procs.append(
            subprocess.Popen(
                cmd, env=env or _env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        results.append((p.returncode, json.loads(lines[-1]) if lines else None, stderr))
    return results


def rank_logs(out):
    """{rank: [parsed .cplog files of that rank, in creation order]} under ``out``."""
    found = {}
    for directory, _, files in os.walk(out):
        for name in files:
            if name.endswith(".cplog"):
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    parsed = logfile.parse(f.read(), ROW.size, row_dtype(np), path)
                found.setdefault(parsed.header.get("rank"), []).append((os.path.getmtime(path), path, parsed))
    return {rank: [p for _, _, p in sorted(v, key=lambda x: x[:2])] for rank, v in found.items()}


def commpatch_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "commpatch:" in ln]


# ---- 1 and 8: a full disk, then freed ------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_then_freed_leaves_whole_frames_and_every_row(tmpfs, tmp_path):
    mnt, _ = tmpfs
    with _mounted(tmp_path / "plain") as plain_mnt:  # the plain job fills its disk too: a tmpfs of its own
        plain = run_job(plain_mnt, "diskfull", plain=True)
    results = run_job(mnt, "diskfull")
    assert [r[0] for r in results] == [r[0] for r in plain] == [0, 0], [r[2][-2000:] for r in results]
    logs = rank_logs(mnt)
    assert sorted(logs) == [0, 1]
    for rank, parsed in logs.items():
        assert len(parsed) == 1, (rank, len(parsed))  # one file: cut back to whole frames, written on
        p = parsed[0]
        assert p.torn == 0, (rank, p.torn)  # no record cut short inside the file
        seqs = np.sort(p.rows["seq"])
        assert seqs.tolist() == list(range(len(seqs))), rank  # before, during and after the fault
        assert (p.rows["op"] == ALL_REDUCE).sum() == 3 * 2000, rank
    for _rank, (_code, result, stderr) in enumerate(results):
        assert "Traceback" not in stderr, stderr[-3000:]
        assert result["errors"] == {} and result["dropped"] == 0, result  # nothing lost: all kept, then written
        warned = commpatch_lines(stderr)
        assert any("cannot write" in ln and "tried again" in ln for ln in warned), stderr[-2000:]
        assert any("is written again" in ln for ln in warned), stderr[-2000:]
    df = commpatch.read_csv(str(mnt))  # the CSV at exit, once the disk had room again
    df = df[df["op"] == "all_reduce"]
    assert sorted(df.groupby("rank").size().to_dict().items()) == [(0, 6000), (1, 6000)]


def test_a_write_cut_short_is_truncated_back_to_the_last_whole_frame(tmpfs):
    """The sink on its own: on a full tmpfs a frame bigger than what is left is written in part,
    then cut back; the file reads as before the failed write; more frames follow once there is room."""
    mnt, _ = tmpfs
    sink = sinks.FileSink(str(mnt / "r.cplog"))
    rows = lambda lo, n: logfile.frame(
        logfile.ROWS,
        b"".join(  # noqa: E731
            ROW.pack(s, 0, 0, 0, 1, 0, 1, 2, -1, 0, 0, 0) for s in range(lo, lo + n)
        ),
    )
    sink.append(logfile.meta("header", rank=0, world_size=1, pid=os.getpid()) + rows(0, 100), 100)  # as a rank writes
    from tests.faults.job import fill

    filler = fill(str(mnt), 4096)
    size = os.path.getsize(mnt / "r.cplog")
    with pytest.raises(OSError):
        sink.append(rows(100, 1000), 1000)  # 59 KB into a page or so: cut short, then cut back
    assert os.path.getsize(mnt / "r.cplog") == size == sink.size
    os.unlink(filler)
    sink.append(rows(100, 1000), 1000)
    sink.close()
    parsed = logfile.parse((mnt / "r.cplog").read_bytes(), ROW.size, row_dtype(np))
    assert parsed.torn == 0 and parsed.rows["seq"].tolist() == list(range(1100))


# ---- 2: disable() then enable(), capture() blocks, then SIGKILL ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reenable", "capture"])
def test_rows_recorded_after_a_reenable_reach_the_disk_before_a_sigkill(tmp_path, mode):
    plain = run_job(tmp_path / "plain", mode, plain=True, calls=1500)
    results = run_job(tmp_path / "cp", mode, calls=1500)
    assert [r[0] for r in results] == [r[0] for r in plain] == [-9, -9], [r[2][-2000:] for r in results]
    logs = rank_logs(tmp_path / "cp")
    blocks = 2 if mode == "reenable" else 3
    for rank in (0, 1):
        ops = np.concatenate([p.rows["op"] for p in logs[rank]])
        assert (ops == ALL_REDUCE).sum() == blocks * 1500, rank  # every row, though none was flushed by a chunk


# ---- 3 and 15: an output that cannot be written ----------------------------------------------


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    commpatch.disable()
    if dist.is_initialized():
        destroy_process_group()
    _runtime.STATE.settings = {}


@pytest.mark.faults
def test_a_read_only_output_keeps_a_bounded_log_and_retries_the_file(tmpfs, fake_group, monkeypatch):
    import torch
    import torch.distributed as dist

    from commpatch import session

    mnt, remount = tmpfs
    remount("ro")
    monkeypatch.setattr(sinks, "BACKLOG_ROWS", 2 * CHUNK)
    monkeypatch.setattr(sinks, "RETRY_S", 0.2)
    seq0 = peek_seq(SEQ)
    with pytest.warns(RuntimeWarning) as record:
        commpatch.enable(output=str(mnt / "{run}" / "rank{rank}.csv"))  # not refused: the job runs
        t = torch.ones(2)
        for _ in range(6 * CHUNK):
            dist.all_reduce(t)
    log = session.default().log
    warned = [str(w.message) for w in record if "commpatch" in str(w.message)]
    assert len([w for w in warned if "not writable" in w or "cannot write" in w]) == 1, warned
    assert any("were NOT written" in w for w in warned), warned  # the bound: dropped, counted, warned once
    assert log.nbytes() <= 3 * CHUNK * ROW.size + 65536  # bounded memory
    df = commpatch.log()  # the rows kept are still shown
    dropped = df.attrs["dropped_rows"]
    assert len(df) + dropped == 6 * CHUNK and _runtime.ERRORS["export.dropped"] == dropped
    assert df["seq"].tolist() == list(range(seq0 + dropped, seq0 + 6 * CHUNK))  # the oldest were dropped
    remount("rw")
    deadline, more = time.monotonic() + 20, 0
    while not list(mnt.rglob("*.cplog")) and time.monotonic() < deadline:
        time.sleep(0.1)
        dist.all_reduce(t)  # the flusher retries meanwhile
        more += 1
    files = list(mnt.rglob("*.cplog"))
    assert len(files) == 1
    commpatch.disable()
    log.flush()
    parsed = logfile.parse(files[0].read_bytes(), ROW.size, row_dtype(np))
    dropped = log.dropped
    assert parsed.torn == 0 and len(parsed.rows) + dropped == 6 * CHUNK + more  # kept rows reached the file
    lost = [json.loads(bytes(m)) for m in _meta_payloads(files[0].read_bytes()) if b'"lost"' in m]
    assert sum(m["rows"] for m in lost) == dropped and lost[0]["first_seq"] == seq0  # the loss is in the log
    assert _runtime.ERRORS["export.dropped"] == dropped
    assert sum(n for n, _, _, _ in parsed.lost) == dropped  # ... and the reader says it
    said = [p for p in parsed.damage() if "never written" in p]
    assert len(said) == 1 and said[0].startswith(f"{dropped} row(s) recorded but never written"), parsed.damage()
    with pytest.warns(Warning, match=f"{dropped} row\\(s\\) recorded but never written"):
        commpatch.read_csv(str(files[0]))


def _meta_payloads(data: bytes):
    pos = len(logfile.MAGIC)
    while pos + 5 <= len(data):
        kind, length = logfile._FRAME.unpack_from(data, pos)
        if kind == logfile.META:
            yield data[pos + 5 : pos + 5 + length]
        pos += 5 + length


@pytest.mark.parametrize("strict", ["0", "1"])
def test_an_unwritable_output_under_commpatch_1_runs_the_job_unless_strict(tmpfs, tmp_path, strict):
    mnt, remount = tmpfs
    remount("ro")
    script = (
        "import torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=1)\n"
        "t = torch.ones(2)\n"
        "[dist.all_reduce(t) for _ in range(10)]\n"
        "import commpatch; print('rows', len(commpatch.log()))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(COMMPATCH="1", COMMPATCH_OUTPUT=str(mnt / "rank{rank}.csv"), COMMPATCH_STRICT=strict),
    )
    if strict == "1":
        assert res.returncode == 2 and res.stdout == "", res.stderr[-2000:]
        assert len(res.stderr.strip().splitlines()) == 1 and "COMMPATCH_STRICT=1" in res.stderr, res.stderr
    else:
        assert res.returncode == 0 and res.stdout == "rows 10\n", res.stderr[-2000:]
        assert "Traceback" not in res.stderr
        assert "not writable" in res.stderr and "were NOT written" in res.stderr  # at exit: how many
        assert "10 row(s)" in res.stderr, res.stderr


# ---- 4: the run directory removed mid-run ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.faults
def test_a_run_directory_removed_mid_run_is_recreated_and_the_loss_said_once(tmp_path):
    plain = run_job(tmp_path / "plain", "rmdir", plain=True)
    results = run_job(tmp_path / "cp", "rmdir")
    assert [r[0] for r in results] == [r[0] for r in plain] == [0, 0], [r[2][-2000:] for r in results]
    logs = rank_logs(tmp_path / "cp")
    for rank, (_code, result, stderr) in enumerate(results):
        removed = [ln for ln in commpatch_lines(stderr) if "was deleted while the job ran" in ln]
        assert len(removed) == 1, stderr[-3000:]
        assert "2000 row(s) of this rank's log were NOT written" in removed[0]  # counted right
        assert result["errors"] == {"export.removed": 2000}, result
        (p,) = logs[rank]  # re-created, with its registries
        assert p.header["rank"] == rank and p.groups and p.torn == 0
        seqs = np.sort(p.rows["seq"])
        assert seqs[0] >= 2000 and seqs.tolist() == list(range(seqs[0], seqs[0] + len(seqs))), rank
        assert (p.rows["op"] == ALL_REDUCE).sum() == 2000, rank  # every call after the removal
    df = commpatch.read_csv(str(tmp_path / "cp"))  # the CSVs at exit, in the new directory
    assert (df["op"] == "all_reduce").sum() == 2 * 2000


# ---- 5: a slow disk (2 s per write) ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.faults
def test_a_slow_disk_never_makes_the_training_thread_write_and_drops_past_the_bound(tmp_path, shim):
    shim_log = tmp_path / "writes.txt"
    env = _env(LD_PRELOAD=shim, SHIM_DELAY_MS="2000", SHIM_LOG=str(shim_log))
    calls = CHUNK + 2000  # a chunk's maintenance on the training thread included
    plain = run_job(tmp_path / "plain", "slow", plain=True, calls=calls)
    results = run_job(tmp_path / "cp", "slow", calls=calls, env=env, extra=("--backlog", "500"), timeout=240)
    assert [r[0] for r in results] == [r[0] for r in plain] == [0, 0], [r[2][-2000:] for r in results]
    lines = shim_log.read_text().splitlines()
    ends = {ln.split()[1] for ln in lines if ln.startswith("END")}
    assert len(ends) == 2, lines
    training = []
    for tid in ends:  # the shim's notes before that thread said END
        for ln in lines:
            if ln == f"END {tid}":
                break
            training.append(ln.split()[0])
    assert not set(training) & ends, "the training thread wrote to the disk itself"
    logs = rank_logs(tmp_path / "cp")
    for rank, (_code, result, stderr) in enumerate(results):
        dropped = result["dropped"]
        assert dropped > 0 and result["errors"] == {"export.dropped": dropped}, result
        warned = [ln for ln in commpatch_lines(stderr) if "NOT written" in ln]
        assert len(warned) == 1 and "the job is never made to wait" in warned[0], stderr[-3000:]
        (p,) = logs[rank]
        assert len(p.rows) + dropped == calls and p.torn == 0  # every row written or counted


# ---- 12: the watchdog's dump never goes through a link or over a file -------------------------


def test_the_hang_dump_never_follows_a_planted_link_or_replaces_a_file(tmp_path, monkeypatch, capsys):
    from commpatch import session, watchdog

    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / f"hang_rank0.txt.tmp{os.getpid()}").symlink_to(victim)  # the temporary name
    (tmp_path / "hang_rank0.1.txt").symlink_to(victim)  # a later name
    (tmp_path / "hang_rank0.2.txt").write_text("an earlier run's dump\n")
    commpatch.enable(output="none")
    dog = watchdog.Watchdog(session.default().log, 0.1, "")
    dog.write("first dump\n")
    dog.write("second dump\n")
    capsys.readouterr()
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "hang_rank0.2.txt").read_text() == "an earlier run's dump\n"
    assert (tmp_path / "hang_rank0.3.txt").read_text() == "first dump\nsecond dump\n"
    assert os.path.islink(tmp_path / "hang_rank0.1.txt")


@pytest.mark.faults
def test_a_dump_file_swapped_for_a_link_is_not_appended_to(tmp_path, monkeypatch, capsys):
    from commpatch import session, watchdog

    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    commpatch.enable(output="none")
    dog = watchdog.Watchdog(session.default().log, 0.1, "")
    dog.write("first dump\n")
    os.unlink(tmp_path / "hang_rank0.txt")
    (tmp_path / "hang_rank0.txt").symlink_to(victim)
    with pytest.warns(RuntimeWarning, match="watchdog"):
        dog.write("second dump\n")
    capsys.readouterr()
    assert victim.read_text() == "precious\n"


# ---- 14: output templates, symlinked parents ---------------------------------------------------

BAD_TEMPLATES = [
    "{rank[0]}.csv",
    "{rank.foo}.csv",
    "{nope}.csv",
    "{0}.csv",
    "{}.csv",
    "a{.csv",
    "a}.csv",
    "{rank!r}.csv",
    "{rank:03d}.csv",
    "{pid.real}/{rank}.csv",
]


@pytest.mark.parametrize("template", BAD_TEMPLATES)
def test_a_bad_output_template_is_one_config_error(template):
    with pytest.raises(commpatch.ConfigError, match=r"COMMPATCH_OUTPUT|output") as err:
        commpatch.enable(output=template)
    assert "{run}, {rank} and {pid}" in str(err.value) and "\n" not in str(err.value)
    assert not commpatch.is_enabled()


@pytest.mark.parametrize("template", ["{rank[0]}.csv", "{rank.foo}.csv", "{nope}.csv"])
def test_a_bad_output_template_exits_2_under_commpatch_1_and_is_reported_by_env(tmp_path, template):
    env = _env(COMMPATCH="1", COMMPATCH_OUTPUT=str(tmp_path / template))
    res = subprocess.run(
        [sys.executable, "-c", "import torch.distributed; print('ran')"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "only the fields" in res.stderr, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "commpatch", "env"], capture_output=True, text=True, timeout=120, env=env
    )
    assert "Traceback" not in res.stderr and "only the fields" in res.stdout + res.stderr, res.stdout + res.stderr


def test_good_templates_still_expand():
    from commpatch.io.paths import rank_path

    assert rank_path("d/{run}/r{rank}-{pid}{{x}}.csv", rank=3, pid=9, run="R") == "d/R/r3-9{x}.csv"
    with pytest.raises(commpatch.ConfigError, match="only the fields"):
        rank_path("{rank[0]}.csv", rank=1)


def test_a_symlinked_parent_directory_is_followed_and_the_file_is_never_a_link(tmp_path):
    """Documented in README: links among the parent directories are followed (``mkdir -p``); the
    file itself is created exclusively, never through a link."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "logs").symlink_to(real)
    victim = tmp_path / "victim"
    (real / "rank0.cplog").symlink_to(victim)  # a planted link at the file's name
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        commpatch.enable(output=str(tmp_path / "logs" / "rank{rank}.csv"))
        dist.all_reduce(torch.ones(2))
        commpatch.disable()
        assert len(commpatch.log()) == 1
    finally:
        destroy_process_group()
    assert not victim.exists() and os.path.islink(tmp_path / "logs")
    assert (real / "rank0.1.cplog").is_file() and not os.path.islink(real / "rank0.1.cplog")


@pytest.mark.parametrize("strict", ["0", "1"])
def test_commpatch_run_with_an_unwritable_output_runs_the_command_unless_strict(tmp_path, strict):
    """Item 15 for ``commpatch run``: an output that cannot be written is a warning and the
    command runs; with COMMPATCH_STRICT=1 it is refused (exit 2) and the command never starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    marker = tmp_path / "ran"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")}
    env["COMMPATCH_STRICT"] = strict
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "commpatch",
            "run",
            "--output",
            str(blocker / "rank{rank}.csv"),
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w').close()",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "is not a directory" in res.stderr and "Traceback" not in res.stderr, res.stderr
    if strict == "1":
        assert res.returncode == 2 and not marker.exists()
    else:
        assert res.returncode == 0 and marker.exists() and "warning" in res.stderr
