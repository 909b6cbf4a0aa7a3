"""``commpatch watch RUN_DIR``: the live view of a running job. Every ``interval`` seconds the
rank logs' new bytes are read (``io.follow``: each byte once, a window of recent steps kept), the
figures computed (``analysis.live``) and the screen redrawn (``render.live``, with rich). Ends on
Ctrl-C, when every rank has written its export at a clean exit, or when no log grew for ``idle``
seconds; says which."""

from __future__ import annotations

import os
import sys
import time
import warnings

from .analysis.live import in_flight, rank_live, slowest
from .io.follow import RunFollower
from .io.paths import export_path
from .render.live import screen
from .render.people import terminal_safe

WINDOW_STEPS = 4  # steps of rows kept per rank
WINDOW_ROWS = 1 << 16  # at most this many rows per rank


def snapshot(follower: RunFollower, now_ns: int, stuck_s: float) -> dict:
    """The figures of every rank read so far."""
    import pandas as pd

    ranks, stuck, notes = [], [], []
    for rank, f in sorted(follower.by_rank().items()):
        live = f.follower
        if not len(live.window):
            continue
        df = live.dataframe()
        with warnings.catch_warnings(record=True) as said:  # shown under the table, not over it
            warnings.simplefilter("always")
            ranks.append(rank_live(df))
        notes += sorted({f"rank {rank}: {str(w.message).splitlines()[0][:200]}" for w in said})
        stuck.append(in_flight(df, now_ns, stuck_s))
        if live.skipped_bytes or live.bad_rows or live.bad_records:
            notes.append(
                f"rank {rank}: {live.skipped_bytes} byte(s) that are no frame, {live.bad_rows} impossible "
                f"row(s), {live.bad_records} bad record(s) skipped"
            )
    notes += follower.errors() + follower.restarts()
    frames = [s for s in stuck if len(s)]
    return dict(
        ranks=ranks,
        slowest=slowest(ranks),
        stuck=pd.concat(frames, ignore_index=True) if frames else None,
        notes=notes,
        now_ns=now_ns,
    )


def finished(follower: RunFollower) -> bool:
    """Every rank log has its export beside it: each rank ended cleanly (exports are written at exit)."""
    files = list(follower.files)
    return bool(files) and all(any(os.path.exists(export_path(p, s)) for s in (".csv", ".parquet")) for p in files)


def watch(directory: str, interval: float = 1.0, idle: float = 60.0, stuck_s: float = 30.0, console=None) -> int:
    """Run the live view until Ctrl-C, the job's clean end or ``idle`` seconds without growth."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    follower = RunFollower(directory, keep_steps=WINDOW_STEPS, max_rows=WINDOW_ROWS)
    # rich redraws a terminal only: elsewhere (a pipe, a file, CI) the state is said in lines
    say = _Status() if not console.is_terminal else None
    grew = time.monotonic()
    seen = False
    reason = ""
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                # whether the job had ended is asked before reading: what the ranks wrote before their
                # exports is then read to its end and in the last frame (asked after, a frame drawn
                # before the last rows were read was the last one: step 22 of 24 under load)
                ended = seen and finished(follower)
                if follower.poll():
                    grew, seen = time.monotonic(), True
                    while ended and follower.poll():
                        pass
                quiet = time.monotonic() - grew
                snap = snapshot(follower, time.time_ns(), stuck_s)
                snap["title"] = f"commpatch watch {follower.directory()} ({time.strftime('%H:%M:%S')})"
                snap["idle_s"] = quiet if seen else None
                if not seen:
                    snap["notes"].append(
                        f"waiting for rank logs (*.cplog) in {follower.directory()} (for {idle:g} s at most)"
                    )
                if say is not None:
                    say.update(follower, seen, quiet, idle)
                live.update(screen(snap), refresh=True)
                if ended:
                    reason = "the job ended: every rank wrote its export at exit"
                    break
                if quiet >= idle:
                    last = time.strftime("%H:%M:%S", time.localtime(time.time() - quiet))
                    reason = (
                        f"no rank's log grew for {idle:g} s (last growth at {last})"
                        if seen
                        else f"no rank log appeared in {idle:g} s"
                    )
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        follower.close()
    print(f"commpatch watch: stopped at {time.strftime('%H:%M:%S')}: {reason}", file=sys.stderr)
    return 0


class _Status:
    """What ``watch`` waits for and what it follows, a line to stderr each time it changes (where
    the screen is not redrawn): waiting for logs, following N of them, a log read again from its
    start, no growth for a while."""

    QUIET_S = 5.0  # no growth for this long is said (once per quiet spell)

    def __init__(self) -> None:
        self.said: set[str] = set()
        self.files = -1
        self.quiet = False

    def line(self, text: str) -> None:
        print(f"commpatch watch: {terminal_safe(text)}", file=sys.stderr, flush=True)  # paths from the disk

    def update(self, follower: RunFollower, seen: bool, quiet: float, idle: float) -> None:
        where = follower.directory()
        if not seen:
            if "waiting" not in self.said:
                self.said.add("waiting")
                self.line(f"waiting for rank logs (*.cplog) in {where} (for {idle:g} s at most)")
            return
        if len(follower.files) != self.files:
            self.files = len(follower.files)
            self.line(f"following {self.files} rank log(s) in {where}; the table is printed when watch stops")
        for text in follower.restarts() + follower.errors():
            if text not in self.said:
                self.said.add(text)
                self.line(text)
        if quiet >= self.QUIET_S and not self.quiet:
            self.line(f"no rank's log grew for {quiet:.0f} s: waiting (for {idle:g} s at most)")
        self.quiet = quiet >= self.QUIET_S
