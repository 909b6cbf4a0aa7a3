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
from .data import logfile
from .data.frame import apply_schema
from .data.ops import OP_CODE, OP_NAMES, describe_op
from .data.schema import DERIVED_FROM_OP, ROW, SCHEMA, SCHEMA_VERSION, TIMINGS, compact_ranks, row_dtype
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


def rank_logs(
    world_size: int = 4,
    steps: int = 10,
    *,
    pattern=PATTERN,
    p2p: bool = False,
    straggler: int | None = None,
    straggler_delay_us: float = 2000.0,
    jitter_us: float = 50.0,
    bandwidth_gbps: float = 5.0,
    compute_us: float = 20000.0,
    mismatch: tuple[int, int] | None = None,
    missing: tuple[int, int] | None = None,
    seed: int = 0,
):
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
    transfer_us = nbytes / (bandwidth_gbps * 1e3) + 20.0  # latency + size / bandwidth

    # collective k is issued by rank r at ready[k] + jitter (+ the straggler's delay)
    issue_us = rng.exponential(jitter_us, size=(k_total, n))
    if straggler is not None:
        issue_us[:, straggler] += straggler_delay_us
    # a collective can start only after the previous one finished; each step begins with compute
    span = issue_us.max(axis=1) + transfer_us + np.where(index == per_step - 1, compute_us, 0.0)
    ready = compute_us + np.concatenate(([0.0], np.cumsum(span)[:-1]))
    end_us = ready + issue_us.max(axis=1) + transfer_us
    last = np.flatnonzero(index == per_step - 1)  # p2p after these collectives
    for rank in range(n):
        yield _rank_frame(
            rank,
            n,
            ops,
            dtypes,
            nbytes,
            step,
            ready + issue_us[:, rank],
            end_us,
            (mismatch, missing),
            last if p2p and n > 1 else last[:0],
            5.0 + transfer_us[0] / 100,
        )


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
    parts = {
        "op": [ops[keep]],
        "dtype": [dtypes[keep]],
        "bytes": [nbytes[keep]],
        "step": [step[keep]],
        "start_us": [start_us[keep]],
        "duration_us": [(end_us - start_us)[keep]],
        "peer": [np.full(keep.sum(), -1)],
        "order": [order[keep]],
    }
    m = len(p2p_after)
    for op, peer, offset in (("send", (rank + 1) % n, 0.5), ("recv", (rank - 1) % n, 0.6)):
        for key, value in (
            ("op", np.full(m, op)),
            ("dtype", np.full(m, "float32")),
            ("bytes", np.full(m, 1 << 12)),
            ("step", step[p2p_after]),
            ("start_us", end_us[p2p_after] + 10.0),
            ("duration_us", np.full(m, p2p_us)),
            ("peer", np.full(m, peer)),
            ("order", p2p_after + offset),
        ):
            parts[key].append(value)
    cols = {key: np.concatenate(value) for key, value in parts.items()}
    sort = np.argsort(cols["order"], kind="stable")
    cols = {key: value[sort] for key, value in cols.items()}
    rows = len(sort)
    elsize = pd.Series(cols["dtype"]).map(ELEMENT_BYTES).to_numpy()
    known = {
        "seq": np.arange(rows),
        "op": cols["op"],
        "rank": rank,
        "world_size": n,
        "group": "0",
        "group_size": n,
        "group_ranks": compact_ranks(range(n)),
        "group_seq": np.arange(rows),
        "backend": "gloo",
        "device": "cpu",
        "dtype": cols["dtype"],
        "numel": cols["bytes"] // elsize,
        "bytes": cols["bytes"],
        "peer": cols["peer"],
        "async_op": False,
        "start_ns": T0_NS + (cols["start_us"] * 1e3).astype(np.int64),
        "host_us": cols["duration_us"],
        "duration_us": cols["duration_us"],
        "own_us": cols["duration_us"],
        "timing": "host",
        "status": "ok",
        "step": cols["step"],
        "pid": 1000 + rank,
        "bucket": -1,
        "tensors": 1,
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

    return [
        write(frame, os.path.join(directory, f"rank{rank}.csv"))
        for rank, frame in enumerate(rank_logs(world_size, steps, **options))
    ]


# ---- binary rank logs, as a real run writes them ----------------------------------------------
# Per step, in this order: (op, group kind, bytes, dtype). Group kinds: "tp" (8 consecutive
# ranks), "dp" (every 8th rank: world / 8 of them), "world", and a send / recv with the
# neighbour rank (r xor 1) on the world group, which advances group_seq on those two ranks only.
BINARY_PATTERN = (
    ("all_reduce", "tp", 1 << 20, "bfloat16"),
    ("all_gather_into_tensor", "tp", 1 << 21, "bfloat16"),
    ("all_reduce", "tp", 1 << 20, "bfloat16"),
    ("reduce_scatter_tensor", "dp", 1 << 24, "float32"),
    ("all_gather_into_tensor", "dp", 1 << 23, "bfloat16"),
    ("send", "world", 1 << 16, "bfloat16"),
    ("recv", "world", 1 << 16, "bfloat16"),
    ("all_reduce", "tp", 1 << 12, "float32"),
    ("all_reduce", "world", 8, "float32"),
    ("broadcast", "dp", 1 << 10, "int64"),
)
HANG_S = 60.0  # write_binary_run(hang=...): the ranks are alive this long after the hung call's issue
_DTYPE_CODES = {"bfloat16": (2, 2), "float32": (3, 4), "int64": (4, 8)}  # code, element size


def binary_groups(world_size: int, rank: int) -> dict:
    """kind -> (name, ranks) of the groups ``rank`` is in (world, its tensor- and data-parallel groups),
    named as torch names them (the default group '0', then one number per new_group call)."""
    tp = min(8, world_size)
    n_tp = world_size // tp
    return {
        "world": ("0", list(range(world_size))),
        "tp": (str(1 + rank // tp), list(range(rank // tp * tp, rank // tp * tp + tp))),
        "dp": (str(1 + n_tp + rank % tp), list(range(rank % tp, world_size, tp))),
    }


def write_binary_run(
    directory: str,
    world_size: int = 16,
    rows: int = 10_000,
    *,
    straggler: int | None = 3,
    straggler_delay_us: float = 400.0,
    mismatch: tuple[int, int] | None = (5, 7),
    seed: int = 0,
    hang: int | None = None,
) -> list[str]:
    """One binary rank log (``rank{r}.cplog``) per rank, framed exactly as ``record.log`` writes them
    (header, groups with their ranks once, dtypes, clock offset, rows in chunks of 16,384), with
    ``rows`` rows per rank (rounded to whole steps) of ``BINARY_PATTERN``: groups of three sizes,
    point-to-point calls, a ``straggler`` that issues every call ``straggler_delay_us`` late, and
    on rank ``mismatch[0]`` the ``mismatch[1]``-th call moving twice the bytes. Issue times jitter
    per rank; a call ends when the last member of its group arrived plus the transfer time, so
    each duration includes the wait for the slowest peer. ``hang``: that rank never issues the last
    step's all_reduce on the world group; every other rank waits in it (an 'inflight' record, as
    ``record.inflight`` writes it), no rank records anything after it, and every rank is alive
    ``HANG_S`` later ('alive' records: the job was killed then). One rank in memory at a time."""
    import os

    world_size = max(2, world_size - world_size % 2)
    per_step = len(BINARY_PATTERN)
    steps = max(1, rows // per_step)
    n = steps * per_step
    index = np.arange(n) % per_step
    kinds = [p[1] for p in BINARY_PATTERN]
    op_code = np.array([OP_CODE[p[0]] for p in BINARY_PATTERN], np.int16)[index]
    dtype_code = np.array([_DTYPE_CODES[p[3]][0] for p in BINARY_PATTERN], np.int16)[index]
    numel = (np.array([p[2] // _DTYPE_CODES[p[3]][1] for p in BINARY_PATTERN], np.int64))[index]
    transfer_us = np.array([20.0 + p[2] / 5e3 for p in BINARY_PATTERN])[index]
    jitter_us, compute_us = 30.0, 2000.0
    # the slot of call k: every rank issues it at slot[k] + its jitter (+ the straggler's delay)
    slot = np.cumsum(
        np.r_[
            compute_us,
            (transfer_us + jitter_us + straggler_delay_us + np.where(index == per_step - 1, compute_us, 0.0))[:-1],
        ]
    )
    perf0, unix0 = 10**12, 1_763_800_000 * 10**9
    os.makedirs(directory, exist_ok=True)
    paths = []
    for rank in range(world_size):
        rng = np.random.default_rng(seed * 100_003 + rank)
        groups = binary_groups(world_size, rank)
        gids = {kind: i for i, kind in enumerate(("world", "tp", "dp"))}
        gid = np.array([gids[k] for k in kinds], np.int16)[index]
        has_straggler = np.array([straggler is not None and straggler in groups[k][1] for k in kinds])[index]
        issue = slot + rng.uniform(0, jitter_us, n) + (straggler_delay_us if rank == straggler else 0.0)
        # p2p: both sides are issued at the slot; the pair ends after the transfer
        p2p = np.isin(op_code, [OP_CODE["send"], OP_CODE["recv"]])
        issue[p2p] = slot[p2p]
        latest = slot + jitter_us + np.where(has_straggler, straggler_delay_us, 0.0)
        end = np.where(p2p, slot, np.maximum(latest, issue)) + transfer_us
        data = np.zeros(n, dtype=row_dtype(np))
        data["seq"] = np.arange(n)
        data["op"], data["gid"], data["dtype"] = op_code, gid, dtype_code
        data["numel"] = numel
        if mismatch is not None and rank == mismatch[0]:
            data["numel"][mismatch[1]] *= 2
        data["start"] = perf0 + (issue * 1e3).astype(np.int64)
        data["end"] = perf0 + (end * 1e3).astype(np.int64)
        data["peer"] = np.where(p2p, rank ^ 1, -1)
        data["step"] = np.arange(n) // per_step
        data["where"] = 2  # phase backward, no module
        meta = [
            logfile.meta(
                "header",
                version=logfile.FORMAT_VERSION,
                schema=SCHEMA_VERSION,
                rank=rank,
                world_size=world_size,
                pid=10_000 + rank,
                ops=list(OP_NAMES),
                timings=list(TIMINGS),
                created_ns=unix0,
            )
        ]
        for kind in ("world", "tp", "dp"):
            name, members = groups[kind]
            meta.append(
                logfile.meta(
                    "group",
                    gid=gids[kind],
                    name=name,
                    size=len(members),
                    ranks=compact_ranks(members),
                    backend="nccl",
                    backends=["gloo", "nccl", "gloo"],
                )
            )
        meta.append(logfile.meta("clock", seq=0, offset=unix0 - perf0))
        meta += [logfile.meta("dtype", code=code, name=name, size=size) for name, (code, size) in _DTYPE_CODES.items()]
        if hang is not None:  # the last step's world all_reduce: nobody gets past it
            k = n - per_step + BINARY_PATTERN.index(("all_reduce", "world", 8, "float32"))
            issued_ns = int(data["start"][k]) + unix0 - perf0
            data = data[:k]
            if rank != hang:
                meta.append(
                    logfile.meta(
                        "inflight",
                        id=0,
                        seq=k,
                        below=k + 1,
                        op=int(op_code[k]),
                        gid=gids["world"],
                        peer=-1,
                        numel=int(numel[k]),
                        bytes=8,
                        start=issued_ns,
                        seen=issued_ns + 200_000_000,
                        thread="MainThread",
                        stack=["train.py:12 in <module>"],
                    )
                )
            meta.append(logfile.meta("alive", ns=issued_ns + int(HANG_S * 1e9)))
        raw = data.tobytes()
        chunk = ROW.size << 14
        body = [logfile.frame(logfile.ROWS, raw[i : i + chunk]) for i in range(0, len(raw), chunk)]
        path = os.path.join(directory, f"rank{rank}{logfile.SUFFIX}")
        with open(path, "wb") as f:
            f.write(logfile.MAGIC + b"".join(meta) + b"".join(body))
        paths.append(path)
    return paths
