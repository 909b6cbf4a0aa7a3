"""The rank log file format (written by ``record.sinks``, read here): a binary file written from the first row, readable whatever kills the process.

The hot path is unchanged: it packs each row into ``Log.buf`` (one C call). A flusher thread
moves what is new to the rank's file every ``record.sinks.FLUSH_S`` seconds with one ``os.write``: the rows,
the late durations, and the registries (groups with their ranks once, dtypes, tags, modules,
clock offsets, DDP bucket spans) as they appear. Bytes written are kept by the OS page cache when
the process dies, by a signal, an abort or SIGKILL, so no exit handler is needed for durability;
a Python handler could not run anyway while the main thread waits in a C++ collective.

File layout: ``MAGIC`` then frames ``<kind:1 byte><length:4 bytes LE><payload>``:
- ``R``: whole packed rows (``data.schema.ROW``);
- ``L``: (seq, duration_ns) pairs, little-endian int64, for rows timed after they were written;
- ``Q``: (seq, own_ns) pairs, the same way: a device-timed row's own time (its completion minus
  the later of its start and the previous call's completion on the group, measured on the device);
- ``M``: one JSON object (``{"k": kind, ...}``): header, group, dtype, tag, module, clock, rank0_offset
  (an interval [lo, hi] ns holding rank 0's wall clock minus this rank's, measured at ``at``;
  same: 1 when rank 0 runs on this machine: ``record.clocksync``), bucket,
  step_source, device (the accelerator type that rows flagged "on the device" ran on), sync (the
  end of DDP's finalize after a backward, ns after the start of the row of its last bucket);
  inflight / landed / alive (a call in flight longer than the flusher's period, its completion,
  the process alive at a time: ``record.inflight``); step (the training thread's wall clock and CPU
  time where a step starts, at 0, and at its first root forward, at 1: ``integrations.steps``);
  settings (a DDP / FSDP module's settings, once per module). A reader ignores the kinds it does
  not know.
A frame cut short (a crash, a short write on a full disk: also mid-file, with frames appended
after it), zeros or garbage are skipped and counted, never fatal: the reader keeps the whole rows
and resynchronises on the next whole frame (see ``_Scanner``).

The file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: never through a pre-planted link,
never over an existing file (a taken name gets a ``.1``, ``.2`` ... suffix).
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

from .ops import OP_NAMES
from .schema import F_ASYNC, F_DEVICE, F_ERROR, ROW, STEP_SOURCES, T_SHIFT, TIMINGS

MAGIC = b"CPLOG1\n"
SUFFIX = ".cplog"
FORMAT_VERSION = 1  # of this file layout; the columns' version is data.schema.SCHEMA_VERSION
_FRAME = struct.Struct("<cI")
ROWS, LATE, META, OWN = b"R", b"L", b"M", b"Q"
_UNUSED_FLAGS = ((1 << T_SHIFT) - 1) & ~(F_ASYNC | F_DEVICE | F_ERROR)  # bits no row sets


def frame(kind: bytes, payload: bytes) -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def meta(kind: str, **fields) -> bytes:
    fields["k"] = kind
    # ensure_ascii: any str (lone surrogates included) round-trips through \\u escapes
    return frame(META, json.dumps(fields, ensure_ascii=True, separators=(",", ":")).encode("ascii"))


# ---- reading --------------------------------------------------------------------------------
# A file read back may be damaged: a frame torn by a short write (a full disk) with later frames
# appended after it, a block of zeros (what a crash leaves on some filesystems), or any bytes at
# all (a hostile or fuzzed file). The parser keeps every whole record, finds the next frame
# boundary after damage (resynchronises) and counts what it skipped; every number a file gives
# that sizes something (a registry code, a row's tag, a group's ranks) is checked against what
# the file can hold before anything is allocated.

MAX_WORLD = 1 << 20  # ranks: a world size (or rank) above this is damage, not a job
RANKS_NAMED = 4 * MAX_WORLD  # ranks the groups of one file may name in all (the analysis lists them)
_KINDS = frozenset((ROWS, LATE, META, OWN))
_PAIR = 16  # one (seq, ns) pair of an L or Q frame
_CANDIDATE = re.compile(rb"[RLMQ]")
_RESYNC_TRIES = 1 << 18  # candidate frame starts tried per file (and one per 64 bytes of it)
_I64 = (-(1 << 63), (1 << 63) - 1)
_UNKNOWN_GROUP = {"name": "?", "size": 0, "ranks": "", "backend": "?", "backends": ["?"] * 3}


class Parsed:
    """What a rank log holds: rows (numpy structured array), late durations, registries, and
    what was left out of a damaged file (``damage()``)."""

    def __init__(self) -> None:
        self.rows: Any = None  # numpy arrays once parsed
        self.late_seq: Any = None
        self.late_dur: Any = None
        self.own_seq: Any = None
        self.own_dur: Any = None
        self.device = "cuda"  # files written before the accelerator was named: CUDA
        self.header: dict = {}
        self.groups: dict[int, dict] = {}
        self.dtypes: dict[int, tuple[str, int]] = {}
        self.tags: dict[int, str] = {0: ""}
        self.modules: dict[int, str] = {0: ""}
        self.clock: list[tuple[int, int]] = []
        # (at, lo, hi ns, same machine as rank 0): rank 0's wall clock minus this rank's
        self.rank0_offsets: list[tuple[int, int, int, int]] = []
        self.buckets: list[tuple[int, int, int, int]] = []
        # (first seq, data.schema.STEP_SOURCES code[, micro-batches, step of the switch])
        self.step_sources: list[tuple] = []
        self.syncs: list[tuple[int, int]] = []  # (seq of a last bucket's row, finalize end ns after its start)
        self.packs: list[tuple[int, int, int]] = []  # (seq of a bucket's first row, packing ns, of which alone)
        self.waits: list[tuple[int, int]] = []  # (seq of a functional collective's row, ns the thread waited for it)
        self.torn = 0  # frames cut short (a crash, a short write): their whole rows kept
        self.damaged = 0  # stretches of bytes that are no frame (zeros, garbage): skipped
        self.skipped_bytes = 0  # bytes of torn frames and damaged stretches left out
        self.bad_records = 0  # registry records that are not valid (bad JSON, a wrong type, out of bounds)
        self.zero_rows = 0  # rows of zeros (a crash on some filesystems)
        self.bad_rows = 0  # rows with impossible values (a code out of range, a negative seq ...)
        self.repeated_rows = 0  # rows repeating the seq of an earlier row
        self.unknown_codes = 0  # codes used by rows whose registry record is lost: named "?"
        self.ranks_named = 0  # ranks named by the groups read so far (bounded: RANKS_NAMED)
        self.lost: list[tuple[int, int, int, str]] = []  # rows the writer dropped: (rows, first seq, last seq, why)
        self.inflight: dict[int, dict] = {}  # id -> a call noted in flight (record.inflight), its fields checked
        self.landed: dict[int, int] = {}  # id -> Unix ns when that call was seen completed
        self.alive_ns = 0  # the latest 'alive' record: the process ran until then at least
        self.step_marks: list[tuple[int, int, int, int]] = []  # (step, at: 0 start / 1 first forward, ns, cpu ns)
        self.settings: list[dict] = []  # {"wrapper", "module", "values": {setting: value}}

    def damage(self) -> list[str]:
        """What was left out or guessed, one phrase per kind (none for an undamaged log)."""
        out = []
        if self.torn:
            out.append(
                f"{self.torn} frame(s) cut short (the process died, or the disk was full, while writing "
                "them): their whole rows kept"
            )
        if self.damaged:
            out.append(
                f"{self.damaged} stretch(es) of bytes that hold no frame (zeros or garbage): read on from "
                "the next whole frame"
            )
        if out and self.skipped_bytes:
            out[-1] += f" ({self.skipped_bytes} byte(s) left out in all)"
        for n, what in (
            (self.zero_rows, "row(s) of zeros (left by a crash on some filesystems)"),
            (self.bad_rows, "row(s) with impossible values (a code out of range, a negative seq)"),
            (self.repeated_rows, "row(s) repeating the seq of an earlier row"),
            (self.bad_records, "registry record(s) that are not valid"),
        ):
            if n:
                out.append(f"{n} {what}: left out")
        if self.unknown_codes:
            out.append(
                f"{self.unknown_codes} group / dtype / tag / module code(s) used by rows but never "
                "registered (their record was lost): named '?'"
            )
        if self.lost:
            rows = sum(n for n, _, _, _ in self.lost)
            whys = sorted({why for _, _, _, why in self.lost if why})
            out.append(
                f"{rows} row(s) recorded but never written: dropped by the writer"
                + (f" ({'; '.join(whys)[:200]})" if whys else "")
                + f", seq {min(f for _, f, _, _ in self.lost)}-{max(last for _, _, last, _ in self.lost)}"
            )
        return out


class _Bad(Exception):
    """A record that is not valid: counted and skipped."""


def parse(data: bytes, row_size: int, row_dtype, name: str = "<log>") -> Parsed:
    """Frames of a rank log. Damage (a torn frame, zeros, garbage, invalid records or rows) is
    skipped and counted in ``Parsed`` (``damage()`` says what); only a file that is not a rank
    log at all raises (ValueError naming ``name``)."""
    import numpy as np

    if not data.startswith(MAGIC):
        raise ValueError(f"{name}: not a commpatch binary log (no {MAGIC[:-1].decode()} header)")
    out = Parsed()
    scan = _Scanner(data, row_size, out)
    rows: list = []
    late: list = []
    own: list = []
    view = memoryview(data)
    for kind, start, stop in scan.frames():
        payload = view[start:stop]
        if kind == ROWS:
            rows.append(payload)
        elif kind == LATE or kind == OWN:
            (late if kind == LATE else own).append(payload[: len(payload) - len(payload) % _PAIR])
        else:
            try:
                _meta(out, json.loads(bytes(payload)), scan.limit)
            except (ValueError, KeyError, TypeError, RecursionError, _Bad):
                out.bad_records += 1
            scan.ops, scan.timings = _header_sizes(out.header)
    if out.header.get("k") != "header" and (rows or late or own):
        raise ValueError(f"{name}: its header record (rank, world size) is missing or damaged")
    out.rows = _valid_rows(np, out, b"".join(rows), row_dtype, row_size, scan)
    pairs = np.frombuffer(b"".join(late), dtype="<i8").reshape(-1, 2)
    out.late_seq, out.late_dur = pairs[:, 0].copy(), pairs[:, 1].copy()
    pairs = np.frombuffer(b"".join(own), dtype="<i8").reshape(-1, 2)
    out.own_seq, out.own_dur = pairs[:, 0].copy(), pairs[:, 1].copy()
    return out


class _Scanner:
    """The whole frames of a file in order, resynchronising after damage: a frame is taken when
    its header is plausible (a known kind, a length that fits the file and suits the kind), its
    content looks like its kind (JSON braces, first and last row plausible) and the frame after
    it does too (or the file ends there). After a frame that fails, the next place where two such
    frames follow each other (or one ends the file) is where reading goes on."""

    def __init__(self, data: bytes, row_size: int, out: Parsed) -> None:
        self.data, self.end, self.row_size, self.out = data, len(data), row_size, out
        # a registry code needs a record of ~30 bytes in the file: a code above this is damage
        self.limit = len(data) // 16 + 16
        self.ops, self.timings = _header_sizes({})
        self.tries = _RESYNC_TRIES + len(data) // 64  # bounded work on any input

    def frames(self):
        pos, end, out = len(MAGIC), self.end, self.out
        ahead = None  # the frame after the last one taken, already looked at
        while pos < end:
            got = ahead if ahead is not None and ahead[1] == pos + _FRAME.size else self._whole(pos)
            ahead = None
            if got is not None and (got[2] == end or (ahead := self._whole(got[2])) is not None):
                yield got
                pos = got[2]
                continue
            head = got or self._head(pos)
            nxt = self._resync(head[1] if head is not None else pos + 1)
            if got is not None and nxt >= got[2]:  # a whole frame; the damage starts after it
                yield got
                pos = got[2]
                continue
            if head is not None and head[0] == ROWS:  # rows: the whole ones before the damage kept
                whole = head[1] + (min(nxt, head[2]) - head[1]) // self.row_size * self.row_size
                if whole > head[1]:
                    yield ROWS, head[1], whole
                pos = whole
            if head is not None and head[2] > nxt:  # cut short: another frame starts inside it
                out.torn += 1
            else:  # bytes that are no frame (zeros, garbage)
                out.damaged += 1
            # the rows of a frame whose header was lost end where the next whole frame starts
            first = self._rows_before(pos, nxt)
            if first < nxt:
                yield ROWS, first, nxt
            out.skipped_bytes += first - pos
            pos = nxt

    def _head(self, pos):
        """(kind, payload start, payload stop) of a plausible frame header at ``pos`` (the stop
        may lie past the end of the file: a torn frame), else None."""
        data, end = self.data, self.end
        if end - pos < _FRAME.size:
            return None
        kind, length = _FRAME.unpack_from(data, pos)
        if kind not in _KINDS:
            return None
        start = pos + _FRAME.size
        if kind == ROWS:
            ok = length % self.row_size == 0
        elif kind == META:
            brace = data[start : start + 2]  # a torn last frame may hold less
            ok = length >= 2 and (brace == b'{"' or (len(brace) < 2 and b'{"'.startswith(brace)))
        else:
            ok = length % _PAIR == 0
        return (kind, start, start + length) if ok else None

    def _whole(self, pos):
        """``_head`` of a frame that fits in the file and whose content looks like its kind."""
        head = self._head(pos)
        if head is None or head[2] > self.end:
            return None
        kind, start, stop = head
        if kind == META:
            ok = self.data[stop - 1 : stop] == b"}"
        elif kind == ROWS:
            ok = start == stop or (self._row_ok(start) and self._row_ok(stop - self.row_size))
        else:
            ok = start == stop or int.from_bytes(self.data[start : start + 8], "little", signed=True) >= 0
        return head if ok else None

    def _row_ok(self, at: int) -> bool:
        if self.row_size != ROW.size:
            return True
        seq, op, gid, dtype, _, flags, start, _, _, _, tag, where = ROW.unpack_from(self.data, at)
        return (
            seq >= 0
            and 0 <= op < self.ops
            and gid >= 0
            and dtype >= 0
            and not flags & _UNUSED_FLAGS
            and flags >> T_SHIFT < self.timings
            and start > 0
            and 0 <= tag < self.limit
            and where >= 0
        )

    def _rows_before(self, lo: int, hi: int) -> int:
        """Where the run of plausible rows that ends at ``hi`` starts (``hi`` if none), not before ``lo``."""
        at, size = hi, self.row_size
        while at - size >= lo and self._row_ok(at - size):
            at -= size
        return at

    def _resync(self, start: int) -> int:
        """The first position from ``start`` on where whole frames begin again (the end if none)."""
        for m in _CANDIDATE.finditer(self.data, start):
            self.tries -= 1
            if self.tries < 0:
                break
            p = m.start()
            got = self._whole(p)
            if got is not None and (got[2] == self.end or self._whole(got[2]) is not None):
                return p
        return self.end


def _header_sizes(header: dict) -> tuple[int, int]:
    """(op codes, timing codes) a row of this log may hold."""
    return len(header.get("ops", OP_NAMES)), len(header.get("timings", TIMINGS))


def _valid_rows(np, out: Parsed, raw: bytes, row_dtype, row_size: int, scan: _Scanner):
    """The rows of ``raw`` without those of zeros, with impossible values or repeating an earlier
    seq (counted); codes used by rows but never registered get a '?' entry (counted)."""
    rows = np.frombuffer(raw, dtype=row_dtype)
    if len(rows) == 0 or rows.dtype.names is None or "seq" not in rows.dtype.names:
        return rows
    # int64 copies of the packed (unaligned) fields, so every bound below is in the arrays' range:
    # numpy 2.0.2 (Python 3.9) crashed here in one test process (a NULL ufunc loop under bitwise_and
    # of these comparisons on the packed fields; not reproduced in isolation)
    f = {
        name: rows[name].astype(np.int64)
        for name in ("seq", "op", "gid", "dtype", "flags", "start", "tag", "where")
        if name in rows.dtype.names
    }
    ok = f["seq"] >= 0
    for name, hi in (("op", scan.ops), ("gid", 1 << 15), ("dtype", 1 << 15), ("tag", scan.limit)):
        if name in f:
            ok &= (f[name] >= 0) & (f[name] < hi)
    if "flags" in f:
        ok &= ((f["flags"] & _UNUSED_FLAGS) == 0) & (f["flags"] < scan.timings << T_SHIFT)
    if "start" in f:
        ok &= f["start"] > 0
    if "where" in f:
        ok &= (f["where"] >= 0) & (f["where"] < scan.limit << 2)
    keep = None if ok.all() else np.flatnonzero(ok)
    if keep is not None:  # of the rows left out, those of zeros (every row has a start > 0)
        bad = np.flatnonzero(~ok)
        zero = int((~np.frombuffer(raw, np.uint8).reshape(len(rows), row_size)[bad].any(axis=1)).sum())
        out.zero_rows += zero
        out.bad_rows += len(bad) - zero
    seq = f["seq"] if keep is None else f["seq"][keep]
    if len(seq) > 1 and not (seq[1:] > seq[:-1]).all():  # seq must not repeat: the first row kept
        _, first = np.unique(seq, return_index=True)
        if len(first) < len(seq):
            out.repeated_rows += len(seq) - len(first)
            keep = (np.arange(len(rows)) if keep is None else keep)[np.sort(first)]
    if keep is not None:
        rows = rows[keep]
    codes: list[tuple] = [
        ("gid", rows["gid"] if "gid" in f else None, out.groups, _UNKNOWN_GROUP, 0),
        ("dtype", rows["dtype"] if "dtype" in f else None, out.dtypes, ("?", 0), 2),  # 0, 1: none, object
        ("tag", rows["tag"] if "tag" in f else None, out.tags, "?", 0),
        ("module", rows["where"] >> 2 if "where" in f else None, out.modules, "?", 0),
    ]
    for _, used, registry, unknown, first in codes:
        if used is None or len(used) == 0:
            continue
        top = int(used.max())
        if top < len(registry) and all(c in registry for c in range(first, top + 1)):
            continue  # the usual case: every code up to the top is known
        for code in np.unique(used).tolist():
            if code >= first and code not in registry:
                registry[code] = unknown
                out.unknown_codes += 1
    return rows


def parse_header(data: bytes) -> dict:
    """The header record of a rank log (rank, world_size, pid, ...) from its first bytes; {} when
    they do not start with a valid one."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _FRAME.size:
        return {}
    kind, length = _FRAME.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _FRAME.size
    if kind != META or len(data) < start + length:
        return {}
    out = Parsed()
    try:
        _meta(out, json.loads(data[start : start + length]), len(data))
    except (ValueError, KeyError, TypeError, RecursionError, _Bad):
        return {}
    return out.header


def _int(m: dict, key: str, lo: int = _I64[0], hi: int = _I64[1]) -> int:
    value = m[key]
    if type(value) is not int or not lo <= value <= hi:
        raise _Bad(key)
    return value


def _str(m: dict, key: str) -> str:
    value = m[key]
    if type(value) is not str:
        raise _Bad(key)
    return value


def _strs(m: dict, key: str, most: int) -> list:
    value = m[key]
    if type(value) is not list or len(value) > most or any(type(v) is not str for v in value):
        raise _Bad(key)
    return value


def rank_count(text: str, world: int = MAX_WORLD) -> int:
    """How many ranks a ``group_ranks`` value (range notation, ``data.schema.compact_ranks``)
    names, without listing them; raises ValueError unless every rank is in [0, ``world``)."""
    n = 0
    for part in text.split():
        span, _, step = part.partition(":")
        first, dash, last = span.partition("-")
        a, b, s = int(first), int(last) if dash else int(first), int(step) if step else 1
        if not (0 <= a <= b < world and s >= 1) or (step and not dash):
            raise ValueError(f"ranks {part!r} not within 0-{world - 1}")
        n += (b - a) // s + 1
    return n


def _meta(out: Parsed, m: dict, limit: int) -> None:
    """One registry record into ``out``, every field checked (type, and bounds where it sizes
    something); raises _Bad (or KeyError, TypeError) for an invalid one."""
    if type(m) is not dict:
        raise _Bad("not an object")
    kind = _str(m, "k")
    if kind == "header":
        if out.header:
            raise _Bad("a second header")
        world = _int(m, "world_size", -1, MAX_WORLD)
        _int(m, "rank", -1, world - 1 if world > 0 else MAX_WORLD)
        _int(m, "pid")
        for key, most in (("ops", 1 << 15), ("timings", 1 << 4)):
            if key in m:
                _strs(m, key, most)
        out.header = m
    elif kind == "group":
        # within MAX_WORLD, not the header's world size: a log may outlive a process group (a
        # new init_process_group of another size in the same process)
        ranks = _str(m, "ranks")
        size = _int(m, "size", 0, MAX_WORLD)
        if ranks and rank_count(ranks) != size or out.ranks_named + size > RANKS_NAMED:
            raise _Bad("ranks")
        out.ranks_named += size
        backend = _str(m, "backend")
        backends = _strs(m, "backends", 3) if "backends" in m else [backend] * 3
        if len(backends) != 3:
            raise _Bad("backends")
        out.groups[_int(m, "gid", 0, min(limit, 1 << 15) - 1)] = {
            "name": _str(m, "name"),
            "size": size,
            "ranks": ranks,
            "backend": backend,
            "backends": backends,
        }
    elif kind == "dtype":
        out.dtypes[_int(m, "code", 0, min(limit, 1 << 15) - 1)] = (_str(m, "name"), _int(m, "size", 0, 1 << 10))
    elif kind == "tag":
        out.tags[_int(m, "code", 0, limit - 1)] = _str(m, "name")
    elif kind == "module":
        out.modules[_int(m, "code", 0, limit - 1)] = _str(m, "name")
    elif kind == "clock":
        out.clock.append((_int(m, "seq"), _int(m, "offset")))
    elif kind == "rank0_offset":
        lo, hi = _int(m, "lo"), _int(m, "hi")
        if lo > hi:
            raise _Bad("an empty interval")
        out.rank0_offsets.append((_int(m, "at"), lo, hi, _int(m, "same", 0, 1) if "same" in m else 0))
    elif kind == "device":
        out.device = _str(m, "name")
    elif kind == "step_source":
        mark: tuple = (_int(m, "seq"), _int(m, "source", 0, len(STEP_SOURCES) - 1))
        if "micro" in m:  # integrations.steps._micro_batches
            mark += (_int(m, "micro", 2), _int(m, "switched", 0))
        out.step_sources.append(mark)
    elif kind == "bucket":
        out.buckets.append((_int(m, "lo"), _int(m, "hi"), _int(m, "index"), _int(m, "params")))
    elif kind == "sync":
        out.syncs.append((_int(m, "seq"), _int(m, "end")))
    elif kind == "pack":
        out.packs.append((_int(m, "seq"), _int(m, "ns"), _int(m, "alone")))
    elif kind == "wait":
        out.waits.append((_int(m, "seq"), _int(m, "ns")))
    elif kind == "inflight":  # a call in flight longer than the flusher's period (record.inflight)
        out.inflight[_int(m, "id", 0)] = {
            "seq": _int(m, "seq", -1),
            "below": _int(m, "below", 0),
            "op": _int(m, "op", 0, 1 << 15),
            "gid": _int(m, "gid", 0, min(limit, 1 << 15) - 1),
            "peer": _int(m, "peer", -1, MAX_WORLD),
            "numel": _int(m, "numel", -1),
            "bytes": _int(m, "bytes", -1),
            "start_ns": _int(m, "start", -1),
            "seen_ns": _int(m, "seen", 0),
            "thread": _str(m, "thread")[:200],
            "stack": [line[:500] for line in _strs(m, "stack", 64)],
        }
    elif kind == "landed":
        out.landed[_int(m, "id", 0)] = _int(m, "ns", 0)
    elif kind == "alive":
        out.alive_ns = max(out.alive_ns, _int(m, "ns", 0))
    elif kind == "step":  # the training thread at a step's start / first forward (integrations.steps)
        out.step_marks.append((_int(m, "step"), _int(m, "at", 0, 1), _int(m, "ns"), _int(m, "cpu", 0)))
    elif kind == "settings":  # a DDP / FSDP module's settings (integrations.ddp, fsdp)
        values = m["values"]
        if type(values) is not dict or len(values) > 64:
            raise _Bad("values")
        out.settings.append(
            {
                "wrapper": _str(m, "wrapper")[:40],
                "module": _str(m, "module")[:200],
                "values": {
                    str(k)[:80]: v for k, v in values.items() if v is None or type(v) in (bool, int, float, str, list)
                },
            }
        )
    elif kind == "lost":  # rows the writer dropped (a slow or full disk: record.log)
        out.lost.append((_int(m, "rows", 0), _int(m, "first_seq"), _int(m, "last_seq"), _str(m, "why")))


# df.attrs key of the readers (io.read): per rank log read, its ``in_flight`` dict
IN_FLIGHT_ATTR = "in_flight"
# df.attrs key of the readers (io.read, log()): per rank log read, its ``job_notes`` dict
JOB_ATTR = "job_notes"


def job_notes(parsed: Parsed) -> dict:
    """What a parsed rank log says about the job around its calls: ``rank``, ``step_marks`` (the
    training thread's (step, at, Unix ns, thread CPU ns) where a step starts, at 0, and at the step's
    first root forward, at 1) and ``settings`` (per DDP / FSDP module: wrapper, module, values)."""
    rank = parsed.header.get("rank", -1)
    return {"rank": rank, "step_marks": list(parsed.step_marks), "settings": list(parsed.settings)}


def in_flight(parsed: Parsed) -> dict:
    """What a parsed rank log says about its last moments: ``rank``, ``pid``, ``alive_ns`` (the
    latest time the process was seen alive: its last 'alive' record, else 0) and ``calls``: the
    calls noted in flight (``record.inflight``) and never seen completing, each a dict with ``op``,
    ``group``, ``group_ranks``, ``peer`` (-1: none or unknown), ``seq`` (-1: unknown), ``below``
    (the call's seq is below it: every row recorded before it has a lower seq), ``numel``,
    ``bytes`` (-1: unknown), ``start_ns`` (-1: unknown), ``seen_ns`` (first seen in flight: it was
    issued before), ``thread`` and ``stack`` ('file:line in function', innermost last)."""
    ops = parsed.header.get("ops", OP_NAMES)
    calls = []
    for key in sorted(parsed.inflight):
        if key in parsed.landed:
            continue
        c = dict(parsed.inflight[key])
        group = parsed.groups.get(c.pop("gid"), _UNKNOWN_GROUP)
        op = c.pop("op")
        calls.append(
            {"op": ops[op] if op < len(ops) else "?", "group": group["name"], "group_ranks": group["ranks"], **c}
        )
    return {
        "rank": parsed.header.get("rank", -1),
        "pid": parsed.header.get("pid", -1),
        "alive_ns": parsed.alive_ns,
        "calls": calls,
    }
