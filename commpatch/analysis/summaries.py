"""Pure analysis: DataFrame -> DataFrame, vectorised, units in column names.

Nothing here prints or plots; renderers live in ``commpatch.render``.
Bandwidth follows nccl-tests: algbw = S / t and
busbw = algbw x factor(n), with n the size of the group actually used; t is the call's transfer
time (``transfer_us``, cross-rank: from the last rank's issue), else its own time (``own_us``: not
the time it waited behind earlier calls of its group), or its duration for logs that predate
``own_us``.
"""

from __future__ import annotations

import numpy as np

from ..data.frame import HOST_CLOCK_TIMINGS
from ..data.ops import BY_NAME, NO_BW, bus_factor
from ..data.schema import TIMINGS

# the timing names whose durations are on the host's clock, from issue (start_ns) to completion
HOST_CLOCK_NAMES = tuple(TIMINGS[t] for t in HOST_CLOCK_TIMINGS)


def durations(df, column: str = "duration_us") -> np.ndarray:
    """``duration_us`` (or another time column) as float64, impossible values (infinite,
    negative) as NaN: unmeasured.

    Every analysis reads durations through this, so that a damaged value never reaches a time
    or a bandwidth (``export.read`` already clears them, with a warning, for files).
    """
    d = df[column].to_numpy(np.float64)
    with np.errstate(invalid="ignore"):
        bad = np.isinf(d) | (d < 0)
    return np.where(bad, np.nan, d) if bad.any() else d


def own_durations(df) -> np.ndarray:
    """Each call's own time (``own_us``, never more than its duration); its duration where the own
    time is unknown (a log or a frame without ``own_us``); NaN where the duration is unknown."""
    duration = durations(df)
    if "own_us" not in df.columns:
        return duration
    own = durations(df, "own_us")
    return np.where(np.isnan(own), duration, np.minimum(own, duration))  # NaN where the duration is


def transfer_durations(df, own=None) -> np.ndarray:
    """Each call's arrival-free transfer time (``transfer_us``, from ``matching.with_transfer``:
    never more than its own time); its own time where that column is absent or unknown."""
    own = own_durations(df) if own is None else own
    if "transfer_us" not in df.columns:
        return own
    transfer = durations(df, "transfer_us")
    return np.where(np.isnan(transfer), own, np.fmin(transfer, own))


def add_bandwidth(df):
    """Return ``df`` with ``algbw_gbps`` and ``busbw_gbps`` from bytes, own_us and group_size."""
    import pandas as pd

    df = df.copy(deep=False)
    seconds = own_durations(df) / 1e6
    nbytes = df["bytes"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where((seconds > 0) & (nbytes > 0), nbytes / seconds / 1e9, np.nan)
    factor = np.full(len(df), np.nan)
    # per distinct op, not per row: categorical codes avoid converting 1M strings
    ops = df["op"] if isinstance(df["op"].dtype, pd.CategoricalDtype) else df["op"].astype("category")
    codes = ops.cat.codes.to_numpy()
    sizes = df["group_size"].to_numpy(np.float64)
    for code, name in enumerate(ops.cat.categories):
        target = BY_NAME.get(name)
        kind = target.bw if target is not None else NO_BW
        mask = codes == code
        factor[mask] = bus_factor(kind, sizes[mask])
    df["algbw_gbps"] = algbw
    df["busbw_gbps"] = algbw * factor
    return df


def size_bucket(nbytes):
    """Power-of-two bucket (the upper bound in bytes) for message sizes; 0 stays 0."""
    b = np.asarray(nbytes, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(b > 0, 2.0 ** np.ceil(np.log2(np.maximum(b, 1))), 0).astype(np.int64)


def summary(df, by=("collective",)):
    """Per group of ``by``: count, time, bytes, bandwidth and share of total communication time.

    ``by`` may include ``"size_bucket"`` (powers of two) besides any column of the log.
    Columns: the ``by`` keys, count, total_us, mean_us, p50_us, p95_us, max_us (issue to
    completion), own_us (the calls' own time summed: without waiting behind earlier calls of the
    group), transfer_us (their arrival-free transfer time summed: own time without the wait for
    ranks that issued the collective later, see ``matching.transfer_times``; the own time where the
    frame has no ``transfer_us`` column), bytes, unmeasured (calls without a duration), algbw_gbps,
    busbw_gbps (bandwidth of the transfer), busbw_with_wait_gbps (the per-rank figure: over own
    time, which counts each rank's wait for the last one), time_share.
    Bandwidth per group is measured bytes over time summed (time-weighted, as nccl-tests
    reports); busbw weights each call's bytes by its own bus factor, so a group mixing group
    sizes still uses each call's own n.
    """
    by = [by] if isinstance(by, str) else list(by)
    duration = durations(df)
    own = own_durations(df)
    transfer = transfer_durations(df, own)
    measured = ~np.isnan(own)
    nbytes = df["bytes"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = df["busbw_gbps"].to_numpy(np.float64) / df["algbw_gbps"].to_numpy(np.float64)
    work = {
        key: (
            size_bucket(df["bytes"])
            if key == "size_bucket"
            else df[key].to_numpy()
            if df[key].dtype.name != "category"
            else df[key]
        )
        for key in by
    }
    import pandas as pd

    work = pd.DataFrame(work, index=df.index)
    work["duration_us"] = duration
    work["own_us"] = own
    work["transfer_us"] = transfer
    work["bytes"] = df["bytes"].to_numpy()
    work["_unmeasured"] = (~measured).astype(np.int64)
    work["_mbytes"] = np.where(measured, nbytes, 0.0)
    work["_busbytes"] = np.where(measured & (factor > 0), nbytes * np.nan_to_num(factor), 0.0)
    grouped = work.groupby(by, observed=True, sort=True)
    out = grouped.agg(
        count=("bytes", "size"),
        total_us=("duration_us", "sum"),
        mean_us=("duration_us", "mean"),
        max_us=("duration_us", "max"),
        own_us=("own_us", "sum"),
        transfer_us=("transfer_us", "sum"),
        bytes=("bytes", "sum"),
        unmeasured=("_unmeasured", "sum"),
        _mbytes=("_mbytes", "sum"),
        _busbytes=("_busbytes", "sum"),
    )
    out.insert(3, "p50_us", grouped["duration_us"].quantile(0.5))
    out.insert(4, "p95_us", grouped["duration_us"].quantile(0.95))
    return finish_summary(out)


def finish_summary(out):
    """Bandwidth, time share and order of a summary from its per-group sums (``summary``'s
    columns, with _mbytes and _busbytes, indexed by the group keys); shared with the engine."""
    for name, column in (("", "transfer_us"), ("_with_wait", "own_us")):
        seconds = out[column].to_numpy() / 1e6
        with np.errstate(divide="ignore", invalid="ignore"):
            if not name:
                out["algbw_gbps"] = np.where(
                    (seconds > 0) & (out["_mbytes"] > 0), out["_mbytes"] / seconds / 1e9, np.nan
                )
            out[f"busbw{name}_gbps"] = np.where(
                (seconds > 0) & (out["_busbytes"] > 0), out["_busbytes"] / seconds / 1e9, np.nan
            )
    # a group none of whose calls has a duration (gloo's isend / irecv): its time is unknown, not 0
    unknown = (out["unmeasured"] >= out["count"]).to_numpy()
    if unknown.any():
        out.loc[unknown, ["total_us", "own_us", "transfer_us"]] = np.nan
    total = out["total_us"].sum()
    out["time_share"] = out["total_us"] / total if total > 0 else np.nan
    out = out.drop(columns=["_mbytes", "_busbytes"]).reset_index()
    return out.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)
