"""The columnar in-memory log, its SCHEMA, and the build of the pandas DataFrame.

The hot path appends one tuple per call (``Log.rows``: one atomic ``list.append``, safe
across threads). Every ``CHUNK`` calls the tuples are compacted into typed ``array``
columns (~61 bytes a row), so the live log stays small; names (op, group, dtype, tag)
are stored as small integer codes into registries. Nothing here imports pandas until
``to_dataframe()`` is called, and every derived column (bytes, Unix times, bandwidth)
is computed there, vectorised.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from dataclasses import dataclass

from . import _runtime
from ._targets import BY_NAME, OBJECT, OP_CODE, TARGET_NAMES

CHUNK_BITS = 14
CHUNK = 1 << CHUNK_BITS           # rows per compaction
CHUNK_MASK = CHUNK - 1

# Row tuple layout written by the wrapper (indices used below).
SEQ, OP, GID, DTYPE, NUMEL, FLAGS, START, END, PEER, STEP, TAG = range(11)
# FLAGS bits
F_ASYNC, F_CUDA, F_ERROR = 1, 2, 4
T_SHIFT = 4                          # timing code lives in bits 4..7
TIMINGS = ("host", "future", "cuda_event", "nccl", "none")
T_HOST, T_FUTURE, T_CUDA, T_NCCL, T_NONE = range(5)

# (column, typecode) of a compacted chunk; DUR is filled in when a pending timing resolves
_CHUNK_COLUMNS = (("seq", "q"), ("op", "b"), ("gid", "h"), ("dtype", "h"), ("numel", "q"),
                  ("flags", "B"), ("start", "q"), ("end", "q"), ("peer", "i"), ("step", "q"),
                  ("tag", "i"))


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
    Column("backend", "category", "", "backend of the group (gloo, nccl, ...)"),
    Column("device", "category", "", "device type of the tensors (cpu, cuda, none)"),
    Column("dtype", "category", "", "element type ('object' for object collectives, 'none' when no tensor)"),
    Column("numel", "int64", "elements", "elements in the message S (see bytes)"),
    Column("bytes", "int64", "bytes", "message size S as nccl-tests counts it: all_reduce the tensor, all_gather the full output, reduce_scatter the full input, all_to_all the total; for object collectives the bytes of the tensors they moved"),
    Column("peer", "int64", "", "global rank of the peer (send/recv) or root (broadcast/reduce/gather/scatter); -1 if none"),
    Column("async_op", "bool", "", "the call was asynchronous (returned a Work)"),
    Column("start_ns", "int64", "ns", "Unix time when the call was issued"),
    Column("host_us", "float64", "us", "wall time spent inside the Python call"),
    Column("duration_us", "float64", "us", "duration from the source named in 'timing' (NaN when unknown)"),
    Column("timing", "category", "", "source of duration_us: host, future, cuda_event, nccl or none"),
    Column("algbw_gbps", "float64", "GB/s", "bytes / duration (1e9 bytes per second)"),
    Column("busbw_gbps", "float64", "GB/s", "algbw times the nccl-tests bus factor for the op and group size"),
    Column("status", "category", "", "ok, or error when torch raised"),
    Column("step", "int64", "", "value of commpatch.step() when the call was issued"),
    Column("tag", "category", "", "innermost commpatch.tag() active when the call was issued"),
    Column("pid", "int64", "", "process id"),
)
COLUMNS = tuple(c.name for c in SCHEMA)
DTYPES = {c.name: c.dtype for c in SCHEMA}


@dataclass(frozen=True)
class GroupInfo:
    name: str
    size: int
    ranks: str
    backend: str


class Log:
    """Rows of one process. ``rows`` is the hot-path tail; ``chunks`` the compacted part."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.rows: list[tuple] = []
        self.chunks: list[dict] = []
        self.done: dict[int, int] = {}        # seq -> duration_ns of rows resolved late
        self.groups: list[GroupInfo] = []
        self.group_ids: dict = {}             # group object (None: default group) -> gid
        self.dtype_names: list[str] = ["none", OBJECT]
        self.dtype_sizes: list[int] = [0, 1]
        self.dtype_ids: dict = {None: 0, OBJECT: 1}
        self.rank = -1
        self.world_size = -1
        self.pid = os.getpid()
        self.dropped = 0
        self.group_base: list[int] = []      # calls per gid already cleared (keeps group_seq global)

    # ---- registries (slow path, first sight only) -------------------------------------
    def group_id(self, group) -> int:
        """Code for a group; -1 for a rank that is not a member (nothing is recorded)."""
        gid = self.group_ids.get(group)
        if gid is not None:
            return gid
        import torch.distributed as dist

        with self.lock:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            if pg is dist.GroupMember.NON_GROUP_MEMBER:
                self.group_ids[group] = -1
                return -1
            if self.rank < 0:
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            info = GroupInfo(
                name=str(getattr(pg, "group_name", "")),
                size=pg.size(),
                ranks=" ".join(map(str, dist.get_process_group_ranks(pg))),
                backend=str(dist.get_backend(pg)),
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

    def _dtype_id(self, dt) -> int:
        code = self.dtype_ids.get(dt)
        if code is None:
            code = self.dtype_ids[dt] = len(self.dtype_names)
            self.dtype_names.append(str(dt).replace("torch.", ""))
            self.dtype_sizes.append(dt.itemsize)
        return code

    # ---- compaction ---------------------------------------------------------------
    def compact(self, everything: bool = False) -> None:
        """Move finished tuples into typed columns; called every CHUNK rows and on read."""
        with self.lock:
            k = len(self.rows) if everything else min(len(self.rows), CHUNK)
            if not k:
                return
            batch = self.rows[:k]
            del self.rows[:k]   # only appends happen concurrently, at the end
            batch.sort(key=_seq_key)
            cols = list(zip(*batch))
            dtype_id = self._dtype_id
            cols[DTYPE] = [dtype_id(d) for d in cols[DTYPE]]
            chunk = {name: array(code, col) for (name, code), col in zip(_CHUNK_COLUMNS, cols)}
            chunk["dur"] = array("q", [-1]) * k
            # perf_counter -> Unix offset, re-read per chunk so long runs do not drift
            chunk["offset"] = time.time_ns() - time.perf_counter_ns()
            self.chunks.append(chunk)
            self._apply_done()

    def _apply_done(self) -> None:
        """Write resolved late durations into the chunks that hold their rows."""
        if not self.done:
            return
        import bisect

        for seq in list(self.done):
            for chunk in reversed(self.chunks):
                seqs = chunk["seq"]
                if seqs and seqs[0] <= seq <= seqs[-1]:
                    i = bisect.bisect_left(seqs, seq)
                    if i < len(seqs) and seqs[i] == seq:
                        chunk["dur"][i] = self.done.pop(seq)
                    break

    def clear(self) -> None:
        with self.lock:
            self.compact(everything=True)
            for chunk in self.chunks:
                for gid in chunk["gid"]:
                    if gid >= len(self.group_base):
                        self.group_base.extend([0] * (gid + 1 - len(self.group_base)))
                    self.group_base[gid] += 1
            self.rows.clear()
            self.chunks.clear()
            self.done.clear()
            self.dropped = 0

    def __len__(self) -> int:
        return len(self.rows) + sum(len(c["seq"]) for c in self.chunks)

    def nbytes(self) -> int:
        """Bytes held by the compacted columns (the per-row memory figure)."""
        return sum(a.itemsize * len(a) for c in self.chunks for k, a in c.items() if k != "offset")

    # ---- derivation ---------------------------------------------------------------
    def to_dataframe(self):
        """Every row as a DataFrame with the SCHEMA's columns and dtypes."""
        import numpy as np
        import pandas as pd

        from .analysis import add_bandwidth

        with self.lock:
            self.compact(everything=True)
            chunks = list(self.chunks)
            raw = {name: _concat(np, [c[name] for c in chunks], code)
                   for name, code in _CHUNK_COLUMNS + (("dur", "q"),)}
            offset = np.concatenate([np.full(len(c["seq"]), c["offset"], dtype=np.int64) for c in chunks]) \
                if chunks else np.zeros(0, np.int64)
            groups = list(self.groups)
            dtype_names, dtype_sizes = list(self.dtype_names), list(self.dtype_sizes)
            rank, world_size, pid = self.rank, self.world_size, self.pid
            group_base = np.array(self.group_base + [0] * (len(groups) - len(self.group_base)) or [0], np.int64)
        order = np.argsort(raw["seq"], kind="stable")
        raw = {k: v[order] for k, v in raw.items()}
        offset = offset[order]

        gid = raw["gid"].astype(np.int64)
        g_size = np.array([g.size for g in groups] or [0], dtype=np.int64)[gid]
        op = raw["op"].astype(np.int64)
        xn = np.array([BY_NAME[n].size[0] == "xn" for n in TARGET_NAMES])[op]
        numel = raw["numel"] * np.where(xn, g_size, 1)
        elsize = np.array(dtype_sizes, dtype=np.int64)[raw["dtype"]]
        flags = raw["flags"].astype(np.int64)
        timing = flags >> T_SHIFT
        host_ns = raw["end"] - raw["start"]
        dur_ns = np.where(timing == T_HOST, host_ns, raw["dur"]).astype(np.float64)
        dur_ns[dur_ns < 0] = np.nan
        device = np.where(flags & F_CUDA, 1, np.where(raw["dtype"] <= 1, 2, 0))
        # per-group sequence: the n-th call of this rank on that group
        group_seq = group_base[gid] + pd.Series(gid).groupby(gid).cumcount().to_numpy(np.int64)
        n = len(gid)
        df = pd.DataFrame({
            "seq": raw["seq"],
            "op": _cat(pd, np, op, list(TARGET_NAMES)),
            "rank": np.full(n, rank, np.int64),
            "world_size": np.full(n, world_size, np.int64),
            "group": _cat(pd, np, gid, [g.name for g in groups]),
            "group_size": g_size,
            "group_ranks": _cat(pd, np, gid, [g.ranks for g in groups]),
            "group_seq": group_seq,
            "backend": _cat(pd, np, gid, [g.backend for g in groups]),
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
        })
        df = add_bandwidth(df)
        return df[list(COLUMNS)]


def _seq_key(row):
    return row[SEQ]


def _concat(np, arrays, code):
    if not arrays:
        return np.zeros(0, dtype=np.dtype(code))
    return np.concatenate([np.frombuffer(a, dtype=np.dtype(a.typecode)) for a in arrays])


def _cat(pd, np, codes, names):
    """Categorical with sorted categories of the values present: the same dtype as read_csv gives."""
    if len(codes) == 0:
        return pd.Categorical([], categories=[])
    present = np.flatnonzero(np.bincount(codes, minlength=len(names)))
    used = [names[i] for i in present]
    order = sorted(range(len(used)), key=used.__getitem__)
    lut = np.full(len(names), -1, dtype=np.int64)
    lut[present[order]] = np.arange(len(order))
    return pd.Categorical.from_codes(lut[codes], categories=[used[i] for i in order])


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
            s = s.fillna("").astype(str)
            out[col.name] = pd.Categorical(s)
        elif col.dtype == "bool":
            out[col.name] = s.astype(str).str.lower().isin(("true", "1")) if s.dtype != bool else s
        else:
            out[col.name] = s.astype(col.dtype)
    return pd.DataFrame(out)


def op_code(name: str) -> int:
    return OP_CODE[name]
