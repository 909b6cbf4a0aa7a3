"""``commpatch watch``'s follower on fuzzed input: the seeded mutations of ``tests/test_fuzz.py``
(a real log written by commpatch's writer, damaged) written to a file piece by piece as a rank
would, with the file replaced (a new inode) or truncated now and then, read by ``io.follow``'s
``FileFollower`` after every piece, then the live view's figures and screen computed from it
(``watch.snapshot``, ``render.live.screen``). What must hold on every input (issue 33): no
exception (a file that is no rank log is refused: ``FileFollower.error``), no case past
``HANG_S``, the follower holding no more than its window (rows, LATE / OWN pairs, bytes waiting)
after every piece, and the child's peak resident memory below ``PEAK_MB`` above its baseline.
The cases run in one child process under an address-space limit, as ``tests/test_fuzz.py``'s."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tests.test_fuzz import (  # noqa: F401 - writer_log: a fixture
    HANG_S,
    PEAK_MB,
    SEED,
    _report,
    each_case,
    limit_memory,
    mutate_binary,
    writer_log,
)

CASES = 120
MAX_ROWS = 64  # a small window: the bounds are reached and held on every case


def _follow_case(path: str, seed: int) -> str:
    """'ok', 'refused' (not a rank log), or what went wrong."""
    import io
    import time

    from rich.console import Console

    from commpatch.data.follow import MAX_META
    from commpatch.io.follow import FileFollower, RunFollower
    from commpatch.render.live import screen
    from commpatch.watch import snapshot

    rng = random.Random(seed)
    data = Path(path).read_bytes()
    live = Path(path).parent / "live"
    live.mkdir()
    target = live / "rank0.cplog"
    target.write_bytes(b"")
    f = FileFollower(str(target), max_rows=MAX_ROWS, keep_steps=2)
    pos = 0
    try:
        while pos < len(data):
            n = rng.choice((1, 7, 64, 500, 4096, 1 << 16))
            with open(target, "ab") as out:
                out.write(data[pos : pos + n])
            pos = min(len(data), pos + n)
            f.poll()
            held = f.follower
            if len(held.window) > MAX_ROWS or len(held.late) > len(held.window) + MAX_ROWS:
                return f"unbounded: {len(held.window)} rows, {len(held.late)} late pairs held"
            if len(held.own) > len(held.window) + MAX_ROWS or len(held.pending) > MAX_META + 5:
                return f"unbounded: {len(held.own)} own pairs, {len(held.pending)} bytes waiting"
            event = rng.random()
            if event < 0.03:  # replaced: a new file with what was written so far
                (live / "new").write_bytes(data[:pos])
                os.replace(live / "new", target)
            elif event < 0.06:  # truncated: written again from a shorter length
                pos = rng.randrange(pos + 1)
                os.truncate(target, pos)
        f.poll()
        run = RunFollower(str(live))
        run.poll()
        snap = snapshot(run, time.time_ns(), 1.0)
        snap["title"] = f"commpatch watch {live}"
        Console(file=io.StringIO(), force_terminal=True, width=120).print(screen(snap))
        run.close()
    except Exception as exc:  # noqa: BLE001 - what the test is looking for
        return f"raw {type(exc).__name__}: {exc}"[:300]
    finally:
        f.close()
    if f.error and "not a commpatch binary log" not in f.error:
        return f"error: {f.error}"[:300]
    return "refused" if f.error else "ok"


def child(cases: list[str]) -> dict:
    limit_memory()
    import numpy  # noqa: F401 - what a case loads, loaded before the baseline
    import pandas  # noqa: F401
    import rich.console  # noqa: F401

    import commpatch.watch  # noqa: F401

    return each_case(cases, lambda path, i: _follow_case(path, SEED * 1000 + i))


def test_fuzzed_logs_followed_never_crash_hang_or_grow(writer_log, tmp_path):  # noqa: F811 - the fixture
    cplog, _ = writer_log
    binary = Path(cplog).read_bytes()
    rng = random.Random(SEED + 33)
    cases = []
    for i in range(CASES):
        d = tmp_path / f"case{i:03d}"
        d.mkdir()
        data = binary if i == 0 else mutate_binary(rng, binary)  # the first: the log as written
        (d / "rank0.cplog").write_bytes(data)
        cases.append(str(d / "rank0.cplog"))
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_fuzz_follow", *cases],
        capture_output=True,
        text=True,
        timeout=HANG_S * 10 + 600,
        cwd=str(Path(__file__).parent.parent),
        env=dict(os.environ, COMMPATCH_OUTPUT="none"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    results = got["results"]
    failed = _report(results, tmp_path)
    assert not failed, "\n".join(failed)
    outcomes = list(results.values())
    assert results[cases[0]] == "ok" and outcomes.count("ok") > CASES // 2, outcomes
    assert got["peak_mb"] - got["baseline_mb"] < PEAK_MB, got


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1:])))
