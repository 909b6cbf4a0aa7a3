"""Pure analysis: DataFrame -> DataFrame, vectorised, units in column names.

Nothing here prints or plots; renderers live in ``report.py``.
Bandwidth follows nccl-tests (DESIGN.md section 4): algbw = S / t and
busbw = algbw x factor(n), with n the size of the group actually used.
"""

from __future__ import annotations

import numpy as np

from ._targets import (ALLGATHER, ALLREDUCE, ALLTOALL, BY_NAME, NO_BW, ONE,
                       REDUCESCATTER, ROOTED_N)


def bus_factor(kind: str, n):
    """nccl-tests bus-bandwidth factor for a factor kind and group size(s) ``n``."""
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == ALLREDUCE:
            return 2.0 * (n - 1) / n
        if kind in (ALLGATHER, REDUCESCATTER, ALLTOALL, ROOTED_N):
            return (n - 1) / n
        if kind == ONE:
            return np.ones_like(n)
        if kind == NO_BW:
            return np.full_like(n, np.nan)
    raise ValueError(f"unknown bandwidth kind {kind!r}")


def add_bandwidth(df):
    """Return ``df`` with ``algbw_gbps`` and ``busbw_gbps`` from bytes, duration_us and group_size."""
    df = df.copy(deep=False)
    seconds = df["duration_us"].to_numpy(np.float64) / 1e6
    nbytes = df["bytes"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where((seconds > 0) & (nbytes > 0), nbytes / seconds / 1e9, np.nan)
    factor = np.full(len(df), np.nan)
    ops = df["op"].astype(str).to_numpy()
    sizes = df["group_size"].to_numpy(np.float64)
    for name in np.unique(ops):
        target = BY_NAME.get(name)
        kind = target.bw if target is not None else NO_BW
        mask = ops == name
        factor[mask] = bus_factor(kind, sizes[mask])
    df["algbw_gbps"] = algbw
    df["busbw_gbps"] = algbw * factor
    return df


def size_bucket(nbytes):
    """Power-of-two bucket (the upper bound in bytes) for message sizes; 0 stays 0."""
    b = np.asarray(nbytes, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(b > 0, 2.0 ** np.ceil(np.log2(np.maximum(b, 1))), 0).astype(np.int64)


def summary(df, by=("op",)):
    """Per group of ``by``: count, time, bytes, bandwidth and share of total communication time.

    ``by`` may include ``"size_bucket"`` (powers of two) besides any column of the log.
    Bandwidth per group is total bytes over total time (time-weighted), as nccl-tests reports.
    """
    import pandas as pd

    by = [by] if isinstance(by, str) else list(by)
    work = df.copy(deep=False)
    if "size_bucket" in by:
        work["size_bucket"] = size_bucket(work["bytes"])
    work["_factor"] = np.where(work["algbw_gbps"] > 0, work["busbw_gbps"] / work["algbw_gbps"], np.nan)
    grouped = work.groupby(by, observed=True, sort=True)
    out = grouped.agg(
        count=("seq", "size"),
        total_us=("duration_us", "sum"),
        mean_us=("duration_us", "mean"),
        p50_us=("duration_us", "median"),
        p95_us=("duration_us", lambda s: s.quantile(0.95)),
        max_us=("duration_us", "max"),
        bytes=("bytes", "sum"),
        unmeasured=("duration_us", lambda s: int(s.isna().sum())),
        _factor=("_factor", "mean"),
    )
    measured_bytes = grouped.apply(lambda g: g.loc[g["duration_us"].notna(), "bytes"].sum(), include_groups=False)
    seconds = out["total_us"] / 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        out["algbw_gbps"] = np.where((seconds > 0) & (measured_bytes > 0), measured_bytes / seconds / 1e9, np.nan)
    out["busbw_gbps"] = out["algbw_gbps"] * out["_factor"]
    total = out["total_us"].sum()
    out["time_share"] = out["total_us"] / total if total > 0 else np.nan
    out = out.drop(columns="_factor").reset_index()
    return out.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)
