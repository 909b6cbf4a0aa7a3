"""Where a rank's log goes: a file created exclusively from the first row (``FileSink``), or
frames kept in memory (``MemorySink``: output 'none', and the backlog of frames waiting for the
disk), both in the ``data.logfile`` format; the flusher thread that moves new rows to the disk
every ``FLUSH_S`` seconds; the run directory name agreed by the ranks.

A file only ever holds whole frames followed by, at worst, one torn last frame (the process died
while writing it): a write that fails part-way (disk full) is cut back to the last whole frame
before anything else is appended, and if even that fails the file is left as it is and later
rows go to a new one."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

from ..data.logfile import _FRAME, MAGIC
from ..data.schema import ROW

FLUSH_S = 0.2
RETRY_S = 1.0  # a file that could not be opened or written is tried again this often
BACKLOG_ROWS = 1 << 18  # rows waiting for the disk when COMMPATCH_MAX_ROWS is 0 (~15 MB)


class MemorySink:
    """Frames kept in memory: the same format, read by the same parser. Row frames are kept apart
    from the rest so that a cap can drop the oldest rows alone (registries are never dropped)."""

    path = None

    def __init__(self) -> None:
        self.other = bytearray()  # registry and late-duration frames (never dropped)
        self.row_frames: list[bytes] = []
        self.rows = 0

    def append(self, other: bytes, rows: bytes, n_rows: int) -> None:
        self.other += other
        if rows:
            self.row_frames.append(rows)
            self.rows += n_rows

    def extend(self, later: MemorySink) -> None:
        """``later``'s frames after this one's (a backlog put back after a failed write)."""
        self.other += later.other
        self.row_frames += later.row_frames
        self.rows += later.rows

    def cap_rows(self, max_rows: int, row_size: int) -> tuple[int, int, int]:
        """Drop the oldest rows while more than ``max_rows`` are held (a frame cut at a row boundary
        if need be): (rows dropped, first and last seq among them; -1 when none)."""
        dropped, first, last = 0, -1, -1
        while self.rows > max_rows and self.row_frames:
            frame = self.row_frames[0]
            n = (len(frame) - _FRAME.size) // row_size
            k = min(n, self.rows - max_rows)
            if k == n:
                self.row_frames.pop(0)
            else:
                cut = _FRAME.size + k * row_size
                self.row_frames[0] = _FRAME.pack(frame[:1], len(frame) - cut) + frame[cut:]
            self.rows -= k
            dropped += k
            if k:
                lo, hi = _seq_at(frame, 0), _seq_at(frame, k - 1)
                first = lo if first < 0 else min(first, lo)
                last = max(last, hi)
        return dropped, first, last

    def __bool__(self) -> bool:
        return bool(self.other or self.row_frames)

    def payload(self) -> bytes:
        return bytes(self.other) + b"".join(self.row_frames)

    def nbytes(self) -> int:
        return len(self.other) + sum(map(len, self.row_frames))

    def read(self) -> bytes:
        return MAGIC + self.payload()

    def close(self) -> None:
        pass


def _seq_at(frame: bytes, i: int) -> int:
    return ROW.unpack_from(frame, _FRAME.size + i * ROW.size)[0]


class FileSink:
    """An append-only file created exclusively; writes go straight to the OS (no user-space buffer)
    and are all or nothing: a write cut short is truncated back to the file's last whole frame."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()
        flags = (
            os.O_WRONLY
            | os.O_CREAT
            | os.O_EXCL
            | os.O_APPEND
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0)
        )
        self.fd = os.open(path, flags, 0o644)
        self.size = 0  # bytes of whole frames in the file (MAGIC goes with the first write:
        self.rows = 0  # opening is all the recording thread does, the flusher writes)
        self.torn = False  # a failed write could not be cut back: nothing more may be appended

    def append(self, data: bytes, n_rows: int = 0) -> None:
        """Write ``data`` (whole frames) entirely, or raise OSError with the file as it was before."""
        if self.fd < 0 or os.getpid() != self.pid:  # closed, or a forked child: never ours to write
            return
        if self.torn:
            raise OSError(errno.EIO, f"{self.path} ends in a record cut short: not appended to")
        if not self.size:
            data = MAGIC + data
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                n = os.write(self.fd, view[done:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError:
            if done:
                try:
                    os.ftruncate(self.fd, self.size)
                except OSError:
                    self.torn = True
            raise
        self.size += len(data)
        self.rows += n_rows

    def removed(self) -> bool:
        """Whether the file was deleted under us (its name, or its whole directory): what is written
        to it from now on would be lost."""
        try:
            return self.fd >= 0 and os.fstat(self.fd).st_nlink == 0
        except OSError:
            return False

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            data = f.read(self.size) if os.getpid() == self.pid else f.read()
        return data or MAGIC

    def close(self) -> None:
        if self.fd >= 0 and os.getpid() == self.pid:
            os.close(self.fd)
        self.fd = -1


def create_exclusive(stem: str, suffixes: tuple[str, ...]) -> tuple[FileSink, str]:
    """A new file ``stem + suffixes[0]`` (or ``stem.N + ...`` when any of the names with the other
    suffixes is taken): the sink and the stem chosen. Creates missing directories (following a
    symbolic link among them, as ``mkdir -p`` does; the file itself never through one)."""
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
    """A daemon thread that calls ``flush()`` every ``interval`` seconds (or when woken) until stopped."""

    def __init__(self, flush, interval: float = FLUSH_S) -> None:
        self.flush = flush
        self.interval = interval
        self.stop_event = threading.Event()
        self.wake_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="commpatch-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            self.wake_event.wait(self.interval)
            self.wake_event.clear()
            if not self.stop_event.is_set():
                self.flush()

    def wake(self) -> None:
        """Flush soon, without waiting for it."""
        self.wake_event.set()

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stop_event.is_set()

    def stop(self) -> None:
        self.stop_event.set()
        self.wake_event.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2)
