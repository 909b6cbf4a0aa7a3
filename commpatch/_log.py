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
    """Rows of one process: ``buf`` holds them packed, ``ROW.size`` bytes each."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.buf = bytearray()
        self.done: dict[int, int] = {}        # seq -> duration_ns, written by completion callbacks
        # seq -> (op code, gid, numel, thread id, start perf ns, issue stack or None): calls in
        # flight (async ones until their timing resolves; sync ones too when the watchdog is on)
        self.pending: dict[int, tuple] = {}
        self.late = (array("q"), array("q"))  # (seq, duration_ns) folded from done: 16 bytes a row
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
        self.dropped = 0                     # rows dropped by the hard cap (max_rows, no output file)
        self.flushed = 0                     # rows already appended to stream_path (streaming)
        self.stream_path = None
        self.max_rows = 0                    # streaming / cap threshold (0: keep everything)
        self.on_full = None                  # called by maintain() past max_rows
        self.group_base: list[int] = []      # calls per gid already cleared (keeps group_seq global)
        self.buckets: list[tuple] = []       # (first_seq, end_seq, bucket, params): DDP hook spans

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
                ranks=" ".join(map(str, dist.get_process_group_ranks(pg))),
                backend=str(dist.get_backend(pg)),
                backends=_device_backends(str(dist.get_backend(pg)), pg),
            )
            try:
                gid = self.groups.index(info)
            except ValueError:
                gid = len(self.groups)
                self.groups.append(info)
            self.group_ids[group] = gid
            return gid

    def forget_groups(self) -> None:
        """Called when process groups are destroyed: group objects may be reused or re-created."""
        with self.lock:
            self.group_ids.clear()   # the same dict object: wrappers hold a reference

    def dtype_id(self, dt) -> int:
        code = self.dtype_ids.get(dt)
        if code is None:
            code = self.dtype_ids[dt] = len(self.dtype_names)
            self.dtype_names.append(str(dt).replace("torch.", ""))
            self.dtype_sizes.append(dt.itemsize)
        return code

    # ---- maintenance (every CHUNK rows, and on read) ---------------------------------
    def _fold_done(self) -> None:
        """Move late durations from the callbacks' dict into the compact (seq, ns) arrays."""
        done, (lseq, ldur) = self.done, self.late
        for key in list(done):
            value = done.pop(key, None)
            if value is not None:
                lseq.append(key)
                ldur.append(value)

    def maintain(self, seq: int) -> None:
        """Fold late durations; re-read the clock offset so long runs do not drift; flush past max_rows."""
        with self.lock:
            self._fold_done()
            self.offsets[0].append(seq)
            self.offsets[1].append(time.time_ns() - time.perf_counter_ns())
        if self.max_rows and len(self) > self.max_rows and self.on_full is not None:
            self.on_full()

    def snapshot(self):
        """The rows as a numpy structured array (a copy: appends go on meanwhile)."""
        import numpy as np

        data = bytes(self.buf)      # one C call: whole rows only
        return np.frombuffer(data, dtype=row_dtype(np))

    def clear(self) -> None:
        with self.lock:
            self._forget(self.snapshot())
            self.done.clear()
            del self.late[0][:], self.late[1][:]
            self.buckets.clear()
            self.dropped = 0
            self.flushed, self.stream_path = 0, None   # a streamed file is started anew

    def after_fork(self) -> None:
        """In a forked child: the parent's rows are not ours; locks may be held by dead threads."""
        self.lock = threading.RLock()
        del self.buf[:]
        self.done.clear()
        self.pending.clear()
        del self.late[0][:], self.late[1][:]
        self.flushed = self.dropped = 0
        self.pid = os.getpid()

    def __len__(self) -> int:
        return len(self.buf) // ROW.size

    def nbytes(self) -> int:
        """Bytes held per the log (rows plus late timings): the per-row memory figure."""
        return len(self.buf) + sum(a.itemsize * len(a) for a in self.late)

    # ---- derivation ---------------------------------------------------------------
    def to_dataframe(self, prefix: int | None = None):
        """Every row in memory (or the oldest ``prefix`` rows) as a DataFrame with the SCHEMA's
        columns and dtypes."""
        import numpy as np
        import pandas as pd

        from .analysis import add_bandwidth

        with self.lock:
            self._fold_done()
            rows = self.snapshot()
            if prefix is not None:
                rows = rows[:prefix]
            late_seq = np.array(self.late[0], np.int64)
            late_dur = np.array(self.late[1], np.int64)
            off_seq, off_val = np.array(self.offsets[0], np.int64), np.array(self.offsets[1], np.int64)
            groups = list(self.groups)
            dtype_names, dtype_sizes = list(self.dtype_names), list(self.dtype_sizes)
            rank, world_size, pid = self.rank, self.world_size, self.pid
            buckets = list(self.buckets)
            group_base = np.array(self.group_base + [0] * (len(groups) - len(self.group_base)) or [0], np.int64)
        rows = rows[np.argsort(rows["seq"], kind="stable")]
        raw = {name: rows[name] for name, _ in _FIELDS}
        offset = off_val[np.maximum(np.searchsorted(off_seq, raw["seq"], side="right") - 1, 0)]
        raw["dur"] = np.full(len(rows), -1, np.int64)
        if len(late_seq):
            pos = np.searchsorted(raw["seq"], late_seq)
            ok = pos < len(rows)
            ok[ok] &= raw["seq"][pos[ok]] == late_seq[ok]
            raw["dur"][pos[ok]] = late_dur[ok]

        gid = raw["gid"].astype(np.int64)
        g_size = np.array([g.size for g in groups] or [0], dtype=np.int64)[gid]
        op = raw["op"].astype(np.int64)
        xn = np.array([BY_NAME[n].size[0] == "xn" for n in OP_NAMES])[op]
        numel = raw["numel"] * np.where(xn, g_size, 1)
        elsize = np.array(dtype_sizes, dtype=np.int64)[raw["dtype"]]
        flags = raw["flags"].astype(np.int64)
        timing = flags >> T_SHIFT
        host_ns = raw["end"] - raw["start"]
        dur_ns = np.where(timing == T_HOST, host_ns, raw["dur"]).astype(np.float64)
        dur_ns[dur_ns < 0] = np.nan
        device = np.where(flags & F_CUDA, 1, np.where(raw["dtype"] <= 1, 2, 0))
        # per-group sequence: the n-th call of this rank on that group
        group_seq = group_base[gid] + _cumcount(np, gid)
        n = len(gid)
        df = pd.DataFrame({
            "seq": raw["seq"],
            "op": _cat(pd, np, op, list(OP_NAMES)),
            "rank": np.full(n, rank, np.int64),
            "world_size": np.full(n, world_size, np.int64),
            "group": _cat(pd, np, gid, [g.name for g in groups]),
            "group_size": g_size,
            "group_ranks": _cat(pd, np, gid, [g.ranks for g in groups]),
            "group_seq": group_seq,
            "backend": _cat(pd, np, gid * 3 + device, [b for g in groups for b in g.backends]),
            "device": _cat(pd, np, device, ["cpu", "cuda", "none"]),
            "dtype": _cat(pd, np, raw["dtype"].astype(np.int64), dtype_names),
            "numel": numel,
            "bytes": numel * elsize,
            "peer": raw["peer"].astype(np.int64),
            "async_op": (flags & F_ASYNC).astype(bool),
            "start_ns": raw["start"] + offset,
            "host_us": host_ns / 1e3,
            "duration_us": dur_ns / 1e3,
            "timing": _cat(pd, np, timing, list(TIMINGS)),
            "status": _cat(pd, np, (flags & F_ERROR) >> 2, ["ok", "error"]),
            "step": raw["step"],
            "tag": _cat(pd, np, raw["tag"].astype(np.int64), list(_runtime.TAGS)),
            "pid": np.full(n, pid, np.int64),
            "module": _cat(pd, np, raw["where"].astype(np.int64) >> 2, list(_runtime.MODULES)),
            "phase": _cat(pd, np, raw["where"].astype(np.int64) & 3, list(_runtime.PHASES)),
            **_bucket_columns(np, raw["seq"], buckets),
        })
        df = add_bandwidth(df)[list(COLUMNS)]
        df.attrs["dropped_rows"] = self.dropped
        return df

    def pop_final_rows(self, force: bool = False):
        """The oldest rows whose timing is final, as a DataFrame, removed from memory (streaming
        to a file, or the hard cap). Stops at the first row still in flight unless ``force``."""
        import numpy as np

        with self.lock:
            self._fold_done()
            rows = self.snapshot()
            k = len(rows)
            pending = list(self.pending)
            if pending and not force:
                in_flight = np.flatnonzero(np.isin(rows["seq"], np.array(pending, np.int64)))
                if len(in_flight):
                    k = int(in_flight[0])
            if k == 0:
                return None
            df = self.to_dataframe(prefix=k)
            self._forget(rows[:k])
            return df

    def _forget(self, rows) -> None:
        """Drop the oldest ``rows`` from memory, keeping group_seq counting on from them."""
        import numpy as np

        gids = rows["gid"].astype(np.int64)
        counts = np.bincount(gids[gids >= 0]) if len(gids) else []
        for gid, count in enumerate(counts):
            if gid >= len(self.group_base):
                self.group_base.extend([0] * (gid + 1 - len(self.group_base)))
            self.group_base[gid] += int(count)
        del self.buf[: len(rows) * ROW.size]
        if len(rows) and len(self.late[0]):
            keep = ~np.isin(np.frombuffer(self.late[0], np.int64), rows["seq"])
            for arr in self.late:
                kept = np.frombuffer(arr, np.int64)[keep].tolist()
                del arr[:]
                arr.extend(kept)


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


def _cat(pd, np, codes, names):
    """Categorical with sorted categories of the values present: the same dtype as read_csv gives.

    ``names`` may repeat a value (two groups with the same ranks): categories are unique values.
    """
    if len(codes) == 0:
        return pd.Categorical([], categories=[])
    present = np.flatnonzero(np.bincount(codes, minlength=len(names)))
    categories = sorted({names[i] for i in present})
    position = {name: i for i, name in enumerate(categories)}
    lut = np.full(len(names), -1, dtype=np.int64)
    lut[present] = [position[names[i]] for i in present]
    return pd.Categorical.from_codes(lut[codes], categories=categories)


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

