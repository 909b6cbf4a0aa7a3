"""Steps, set-up and steady state, overhead and overlap, scaling across world sizes.

Definitions (per rank and step; a step is what the ``step`` column counts: optimizer steps, DDP /
FSDP root forwards or the user's ``commpatch.step()``, see ``step_source``; on a rank with none of
them, the iterations of its repeating pattern of calls, numbered by ``pattern.with_pattern_steps``,
which ``per_step`` and ``scaling`` apply first):

- ``comm_us``: sum of the calls' measured durations.
- ``busy_us``: wall time with communication under way: the union of the calls' windows [start,
  start + duration], where a DDP bucket's window runs on to the end of the reducer's finalize
  noted on it (``sync_end_us``, see ``ddp_finalize_us``); plus DDP's packing with none of its
  buckets in flight (``pack_alone_us``, see ``ddp_pack_us``).
- ``exposed_us``: wall time the training thread spent on communication or waited for it, union of
  - calls timed ``host`` (blocking calls; async ones torch waited for inside the call): the thread
    was inside the call throughout;
  - functional collectives (DTensor, tensor parallel, compiled graphs) whose ``wait_tensor`` was
    seen: the time the thread spent in that wait (``wait_us``), which ends at the call's completion;
  - DDP's gradient buckets (async, timed by their future): the thread waits for them at the end
    of backward, from the issue of the last bucket (the backward's compute is over then) to the
    end of the reducer's finalize where it is measured (``sync_end_us``), else to the completion
    of the last bucket. The buckets' time before that ran under the backward: overlapped;
  - DDP's packing (``ddp_pack_us``): the training thread's own time, before each bucket's issue.
- ``ddp_finalize_us``: DDP's synchronisation after its communication: the end of the reducer's
  finalize minus the completion of the step's last bucket all-reduce (0 where not measured). The
  finalize waits for every bucket, then copies the averaged gradients from the buckets into
  ``.grad``; commpatch times its end once per backward (an autograd-engine callback queued after
  it, CPU buckets only: on an accelerator the host only enqueues the copies). Counted in busy_us
  and exposed_us.
- ``ddp_pack_us``: DDP's packing of the gradients into its buckets during the backward, on the
  training thread: per parameter, from the accumulation of its gradient to the end of the
  reducer's hook on it (which copies it into its bucket view) or to the issue of the bucket it
  completes (``pack_us`` on the bucket rows; CPU models). Counted in exposed_us, and in busy_us
  for the part with none of the model's buckets in flight. Not measured: DDP's forward
  bookkeeping (prepare_for_forward / prepare_for_backward).
- ``overlapped_us``: busy time of those calls that is not exposed (hidden behind compute).
- ``overlap_unknown_us``: durations of the other async / device-timed calls (a user's
  ``async_op=True`` call and its ``Work.wait()``, a functional collective whose wait was not seen,
  CUDA): the log does not say when the thread waited for them, so they are neither exposed nor
  overlapped.
- ``step_us``: from the first call of the step to the first call of the next step on the same
  rank (``step_time_from`` 'log'), or the user's step times ('user').
- ``comm_share`` = busy_us / step_us; ``exposed_share`` = exposed_us / step_us: the overhead, the
  fraction of the step that would go if communication were free.

Stages: step 0 is ``setup`` (process group creation, DDP construction and its parameter check and
broadcast, the first iteration) when the log has later steps, and so are the steps before a rank's
first step counted by its final step source (gradient accumulation: the first iteration's forwards
were counted before its optimizer.step() was seen); the steps after it with a known step
time are ``steady``; the last step has no next one to time it (``end``: tear-down, a partial
step). DDP's bucket rebuild (before the second forward) is a set-up call wherever it falls.
"""

from __future__ import annotations

import numpy as np

from .arrays import in_order, lexsort, running_max
from .matching import with_transfer
from .pattern import with_pattern_steps
from .summaries import durations, size_bucket, summary

# Timing sources whose duration is time the calling thread was blocked in the call.
BLOCKING_TIMINGS = ("host",)
# One-time calls of set-up, wherever they fall (DDP's constructor and its first-iteration rebuild).
SETUP_OPS = ("ddp_verify_params", "ddp_broadcast_coalesced", "ddp_rebuild_buckets")
STAGES = ("setup", "steady", "end")


def _union(groups, start, end, n):
    """Per group (ints 0..n-1): the length of the union of the intervals [start, end]."""
    if len(groups) == 0:
        return np.zeros(n)
    g, s, e = groups, start, end
    if not in_order((start, groups)):  # the step table's rows are, mostly: no copies then
        order = np.lexsort((start, groups))
        g, s, e = groups[order], start[order], end[order]
    new = np.r_[True, g[1:] != g[:-1]]
    furthest = running_max(e, g)
    previous = np.r_[-np.inf, furthest[:-1]]
    previous[new] = -np.inf
    return np.bincount(g, weights=np.clip(e - np.maximum(s, previous), 0, None), minlength=n)


def _nan0(values):
    """``values`` (float64, finite or NaN) with NaN as 0: ``np.nan_to_num`` without its passes for
    infinities (a third of the time on a step table's 550,000 rows)."""
    nan = np.isnan(values)
    return np.where(nan, 0.0, values) if nan.any() else values


def _bucket_mask(df):
    """DDP gradient-bucket calls that the training thread waits for at the end of backward."""
    if "bucket" in df.columns:
        bucket = df["bucket"].to_numpy() >= 0
    else:
        bucket = (df["op"] == "ddp_bucket_allreduce").to_numpy()
    return bucket & df["async_op"].to_numpy(bool)


def per_step(df, steps=None, by_rank: bool = True):
    """Communication per step, per rank (or, with ``by_rank=False``, averaged over ranks).

    Columns (by_rank): rank, step, stage, step_source, calls, unmeasured (calls without a duration:
    a step of such calls only has its communication columns NaN, unknown), bytes, comm_us, busy_us, exposed_us,
    overlapped_us, overlap_unknown_us, setup_comm_us (set-up calls in the step), ddp_finalize_us,
    ddp_pack_us, step_us, step_time_from, comm_share, exposed_share (definitions in the module docstring).

    Step time comes from ``steps`` when given: a DataFrame with ``step`` (and optionally
    ``rank``) and either ``duration_us`` or ``start_ns`` and ``end_ns`` ('user'); otherwise from
    the log ('log'; NaN for the last step and where the next step has no call). With
    ``by_rank=False``: one row per step, time columns averaged over ranks, plus ranks,
    max_comm_us and the rank with the most communication (max_rank).
    """
    import pandas as pd

    df = with_pattern_steps(df)
    rank_all, step_all, start_all = df["rank"].to_numpy(), df["step"].to_numpy(), df["start_ns"].to_numpy()
    order = lexsort((start_all, step_all, rank_all))
    rank, step, start_ns = rank_all[order], step_all[order], start_all[order]
    t0 = start_ns.min() if len(start_ns) else 0
    start = (start_ns - t0).astype(np.float64) / 1e3
    dur = durations(df)[order]
    unknown_dur = np.isnan(dur)
    dur0 = _nan0(dur)
    end = start + dur0
    # the thread was inside the call throughout (an async call timed on the host: torch waited in it)
    blocking = df["timing"].isin(BLOCKING_TIMINGS).to_numpy()[order]
    bucket = _bucket_mask(df)[order]
    # DDP's synchronisation on the training thread: a bucket's window runs on to the end of the
    # reducer's finalize noted on it (the last bucket of a backward), when that is later
    sync_end = (
        df["sync_end_us"].to_numpy(np.float64)[order] if "sync_end_us" in df.columns else np.full(len(rank), np.nan)
    )
    synced = bucket & ~np.isnan(sync_end)
    end_sync = np.where(synced, np.fmax(end, start + _nan0(sync_end)), end)

    def noted(name):
        return _nan0(df[name].to_numpy(np.float64)[order]) if name in df.columns else np.zeros(len(rank))

    pack, pack_alone = noted("pack_us"), noted("pack_alone_us")
    # a functional collective's wait_tensor: the thread waited from (completion - wait_us) to completion
    wait = df["wait_us"].to_numpy(np.float64)[order] if "wait_us" in df.columns else np.full(len(rank), np.nan)
    waited = ~np.isnan(wait) & ~blocking & ~bucket
    wait_lo = end - np.clip(_nan0(wait), 0, dur0)
    setup_op = df["op"].isin(SETUP_OPS).to_numpy()[order]
    new_run = np.r_[True, (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])] if len(rank) else np.zeros(0, bool)
    first = np.flatnonzero(new_run)
    gid = np.cumsum(new_run) - 1
    n = len(first)

    # the exposed windows: blocking calls, and per step the tail of its DDP buckets
    tail_lo = np.full(n, np.inf)
    tail_hi = np.full(n, -np.inf)
    np.maximum.at(tail_hi, gid[bucket], end_sync[bucket])
    comm_hi = np.full(n, -np.inf)  # the completion of the step's last bucket
    np.maximum.at(comm_hi, gid[bucket], end[bucket])
    lo = np.full(n, -np.inf)
    np.maximum.at(lo, gid[bucket], start[bucket])
    has_tail = np.isfinite(lo)
    tail_lo[has_tail] = lo[has_tail]
    tails = np.flatnonzero(has_tail)
    wg = np.r_[gid[blocking], gid[waited], tails]

    def total(values):
        return np.add.reduceat(values, first) if n else np.zeros(0)

    # packing: the training thread's own time, disjoint from its other exposed windows (it ends at a
    # bucket's issue); in flight under a bucket's window for the part that is not alone
    packed, alone = total(pack), total(pack_alone)
    exposed = (
        _union(
            wg,
            np.r_[start[blocking], wait_lo[waited], tail_lo[tails]],
            np.r_[end[blocking], end[waited], tail_hi[tails]],
            n,
        )
        + packed
    )
    known = blocking | bucket | waited
    known_busy = _union(gid[known], start[known], end_sync[known], n) + alone

    unmeasured = total(unknown_dur.astype(np.float64))
    out = pd.DataFrame(
        {
            "rank": rank[first],
            "step": step[first],
            "step_source": _step_source(df.get("step_source"), order, gid, n),
            "calls": np.diff(np.append(first, len(rank))),
            "unmeasured": unmeasured,
            "bytes": total(df["bytes"].to_numpy()[order]),
            "comm_us": total(dur0),
            "busy_us": _union(gid, start, end_sync, n) + alone,
            "exposed_us": exposed,
            "overlapped_us": np.clip(known_busy - exposed, 0, None),
            "overlap_unknown_us": total(np.where(known, 0.0, dur0)),
            "setup_comm_us": total(np.where(setup_op, dur0, 0.0)),
            "ddp_finalize_us": _finalize(tail_hi, comm_hi, has_tail),
            "ddp_pack_us": packed,
            "first_ns": start_ns[first] - t0,
        }
    )  # small: exact as float
    # a step none of whose calls has a duration (gloo's isend / irecv): its communication is unknown, not 0
    unknown = (out["unmeasured"] >= out["calls"]).to_numpy()
    out.loc[unknown, ["comm_us", "busy_us", "exposed_us", "overlapped_us", "overlap_unknown_us"]] = np.nan
    out = _step_time(out, steps)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["comm_share"] = out["busy_us"] / out["step_us"]
        out["exposed_share"] = out["exposed_us"] / out["step_us"]
    out = out.drop(columns="first_ns")
    multi = out["step"].nunique() > 1
    stage = np.where(out["step_us"].notna(), "steady", "end")
    stage[(out["step"] == out["step"].min()).to_numpy() & multi] = "setup"
    stage[_before_final_source(out) & multi] = "setup"
    out.insert(2, "stage", stage)
    if by_rank:
        return out
    means = out.groupby("step").agg(
        stage=("stage", "first"),
        step_source=("step_source", "first"),
        ranks=("rank", "size"),
        calls=("calls", "mean"),
        unmeasured=("unmeasured", "mean"),
        bytes=("bytes", "mean"),
        comm_us=("comm_us", "mean"),
        max_comm_us=("comm_us", "max"),
        busy_us=("busy_us", "mean"),
        exposed_us=("exposed_us", "mean"),
        overlapped_us=("overlapped_us", "mean"),
        overlap_unknown_us=("overlap_unknown_us", "mean"),
        setup_comm_us=("setup_comm_us", "mean"),
        ddp_finalize_us=("ddp_finalize_us", "mean"),
        ddp_pack_us=("ddp_pack_us", "mean"),
        step_us=("step_us", "mean"),
        step_time_from=("step_time_from", "first"),
        comm_share=("comm_share", "mean"),
        exposed_share=("exposed_share", "mean"),
    )
    most = out["comm_us"].fillna(-np.inf).groupby(out["step"]).idxmax()  # unknown: the first rank
    means["max_rank"] = out.loc[most, ["step", "rank"]].set_index("step")["rank"]
    return means.reset_index()


def _before_final_source(out) -> np.ndarray:
    """Per (rank, step) row of ``out`` (sorted by rank, step): the step comes before the rank's first
    step counted by its final step source. Those steps are set-up: an iteration whose forwards were
    counted before its first optimizer.step() was seen (gradient accumulation: two forwards, one
    optimizer step) is one half-counted iteration, not steps of the steady state."""
    source = out["step_source"].astype(str).to_numpy()
    rank = out["rank"].to_numpy()
    before = np.zeros(len(out), bool)
    if not len(out):
        return before
    bounds = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        final = np.flatnonzero(source[lo:hi] == source[hi - 1])
        before[lo : lo + final[0]] = True
    return before


def _finalize(tail_hi, comm_hi, has_tail):
    """Per step: how long DDP's finalize ran on after the step's last bucket all-reduce completed."""
    out = np.zeros(len(has_tail))
    out[has_tail] = tail_hi[has_tail] - comm_hi[has_tail]
    return out


def _step_source(column, order, gid, n):
    """Per step: what counted it (the value of its last row, ``column`` in ``order``: a step opens
    before its source is known); "" without the column. Only those rows are converted to text."""
    out = np.full(n, "", dtype=object)
    if len(gid) and column is not None:
        last = np.r_[gid[1:] != gid[:-1], True]
        out[gid[last]] = column.iloc[order[last]].astype(str).to_numpy()
    return out


def _step_time(out, steps):
    """Add step_us and step_time_from to a per (rank, step) frame that has first_ns."""
    import pandas as pd

    if steps is not None:
        steps = pd.DataFrame(steps)
        if "duration_us" not in steps:
            steps = steps.assign(duration_us=(steps["end_ns"] - steps["start_ns"]) / 1e3)
        keys = ["rank", "step"] if "rank" in steps else ["step"]
        times = steps.groupby(keys)["duration_us"].sum().rename("step_us")
        out = out.join(times, on=keys)
        out["step_time_from"] = np.where(out["step_us"].notna(), "user", "none")
        return out
    nxt = out.groupby("rank")["first_ns"].shift(-1)
    consecutive = out.groupby("rank")["step"].shift(-1) == out["step"] + 1
    out["step_us"] = ((nxt - out["first_ns"]) / 1e3).where(consecutive)
    out["step_time_from"] = np.where(out["step_us"].notna(), "log", "none")
    return out


def steady_state(steps_table) -> dict:
    """Figures of the steady state from ``per_step`` (either form): steps, the median, p95 and
    mean step time, and medians of the per-step communication figures and shares."""
    steady = steps_table[steps_table["stage"] == "steady"]
    if "ranks" not in steps_table.columns and len(steady):  # per rank: the mean over ranks per step
        steady = steady.groupby("step").mean(numeric_only=True)
    t = steady["step_us"].to_numpy(np.float64)

    def median(col):
        return float(np.nanmedian(steady[col])) if len(steady) and steady[col].notna().any() else float("nan")

    return dict(
        steps=int(len(steady)),
        step_p50_us=median("step_us"),
        step_p95_us=float(np.nanpercentile(t, 95)) if len(t) else float("nan"),
        step_mean_us=float(np.nanmean(t)) if len(t) else float("nan"),
        calls=median("calls"),
        unmeasured=median("unmeasured"),
        comm_us=median("comm_us"),
        busy_us=median("busy_us"),
        exposed_us=median("exposed_us"),
        overlap_unknown_us=median("overlap_unknown_us"),
        ddp_finalize_us=median("ddp_finalize_us"),
        ddp_pack_us=median("ddp_pack_us"),
        comm_share=median("comm_share"),
        exposed_share=median("exposed_share"),
    )


def setup_cost(df, steps_table) -> dict:
    """Set-up (see the module docstring), from the log and its ``per_step(by_rank=False)``:
    setup_us (the time of its set-up steps, mean over ranks), setup_comm_us (its communication plus set-up calls
    in later steps, per rank), comm_total_us (all communication per rank), by_op (set-up
    communication per op, per rank) and unmeasured (some call of the log has no duration)."""
    ranks = max(int(df["rank"].nunique()), 1)
    mask = df["op"].isin(SETUP_OPS).to_numpy() | df["step"].isin(setup_steps(steps_table)).to_numpy()
    dur = np.nan_to_num(durations(df))
    by_op = df.loc[mask, ["op"]].assign(us=dur[mask]).groupby("op", observed=True)["us"].sum()
    return setup_from(steps_table, by_op, float(dur.sum()), ranks, bool(df["duration_us"].isna().any()))


def setup_steps(steps_table) -> list:
    """The set-up steps of a ``per_step(by_rank=False)`` table."""
    return steps_table.loc[steps_table["stage"] == "setup", "step"].tolist()


def setup_from(steps_table, by_op, comm_us: float, ranks: int, unmeasured: bool) -> dict:
    """``setup_cost`` from the sums over every rank (the engine computes them in SQL): ``by_op``
    the set-up communication per op (set-up calls and calls of set-up steps), ``comm_us`` all
    communication, ``ranks`` the ranks of the log."""
    setup = steps_table[steps_table["stage"] == "setup"]
    later = steps_table[steps_table["stage"] != "setup"]
    ranks = max(ranks, 1)
    by_op = (by_op.astype(np.float64) / ranks).sort_values(ascending=False, kind="stable")
    return dict(
        setup_us=float(setup["step_us"].sum(min_count=1)) if len(setup) else float("nan"),
        setup_comm_us=float(by_op.sum()),
        comm_total_us=float(comm_us / ranks),
        later_setup_comm_us=float(later["setup_comm_us"].sum()),
        by_op=by_op,
        unmeasured=unmeasured,
    )


def steady_rows(df, steps_table):
    """The log's rows of steady-state steps, set-up calls left out."""
    steady = set(steps_table.loc[steps_table["stage"] == "steady", "step"].tolist())
    return df[df["step"].isin(steady).to_numpy() & ~df["op"].isin(SETUP_OPS).to_numpy()]


# ---- scaling --------------------------------------------------------------------------
SCALING_MODES = ("weak", "strong")


def scaling(runs, mode: str = "weak", global_batch: float | None = None):
    """Compare runs of one job at several world sizes: one row per run, sorted by world size.

    ``runs`` maps a label (e.g. the run directory) to that run's log. Steady-state figures
    (``steady_state``): step_us (median), step_p95_us, comm_share, exposed_share, comm_per_step_us,
    calls_per_step (per rank), busbw_gbps (steady-state calls with a bus factor); steps_per_s;
    samples_per_s when ``global_batch`` is given. ``mode`` 'weak' (the same batch per rank:
    ``global_batch`` is the global batch of the smallest run, growing with the world size):
    efficiency = T(N0) / T(N), speedup = efficiency x N / N0 (throughput ratio); 'strong' (the
    same global batch at every size): speedup = T(N0) / T(N), efficiency = speedup / (N / N0).
    N0 is the smallest world size compared.
    """
    import pandas as pd

    if mode not in SCALING_MODES:
        raise ValueError(f"scaling mode {mode!r}: choose weak or strong")
    rows = []
    for label, df in runs.items():
        df = _with_transfer(with_pattern_steps(df))
        ps = per_step(df, by_rank=False)
        st = steady_state(ps)
        bw = summary(steady_rows(df, ps).assign(_all="all"), by="_all")
        rows.append(
            dict(
                run=str(label),
                world_size=int(df["world_size"].max()),
                ranks=int(df["rank"].nunique()),
                steps=st["steps"],
                step_us=st["step_p50_us"],
                step_p95_us=st["step_p95_us"],
                calls_per_step=st["calls"],
                comm_per_step_us=st["busy_us"],
                comm_share=st["comm_share"],
                exposed_share=st["exposed_share"],
                busbw_gbps=bw["busbw_gbps"].iloc[0] if len(bw) else np.nan,
            )
        )
    out = pd.DataFrame(rows)
    if not len(out):
        return out
    out = out.sort_values(["world_size", "run"], kind="stable").reset_index(drop=True)
    n0, t0 = out["world_size"].iloc[0], out["step_us"].iloc[0]
    ratio = out["world_size"] / n0
    out["steps_per_s"] = 1e6 / out["step_us"]
    if global_batch is not None:
        batch = global_batch * (ratio if mode == "weak" else 1.0)
        out["samples_per_s"] = batch * out["steps_per_s"]
    if mode == "weak":
        out["efficiency"] = t0 / out["step_us"]
        out["speedup"] = out["efficiency"] * ratio
    else:
        out["speedup"] = t0 / out["step_us"]
        out["efficiency"] = out["speedup"] / ratio
    return out


def _with_transfer(df):
    """A run's log with its arrival-free transfer times when it holds several ranks (bandwidth)."""
    return with_transfer(df) if df["rank"].nunique() > 1 else df


def scaling_by_op(runs):
    """Per run, collective and message size, over the steady state: world_size, calls_per_rank,
    p50_us and busbw_gbps (busbw against world size)."""
    import pandas as pd

    frames = []
    for label, df in runs.items():
        df = _with_transfer(with_pattern_steps(df))
        rows = steady_rows(df, per_step(df, by_rank=False))
        if not len(rows):
            continue
        s = summary(rows, by=["collective", "size_bucket"])
        s["calls_per_rank"] = s["count"] / max(int(df["rank"].nunique()), 1)
        s = s[["collective", "size_bucket", "calls_per_rank", "p50_us", "busbw_gbps"]]
        s.insert(0, "world_size", int(df["world_size"].max()))
        s.insert(0, "run", str(label))
        frames.append(s)
    if not frames:
        return pd.DataFrame(
            columns=["run", "world_size", "collective", "size_bucket", "calls_per_rank", "p50_us", "busbw_gbps"]
        )
    out = pd.concat(frames, ignore_index=True)
    out["collective"] = out["collective"].astype(str)
    return out.sort_values(["collective", "size_bucket", "world_size", "run"], kind="stable").reset_index(drop=True)


__all__ = [
    "BLOCKING_TIMINGS",
    "SCALING_MODES",
    "SETUP_OPS",
    "STAGES",
    "per_step",
    "scaling",
    "scaling_by_op",
    "setup_cost",
    "size_bucket",
    "steady_rows",
    "steady_state",
]
