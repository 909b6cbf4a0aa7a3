"""Where a rank's log goes: a file created exclusively from the first row (``FileSink``), or
frames kept in memory (``MemorySink``), both in the ``data.logfile`` format; the flusher thread
that moves new rows there every ``FLUSH_S`` seconds; the run directory name agreed by the ranks."""

from __future__ import annotations

import os
import socket
import threading
import time

from ..data.logfile import _FRAME, MAGIC

FLUSH_S = 0.2


class MemorySink:
    """Frames kept in memory (output 'none'): the same format, read by the same parser. Row frames
    are kept apart from the rest so that a cap (``max_rows``) can drop the oldest rows alone."""

    path = None

    def __init__(self) -> None:
        self.other = bytearray()             # registry and late-duration frames (never dropped)
        self.row_frames: list[bytes] = []
        self.rows = 0

    def append(self, other: bytes, rows: bytes, n_rows: int) -> None:
        self.other += other
        if rows:
            self.row_frames.append(rows)
            self.rows += n_rows

    def cap_rows(self, max_rows: int, row_size: int) -> int:
        """Drop the oldest row frames while more than ``max_rows`` rows are held; returns rows dropped."""
        dropped = 0
        while self.rows > max_rows and len(self.row_frames) > 1:
            n = (len(self.row_frames.pop(0)) - _FRAME.size) // row_size
            self.rows -= n
            dropped += n
        return dropped

    def nbytes(self) -> int:
        return len(self.other) + sum(map(len, self.row_frames))

    def read(self) -> bytes:
        return MAGIC + bytes(self.other) + b"".join(self.row_frames)

    def close(self) -> None:
        pass


class FileSink:
    """An append-only file created exclusively; writes go straight to the OS (no user-space buffer)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) \
            | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(path, flags, 0o644)
        self.write(MAGIC)

    def append(self, other: bytes, rows: bytes, n_rows: int) -> None:
        self.write(other + rows)        # one write: a kill leaves whole frames or a torn last one

    def write(self, data: bytes) -> None:
        if self.fd < 0 or os.getpid() != self.pid:     # closed, or a forked child: never ours to write
            return
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def close(self) -> None:
        if self.fd >= 0 and os.getpid() == self.pid:
            os.close(self.fd)
        self.fd = -1


def create_exclusive(stem: str, suffixes: tuple[str, ...]) -> tuple[FileSink, str]:
    """A new file ``stem + suffixes[0]`` (or ``stem.N + ...`` when any of the names with the other
    suffixes is taken): the sink and the stem chosen. Creates missing directories."""
    directory = os.path.dirname(os.path.abspath(stem))
    os.makedirs(directory, exist_ok=True)
    for n in range(10000):
        candidate = stem if n == 0 else f"{stem}.{n}"
        if any(os.path.lexists(candidate + s) for s in suffixes[1:]):
            continue
        try:
            return FileSink(candidate + suffixes[0]), candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free file name for {stem}{suffixes[0]}")


# ---- the run's name, agreed by every rank --------------------------------------------------

def run_name(store=None) -> str:
    """``YYYYmmdd-HHMMSS-host-pid`` of the first rank to propose one, agreed through the process
    group's store (``compare_set``: first writer wins, nobody waits); a restart attempt of torchrun
    gets its own name (``-attemptN``). Without a usable store: this process's own proposal."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname().split('.')[0]}-{os.getpid()}"
    if attempt not in ("", "0"):
        mine += f"-attempt{attempt}"
    if store is not None:
        try:
            agreed = store.compare_set(f"commpatch/run/{attempt}", "", mine)
            return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        except Exception:  # noqa: BLE001 - a store without compare_set (fake, custom): per process
            pass
    return mine


# ---- the flusher ----------------------------------------------------------------------------

class Flusher:
    """A daemon thread that calls ``flush()`` every ``interval`` seconds until stopped."""

    def __init__(self, flush, interval: float = FLUSH_S) -> None:
        self.flush = flush
        self.interval = interval
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="commpatch-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.flush()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2)
