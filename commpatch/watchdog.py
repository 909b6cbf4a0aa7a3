"""Hang diagnosis: a daemon thread that reports collectives stuck in flight.

Off by default (``COMMPATCH_WATCHDOG`` / ``enable(watchdog=SECONDS)``; 0 is off). When on, the
wrappers register every call in ``Log.pending`` while it is in flight (async ones until their
completion callback fires), and this thread looks at that dict every ``min(1, threshold / 4)``
seconds. Once per stuck call it writes a dump (rank, pid, each pending call with its op, its
number in its group (``collective #k of group g``: the same on every rank, the report's
``coll_seq``; this process's ``seq`` too), group, age and the Python stack of the thread that
issued it, then the last recorded rows) to stderr
and to ``hang_rank{rank}.txt`` in the output file's directory (the current directory when the
output is 'none'; ``hang_rank{rank}.1.txt``... when the name is taken: never over a file, never
through a link). It never stops the job and never raises: a failure is an internal error of
kind ``watchdog``, counted and warned once.

Reading the log here needs neither pandas nor the DataFrame: the tail of ``Log.recent_rows()`` is
decoded with the log's own registries.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

from .data.ops import BY_NAME, OP_CODE, OP_NAMES, P2P_OPS
from .data.schema import TIMINGS, unpack_flags
from .io.paths import rank_path
from .io.writer import write_bytes
from .record import state as _runtime

LAST_ROWS = 20  # most recent rows shown after the pending calls
STACK_LIMIT = 40  # frames per stack
FILE_NAME = "hang_rank{rank}.txt"
_NOFOLLOW, _CLOEXEC = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_CLOEXEC", 0)

_lock = threading.Lock()
_current: Watchdog | None = None


def start(log, settings: dict) -> None:
    """Start the thread when ``settings['watchdog']`` asks for it (called by enable())."""
    global _current
    threshold = settings.get("watchdog") or 0
    if not threshold:
        return
    with _lock:
        if _current is not None and _current.is_alive():
            return
        _current = Watchdog(log, float(threshold), settings.get("output") or "")
        _current.start()


def stop() -> None:
    """Stop the thread (called by disable()); pending calls are left as they are."""
    global _current
    with _lock:
        dog, _current = _current, None
    if dog is not None:
        dog.stop()


def running() -> bool:
    dog = _current
    return dog is not None and dog.is_alive()


class Watchdog(threading.Thread):
    def __init__(self, log, threshold_s: float, output_template: str) -> None:
        super().__init__(name="commpatch-watchdog", daemon=True)
        self.log = log
        self.threshold_ns = int(threshold_s * 1e9)
        self.interval_s = min(1.0, threshold_s / 4)
        self.output_template = output_template
        self.reported: set[int] = set()  # seqs already dumped (each stuck call once)
        self.dump_file = None  # (path, (st_dev, st_ino)) of this process's dump file
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the job must never notice us
                _runtime.fail("watchdog", exc)

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=5)

    # ---- one pass ----------------------------------------------------------------------
    def check(self, now_ns: int | None = None) -> str | None:
        """Dump if some call is stuck and not dumped yet; returns the dump text, or None."""
        now_ns = time.perf_counter_ns() if now_ns is None else now_ns
        pending = self.log.pending.copy()  # one C call: safe against concurrent updates
        self.reported &= pending.keys()  # forget calls that finished
        stuck = [seq for seq, entry in pending.items() if now_ns - entry[4] > self.threshold_ns]
        if not stuck or self.reported.issuperset(stuck):
            return None
        self.reported.update(stuck)
        text = self.render(pending, now_ns)
        self.write(text)
        return text

    def write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stderr: the file still gets it
            pass
        try:
            self._to_file(text)
        except OSError as exc:
            _runtime.fail("watchdog.file", exc)

    def _to_file(self, text: str) -> None:
        """The first dump of this process takes a new name (``hang_rank{r}.txt``, else ``.1``, ``.2``
        ... as the logs do), whole at once: written to a temporary file created exclusively, then
        hard-linked to its name, so neither is ever written through a planted link or over an
        existing file, and a peer waiting for the file never reads half of it. Later dumps are
        appended to that same file (opened without following a link, and checked to be it)."""
        data = text.encode("utf-8", "backslashreplace")
        if self.dump_file is not None:
            path, ident = self.dump_file
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | _NOFOLLOW | _CLOEXEC)
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != ident:
                    raise FileExistsError(f"{path} was replaced by another file: not appended to")
                os.write(fd, data)
            finally:
                os.close(fd)
            return
        base = self.path()
        os.makedirs(os.path.dirname(base) or ".", exist_ok=True)  # removed since enable()
        stem, suffix = os.path.splitext(base)
        for n in range(1000):
            path = base if n == 0 else f"{stem}.{n}{suffix}"
            if os.path.lexists(path):
                continue
            try:
                write_bytes(data, path, exclusive=True)
            except FileExistsError:  # taken meanwhile, or its temporary name is
                continue
            st = os.lstat(path)
            self.dump_file = (path, (st.st_dev, st.st_ino))
            return
        raise FileExistsError(f"no free file name for {base}")

    def path(self) -> str:
        rank = self.rank()
        directory = "."
        sink = self.log.sink
        if sink is not None and sink.path is not None:  # beside this rank's binary log
            directory = os.path.dirname(sink.path) or "."
        elif self.output_template:
            directory = os.path.dirname(os.path.normpath(rank_path(self.output_template, rank=rank))) or "."
        return os.path.join(directory, FILE_NAME.format(rank=rank))

    def rank(self) -> int:
        if self.log.rank >= 0:
            return self.log.rank
        env = os.environ.get("RANK", "")
        return int(env) if env.isdigit() else 0

    # ---- the dump ----------------------------------------------------------------------
    def render(self, pending: dict, now_ns: int) -> str:
        rank, threshold = self.rank(), self.threshold_ns / 1e9
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        over = sum(1 for e in pending.values() if now_ns - e[4] > self.threshold_ns)
        lines = [
            f"===== commpatch watchdog: rank {rank} pid {os.getpid()} host {socket.gethostname()} at {stamp} "
            f"(unix_ns {now_ns + self.log.offsets[1][-1]}) =====",
            f"{over} collective call(s) in flight for more than {threshold:g} s "
            f"({len(pending)} in flight in all). commpatch does not stop the job.",
        ]
        frames = sys._current_frames()
        threads = {t.ident: t.name for t in threading.enumerate()}
        numbers = self._numbers(pending)
        for seq in sorted(pending):
            lines += self._pending_lines(seq, pending[seq], now_ns, frames, threads, numbers.get(seq))
        lines += self._recent_lines(now_ns)
        lines.append(f"===== end of commpatch watchdog dump (rank {rank}) =====\n")
        return "\n".join(lines)

    def _numbers(self, pending: dict) -> dict:
        """seq -> (kind, number) of each pending call, the same on every rank: ('collective', k) for
        the k-th collective of its group on this rank (point-to-point calls left out, as the report's
        matching numbers them), ('call', k) for a point-to-point call (the k-th call on the group).
        Counted from this process's rows (read back: once per dump); {} when they cannot be read."""
        if not pending:
            return {}
        try:
            import numpy as np

            rows = self.log.all_rows()
            seq, gid = rows["seq"].astype(np.int64), rows["gid"].astype(np.int64)
            p2p = np.isin(rows["op"].astype(np.int64), [OP_CODE[n] for n in P2P_OPS if n in OP_CODE])
        except Exception as exc:  # noqa: BLE001 - the dump goes out without the numbers
            _runtime.fail("watchdog.numbers", exc)
            return {}
        out = {}
        for s, entry in pending.items():
            before = (gid == entry[1]) & (seq < s)
            out[s] = (
                ("call", int(before.sum()))
                if OP_NAMES[entry[0]] in P2P_OPS
                else ("collective", int((before & ~p2p).sum()))
            )
        return out

    def _pending_lines(self, seq, entry, now_ns, frames, threads, number=None) -> list[str]:
        code, gid, numel, ident, start_ns, issue_stack = entry[:6]
        op, numel = OP_NAMES[code], self._numel(code, gid, numel)
        age = (now_ns - start_ns) / 1e9
        stuck = "STUCK" if now_ns - start_ns > self.threshold_ns else "in flight"
        name, size, ranks, backend = self._group(gid)
        where = f"{number[0]} #{number[1] + 1} of group {name}" if number else f"group {name}, number unknown"
        lines = [
            "",
            f"[{stuck}] {op}  seq={seq}  {where}  group={name} (ranks {ranks}; size {size}; {backend})  "
            f"numel={numel}  pending for {age:.1f} s  thread {threads.get(ident, '?')!r} ({ident})",
        ]
        if issue_stack is not None:  # (file, line, function) per frame, from record.wrapper._issue_stack
            lines.append("  issued from (async call; the thread has moved on), most recent call last:")
            summary = [traceback.FrameSummary(*frame) for frame in issue_stack][-STACK_LIMIT:]
            stack = traceback.StackSummary.from_list(summary).format()
        elif ident in frames and code == OP_CODE["ddp_bucket_allreduce"]:
            lines.append(
                "  stack of the thread that issued it (DDP's reducer, during the backward), which waits for it "
                "in the reducer's finalize, most recent call last:"
            )
            stack = traceback.format_stack(frames[ident])[-STACK_LIMIT:]
        elif ident in frames:
            lines.append("  stack of the issuing thread, still inside the call, most recent call last:")
            stack = traceback.format_stack(frames[ident])[-STACK_LIMIT:]
        else:
            return lines + ["  (the issuing thread no longer exists; no stack)"]
        for entry_text in stack:
            lines += ["  " + ln for ln in entry_text.rstrip("\n").split("\n")]
        return lines

    def _numel(self, code: int, gid: int, numel: int) -> int:
        """Elements of the message: ops given a per-rank input move n times that (as the log says)."""
        return numel * self._group(gid)[1] if BY_NAME[OP_NAMES[code]].size[0] == "xn" else numel

    def _group(self, gid: int) -> tuple:
        groups = self.log.groups
        if 0 <= gid < len(groups):
            g = groups[gid]
            return g.name, g.size, g.ranks, g.backend
        return "?", 1, "?", "?"

    def _recent_lines(self, now_ns: int) -> list[str]:
        rows = self.log.recent_rows()
        if len(rows) > LAST_ROWS:
            import numpy as np

            rows = rows[np.argpartition(rows["seq"], len(rows) - LAST_ROWS)[-LAST_ROWS:]]
        rows = sorted(rows.tolist(), key=lambda r: r[0])
        lines = [
            "",
            f"last {len(rows)} recorded call(s) on this rank, oldest first (async ones may still be in flight):",
            f"  {'seq':>8}  {'op':<24} {'group':<8} {'dtype':<9} {'numel':>10} {'bytes':>12} "
            f"{'host_us':>10}  {'timing':<12} {'status':<6} {'issued_s_ago':>12}",
        ]
        names, sizes = self.log.dtype_names, self.log.dtype_sizes
        for seq, op, gid, dtype, numel, flags, start, end, *_ in rows:
            name, numel = OP_NAMES[op], self._numel(op, gid, numel)
            known = dtype < len(names)
            is_async, _, err, tcode = unpack_flags(flags)
            timing = TIMINGS[tcode] + (" async" if is_async else "")
            lines.append(
                f"  {seq:>8}  {name:<24} {self._group(gid)[0]:<8} {names[dtype] if known else '?':<9} "
                f"{numel:>10} {numel * sizes[dtype] if known else '?':>12} {(end - start) / 1e3:>10.1f}  "
                f"{timing:<12} {'error' if err else 'ok':<6} {(now_ns - start) / 1e9:>12.1f}"
            )
        return lines
