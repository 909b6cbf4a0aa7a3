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
- ``M``: one JSON object (``{"k": kind, ...}``): header, group, dtype, tag, module, clock, bucket,
  step_source, device (the accelerator type that rows flagged "on the device" ran on), sync (the
  end of DDP's finalize after a backward, ns after the start of the row of its last bucket).
A frame cut short by a crash (the last one) is skipped and counted, never fatal.

The file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: never through a pre-planted link,
never over an existing file (a taken name gets a ``.1``, ``.2`` ... suffix).
"""

from __future__ import annotations

import json
import struct

MAGIC = b"CPLOG1\n"
SUFFIX = ".cplog"
FORMAT_VERSION = 1     # of this file layout; the columns' version is data.schema.SCHEMA_VERSION
_FRAME = struct.Struct("<cI")
ROWS, LATE, META, OWN = b"R", b"L", b"M", b"Q"


def frame(kind: bytes, payload: bytes) -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def meta(kind: str, **fields) -> bytes:
    fields["k"] = kind
    # ensure_ascii: any str (lone surrogates included) round-trips through \\u escapes
    return frame(META, json.dumps(fields, ensure_ascii=True, separators=(",", ":")).encode("ascii"))


# ---- reading --------------------------------------------------------------------------------

class Parsed:
    """What a rank log holds: rows (numpy structured array), late durations, registries."""

    def __init__(self) -> None:
        self.rows = None
        self.late_seq = self.late_dur = None
        self.own_seq = self.own_dur = None
        self.device = "cuda"     # files written before the accelerator was named: CUDA
        self.header: dict = {}
        self.groups: dict[int, dict] = {}
        self.dtypes: dict[int, tuple[str, int]] = {}
        self.tags: dict[int, str] = {0: ""}
        self.modules: dict[int, str] = {0: ""}
        self.clock: list[tuple[int, int]] = []
        self.buckets: list[tuple[int, int, int, int]] = []
        self.step_sources: list[tuple[int, int]] = []   # (first seq, data.schema.STEP_SOURCES code)
        self.syncs: list[tuple[int, int]] = []          # (seq of a last bucket's row, finalize end ns after its start)
        self.packs: list[tuple[int, int, int]] = []     # (seq of a bucket's first row, packing ns, of which alone)
        self.torn = 0            # frames (or rows) cut short by a crash, skipped


def parse(data: bytes, row_size: int, row_dtype, name: str = "<log>") -> Parsed:
    """Frames of a rank log; a torn tail is skipped and counted in ``Parsed.torn``."""
    import numpy as np

    if not data.startswith(MAGIC):
        raise ValueError(f"{name}: not a commpatch binary log (no {MAGIC[:-1].decode()} header)")
    out = Parsed()
    rows, late, own = [], [], []
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
        elif kind == LATE or kind == OWN:
            (late if kind == LATE else own).append(payload[:length - length % 16])
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
    pairs = np.frombuffer(b"".join(own), dtype="<i8").reshape(-1, 2)
    out.own_seq, out.own_dur = pairs[:, 0].copy(), pairs[:, 1].copy()
    return out


def parse_header(data: bytes) -> dict:
    """The header record of a rank log (rank, world_size, pid, ...) from its first bytes; {} when
    they do not start with one."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _FRAME.size:
        return {}
    kind, length = _FRAME.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _FRAME.size
    if kind != META or len(data) < start + length:
        return {}
    try:
        m = json.loads(data[start:start + length])
    except ValueError:
        return {}
    return m if isinstance(m, dict) and m.get("k") == "header" else {}


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
    elif kind == "device":
        out.device = str(m["name"])
    elif kind == "step_source":
        out.step_sources.append((m["seq"], m["source"]))
    elif kind == "bucket":
        out.buckets.append((m["lo"], m["hi"], m["index"], m["params"]))
    elif kind == "sync":
        out.syncs.append((m["seq"], m["end"]))
    elif kind == "pack":
        out.packs.append((m["seq"], m["ns"], m["alone"]))
