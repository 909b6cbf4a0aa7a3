"""The durable rank log: a binary file written from the first row, readable whatever kills the process.

The hot path is unchanged: it packs each row into ``Log.buf`` (one C call). A flusher thread
moves what is new to the rank's file every ``FLUSH_S`` seconds with one ``os.write``: the rows,
the late durations, and the registries (groups with their ranks once, dtypes, tags, modules,
clock offsets, DDP bucket spans) as they appear. Bytes written are kept by the OS page cache when
the process dies, by a signal, an abort or SIGKILL, so no exit handler is needed for durability;
a Python handler could not run anyway while the main thread waits in a C++ collective.

File layout: ``MAGIC`` then frames ``<kind:1 byte><length:4 bytes LE><payload>``:
- ``R``: whole packed rows (``_log.ROW``);
- ``L``: (seq, duration_ns) pairs, little-endian int64, for rows timed after they were written;
- ``M``: one JSON object (``{"k": kind, ...}``): header, group, dtype, tag, module, clock, bucket.
A frame cut short by a crash (the last one) is skipped and counted, never fatal.

The file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: never through a pre-planted link,
never over an existing file (a taken name gets a ``.1``, ``.2`` ... suffix).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

MAGIC = b"CPLOG1\n"
SUFFIX = ".cplog"
FORMAT_VERSION = 1     # of this file layout; the columns' version is _log.SCHEMA_VERSION
FLUSH_S = 0.2
_FRAME = struct.Struct("<cI")
ROWS, LATE, META = b"R", b"L", b"M"


def frame(kind: bytes, payload: bytes) -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def meta(kind: str, **fields) -> bytes:
    fields["k"] = kind
    # ensure_ascii: any str (lone surrogates included) round-trips through \\u escapes
    return frame(META, json.dumps(fields, ensure_ascii=True, separators=(",", ":")).encode("ascii"))


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


# ---- reading --------------------------------------------------------------------------------

class Parsed:
    """What a rank log holds: rows (numpy structured array), late durations, registries."""

    def __init__(self) -> None:
        self.rows = None
        self.late_seq = self.late_dur = None
        self.header: dict = {}
        self.groups: dict[int, dict] = {}
        self.dtypes: dict[int, tuple[str, int]] = {}
        self.tags: dict[int, str] = {0: ""}
        self.modules: dict[int, str] = {0: ""}
        self.clock: list[tuple[int, int]] = []
        self.buckets: list[tuple[int, int, int, int]] = []
        self.torn = 0            # frames (or rows) cut short by a crash, skipped


def parse(data: bytes, row_size: int, row_dtype, name: str = "<log>") -> Parsed:
    """Frames of a rank log; a torn tail is skipped and counted in ``Parsed.torn``."""
    import numpy as np

    if not data.startswith(MAGIC):
        raise ValueError(f"{name}: not a commpatch binary log (no {MAGIC[:-1].decode()} header)")
    out = Parsed()
    rows, late = [], []
    pos, end, head = len(MAGIC), len(data), _FRAME.size
    view = memoryview(data)
    while pos < end:
        if end - pos < head:
            out.torn += 1
            break
        kind, length = _FRAME.unpack_from(data, pos)
        pos += head
        if pos + length > end:
            out.torn += 1
            break
        payload = view[pos:pos + length]
        pos += length
        if kind == ROWS:
            whole = length - length % row_size
            out.torn += length != whole
            rows.append(payload[:whole])
        elif kind == LATE:
            late.append(payload[:length - length % 16])
        elif kind == META:
            try:
                _meta(out, json.loads(bytes(payload)))
            except (ValueError, KeyError, TypeError):
                out.torn += 1
        else:
            out.torn += 1
            break
    out.rows = np.frombuffer(b"".join(rows), dtype=row_dtype)
    pairs = np.frombuffer(b"".join(late), dtype="<i8").reshape(-1, 2)
    out.late_seq, out.late_dur = pairs[:, 0].copy(), pairs[:, 1].copy()
    return out


def _meta(out: Parsed, m: dict) -> None:
    kind = m["k"]
    if kind == "header":
        out.header = m
    elif kind == "group":
        out.groups[m["gid"]] = m
    elif kind == "dtype":
        out.dtypes[m["code"]] = (m["name"], m["size"])
    elif kind == "tag":
        out.tags[m["code"]] = m["name"]
    elif kind == "module":
        out.modules[m["code"]] = m["name"]
    elif kind == "clock":
        out.clock.append((m["seq"], m["offset"]))
    elif kind == "bucket":
        out.buckets.append((m["lo"], m["hi"], m["index"], m["params"]))


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
