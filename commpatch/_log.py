"""The columnar in-memory log, its SCHEMA, and the build of the pandas DataFrame.

The hot path packs one fixed-size binary row per call into a ``bytearray``
(``buf.extend(ROW.pack(...))``: one C call, atomic under the GIL, so threads never
interleave half rows). There is no per-row Python object and no compaction pass: 59
bytes a row, and reading is a zero-copy ``np.frombuffer`` of a snapshot. (Measured here:
tuple rows cost ~28 ns less to append but ~600-950 ns a row to compact into columns.)
Names (op, group, dtype, tag, module) are small integer codes into registries.
Nothing here imports pandas until ``to_dataframe()`` is called, and every derived column
(bytes, Unix times, bandwidth) is computed there, vectorised.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from array import array
from dataclasses import dataclass

from . import _runtime
from ._targets import BY_NAME, OBJECT, OP_NAMES

CHUNK_BITS = 14
CHUNK = 1 << CHUNK_BITS           # rows between maintenance passes (late timings, clock offset)
CHUNK_MASK = CHUNK - 1

# Row tuple layout written by the wrapper (indices used below).
SEQ, OP, GID, DTYPE, NUMEL, FLAGS, START, END, PEER, STEP, TAG, WHERE = range(12)
# FLAGS bits
F_ASYNC, F_CUDA, F_ERROR = 1, 2, 4
T_SHIFT = 4                          # timing code lives in bits 4..7
TIMINGS = ("host", "future", "cuda_event", "nccl", "none", "wait")
T_HOST, T_FUTURE, T_CUDA, T_NCCL, T_NONE, T_WAIT = range(6)

# The binary row: (field, struct code) in tuple order, little-endian, no padding.
_FIELDS = (("seq", "q"), ("op", "h"), ("gid", "h"), ("dtype", "h"), ("numel", "q"),
           ("flags", "B"), ("start", "q"), ("end", "q"), ("peer", "i"), ("step", "q"),
           ("tag", "i"), ("where", "i"))
ROW = struct.Struct("<" + "".join(code for _, code in _FIELDS))
_NP_CODES = {"q": "<i8", "i": "<i4", "h": "<i2", "B": "u1"}


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str   # pandas dtype of the DataFrame column (and of the CSV round trip)
    unit: str
    doc: str


SCHEMA: tuple[Column, ...] = (
    Column("seq", "int64", "", "per-process sequence number of the call (0, 1, 2, ...)"),
    Column("op", "category", "", "torch.distributed function name (torch's own name, e.g. all_reduce)"),
    Column("rank", "int64", "", "global rank of the process that made the call"),
    Column("world_size", "int64", "", "size of the default process group"),
    Column("group", "category", "", "process group name ('0' is the default group)"),
    Column("group_size", "int64", "", "number of ranks in the group used by the call"),
    Column("group_ranks", "category", "", "global ranks of that group, space separated"),
    Column("group_seq", "int64", "", "sequence number of the call within its group on this rank (matches the same collective across ranks)"),
    Column("backend", "category", "", "backend that ran the call: the group's backend for the tensors' device (gloo, nccl, or a registered backend's name); a group configured 'cpu:gloo,cuda:nccl' shows gloo or nccl per row"),
    Column("device", "category", "", "device type of the tensors (cpu, cuda, none)"),
    Column("dtype", "category", "", "element type ('object' for object collectives, 'none' when no tensor)"),
    Column("numel", "int64", "elements", "elements in the message S (see bytes)"),
    Column("bytes", "int64", "bytes", "message size S as nccl-tests counts it: all_reduce the tensor, all_gather the full output, reduce_scatter the full input, all_to_all the total; for object collectives the bytes of the tensors they moved"),
    Column("peer", "int64", "", "global rank of the peer (send/recv) or root (broadcast/reduce/gather/scatter); -1 if none"),
    Column("async_op", "bool", "", "the call was asynchronous (returned a Work)"),
    Column("start_ns", "int64", "ns", "Unix time when the call was issued"),
    Column("host_us", "float64", "us", "wall time spent inside the Python call"),
    Column("duration_us", "float64", "us", "duration from the source named in 'timing' (NaN when unknown)"),
    Column("timing", "category", "", "source of duration_us: host, future, cuda_event, nccl, wait or none"),
    Column("algbw_gbps", "float64", "GB/s", "bytes / duration (1e9 bytes per second)"),
    Column("busbw_gbps", "float64", "GB/s", "algbw times the nccl-tests bus factor for the op and group size"),
    Column("status", "category", "", "ok, or error when torch raised"),
    Column("step", "int64", "", "value of commpatch.step() when the call was issued"),
    Column("tag", "category", "", "innermost commpatch.tag() active when the call was issued"),
    Column("pid", "int64", "", "process id"),
    Column("module", "category", "", "fully qualified name of the innermost nn.Module running when the call was issued (forward), or of the root module whose backward issued it; '' outside modules"),
    Column("phase", "category", "", "forward, backward, optimizer (inside optimizer.step) or other"),
    Column("bucket", "int64", "", "DDP gradient bucket index the call reduced; -1 if none"),
    Column("bucket_params", "int64", "", "number of parameters in that DDP bucket, or of tensors in a coalesced.* call; 0 if none"),
)
COLUMNS = tuple(c.name for c in SCHEMA)
DTYPES = {c.name: c.dtype for c in SCHEMA}

# Schema version: bumped whenever columns are added (columns are never renamed, retyped or
# removed). ADDED_IN names the version that added a column (the others are in version 1).
# Parquet files carry the version in their key-value metadata (SCHEMA_VERSION_KEY); a CSV's
# header is its schema: readers go by column names, and fill columns a file predates.
SCHEMA_VERSION = 2
SCHEMA_VERSION_KEY = b"commpatch.schema_version"
ADDED_IN = {"module": 2, "phase": 2, "bucket": 2, "bucket_params": 2}


@dataclass(frozen=True)
class GroupInfo:
    name: str
    size: int
    ranks: str
    backend: str                  # as configured: 'gloo', or 'cpu:gloo,cuda:nccl' for several
    backends: tuple = ()          # the one that runs, per device code (cpu, cuda, none)


class _Rows:
    """``log.rows.append(tuple)``: the slow-path way to add a row (dtype given as an object)."""

    __slots__ = ("append",)

    def __init__(self, log: "Log") -> None:
        pack, extend, dtype_id = ROW.pack, log.buf.extend, log.dtype_id

        def append(row) -> None:
            row = list(row)
            row[DTYPE] = dtype_id(row[DTYPE])
            extend(pack(*row))

        self.append = append


class Log:
    """Rows of one process. ``buf`` holds the rows not yet flushed, ``ROW.size`` bytes each; every
    ``FLUSH_S`` seconds (and every ``CHUNK`` rows) ``flush()`` moves them, with the late durations
    and the registries seen since, to the rank's binary log (``_logfile``): a file from the first
    row when an output is configured, else frames in memory. Readers parse what was flushed."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.buf = bytearray()
        self.done: dict[int, int] = {}        # seq -> duration_ns, written by completion callbacks
        # seq -> (op code, gid, numel, thread id, start perf ns, issue stack or None): calls in
        # flight (async ones until their timing resolves; sync ones too when the watchdog is on)
        self.pending: dict[int, tuple] = {}
        self.offsets = ([0], [time.time_ns() - time.perf_counter_ns()])  # (from seq, perf->Unix ns)
        self.groups: list[GroupInfo] = []
        self.group_ids: dict = {}             # group object (None: default group) -> gid
        self.dtype_names: list[str] = ["none", OBJECT]
        self.dtype_sizes: list[int] = [0, 1]
        self.dtype_ids: dict = {None: 0, OBJECT: 1}
        self.rows = _Rows(self)
        self.rank = -1
        self.world_size = -1
        self.pid = os.getpid()
        self.buckets: list[tuple] = []       # (first_seq, end_seq, bucket, params): DDP hook spans
        self.output = ""                     # path template ('' : frames kept in memory)
        self.max_rows = 0                    # with no output: rows kept in memory (0: no limit)
        self.on_open = None                  # called with (log) before a file is opened: e.g. start the flusher
        self.on_warn = None                  # called with a message the user should see once
        self.sink = None                     # the current _logfile sink
        self.closed: list = []               # earlier sinks that log() still shows (re-initialised ranks)
        self.files: list = []                # every file sink this process opened (exported at exit)
        self.written: dict[str, int] = {}    # registry -> entries already in the current sink
        self.flushed_rows = 0                # rows in the sinks
        self.dropped = 0                     # rows dropped by the in-memory cap (max_rows, no output)
        self.reset_seq = 0                   # log() shows rows from this seq on (commpatch.reset())
        self.recent = b""                    # the last flushed rows (the watchdog's view)

    # ---- registries (slow path, first sight only) -------------------------------------
    def group_id(self, group) -> int:
        """Code for a group; -1 for a rank that is not a member (nothing is recorded)."""
        gid = self.group_ids.get(group)
        if gid is not None:
            return gid
        import torch.distributed as dist

        with self.lock:
            if group is None and not dist.is_initialized():
                return -1          # not cached: torch raises its own error for this call
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            if pg is dist.GroupMember.NON_GROUP_MEMBER:
                self.group_ids[group] = -1
                return -1
            if self.rank < 0:
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            info = GroupInfo(
                name=_group_name(pg),
                size=pg.size(),
                ranks=compact_ranks(dist.get_process_group_ranks(pg)),
                backend=str(dist.get_backend(pg)),
                backends=_device_backends(str(dist.get_backend(pg)), pg),
            )
            try:
                gid = self.groups.index(info)
            except ValueError:
                gid = len(self.groups)
                self.groups.append(info)
            self.group_ids[group] = gid
            if self.sink is None and self.output and self.on_open is not None:
                self.on_open(self)
            return gid

    def forget_groups(self) -> None:
        """Called when process groups are destroyed: group objects may be reused or re-created."""
        with self.lock:
            self.group_ids.clear()   # the same dict object: wrappers hold a reference

    def end_file(self) -> None:
        """The default group is destroyed: flush and close this rank's file; a re-initialised
        process group (maybe with another rank) starts a new one."""
        with self.lock:
            self.flush()
            if self.sink is not None and self.sink.path is not None:
                self.sink.close()
                self.closed.append(self.sink)
                self.sink = None
            self.rank = self.world_size = -1
            self.forget_groups()

    def dtype_id(self, dt) -> int:
        code = self.dtype_ids.get(dt)
        if code is None:
            code = self.dtype_ids[dt] = len(self.dtype_names)
            self.dtype_names.append(str(dt).replace("torch.", ""))
            self.dtype_sizes.append(dt.itemsize)
        return code

    # ---- maintenance (every CHUNK rows, and on read) ---------------------------------
    def maintain(self, seq: int) -> None:
        """Re-read the clock offset so long runs do not drift; flush what is new."""
        with self.lock:
            self.offsets[0].append(seq)
            self.offsets[1].append(time.time_ns() - time.perf_counter_ns())
            self.flush()

    def flush(self) -> int:
        """Move new rows, late durations and registry entries to the sink; never raises.
        Returns the rows moved."""
        from . import _logfile, _runtime

        with self.lock:
            try:
                if self.sink is None:
                    if not self.buf and not self.done:
                        return 0
                    self._open_sink()
                other = bytearray(self._new_meta())
                done = self.done
                if done:
                    late = array("q")
                    for key in list(done):
                        value = done.pop(key, None)
                        if value is not None:
                            late.append(key)
                            late.append(value)
                    other += _logfile.frame(_logfile.LATE, late.tobytes())
                n = len(self.buf) // ROW.size * ROW.size
                chunk = bytes(self.buf[:n])     # whole rows; appends meanwhile stay in buf
                del self.buf[:n]
                rows = n // ROW.size
                if chunk:
                    self.recent = chunk[-_RECENT * ROW.size:]
                    chunk = _logfile.frame(_logfile.ROWS, chunk)
                if other or chunk:
                    self.sink.append(bytes(other), chunk, rows)
                self.flushed_rows += rows
                if self.max_rows and self.sink.path is None:
                    self.dropped += self.sink.cap_rows(self.max_rows, ROW.size)
                return rows
            except Exception as exc:  # noqa: BLE001 - the user's job goes on without us
                _runtime.fail("export.flush", exc, rows=len(self.buf) // ROW.size)
                return 0

    def open(self) -> None:
        """Open this rank's sink now (the file exists from the first row's call on), never raising."""
        with self.lock:
            if self.sink is None:
                try:
                    self._open_sink()
                except Exception as exc:  # noqa: BLE001
                    from . import _runtime

                    _runtime.fail("export.open", exc, rows=0)

    def _open_sink(self) -> None:
        from . import _logfile

        if not self.output or self.rank < 0:
            self.sink = _logfile.MemorySink()
        else:
            stem, export_suffix = self.stem()
            try:
                self.sink, _ = _logfile.create_exclusive(stem, (_logfile.SUFFIX, export_suffix))
                self.files.append(self.sink)
            except OSError as exc:
                from . import _runtime

                _runtime.fail("export.open", exc, rows=0)
                self.sink = _logfile.MemorySink()
        self.written = {}

    def stem(self) -> tuple[str, str]:
        """(path without suffix, export suffix) of this rank's files, from the output template."""
        from . import _logfile

        template = self.output
        root, suffix = os.path.splitext(template)
        run = ""
        if "{run}" in template:
            store = None
            try:
                import torch.distributed as dist

                store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - no default group: a per-process name
                pass
            run = _logfile.run_name(store)
        stem = root.format(rank=self.rank, pid=self.pid, run=run)
        if "{rank}" not in template and "{pid}" not in template and self.world_size > 1:
            stem += f".rank{self.rank}"
            if self.on_warn is not None:
                self.on_warn(f"commpatch: the output {template!r} has no {{rank}} in a {self.world_size}-rank job: "
                             f"this rank writes {stem}{suffix}")
        return stem, suffix

    def _new_meta(self) -> bytes:
        """Frames for what the current sink has not been told yet (registries only grow)."""
        from . import _logfile
        from ._runtime import MODULES, TAGS

        w, out = self.written, []
        if not w:
            out.append(_logfile.meta("header", version=_logfile.FORMAT_VERSION, schema=SCHEMA_VERSION, rank=self.rank,
                                     world_size=self.world_size, pid=self.pid, ops=list(OP_NAMES),
                                     timings=list(TIMINGS), created_ns=time.time_ns()))
        for key, items, make in (
            ("groups", self.groups, lambda i, g: _logfile.meta(
                "group", gid=i, name=g.name, size=g.size, ranks=g.ranks, backend=g.backend, backends=list(g.backends))),
            ("dtypes", self.dtype_names, lambda i, name: _logfile.meta(
                "dtype", code=i, name=name, size=self.dtype_sizes[i])),
            ("tags", TAGS, lambda i, name: _logfile.meta("tag", code=i, name=name)),
            ("modules", MODULES, lambda i, name: _logfile.meta("module", code=i, name=name)),
            ("clock", self.offsets[0], lambda i, seq: _logfile.meta("clock", seq=seq, offset=self.offsets[1][i])),
        ):
            start, stop = w.get(key, 0), len(items)
            out.extend(make(i, items[i]) for i in range(start, stop))
            w[key] = stop
        buckets = self.buckets
        if buckets:
            k = len(buckets)
            out.extend(_logfile.meta("bucket", lo=lo, hi=hi, index=index, params=params)
                       for lo, hi, index, params in buckets[:k])
            del buckets[:k]
        return b"".join(out)

    def sinks(self) -> list:
        return self.closed + ([self.sink] if self.sink is not None else [])

    def recent_rows(self):
        """The last rows recorded (flushed or not), as a numpy structured array: the watchdog's view."""
        import numpy as np

        data = self.recent + bytes(self.buf)
        return np.frombuffer(data[len(data) % ROW.size:], dtype=row_dtype(np))

    def clear(self, next_seq: int) -> None:
        """Forget the rows recorded so far (``commpatch.reset()``): files keep them, log() does not."""
        with self.lock:
            self.flush()
            self.reset_seq = next_seq
            self.closed = []
            if self.sink is not None and self.sink.path is None:
                self.sink = None
            self.dropped = 0

    def set_output(self, output: str) -> None:
        """A new output template (enable() after disable()): later rows go to a new file."""
        with self.lock:
            if output != self.output:
                self.flush()
                if self.sink is not None:
                    self.sink.close()
                    self.closed.append(self.sink)
                    self.sink = None
                self.output = output

    def after_fork(self) -> None:
        """In a forked child: the parent's rows and file are not ours; locks may be held by dead threads.
        A child that initialises its own process group is a rank of its own and opens its own file."""
        self.lock = threading.RLock()
        del self.buf[:]
        self.done.clear()
        self.pending.clear()
        self.buckets.clear()
        self.sink, self.closed, self.files, self.written = None, [], [], {}
        self.flushed_rows = self.dropped = 0
        self.recent = b""
        self.rank = self.world_size = -1
        self.group_ids.clear()
        self.pid = os.getpid()

    def __len__(self) -> int:
        return self.flushed_rows + len(self.buf) // ROW.size

    def nbytes(self) -> int:
        """Bytes of rows held in memory: the unflushed rows plus an in-memory sink."""
        return len(self.buf) + sum(s.nbytes() for s in self.sinks() if s.path is None)

    # ---- derivation ---------------------------------------------------------------
    def to_dataframe(self):
        """Every row this process recorded since the last reset, from its sinks, as a DataFrame
        with the SCHEMA's columns and dtypes."""
        import numpy as np
        import pandas as pd

        from . import _logfile

        with self.lock:
            self.flush()
            datas = []
            for sink in self.sinks():
                try:
                    datas.append(sink.read())
                except OSError as exc:      # removed under us: its rows are gone
                    _runtime.fail("export.read_back", exc, rows=0)
        frames = [dataframe(_logfile.parse(d, ROW.size, row_dtype(np))) for d in datas]
        if not frames:
            frames = [dataframe(_logfile.parse(_logfile.MAGIC, ROW.size, row_dtype(np)))]
        df = frames[0] if len(frames) == 1 else _concat(pd, frames)
        if self.reset_seq:
            df = df[df["seq"] >= self.reset_seq].reset_index(drop=True)
        df.attrs["dropped_rows"] = self.dropped
        return df


_RECENT = 64


def _concat(pd, frames):
    from pandas.api.types import union_categoricals

    out = {}
    for col in COLUMNS:
        if DTYPES[col] == "category":
            out[col] = union_categoricals([f[col] for f in frames], sort_categories=True)
        else:
            out[col] = pd.concat([f[col] for f in frames], ignore_index=True)
    return pd.DataFrame(out)


class Cat:
    """A categorical column: integer codes into sorted unique ``categories`` (-1: missing)."""

    __slots__ = ("codes", "categories")

    def __init__(self, codes, categories) -> None:
        self.codes, self.categories = codes, categories


def columns(parsed) -> dict:
    """The SCHEMA's columns of one parsed rank log (``_logfile.parse``): numpy arrays, and ``Cat``
    for categorical ones. Built once, vectorised; shared by the DataFrame and the Arrow export."""
    import numpy as np

    from .analysis import bus_factor
    from ._targets import NO_BW

    h = parsed.header
    rows = parsed.rows
    seq = rows["seq"]
    if len(seq) > 1 and not (seq[1:] >= seq[:-1]).all():      # threads may interleave: order by seq
        rows = rows[np.argsort(seq, kind="stable")]
    # contiguous columns (fields of the packed rows are strided views): every step below is faster
    raw = {name: np.ascontiguousarray(rows[name]) for name, _ in _FIELDS}
    clock = sorted(parsed.clock) or [(0, 0)]
    off_seq = np.array([c[0] for c in clock], np.int64)
    off_val = np.array([c[1] for c in clock], np.int64)
    offset = off_val[np.maximum(np.searchsorted(off_seq, raw["seq"], side="right") - 1, 0)]
    late = np.full(len(rows), -1, np.int64)
    late_seq, late_dur = parsed.late_seq, parsed.late_dur
    if len(late_seq):
        pos = np.searchsorted(raw["seq"], late_seq)
        ok = pos < len(rows)
        ok[ok] &= raw["seq"][pos[ok]] == late_seq[ok]
        late[pos[ok]] = late_dur[ok]

    n_groups = max(parsed.groups, default=-1) + 1
    groups = [parsed.groups.get(i, {"name": "?", "size": 0, "ranks": "", "backend": "?", "backends": ["?"] * 3})
              for i in range(n_groups)]
    op_names = h.get("ops", list(OP_NAMES))
    n_dtypes = max(parsed.dtypes, default=1) + 1
    dtypes = [parsed.dtypes.get(i, ("none", 0) if i == 0 else (OBJECT, 1) if i == 1 else ("?", 0)) for i in range(n_dtypes)]

    gid = raw["gid"].astype(np.int64)
    g_size = np.array([g["size"] for g in groups] or [0], dtype=np.int64)[gid]
    op = raw["op"].astype(np.int64)
    targets = [BY_NAME.get(name) for name in op_names]
    xn = np.array([t is not None and t.size[0] == "xn" for t in targets] or [False])[op]
    numel = raw["numel"] * np.where(xn, g_size, 1)
    nbytes = numel * np.array([d[1] for d in dtypes], dtype=np.int64)[raw["dtype"]]
    flags = raw["flags"].astype(np.int64)
    timing = flags >> T_SHIFT
    host_ns = raw["end"] - raw["start"]
    dur_ns = np.where(timing == T_HOST, host_ns, late).astype(np.float64)
    dur_ns[dur_ns < 0] = np.nan
    device = np.where(flags & F_CUDA, 1, np.where(raw["dtype"] <= 1, 2, 0))
    n = len(gid)
    where = raw["where"].astype(np.int64)
    seconds = dur_ns / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where((seconds > 0) & (nbytes > 0), nbytes / seconds / 1e9, np.nan)
    factor = np.full(n, np.nan)
    sizes = g_size.astype(np.float64)
    for code in np.unique(op):
        mask = op == code
        factor[mask] = bus_factor(targets[code].bw if targets[code] is not None else NO_BW, sizes[mask])
    out = {
        "seq": raw["seq"],
        "op": _cat(np, op, op_names),
        "rank": np.full(n, h.get("rank", -1), np.int64),
        "world_size": np.full(n, h.get("world_size", -1), np.int64),
        "group": _cat(np, gid, [g["name"] for g in groups]),
        "group_size": g_size,
        "group_ranks": _cat(np, gid, [g["ranks"] for g in groups]),
        "group_seq": _cumcount(np, gid),          # the n-th call of this rank on that group
        "backend": _cat(np, gid * 3 + device, [b for g in groups for b in g["backends"]]),
        "device": _cat(np, device, ["cpu", "cuda", "none"]),
        "dtype": _cat(np, raw["dtype"].astype(np.int64), [d[0] for d in dtypes]),
        "numel": numel,
        "bytes": nbytes,
        "peer": raw["peer"].astype(np.int64),
        "async_op": (flags & F_ASYNC).astype(bool),
        "start_ns": raw["start"] + offset,
        "host_us": host_ns / 1e3,
        "duration_us": dur_ns / 1e3,
        "timing": _cat(np, timing, list(h.get("timings", TIMINGS))),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor,
        "status": _cat(np, (flags & F_ERROR) >> 2, ["ok", "error"]),
        "step": raw["step"],
        "tag": _cat(np, raw["tag"].astype(np.int64), _names(parsed.tags)),
        "pid": np.full(n, h.get("pid", -1), np.int64),
        "module": _cat(np, where >> 2, _names(parsed.modules)),
        "phase": _cat(np, where & 3, list(_runtime.PHASES)),
        **_bucket_columns(np, raw["seq"], parsed.buckets),
    }
    return {name: out[name] for name in COLUMNS}


def dataframe(parsed):
    """The SCHEMA's DataFrame of one parsed rank log."""
    import pandas as pd

    cols = columns(parsed)
    df = pd.DataFrame({name: pd.Categorical.from_codes(c.codes, categories=c.categories) if isinstance(c, Cat) else c
                       for name, c in cols.items()}, copy=False)
    df.attrs["torn_records"] = parsed.torn
    return df


def arrow_table(parsed):
    """The same columns as a pyarrow Table (no pandas involved: the fast path of the exports)."""
    import pyarrow as pa

    arrays = []
    for name, c in columns(parsed).items():
        if isinstance(c, Cat):
            arrays.append(pa.DictionaryArray.from_arrays(pa.array(c.codes.astype("int32")),
                                                         pa.array(c.categories, type=pa.string())))
        else:
            arrays.append(pa.array(c))
    return pa.Table.from_arrays(arrays, names=list(COLUMNS))


def _names(registry: dict) -> list[str]:
    """code -> name as a list, each as ``printable_name`` makes it."""
    out = [""] * (max(registry, default=0) + 1)
    for code, name in registry.items():
        out[code] = printable_name(name)
    return out


def printable_name(name: str) -> str:
    """A tag or module name as every file format can hold it: what UTF-8 cannot encode (lone
    surrogates, how Python carries undecodable file names) and NUL bytes are backslash-escaped."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name.replace("\x00", "\\x00") if "\x00" in name else name


def compact_ranks(ranks) -> str:
    """Global ranks of a group in range notation: '0-7', '0-1022:2', '0 3 5' (runs of equal step
    of 3 or more become 'first-last[:step]'), so a row's group costs the same at 8 or 8,192 ranks."""
    ranks = list(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i + 1
        if j < len(ranks):
            step = ranks[j] - ranks[i]
            while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
                j += 1
            if j - i >= 2 and step > 0:
                parts.append(f"{ranks[i]}-{ranks[j]}" + (f":{step}" if step != 1 else ""))
                i = j + 1
                continue
        parts.append(str(ranks[i]))
        i += 1
    return " ".join(parts)


def expand_ranks(text) -> list[int]:
    """The ranks of a ``group_ranks`` value (range notation or the older space-separated list)."""
    out: list[int] = []
    for part in str(text).split():
        if "-" in part:
            span, _, step = part.partition(":")
            first, _, last = span.partition("-")
            out.extend(range(int(first), int(last) + 1, int(step or 1)))
        else:
            out.append(int(part))
    return out


def _group_name(pg) -> str:
    """``pg.group_name``; a Python ProcessGroup from a registered backend has none set (it
    raises): then the name torch keeps for the group in its registry."""
    try:
        return str(pg.group_name)
    except (AttributeError, RuntimeError):
        import torch.distributed as dist

        return str(dist.distributed_c10d._world.pg_names.get(pg, ""))


def _device_backends(backend: str, pg) -> tuple:
    """(cpu, cuda, no tensor) -> name of the backend that runs the call, from a configured string.

    A group set up with one backend per device (``"cpu:gloo,cuda:nccl"``) runs a call on the
    backend of its tensors' device; calls without a tensor (barrier, object collectives) run on
    the device torch picks for them (``_get_object_coll_device``: cpu when the group has one).
    """
    if ":" not in backend:
        return (backend,) * 3
    by_device = dict(pair.split(":", 1) for pair in backend.split(",") if ":" in pair)
    try:
        import torch.distributed as dist

        none = by_device.get(dist.distributed_c10d._get_object_coll_device(pg), backend)
    except Exception:  # noqa: BLE001 - an unusual group: keep the configured string
        none = backend
    return by_device.get("cpu", backend), by_device.get("cuda", backend), none


def _bucket_columns(np, seqs, spans):
    """DDP bucket index / parameter count per row, from the hook spans (derived, not on the hot path)."""
    bucket = np.full(len(seqs), -1, np.int64)
    params = np.zeros(len(seqs), np.int64)
    for lo, hi, index, nparams in spans:
        i, j = np.searchsorted(seqs, (lo, hi))
        bucket[i:j], params[i:j] = index, nparams
    return {"bucket": bucket, "bucket_params": params}


def _cumcount(np, keys):
    """For each row, how many earlier rows share its key (vectorised groupby().cumcount())."""
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    out = np.empty(len(keys), np.int64)
    out[order] = np.arange(len(keys)) - run_start
    return out


def row_dtype(np):
    """numpy dtype of one packed row (the same layout as ROW)."""
    return np.dtype([(name, _NP_CODES[code]) for name, code in _FIELDS])


def _cat(np, codes, names) -> Cat:
    """Sorted categories of the values present (the dtype read_csv gives); ``names`` may repeat a
    value (two groups with the same ranks): categories are unique values."""
    if len(codes) == 0:
        return Cat(np.zeros(0, np.int64), [])
    present = np.flatnonzero(np.bincount(codes, minlength=len(names)))
    categories = sorted({names[i] for i in present})
    position = {name: i for i, name in enumerate(categories)}
    lut = np.full(len(names), -1, dtype=np.int64)
    lut[present] = [position[names[i]] for i in present]
    return Cat(lut[codes], categories)


def apply_schema(df):
    """Give a DataFrame read from disk the SCHEMA's dtypes (and column order)."""
    import pandas as pd

    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"not a commpatch log: missing column(s) {', '.join(missing)}")
    out = {}
    for col in SCHEMA:
        s = df[col.name]
        if col.dtype == "category":
            s = s.astype(object).fillna("").astype(str)
            out[col.name] = pd.Categorical(s)
        elif col.dtype == "bool":
            out[col.name] = s.astype(str).str.lower().isin(("true", "1")) if s.dtype != bool else s
        else:
            out[col.name] = s.astype(col.dtype)
    return pd.DataFrame(out)

