"""The watchdog's dump files (``hang_rank{rank}.txt``, ``commpatch.watchdog``) beside the logs, read
back as what each rank was waiting in: the report's hang finding uses them for a rank whose
binary log says nothing of its last moments (no ``inflight`` / ``alive`` record: written by an
older commpatch), and names them (they hold the stacks).

Each file may hold several dumps of one process, appended: the last one is the latest state.
"""

from __future__ import annotations

import glob
import os
import re

FILE_GLOB = "hang_rank*.txt"
MAX_BYTES = 16 << 20  # a dump file larger than this is not one: skipped
_HEAD = re.compile(r"^===== commpatch watchdog: rank (\d+) pid (\d+) host .* \(unix_ns (\d+)\) =====$")
_CALL = re.compile(
    r"^\[(?:STUCK|in flight)\] (\S+)  seq=(\d+)  (?:(?:collective|call) #\d+ of group .*?|group .*?, "
    r"number unknown)  group=(.*?) \(ranks (.*?); size \d+; .*?\)  numel=(-?\d+)  pending for "
    r"([0-9.]+) s  thread (.*)$"
)


def dumps_beside(paths) -> list[dict]:
    """The last dump of each watchdog file in the directories of ``paths`` (log files), as
    ``data.logfile.in_flight``-shaped dicts with ``dump`` (the file's path); unreadable or
    foreign files are skipped."""
    out = []
    for directory in sorted({os.path.dirname(os.path.abspath(p)) for p in paths}):
        for path in sorted(glob.glob(os.path.join(glob.escape(directory), FILE_GLOB))):
            try:
                if os.path.islink(path) or os.path.getsize(path) > MAX_BYTES:
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    got = parse_dump(f.read())
            except OSError:
                continue
            if got is not None:
                got["dump"] = path
                out.append(got)
    return out


def parse_dump(text: str) -> dict | None:
    """The last dump of a watchdog file: {rank, pid, alive_ns (the dump's time), calls}, or None."""
    last: dict | None = None
    calls: list = []
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            rank, pid, at = map(int, head.groups())
            calls = []
            last = {"rank": rank, "pid": pid, "alive_ns": at, "calls": calls}
            continue
        call = _CALL.match(line) if last is not None else None
        if call:
            op, seq, group, ranks, numel, age, thread = call.groups()
            start = at - int(float(age) * 1e9)
            calls.append(
                {
                    "op": op,
                    "group": group,
                    "group_ranks": ranks,
                    "peer": -1,
                    "seq": int(seq),
                    "below": int(seq) + 1,
                    "numel": int(numel),
                    "bytes": -1,
                    "start_ns": start,
                    "seen_ns": start,
                    "thread": thread,
                    "stack": [],
                }
            )
    return last
