"""Synthetic multi-rank logs with the SCHEMA's columns: for tests, benchmarks and the notebook.

``make_log`` builds, vectorised, what N ranks of a data-parallel job would record: per step a
fixed pattern of collectives on the default group (and optionally a ring of send/recv pairs),
arrival jitter per rank, an optional straggler that arrives late to every collective, and
optional planted faults (a rank that sends a different size, or skips a collective). Durations
include the time spent waiting for the last rank, as real measured durations do.
"""

from __future__ import annotations

import numpy as np

from .analysis.summaries import add_bandwidth
from .data.frame import apply_schema
from .data.ops import describe_op
from .data.schema import DERIVED_FROM_OP, SCHEMA
from .io.writer import write

# (op, bytes, dtype) issued by every rank in each step, in this order
PATTERN = (
    ("all_reduce", 1 << 22, "float32"),
    ("all_gather_into_tensor", 1 << 20, "float32"),
    ("broadcast", 1 << 16, "float32"),
    ("reduce_scatter_tensor", 1 << 21, "bfloat16"),
    ("all_reduce", 1 << 10, "float32"),
)
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "int64": 8, "object": 1, "none": 1}
T0_NS = 1_700_000_000_000_000_000


def make_log(world_size: int = 4, steps: int = 10, **options):
    """A merged log of ``world_size`` ranks as a DataFrame with the SCHEMA's columns and dtypes.

    Options (see ``rank_logs``): ``pattern``, ``p2p``, ``straggler``, ``straggler_delay_us``,
    ``jitter_us``, ``bandwidth_gbps``, ``compute_us``, ``mismatch=(rank, k)`` (on ``rank`` the
    k-th collective of the default group moves twice the bytes), ``missing=(rank, k)``
    (``rank`` never issues the k-th collective), ``seed``.
    """
    import pandas as pd

    return apply_schema(pd.concat(list(rank_logs(world_size, steps, **options)), ignore_index=True))


def rank_logs(world_size: int = 4, steps: int = 10, *, pattern=PATTERN, p2p: bool = False,
              straggler: int | None = None, straggler_delay_us: float = 2000.0,
              jitter_us: float = 50.0, bandwidth_gbps: float = 5.0, compute_us: float = 20000.0,
              mismatch: tuple[int, int] | None = None, missing: tuple[int, int] | None = None,
              seed: int = 0):
    """Yield each rank's log in turn (memory for one rank at a time; ``make_log`` joins them).

    ``p2p``: each step ends with rank r sending to rank r+1 (mod n), which bumps group_seq on
    those ranks only, as real point-to-point calls do.
    """
    rng = np.random.default_rng(seed)
    n, per_step = world_size, len(pattern)
    k_total = steps * per_step
    index = np.arange(k_total) % per_step
    ops = np.array([p[0] for p in pattern])[index]
    nbytes = np.array([p[1] for p in pattern], np.int64)[index]
    dtypes = np.array([p[2] for p in pattern])[index]
    step = np.arange(k_total) // per_step
    transfer_us = nbytes / (bandwidth_gbps * 1e3) + 20.0            # latency + size / bandwidth

    # collective k is issued by rank r at ready[k] + jitter (+ the straggler's delay)
    issue_us = rng.exponential(jitter_us, size=(k_total, n))
    if straggler is not None:
        issue_us[:, straggler] += straggler_delay_us
    # a collective can start only after the previous one finished; each step begins with compute
    span = issue_us.max(axis=1) + transfer_us + np.where(index == per_step - 1, compute_us, 0.0)
    ready = compute_us + np.concatenate(([0.0], np.cumsum(span)[:-1]))
    end_us = ready + issue_us.max(axis=1) + transfer_us
    last = np.flatnonzero(index == per_step - 1)                     # p2p after these collectives
    for rank in range(n):
        yield _rank_frame(rank, n, ops, dtypes, nbytes, step, ready + issue_us[:, rank], end_us,
                          (mismatch, missing), last if p2p and n > 1 else last[:0],
                          5.0 + transfer_us[0] / 100)


def _rank_frame(rank, n, ops, dtypes, nbytes, step, start_us, end_us, faults, p2p_after, p2p_us):
    import pandas as pd

    mismatch, missing = faults
    nbytes = nbytes.copy()
    if mismatch is not None and mismatch[0] == rank:
        nbytes[mismatch[1]] *= 2
    keep = np.ones(len(ops), bool)
    if missing is not None and missing[0] == rank:
        keep[missing[1]] = False
    order = np.arange(len(ops), dtype=np.float64)
    parts = {"op": [ops[keep]], "dtype": [dtypes[keep]], "bytes": [nbytes[keep]], "step": [step[keep]],
             "start_us": [start_us[keep]], "duration_us": [(end_us - start_us)[keep]],
             "peer": [np.full(keep.sum(), -1)], "order": [order[keep]]}
    m = len(p2p_after)
    for op, peer, offset in (("send", (rank + 1) % n, 0.5), ("recv", (rank - 1) % n, 0.6)):
        for key, value in (("op", np.full(m, op)), ("dtype", np.full(m, "float32")),
                           ("bytes", np.full(m, 1 << 12)), ("step", step[p2p_after]),
                           ("start_us", end_us[p2p_after] + 10.0), ("duration_us", np.full(m, p2p_us)),
                           ("peer", np.full(m, peer)), ("order", p2p_after + offset)):
            parts[key].append(value)
    cols = {key: np.concatenate(value) for key, value in parts.items()}
    sort = np.argsort(cols["order"], kind="stable")
    cols = {key: value[sort] for key, value in cols.items()}
    rows = len(sort)
    elsize = pd.Series(cols["dtype"]).map(ELEMENT_BYTES).to_numpy()
    known = {
        "seq": np.arange(rows), "op": cols["op"], "rank": rank, "world_size": n, "group": "0",
        "group_size": n, "group_ranks": " ".join(map(str, range(n))), "group_seq": np.arange(rows),
        "backend": "gloo", "device": "cpu", "dtype": cols["dtype"],
        "numel": cols["bytes"] // elsize, "bytes": cols["bytes"], "peer": cols["peer"],
        "async_op": False, "start_ns": T0_NS + (cols["start_us"] * 1e3).astype(np.int64),
        "host_us": cols["duration_us"], "duration_us": cols["duration_us"],
        "own_us": cols["duration_us"], "timing": "host",
        "status": "ok", "step": cols["step"], "pid": 1000 + rank, "bucket": -1, "tensors": 1,
    }
    unique_ops, which = np.unique(cols["op"].astype(str), return_inverse=True)
    for i, name in enumerate(DERIVED_FROM_OP):
        known[name] = np.array([describe_op(op)[i] for op in unique_ops] or [""], dtype=object)[which]
    defaults = {"category": "", "int64": 0, "float64": np.nan, "bool": False}
    out = pd.DataFrame({c.name: known.get(c.name, defaults[c.dtype]) for c in SCHEMA}, index=range(rows))
    for c in SCHEMA:
        if c.dtype == "category":
            out[c.name] = out[c.name].astype("category")
    return add_bandwidth(out)


def write_rank_files(directory: str, world_size: int = 4, steps: int = 10, **options) -> list[str]:
    """Write one CSV per rank (``rank{r}.csv``) as a real job does, one rank in memory at a time."""
    import os

    return [write(frame, os.path.join(directory, f"rank{rank}.csv"))
            for rank, frame in enumerate(rank_logs(world_size, steps, **options))]
