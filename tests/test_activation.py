"""Zero-code activation in real subprocesses: `commpatch run`, COMMPATCH=1 with the .pth hook,
torchrun workers writing one CSV per rank, bad settings, SIGTERM."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import commpatch
from commpatch.cli import PTH_SOURCE, hook_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
STEPS = 4
# per rank: 6 parameters broadcast once; per step 6 gradient all_reduce + 1 all_gather;
# one extra all_reduce at step 0 through the name imported at the top; object gather; barrier
EXPECTED = {"broadcast": 6, "all_reduce": 6 * STEPS + 1, "all_gather": STEPS, "all_gather_object": 1, "barrier": 1}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")}
    env.update(extra)
    return env


def _torchrun(out, env, prefix=(), script=TRAIN, args=("--steps", str(STEPS))):
    cmd = list(prefix) + [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
    return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True, timeout=120, cwd=str(out))


def _check_rank_files(out):
    files = sorted(os.listdir(out / "logs"))
    # the launcher wrote nothing; each rank its binary log and, at its clean exit, its CSV
    assert files == ["rank0.cplog", "rank0.csv", "rank1.cplog", "rank1.csv"], files
    for rank in (0, 1):
        df = commpatch.read_csv(str(out / "logs" / f"rank{rank}.csv"))
        assert (df["rank"] == rank).all() and (df["world_size"] == 2).all()
        assert df["op"].astype(str).value_counts().to_dict() == EXPECTED
        assert df["step"].max() == STEPS  # commpatch.step() reached through sys.modules
        assert df["status"].eq("ok").all()


@pytest.mark.slow
def test_commpatch_run_instruments_torchrun_workers(tmp_path):
    res = _torchrun(
        tmp_path, _env(), prefix=[sys.executable, "-m", "commpatch", "run", "--output", "logs/rank{rank}.csv", "--"]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    _check_rank_files(tmp_path)
    # at the end: where the logs went and the command that reports them
    assert res.stderr.splitlines()[-1] == "commpatch: the logs are in logs; the report: commpatch report logs", (
        res.stderr
    )


FOREVER = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    with open(os.path.join(sys.argv[1], f"pid{dist.get_rank()}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(sys.argv[1], f"pid{dist.get_rank()}.tmp"), os.path.join(sys.argv[1], f"pid{dist.get_rank()}"))
    while True:
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
""")


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped is not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_commpatch_run_takes_torchrun_and_its_workers_with_it(tmp_path):
    """Issue 36: `timeout -s KILL 90 commpatch run -- torchrun ...` left the workers running,
    re-parented, for minutes (commpatch run exec'd torchrun, whose SIGKILL its workers never
    hear). Now torchrun gets SIGTERM when commpatch run dies and stops its workers."""
    script = tmp_path / "forever.py"
    script.write_text(FOREVER)
    cmd = [sys.executable, "-m", "commpatch", "run", "--output", str(tmp_path / "logs" / "rank{rank}.csv"), "--"]
    cmd += [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.Popen(cmd + [str(tmp_path)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        workers = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        assert all(map(_alive, workers))
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), [w for w in workers if _alive(w)]
    finally:
        for r in (0, 1):
            try:
                os.kill(int((tmp_path / f"pid{r}").read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def test_commpatch_run_ends_as_its_command_does(tmp_path):
    """The command's exit status is `commpatch run`'s; a command killed by a signal ends it by the
    same signal; SIGTERM sent to `commpatch run` reaches the command."""
    run = [sys.executable, "-m", "commpatch", "run", "--output", str(tmp_path / "rank{rank}.csv"), "--", sys.executable]
    res = subprocess.run(run + ["-c", "raise SystemExit(3)"], env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert f"no log was written under {tmp_path}" in res.stderr, res.stderr
    res = subprocess.run(
        run + ["-c", "import os; os.kill(os.getpid(), 9)"], env=_env(), capture_output=True, timeout=60
    )
    assert res.returncode == -9, res.stderr
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(run + ["-c", code], env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM and time.monotonic() - start < 20


def test_report_without_a_path_reads_the_default_directory(tmp_path):
    """`commpatch report` with no path reads where the output setting writes (commpatch_logs by
    default); without it, one line naming the directory."""

    def report():
        cmd = [sys.executable, "-m", "commpatch", "report"]
        return subprocess.run(cmd, env=_env(), cwd=str(tmp_path), capture_output=True, text=True, timeout=120)

    res = report()
    assert res.returncode == 2 and res.stderr.strip().endswith("there is no commpatch_logs here"), res.stderr
    from commpatch.testing import make_log

    run = tmp_path / "commpatch_logs" / "20260101-000000-host-1"
    run.mkdir(parents=True)
    for rank, frame in make_log(world_size=2).groupby("rank", observed=True):
        commpatch.export_csv(str(run / f"rank{rank}.csv"), df=frame.reset_index(drop=True))
    res = report()
    assert res.returncode == 0 and "20260101-000000-host-1" in res.stdout + res.stderr, res.stderr[-2000:]


@pytest.fixture
def pth_hook():
    """The .pth hook in site-packages (as `make install` / a regular pip install leaves it)."""
    path = hook_path()
    installed_here = not os.path.exists(path)
    if installed_here:
        import shutil

        shutil.copyfile(PTH_SOURCE, path)
    yield path
    if installed_here:
        os.unlink(path)


@pytest.mark.slow
def test_env_var_activation_with_no_code_change(tmp_path, pth_hook):
    res = _torchrun(tmp_path, _env(COMMPATCH="1", COMMPATCH_OUTPUT="logs/rank{rank}.csv"))
    assert res.returncode == 0, res.stderr[-3000:]
    _check_rank_files(tmp_path)


@pytest.mark.slow
def test_zero_code_ddp_job_is_bit_identical_and_gets_a_report(tmp_path, pth_hook):
    """``COMMPATCH=1 torchrun`` on the DDP example: the trained parameters' bytes equal a plain run's,
    and ``commpatch report`` reads the rows of both ranks (the issue's check on every matrix cell)."""
    import json

    ddp = os.path.join(ROOT, "examples", "train_ddp.py")
    digests = []
    for env in (_env(), _env(COMMPATCH="1", COMMPATCH_OUTPUT="logs/rank{rank}.csv")):
        res = _torchrun(tmp_path, env, script=ddp, args=("--steps", "6", "--hidden", "64"))
        assert res.returncode == 0, res.stderr[-3000:]
        digests += [line for line in res.stdout.splitlines() if line.startswith("parameters sha256 ")]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    rep = subprocess.run(
        [sys.executable, "-m", "commpatch", "report", "logs", "--format", "json", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert rep.returncode == 0, rep.stderr[-3000:]
    headline = json.loads(rep.stdout)["headline"]
    df = commpatch.read_csv(str(tmp_path / "logs"))
    assert headline["ranks"] == 2 and headline["calls"] == len(df) and set(df["rank"]) == {0, 1}
    assert (
        df["op"].astype(str) == "ddp_bucket_allreduce"
    ).sum() >= 2 * 6  # DDP seen: a bucket per rank and step at least


def test_hook_is_inert_without_the_variable(tmp_path, pth_hook):
    code = "import sys; import torch.distributed; print('commpatch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "False"


USES_DIST = "import torch.distributed; print('ran')"


def test_bad_env_value_fails_clearly_in_a_subprocess(pth_hook, tmp_path):
    """Only in processes that use torch.distributed: anything else (pip, a data script) runs as
    without commpatch and leaves nothing behind."""
    for env in (dict(COMMPATCH="1", COMMPATCH_TIMING="fast"), dict(COMMPATCH="perhaps")):
        res = subprocess.run(
            [sys.executable, "-c", "print('ran')"],
            env=_env(**env),
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0 and res.stdout == "ran\n" and res.stderr == ""
    assert os.listdir(tmp_path) == []
    res = subprocess.run(
        [sys.executable, "-c", USES_DIST],
        env=_env(COMMPATCH="1", COMMPATCH_TIMING="fast"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "ran" not in res.stdout
    assert "COMMPATCH_TIMING" in res.stderr and "auto, host" in res.stderr
    res = subprocess.run(
        [sys.executable, "-c", USES_DIST], env=_env(COMMPATCH="perhaps"), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "COMMPATCH=" in res.stderr


def test_commpatch_run_rejects_bad_settings_before_starting(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "commpatch", "run", "--ops", "allreduce", "--", sys.executable, "-c", "print('ran')"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "COMMPATCH_OPS" in res.stderr and "all_reduce" in res.stderr
    assert "ran" not in res.stdout


SIGTERM_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import commpatch
    if sys.argv[2] == "chain":
        def user_handler(signum, frame):
            open(sys.argv[1] + ".user", "w").write("called")
            sys.exit(0)
        signal.signal(signal.SIGTERM, user_handler)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)
    commpatch.enable(output=sys.argv[1])
    for _ in range(50):
        dist.all_reduce(torch.ones(4))
    print("ready", flush=True)
    while True:
        dist.all_reduce(torch.ones(4))
        time.sleep(0.01)
""")


@pytest.mark.parametrize("mode", ["default", "chain"])
def test_sigterm_keeps_the_rows_and_the_users_handler(tmp_path, mode):
    """commpatch installs no signal handler: the rows are in the binary log already."""
    script = tmp_path / "job.py"
    script.write_text(SIGTERM_SCRIPT)
    out = tmp_path / "out.csv"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), mode], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the promise: calls that returned 1 s before the signal are on disk
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    if mode == "default":
        assert code == -signal.SIGTERM  # still dies by SIGTERM, as torchrun expects
    else:
        assert code == 0 and (tmp_path / "out.csv.user").read_text() == "called"
    df = commpatch.read_csv(str(tmp_path / "out.cplog"))
    assert len(df) >= 50 and df["op"].eq("all_reduce").all()


def test_commpatch_env_lists_every_setting():
    res = subprocess.run(
        [sys.executable, "-m", "commpatch", "env"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0
    for var in ("COMMPATCH", "COMMPATCH_OUTPUT", "COMMPATCH_OPS", "COMMPATCH_TIMING", "COMMPATCH_SUMMARY"):
        assert var in res.stdout
    lines = res.stdout.splitlines()  # defaults as the README writes them, unset values said so
    assert any(line.split() == ["COMMPATCH", "=", "(unset)", "(default", "0)"] for line in lines)
    assert any(line.split() == ["COMMPATCH_OPS", "=", "(unset)", "(default", "all)"] for line in lines)
    from commpatch.record import rows

    hot = [line for line in lines if line.startswith("hot path: ")]  # which tail records, said plainly
    assert len(hot) == 1 and hot[0].startswith("hot path: C recorder" if rows.C_ROWS else "hot path: pure Python")
