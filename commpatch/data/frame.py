"""A parsed rank log (``data.logfile``) -> the SCHEMA's columns: numpy arrays, a pandas DataFrame
or a pyarrow Table. Built once, vectorised; every derived column (bytes, Unix times, bandwidth)
is computed here, never on the hot path."""

from __future__ import annotations

import threading

from .attrs import shared
from .clock import CLOCK_ATTR, RankClock, rank_clock
from .logfile import parse
from .ops import BY_NAME, NO_BW, OBJECT, OP_NAMES, bus_factor, describe_op
from .schema import (
    _FIELDS,
    COLUMNS,
    DERIVED_FROM_OP,
    OLD_TIMING_NAMES,
    PHASES,
    ROW,
    S_OPTIMIZER,
    S_USER,
    SCHEMA,
    STEP_SOURCES,
    T_DEVICE,
    T_FUTURE,
    T_HOST,
    T_NCCL,
    T_WAIT,
    TIMINGS,
    printable_name,
    row_dtype,
    unpack_flags,
    unpack_where,
)

_DTYPES = {c.name: c.dtype for c in SCHEMA}


def concat_frames(pd, frames):
    from pandas.api.types import union_categoricals

    out = {}
    for col in COLUMNS:
        if _DTYPES[col] == "category":
            out[col] = union_categoricals([f[col] for f in frames], sort_categories=True)
        else:
            out[col] = pd.concat([f[col] for f in frames], ignore_index=True)
    return pd.DataFrame(out)


class Cat:
    """A categorical column: integer codes into sorted unique ``categories`` (-1: missing)."""

    __slots__ = ("codes", "categories")

    def __init__(self, codes, categories) -> None:
        self.codes, self.categories = codes, categories


def columns(parsed, names=None) -> dict:
    """The SCHEMA's columns of one parsed rank log (``data.logfile.parse``): numpy arrays, and ``Cat``
    for categorical ones. Built once, vectorised; shared by the DataFrame and the Arrow export.
    ``names``: only these columns (in SCHEMA order)."""
    import numpy as np

    h = parsed.header
    rows = parsed.rows
    seq = rows["seq"]
    if len(seq) > 1 and not (seq[1:] >= seq[:-1]).all():  # threads may interleave: order by seq
        rows = rows[np.argsort(seq, kind="stable")]
    # contiguous, aligned columns (fields of the packed rows are strided, unaligned views; one row's
    # view counts as contiguous): every step below is faster, and Arrow takes no unaligned buffer
    raw = {name: np.require(rows[name], requirements=("C", "A")) for name, _ in _FIELDS}
    clock = sorted(parsed.clock) or [(0, 0)]
    off_seq = np.array([c[0] for c in clock], np.int64)
    off_val = np.array([c[1] for c in clock], np.int64)
    offset = off_val[np.maximum(np.searchsorted(off_seq, raw["seq"], side="right") - 1, 0)]
    late = _by_seq(np, raw["seq"], parsed.late_seq, parsed.late_dur)

    n_groups = max(parsed.groups, default=-1) + 1
    groups = [
        parsed.groups.get(i, {"name": "?", "size": 0, "ranks": "", "backend": "?", "backends": ["?"] * 3})
        for i in range(n_groups)
    ]
    op_names = h.get("ops", list(OP_NAMES))
    described = [describe_op(name) for name in op_names]
    n_dtypes = max(parsed.dtypes, default=1) + 1
    dtypes = [
        parsed.dtypes.get(i, ("none", 0) if i == 0 else (OBJECT, 1) if i == 1 else ("?", 0)) for i in range(n_dtypes)
    ]

    gid = raw["gid"].astype(np.int64)
    g_size = np.array([g["size"] for g in groups] or [0], dtype=np.int64)[gid]
    op = raw["op"].astype(np.int64)
    targets = [BY_NAME.get(name) for name in op_names]
    xn = np.array([t is not None and t.size[0] == "xn" for t in targets] or [False])[op]
    numel = raw["numel"] * np.where(xn, g_size, 1)
    nbytes = numel * np.array([d[1] for d in dtypes], dtype=np.int64)[raw["dtype"]]
    flags = raw["flags"].astype(np.int64)
    is_async, on_device, is_error, timing = unpack_flags(flags)
    host_ns = raw["end"] - raw["start"]
    dur_ns = np.where(timing == T_HOST, host_ns, late).astype(np.float64)
    dur_ns[dur_ns < 0] = np.nan
    device_own = _by_seq(np, raw["seq"], parsed.own_seq, parsed.own_dur).astype(np.float64)
    device_own[device_own < 0] = np.nan
    start_ns = raw["start"] + offset
    start_ns = start_ns + parsed_clock(parsed).shift(np, start_ns)  # on rank 0's wall clock, when measured
    device = np.where(on_device, 1, np.where(raw["dtype"] <= 1, 2, 0))
    n = len(gid)
    module, phase = unpack_where(raw["where"].astype(np.int64))
    memo: dict = {}

    def own_ns():
        if "own" not in memo:
            memo["own"] = own_times(np, gid, start_ns, dur_ns, timing, device_own)
        return memo["own"]

    def algbw():
        if "algbw" not in memo:
            seconds = own_ns() / 1e9
            with np.errstate(divide="ignore", invalid="ignore"):
                memo["algbw"] = np.where((seconds > 0) & (nbytes > 0), nbytes / seconds / 1e9, np.nan)
        return memo["algbw"]

    def factor():
        out = np.full(n, np.nan)
        sizes = g_size.astype(np.float64)
        for code in np.unique(op):
            mask = op == code
            out[mask] = bus_factor(targets[code].bw if targets[code] is not None else NO_BW, sizes[mask])
        return out

    def bucket_columns():
        if "buckets" not in memo:
            memo["buckets"] = _bucket_columns(np, raw["seq"], parsed.buckets)
        return memo["buckets"]

    out: dict = {  # column -> how to build it: only the columns asked for are built
        "seq": lambda: raw["seq"],
        "op": lambda: _cat(np, op, op_names),
        **{
            name: (lambda i=i: _cat(np, op, [kinds[i] for kinds in described]))
            for i, name in enumerate(DERIVED_FROM_OP)
        },
        "rank": lambda: np.full(n, h.get("rank", -1), np.int64),
        "world_size": lambda: np.full(n, h.get("world_size", -1), np.int64),
        "group": lambda: _cat(np, gid, [g["name"] for g in groups]),
        "group_size": lambda: g_size,
        "group_ranks": lambda: _cat(np, gid, [g["ranks"] for g in groups]),
        "group_seq": lambda: _cumcount(np, gid),  # the n-th call of this rank on that group
        "backend": lambda: _cat(np, gid * 3 + device, [b for g in groups for b in g["backends"]]),
        "device": lambda: _cat(np, device, ["cpu", parsed.device, "none"]),
        "dtype": lambda: _cat(np, raw["dtype"].astype(np.int64), [d[0] for d in dtypes]),
        "numel": lambda: numel,
        "bytes": lambda: nbytes,
        "peer": lambda: raw["peer"].astype(np.int64),
        "async_op": lambda: is_async.astype(bool),
        "start_ns": lambda: start_ns,
        "host_us": lambda: host_ns / 1e3,
        "duration_us": lambda: dur_ns / 1e3,
        "own_us": lambda: own_ns() / 1e3,
        "timing": lambda: _cat(np, timing, [OLD_TIMING_NAMES.get(t, t) for t in h.get("timings", TIMINGS)]),
        "algbw_gbps": algbw,
        "busbw_gbps": lambda: algbw() * factor(),
        "status": lambda: _cat(np, is_error, ["ok", "error"]),
        "step": lambda: _job_steps(np, raw["seq"], raw["step"], parsed.step_sources),
        "tag": lambda: _cat(np, raw["tag"].astype(np.int64), _names(parsed.tags)),
        "pid": lambda: np.full(n, h.get("pid", -1), np.int64),
        "module": lambda: _cat(np, module, _names(parsed.modules)),
        "phase": lambda: _cat(np, phase, list(PHASES)),
        **{name: (lambda name=name: bucket_columns()[name]) for name in ("bucket", "bucket_params", "tensors")},
        "step_source": lambda: _cat(np, _step_sources(np, raw["seq"], parsed.step_sources), list(STEP_SOURCES)),
        "sync_end_us": lambda: _noted_us(np, raw["seq"], parsed.syncs, 1),  # end of DDP's finalize
        "pack_us": lambda: _noted_us(np, raw["seq"], parsed.packs, 1),
        "pack_alone_us": lambda: _noted_us(np, raw["seq"], parsed.packs, 2),
        "wait_us": lambda: _noted_us(np, raw["seq"], parsed.waits, 1),  # the thread's wait_tensor
    }
    wanted = [name for name in COLUMNS if names is None or name in names]
    return _build(out, wanted, n)


# Columns are built on two threads from this many rows on: numpy releases the GIL in its array
# operations, and most of the time is spent touching fresh memory (design notes, issue 11).
PARALLEL_ROWS = 1 << 17
# columns built in one task, in this order: they share a memoised value (own time, bucket spans)
_CHAINS = (("own_us", "algbw_gbps", "busbw_gbps"), ("bucket", "bucket_params", "tensors"))


def _build(builders: dict, wanted: list, n: int) -> dict:
    """``{name: builders[name]()}`` for the wanted names, in their order; on two threads for large
    logs (one thread where threads cannot start: interpreter shutdown)."""
    if n < PARALLEL_ROWS or len(wanted) < 4:
        return {name: builders[name]() for name in wanted}
    tasks, chained = [], set()
    for chain in _CHAINS:
        names = [name for name in chain if name in wanted]
        if names:
            tasks.append(names)
            chained.update(names)
    tasks += [[name] for name in wanted if name not in chained]
    done: dict = {}

    def run(task_list) -> None:
        for task in task_list:
            for name in task:
                done[name] = builders[name]()

    def run_quietly(task_list) -> None:
        try:
            run(task_list)
        except Exception:  # noqa: BLE001 - what it did not build is built (and raises) on the caller's thread
            pass

    helper = threading.Thread(target=run_quietly, args=(tasks[1::2],), daemon=True)
    try:
        helper.start()
        started = True
    except RuntimeError:  # no new threads at interpreter shutdown: all built below
        started = False
    run(tasks[0::2])
    if started:
        helper.join()
    for name in wanted:  # what the helper did not build (it failed, or never ran)
        if name not in done:
            done[name] = builders[name]()
    return {name: done[name] for name in wanted}


def dataframe(parsed, names=None):
    """The SCHEMA's DataFrame of one parsed rank log (``names``: only these columns)."""
    import pandas as pd

    cols = columns(parsed, names)
    df = pd.DataFrame(
        {
            name: pd.Categorical.from_codes(c.codes, categories=c.categories) if isinstance(c, Cat) else c
            for name, c in cols.items()
        },
        copy=False,
    )
    df.attrs["torn_records"] = parsed.torn
    rank = parsed.header.get("rank")
    if isinstance(rank, int) and rank >= 0:
        df.attrs[CLOCK_ATTR] = shared({rank: parsed_clock(parsed).summary()})
    return df


def parsed_clock(parsed) -> RankClock:
    """The clock of a parsed rank log relative to rank 0's (``data.clock``)."""
    h = parsed.header
    rank, world = h.get("rank", -1), h.get("world_size", -1)
    return rank_clock(
        rank if isinstance(rank, int) else -1, world if isinstance(world, int) else -1, parsed.rank0_offsets
    )


def arrow_table(parsed, names=None):
    """The same columns as a pyarrow Table (no pandas involved: the fast path of the exports);
    ``names``: only these. Arrays are made from the numpy buffers (``Array.from_buffers``):
    ``pa.array`` imports pandas to check its argument (~0.25 s, the largest part of converting a
    1M-row log to Parquet)."""
    import numpy as np
    import pyarrow as pa

    arrays = []
    cols = columns(parsed, names)
    for c in cols.values():
        if isinstance(c, Cat):
            arrays.append(
                pa.DictionaryArray.from_arrays(_arrow_array(pa, np, c.codes), _arrow_strings(pa, np, c.categories))
            )
        else:
            arrays.append(_arrow_array(pa, np, c))
    return pa.Table.from_arrays(arrays, names=list(cols))


_ARROW_TYPES = {"i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64", "f8": "float64", "u1": "uint8"}


def _arrow_array(pa, np, values):
    """A numpy array of numbers or bools as an Arrow array (no nulls: NaN stays a float value, as
    ``pa.array`` leaves it), sharing the numpy buffer except for bools (bit-packed)."""
    values = np.ascontiguousarray(values)
    if values.dtype == bool:
        return pa.Array.from_buffers(
            pa.bool_(), len(values), [None, pa.py_buffer(np.packbits(values, bitorder="little"))]
        )
    kind = values.dtype.str.lstrip("<=|")
    if kind not in _ARROW_TYPES:
        return pa.array(values)
    return pa.Array.from_buffers(getattr(pa, _ARROW_TYPES[kind])(), len(values), [None, pa.py_buffer(values)])


def _arrow_strings(pa, np, values):
    """A list of str as an Arrow string array (offsets and UTF-8 bytes)."""
    data = [v.encode("utf-8") for v in values]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum([len(b) for b in data], out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(data), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])


def _by_seq(np, seqs, keys, values):
    """``values`` placed at the rows whose seq is in ``keys`` (-1 elsewhere); ``seqs`` sorted."""
    out = np.full(len(seqs), -1, np.int64)
    if keys is not None and len(keys):
        pos = np.searchsorted(seqs, keys)
        ok = pos < len(seqs)
        ok[ok] &= seqs[pos[ok]] == keys[ok]
        out[pos[ok]] = values[ok]
    return out


# Timing sources measured on the host's clock from the call's issue (start_ns) to its completion
HOST_CLOCK_TIMINGS = (T_HOST, T_FUTURE, T_WAIT)


def own_times(np, keys, start_ns, dur_ns, timing, device_own=None):
    """Each call's own time (ns, float; NaN when unknown): its completion minus the later of its
    issue and the completion of the previous call with the same key (group) in issue order.

    A call that completes before the earlier ones did was not queued behind them: its own time is
    its duration. Calls on a group run in the order they were issued (gloo, NCCL and stream-ordered backends
    alike), so an async call issued behind others waits for them; issue-to-completion would count
    that wait as the call's own time, and a bandwidth computed from it would be wrong.
    - host-clock sources (host, future, wait): completion = start_ns + duration, from the log;
    - device_event: measured on the device when resolved (``device_own``, the ``Q`` records);
    - nccl: NCCL's own events bracket the kernel on its stream: the duration is already its own.
    Rows in ``keys`` order: ``keys`` group the calls (one file: the group id), rows within a key
    are taken in their order here (seq order).
    """
    n = len(start_ns)
    own = np.full(n, np.nan)
    host_clock = np.isin(timing, HOST_CLOCK_TIMINGS) & ~np.isnan(dur_ns)
    if host_clock.any():
        idx = np.flatnonzero(host_clock)
        k = np.asarray(keys)[idx]
        order = idx[np.argsort(k, kind="stable")]  # by key, then issue (row) order: idx is increasing
        k = np.asarray(keys)[order]
        start = (start_ns[order] - start_ns[idx].min()).astype(np.float64)  # small: exact in float64
        end = start + dur_ns[order]
        prev = np.full(len(end), -np.inf)  # the latest completion among the key's earlier calls
        bounds = np.flatnonzero(np.r_[True, k[1:] != k[:-1], True])
        for lo, hi in zip(bounds[:-1], bounds[1:]):  # one block per group: few
            prev[lo + 1 : hi] = np.maximum.accumulate(end[lo : hi - 1])
        # a call that completed before an earlier one did was not queued behind it: all its own
        own[order] = np.where(end > prev, end - np.maximum(start, prev), dur_ns[order])
    nccl = timing == T_NCCL
    own[nccl] = dur_ns[nccl]
    if device_own is not None:
        dev = timing == T_DEVICE
        own[dev] = device_own[dev]
    return own


def _names(registry: dict) -> list[str]:
    """code -> name as a list, each as ``printable_name`` makes it."""
    out = [""] * (max(registry, default=0) + 1)
    for code, name in registry.items():
        out[code] = printable_name(name)
    return out


def _bucket_columns(np, seqs, spans):
    """DDP bucket index / parameter count, and calls coalesced, per row, from the spans the
    integrations record (derived, not on the hot path)."""
    bucket = np.full(len(seqs), -1, np.int64)
    params = np.zeros(len(seqs), np.int64)
    tensors = np.ones(len(seqs), np.int64)
    for lo, hi, index, count in spans:
        i, j = np.searchsorted(seqs, (lo, hi))
        if index >= 0:
            bucket[i:j], params[i:j] = index, count
        else:  # a _coalescing_manager span: calls coalesced
            tensors[i:j] = count
    return {"bucket": bucket, "bucket_params": params, "tensors": tensors}


def _job_steps(np, seqs, steps, marks):
    """The ``step`` column: the recorded steps, numbered as the job numbers its optimizer steps
    where a mark says the first optimizer step after forward-counted ones took k > 1 root forwards
    (gradient accumulation, ``integrations.steps._micro_batches``): the last k forward-counted
    steps before it are its micro-batches, one step, and the later steps move down by k - 1."""
    micro = next((m for m in marks if len(m) > 2), None)
    if micro is None:
        return steps
    marks = sorted(m[:2] for m in marks)
    first = next((m[0] for m in marks if m[1] == S_OPTIMIZER), None)
    if first is None or any(m[1] == S_USER for m in marks if m[0] <= first):
        return steps
    k, switched = micro[2], micro[3]
    user = next((m[0] for m in marks if m[1] == S_USER and m[0] > first), None)
    steps = steps.copy()
    before = seqs < first
    steps[before & (steps > switched - k)] = switched - k + 1
    after = (seqs >= first) & (seqs < user if user is not None else True)
    steps[after] -= k - 1
    return steps


def _step_sources(np, seqs, marks):
    """Per row, the code of what counted its step: the last change recorded at or before its seq."""
    if not marks:
        return np.zeros(len(seqs), np.int64)
    marks = sorted(marks)
    at = np.array([m[0] for m in marks], np.int64)
    codes = np.array([0] + [m[1] for m in marks], np.int64)
    return codes[np.searchsorted(at, seqs, side="right")]


def _noted_us(np, seqs, notes, field: int):
    """Per row, field ``field`` (ns) of the note ``(seq, ...)`` on it, in us; NaN on rows with none."""
    out = np.full(len(seqs), np.nan)
    if notes:
        keys = np.array([s[0] for s in notes], np.int64)
        ns = _by_seq(np, seqs, keys, np.array([s[field] for s in notes], np.int64))
        out[ns >= 0] = ns[ns >= 0] / 1e3
    return out


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


def _cat(np, codes, names) -> Cat:
    """Sorted categories of the values present (the dtype read_csv gives); ``names`` may repeat a
    value (two groups with the same ranks): categories are unique values."""
    if len(codes) == 0:
        return Cat(np.zeros(0, np.int8), [])
    present = np.flatnonzero(np.bincount(codes, minlength=len(names)))
    categories = sorted({names[i] for i in present})
    position = {name: i for i, name in enumerate(categories)}
    # the smallest code type (what pandas picks too; Arrow's dictionary arrays take any): 1 byte a
    # row for the usual handful of values, not 8 (most of a conversion's time is touching memory)
    lut = np.full(
        len(names), -1, dtype=np.int8 if len(categories) < 127 else np.int16 if len(categories) < 32767 else np.int32
    )
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


def parsed_frame(data: bytes, name: str = "<log>"):
    """The DataFrame of a rank log's bytes."""
    return dataframe(parse_log(data, name))


def parse_log(data: bytes, name: str = "<log>"):
    """``data.logfile.parse`` with this version's row layout."""
    import numpy as np

    return parse(data, ROW.size, row_dtype(np), name)
