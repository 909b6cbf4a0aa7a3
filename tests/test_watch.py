"""The live view: rank logs decoded as they grow (data.follow, io.follow), and `commpatch watch`
following a real running 2-rank gloo job, in a pipe and in tmux as a person sees it."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from commpatch.data.follow import Follower
from commpatch.data.frame import parse_log, parsed_frame
from commpatch.io.follow import FileFollower

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "live_workers.py")


def start_job(tmp, steps=30, sleep=0.05, hold=60.0, release=True, **extra):
    """Two rank processes of tests/live_workers.py; returns (processes, run dir, release file)."""
    logs = os.path.join(tmp, "logs")
    rel = os.path.join(tmp, "release") if release else ""
    procs = []
    for rank in (0, 1):
        cmd = [
            sys.executable,
            WORKER,
            "--rank",
            str(rank),
            "--store",
            os.path.join(tmp, "store"),
            "--output",
            os.path.join(logs, "rank{rank}.csv"),
            "--steps",
            str(steps),
            "--sleep",
            str(sleep),
            "--done",
            os.path.join(tmp, "done"),
            "--release",
            rel,
            "--hold",
            str(hold),
        ]
        for key, value in extra.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs, logs, rel


def wait_done(tmp, procs, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(tmp, f"done.rank{r}")) for r in (0, 1)):
            return
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    out = [p.communicate(timeout=5)[0] if p.poll() is not None else "(running)" for p in procs]
    raise AssertionError(f"the job did not finish its steps: {out}")


def finish(procs, release):
    if release:
        open(release, "w").close()
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.fixture(scope="module")
def finished_log(tmp_path_factory):
    """A finished 2-rank job's rank 0 log (30 steps)."""
    tmp = str(tmp_path_factory.mktemp("job"))
    procs, logs, release = start_job(tmp, steps=30, sleep=0.0)
    wait_done(tmp, procs)
    finish(procs, release)
    return os.path.join(logs, "rank0.cplog")


def _window_frame(follower):
    return follower.dataframe().sort_values("seq").reset_index(drop=True)


def test_follower_fed_in_pieces_decodes_what_the_whole_file_holds(finished_log):
    with open(finished_log, "rb") as f:
        data = f.read()
    whole = parsed_frame(data)
    rng = random.Random(7)
    follower = Follower(max_rows=1 << 20, keep_steps=1 << 20)
    pos = 0
    while pos < len(data):
        n = rng.choice((1, 2, 5, 17, 59, 64, 300, 4096))
        follower.feed(data[pos : pos + n])
        pos += n
    live = _window_frame(follower)
    assert len(live) == len(whole) > 100
    for col in (
        "seq",
        "op",
        "group",
        "dtype",
        "bytes",
        "step",
        "start_ns",
        "duration_us",
        "own_us",
        "busbw_gbps",
        "phase",
        "collective",
    ):
        assert live[col].astype(str).tolist() == whole[col].astype(str).tolist(), col
    assert follower.skipped_bytes == follower.bad_rows == follower.bad_records == 0


def test_follower_waits_for_the_rest_of_a_torn_last_frame(finished_log):
    with open(finished_log, "rb") as f:
        data = f.read()
    whole = parse_log(data)
    follower = Follower(max_rows=1 << 20, keep_steps=1 << 20)
    follower.feed(data[:-7])  # the last frame cut short: its rows not yet taken
    before = len(follower.window)
    assert before < len(whole.rows)
    assert len(follower.pending) > 0 and follower.skipped_bytes == 0
    follower.feed(data[-7:])
    assert len(follower.window) == len(whole.rows)
    assert len(follower.pending) == 0


def test_follower_keeps_a_bounded_window_of_the_last_steps(finished_log):
    with open(finished_log, "rb") as f:
        data = f.read()
    follower = Follower(max_rows=1 << 20, keep_steps=3)
    settling = Follower(max_rows=1 << 20, keep_steps=3, settling=True)
    for i in range(0, len(data), 512):
        follower.feed(data[i : i + 512])
        assert len(set(follower.window["step"].tolist())) <= 3
        settling.feed(data[i : i + 512])
        settling.take_settled(0, 0, final=True)  # handed out: then only the steps bound keeps them
        assert len(set(settling.window["step"].tolist())) <= 3
    assert follower.window["step"].max() == 29
    small = Follower(max_rows=40, keep_steps=1 << 20)
    for i in range(0, len(data), 512):
        small.feed(data[i : i + 512])
        assert len(small.window) <= 40
    assert small.rows_seen == len(parse_log(data).rows)
    assert len(small.late) <= 40 and len(small.own) <= 40


def test_file_follower_reads_each_byte_once_as_the_file_grows(finished_log, tmp_path):
    with open(finished_log, "rb") as f:
        data = f.read()
    path = tmp_path / "rank0.cplog"
    reader = FileFollower(str(path), max_rows=1 << 20, keep_steps=1 << 20)
    with open(path, "wb") as out:
        for i in range(0, len(data), 1000):
            out.write(data[i : i + 1000])
            out.flush()
            reader.poll()
            reader.poll()  # nothing new: nothing read
    assert reader.offset == reader.follower.bytes_read == len(data)
    assert len(reader.follower.window) == len(parse_log(data).rows)
    reader.close()


def test_without_a_step_boundary_the_live_step_figures_are_unknown(finished_log):
    """Steps found from the pattern of a window of recent rows would be the window's numbers, not
    the job's: without a recorded step boundary the live step figures are unknown, not made up."""
    import pandas as pd

    from commpatch.analysis.live import rank_live
    from commpatch.render.live import screen

    with open(finished_log, "rb") as f:
        df = parsed_frame(f.read())
    counted = rank_live(df)
    assert counted["current_step"] == 29 and counted["last_step"] == 28 and counted["step_us"] > 0
    stepless = df.assign(step=0, step_source=pd.Categorical(["none"] * len(df)))
    live = rank_live(stepless)
    assert live["current_step"] == -1 and live["calls"] == -1 and live["last_step"] == -1
    assert np.isnan(live["step_us"]) and np.isnan(live["comm_share"]) and np.isnan(live["exposed_share"])
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(screen(dict(ranks=[live], now_ns=int(df["start_ns"].max()))))
    row = [ln for ln in console.export_text().splitlines() if ln.startswith("│")][0]
    assert [c.strip() for c in row.split("│")[1:-1]][:6] == ["0", "?", "?", "?", "?", "?"]


def _watch(run_dir, *args, timeout=120):
    return subprocess.Popen(
        [sys.executable, "-m", "commpatch", "watch", run_dir, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="120"),
    )


@pytest.mark.slow
def test_watch_follows_a_running_job_until_it_ends(tmp_path):
    tmp = str(tmp_path)
    procs, logs, release = start_job(tmp, steps=25, sleep=0.05)
    watch = _watch(logs, "--interval", "0.3", "--idle", "30")  # started before the logs exist
    wait_done(tmp, procs)
    finish(procs, release)
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    assert "the job ended: every rank wrote its export at exit" in err
    assert "Traceback" not in err + out
    table = [ln for ln in out.splitlines() if ln.startswith("│")]
    ranks = {ln.split("│")[1].strip(): ln for ln in table[-2:]}
    assert set(ranks) == {"0", "1"}, out
    for ln in ranks.values():
        cells = [c.strip() for c in ln.split("│")[1:-1]]
        assert cells[1] == "24"  # the last step, being the current one
        assert cells[3].endswith("(step 23)")  # the last step with a known time
        assert cells[4].endswith("%") and cells[5].endswith("%")


@pytest.mark.slow
def test_watch_stops_when_the_logs_stop_growing(tmp_path):
    tmp = str(tmp_path)
    procs, logs, release = start_job(tmp, steps=10, sleep=0.05, hold=120)
    wait_done(tmp, procs)
    for p in procs:  # killed: no export at exit, the files just stop
        p.kill()
        p.wait()
    watch = _watch(logs, "--interval", "0.3", "--idle", "2")
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 0, err
    assert "no rank's log grew for 2 s" in err
    assert "Traceback" not in err + out


@pytest.mark.slow
def test_the_live_view_lists_a_call_in_flight_too_long(tmp_path):
    """Rank 0's async all_reduce waits 6 s for rank 1: the view, reading the growing logs, lists it
    once it is older than --stuck (1 s), and no more once it completed."""
    from commpatch.io.follow import RunFollower
    from commpatch.watch import snapshot

    tmp = str(tmp_path)
    procs, logs, release = start_job(tmp, steps=5, sleep=0.0, lag=6.0)
    follower = RunFollower(logs)
    try:
        seen, deadline = None, time.monotonic() + 90
        while seen is None and time.monotonic() < deadline:
            follower.poll()
            snap = snapshot(follower, time.time_ns(), stuck_s=1.0)
            if snap["stuck"] is not None and len(snap["stuck"]):
                seen = snap["stuck"]
            time.sleep(0.2)
        assert seen is not None, "the call in flight was never listed"
        assert seen["rank"].tolist() == [0] and seen["op"].tolist() == ["all_reduce"]
        assert (seen["age_s"] > 1.0).all()
        wait_done(tmp, procs)
        time.sleep(0.5)  # the flusher's next pass writes the completion
        follower.poll()
        assert snapshot(follower, time.time_ns(), stuck_s=1.0)["stuck"] is None
    finally:
        follower.close()
        finish(procs, release)


def _tmux(*args, check=True):
    return subprocess.run(["tmux", "-L", "commpatch-test", *args], capture_output=True, text=True, check=check)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (ci/apt-packages.txt)")
def test_watch_in_tmux_shows_the_table_and_ends_cleanly_on_ctrl_c(tmp_path):
    tmp = str(tmp_path)
    procs, logs, release = start_job(tmp, steps=400, sleep=0.05, hold=120)
    session = f"cpw{os.getpid()}"
    _tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "30", "bash --norc --noprofile")
    try:
        # typed at the shell's prompt, as a person would
        _tmux(
            "send-keys",
            "-t",
            session,
            f"cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} -m commpatch watch {logs} --interval 0.5 --idle 60",
            "Enter",
        )
        screen, deadline = "", time.monotonic() + 90
        while time.monotonic() < deadline:
            screen = _tmux("capture-pane", "-p", "-t", session).stdout
            rows = [ln for ln in screen.splitlines() if ln.startswith("│")]
            steps = [int(ln.split("│")[2]) for ln in rows if ln.split("│")[2].strip().isdigit()]
            if len(rows) == 2 and min(steps) >= 5:
                break
            time.sleep(0.5)
        assert "rank" in screen and "step time" in screen and "comm" in screen, screen
        rows = [ln for ln in screen.splitlines() if ln.startswith("│")]
        assert [ln.split("│")[1].strip() for ln in rows] == ["0", "1"], screen
        assert all(" ms (step " in ln and "%" in ln for ln in rows), screen
        assert "slowest now: rank" in screen
        assert max(len(ln) for ln in screen.splitlines()) <= 120
        _tmux("send-keys", "-t", session, "C-c")  # a person's Ctrl-C
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "stopped at" not in screen:
            time.sleep(0.3)
            screen = _tmux("capture-pane", "-p", "-t", session).stdout
        assert "commpatch watch: stopped at" in screen and ": interrupted" in screen, screen
        assert "Traceback" not in screen and "KeyboardInterrupt" not in screen
    finally:
        _tmux("kill-session", "-t", session, check=False)
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


@pytest.mark.parametrize("seed", range(5))
def test_slowest_now_is_the_rank_the_others_wait_for(seed):
    """In lockstep every rank's step is as long: the longest step named the rank that waits (rank 0
    here, in 4 of these 5 logs), not rank 1, 20 ms late before each step (issue 32)."""
    import pandas as pd
    from rich.console import Console

    from commpatch.analysis.live import rank_live, slowest
    from commpatch.render.live import screen
    from commpatch.testing import make_log

    df = make_log(2, 10, straggler=1, straggler_delay_us=20000.0, seed=seed)
    df = df.assign(step_source=pd.Categorical(["optimizer"] * len(df)))
    ranks = [rank_live(df[df["rank"] == r]) for r in (0, 1)]
    slow = slowest(ranks)
    assert slow["rank"] == 1 and slow["work_us"] > slow["others_work_median_us"]
    assert slow["work_us"] == pytest.approx(ranks[1]["step_us"] * (1 - ranks[1]["exposed_share"]))
    console = Console(width=120, record=True)
    console.print(screen(dict(ranks=ranks, slowest=slow, now_ns=int(df["start_ns"].max()))))
    assert "slowest now: rank 1 (the others wait for it)" in console.export_text()
