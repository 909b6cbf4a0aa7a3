"""Pure analysis: DataFrame -> DataFrame, vectorised, units in column names.

Nothing here prints or plots; renderers live in ``commpatch.render``.
Bandwidth follows nccl-tests: algbw = S / t and
busbw = algbw x factor(n), with n the size of the group actually used.
"""

from __future__ import annotations

import numpy as np

from ..data.ops import BY_NAME, NO_BW, bus_factor


def durations(df) -> np.ndarray:
    """``duration_us`` as float64, impossible values (infinite, negative) as NaN: unmeasured.

    Every analysis reads durations through this, so that a damaged value never reaches a time
    or a bandwidth (``export.read`` already clears them, with a warning, for files).
    """
    d = df["duration_us"].to_numpy(np.float64)
    with np.errstate(invalid="ignore"):
        bad = np.isinf(d) | (d < 0)
    return np.where(bad, np.nan, d) if bad.any() else d


def add_bandwidth(df):
    """Return ``df`` with ``algbw_gbps`` and ``busbw_gbps`` from bytes, duration_us and group_size."""
    import pandas as pd

    df = df.copy(deep=False)
    seconds = durations(df) / 1e6
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
    Columns: the ``by`` keys, count, total_us, mean_us, p50_us, p95_us, max_us, bytes,
    unmeasured (calls without a duration), algbw_gbps, busbw_gbps, time_share.
    Bandwidth per group is measured bytes over total time (time-weighted, as nccl-tests
    reports); busbw weights each call's bytes by its own bus factor, so a group mixing group
    sizes still uses each call's own n.
    """
    by = [by] if isinstance(by, str) else list(by)
    duration = durations(df)
    measured = ~np.isnan(duration)
    nbytes = df["bytes"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = df["busbw_gbps"].to_numpy(np.float64) / df["algbw_gbps"].to_numpy(np.float64)
    work = {key: (size_bucket(df["bytes"]) if key == "size_bucket" else df[key].to_numpy()
                  if df[key].dtype.name != "category" else df[key]) for key in by}
    import pandas as pd

    work = pd.DataFrame(work, index=df.index)
    work["duration_us"] = duration
    work["bytes"] = df["bytes"].to_numpy()
    work["_unmeasured"] = (~measured).astype(np.int64)
    work["_mbytes"] = np.where(measured, nbytes, 0.0)
    work["_busbytes"] = np.where(measured & (factor > 0), nbytes * np.nan_to_num(factor), 0.0)
    grouped = work.groupby(by, observed=True, sort=True)
    out = grouped.agg(count=("bytes", "size"), total_us=("duration_us", "sum"), mean_us=("duration_us", "mean"),
                      max_us=("duration_us", "max"), bytes=("bytes", "sum"),
                      unmeasured=("_unmeasured", "sum"), _mbytes=("_mbytes", "sum"),
                      _busbytes=("_busbytes", "sum"))
    out.insert(3, "p50_us", grouped["duration_us"].quantile(0.5))
    out.insert(4, "p95_us", grouped["duration_us"].quantile(0.95))
    return finish_summary(out)


def finish_summary(out):
    """Bandwidth, time share and order of a summary from its per-group sums (``summary``'s
    columns, with _mbytes and _busbytes, indexed by the group keys); shared with the engine."""
    seconds = out["total_us"].to_numpy() / 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        out["algbw_gbps"] = np.where((seconds > 0) & (out["_mbytes"] > 0), out["_mbytes"] / seconds / 1e9, np.nan)
        out["busbw_gbps"] = np.where((seconds > 0) & (out["_busbytes"] > 0), out["_busbytes"] / seconds / 1e9, np.nan)
    total = out["total_us"].sum()
    out["time_share"] = out["total_us"] / total if total > 0 else np.nan
    out = out.drop(columns=["_mbytes", "_busbytes"]).reset_index()
    return out.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)


# ---- per step -------------------------------------------------------------------------
# Timing sources whose duration is time the calling thread was blocked in the call: that
# time cannot have overlapped the thread's own work. Every other source (future, cuda_event,
# nccl, wait, none) measures the communication itself; whether it overlapped compute is not
# in the log.
BLOCKING_TIMINGS = ("host",)


def per_step(df, steps=None, by_rank: bool = True):
    """Communication per training step (``commpatch.step()``), per rank or averaged over ranks.

    Columns (by_rank): rank, step, calls, bytes, comm_us (sum of durations), busy_us (union of
    the calls' [start, start + duration] intervals: concurrent calls counted once), exposed_us
    (durations of blocking calls: the thread waited, nothing overlapped), overlap_unknown_us
    (durations of async / device-timed calls: overlap with compute not measurable from the log),
    step_us, step_source, comm_share (busy_us / step_us), exposed_share (exposed_us / step_us).

    Step time comes from ``steps`` when given: a DataFrame with ``step`` (and optionally
    ``rank``) and either ``duration_us`` or ``start_ns`` and ``end_ns`` (step_source 'user').
    Otherwise it is the period between the first collective of a step and the first of the
    next step on the same rank (step_source 'log'; NaN for the last step, and where the next
    step has no collective). With ``by_rank=False``: one row per step, time columns averaged
    over ranks, plus max_comm_us and the rank with the most communication (max_rank).
    """
    import pandas as pd

    rank_all, step_all, start_all = df["rank"].to_numpy(), df["step"].to_numpy(), df["start_ns"].to_numpy()
    order = np.lexsort((start_all, step_all, rank_all))
    rank, step, start_ns = rank_all[order], step_all[order], start_all[order]
    start = (start_ns - (start_ns.min() if len(start_ns) else 0)).astype(np.float64) / 1e3
    dur = durations(df)[order]
    dur0 = np.nan_to_num(dur)
    end = start + dur0
    blocking = (df["timing"].isin(BLOCKING_TIMINGS) & ~df["async_op"]).to_numpy()[order]
    new_run = np.concatenate(([True], (rank[1:] != rank[:-1]) | (step[1:] != step[:-1]))) if len(rank) else \
        np.zeros(0, bool)
    first = np.flatnonzero(new_run)
    # union of intervals: each call adds what extends past the furthest end seen so far in its run

    furthest = pd.Series(end).groupby(np.cumsum(new_run)).cummax().to_numpy()
    previous = np.concatenate(([-np.inf], furthest[:-1]))
    previous[new_run] = -np.inf
    added = np.clip(end - np.maximum(start, previous), 0, None)

    def total(values):
        return np.add.reduceat(values, first) if len(first) else np.zeros(0)

    out = pd.DataFrame({
        "rank": rank[first], "step": step[first], "calls": np.diff(np.append(first, len(rank))),
        "bytes": total(df["bytes"].to_numpy()[order]),
        "comm_us": total(dur0), "busy_us": total(added),
        "exposed_us": total(np.where(blocking, dur0, 0.0)),
        "overlap_unknown_us": total(np.where(blocking, 0.0, dur0)),
        "first_ns": start_ns[first] - (start_ns.min() if len(start_ns) else 0)})   # small: exact as float
    out = _step_time(out, steps)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["comm_share"] = out["busy_us"] / out["step_us"]
        out["exposed_share"] = out["exposed_us"] / out["step_us"]
    out = out.drop(columns="first_ns")
    if by_rank:
        return out
    means = out.groupby("step").agg(
        ranks=("rank", "size"), calls=("calls", "mean"), bytes=("bytes", "mean"),
        comm_us=("comm_us", "mean"), max_comm_us=("comm_us", "max"), busy_us=("busy_us", "mean"),
        exposed_us=("exposed_us", "mean"), overlap_unknown_us=("overlap_unknown_us", "mean"),
        step_us=("step_us", "mean"), step_source=("step_source", "first"),
        comm_share=("comm_share", "mean"), exposed_share=("exposed_share", "mean"))
    means["max_rank"] = out.loc[out.groupby("step")["comm_us"].idxmax(), ["step", "rank"]].set_index("step")["rank"]
    return means.reset_index()


def _step_time(out, steps):
    """Add step_us and step_source to a per (rank, step) frame that has first_ns."""
    import pandas as pd

    if steps is not None:
        steps = pd.DataFrame(steps)
        if "duration_us" not in steps:
            steps = steps.assign(duration_us=(steps["end_ns"] - steps["start_ns"]) / 1e3)
        keys = ["rank", "step"] if "rank" in steps else ["step"]
        times = steps.groupby(keys)["duration_us"].sum().rename("step_us")
        out = out.join(times, on=keys)
        out["step_source"] = np.where(out["step_us"].notna(), "user", "none")
        return out
    nxt = out.groupby("rank")["first_ns"].shift(-1)
    consecutive = out.groupby("rank")["step"].shift(-1) == out["step"] + 1
    out["step_us"] = ((nxt - out["first_ns"]) / 1e3).where(consecutive)
    out["step_source"] = np.where(out["step_us"].notna(), "log", "none")
    return out


# ---- scaling --------------------------------------------------------------------------
def scaling(runs):
    """Compare runs of the same job at several world sizes: one row per run.

    ``runs`` maps a label (e.g. the run directory) to that run's log. Columns: run, world_size,
    ranks, steps, calls_per_step, comm_per_step_us, step_us, comm_share, exposed_share,
    busbw_gbps (over all calls with a bus factor). Per-step figures are means over ranks and
    steps (see ``per_step``). Sorted by world size.
    """
    import pandas as pd

    rows = []
    for label, df in runs.items():
        ps = per_step(df)
        bw = summary(df.assign(_all="all"), by="_all")
        rows.append(dict(run=str(label), world_size=int(df["world_size"].max()), ranks=int(df["rank"].nunique()),
                         steps=int(ps["step"].nunique()), calls_per_step=ps["calls"].mean(),
                         comm_per_step_us=ps["comm_us"].mean(), step_us=ps["step_us"].mean(),
                         comm_share=ps["comm_share"].mean(), exposed_share=ps["exposed_share"].mean(),
                         busbw_gbps=bw["busbw_gbps"].iloc[0] if len(bw) else np.nan))
    out = pd.DataFrame(rows)
    return out.sort_values(["world_size", "run"], kind="stable").reset_index(drop=True) if len(out) else out


def scaling_by_op(runs):
    """Per run and op: world_size, count, total_us and busbw_gbps (for busbw against world size)."""
    import pandas as pd

    frames = []
    for label, df in runs.items():
        s = summary(df, by="op")[["op", "count", "total_us", "busbw_gbps"]]
        s.insert(0, "world_size", int(df["world_size"].max()))
        s.insert(0, "run", str(label))
        frames.append(s)
    if not frames:
        return pd.DataFrame(columns=["run", "world_size", "op", "count", "total_us", "busbw_gbps"])
    out = pd.concat(frames, ignore_index=True)
    out["op"] = out["op"].astype(str)
    return out.sort_values(["op", "world_size", "run"], kind="stable").reset_index(drop=True)
