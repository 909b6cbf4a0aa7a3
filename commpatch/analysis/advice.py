"""Tuning advice: what to change in the job, from the measured log, each item with its evidence.

``advice(df, steps_table, cross)`` returns a list of ``Advice``, one per rule that fires. Each rule is
a small pure function over the log's rows and the analysis tables (``steps.per_step``,
``stragglers.verdict``); its thresholds are the named constants below; it gives nothing when the
evidence is weak (too few steady-state steps, a gain too small to tell from the machine's noise, a
latency that cannot be fitted). Rules:

- ``ddp_bucket_size``: DDP's last gradient bucket is large and its all-reduce, which starts only when
  the backward is over, is a large exposed tail: a smaller ``bucket_cap_mb`` splits it, so most of
  it runs under the backward.
- ``ddp_grad_copy``: DDP's finalize (its copy of the averaged gradients from the buckets into
  ``.grad``) takes a share of the step: ``gradient_as_bucket_view=True`` makes ``.grad`` a view of
  the bucket, and the copy goes.
- ``small_messages``: many calls per step on one group below the latency-bound size (where a call's
  fixed latency equals its transfer time, fitted from the group's own calls): coalesce them.
- ``straggler``: one rank late in most steady-state steps by a steady amount (the straggler
  verdict): its own compute or data loading, not the network; with its step-time breakdown.

Pure: DataFrames in, a list of ``Advice`` out (renderers word and lay them out).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from . import stragglers
from .steps import _bucket_mask, per_step, steady_rows, steady_state
from .summaries import size_bucket, transfer_durations

# evidence: at least this many steady-state steps
MIN_STEPS = 5
# a change is advised only when its expected gain is at least this share of the median step ...
MIN_GAIN_SHARE = 0.05
# ... and at least this much per step (a loaded machine's noise on a step is of this order)
MIN_GAIN_US = 500.0

# ddp_bucket_size: the exposed tail after the last bucket's issue is at least this share of the step,
BUCKET_TAIL_SHARE = 0.10
# the advised cap splits the step's gradients into about this many buckets,
TARGET_BUCKETS = 4
# never below this (MiB; DDP's own first bucket is 1 MiB: below it per-call latency starts to count),
MIN_BUCKET_MB = 1.0
# and the last bucket is at least this many times the advised cap (else splitting it gains little).
LAST_BUCKET_FACTOR = 2.0
# The backward's length is in the log only as the span of the buckets' issues (nothing with one
# bucket): it is taken as at least this share of the step's time outside exposed communication
# (a backward costs about twice its forward), to check that the other buckets' all-reduce fits under it.
BACKWARD_SHARE = 0.5
MIB = float(1 << 20)

# ddp_grad_copy: DDP's finalize is at least this share of the step
GRAD_COPY_SHARE = 0.03

# small_messages: at least this many calls per step below the latency-bound size on one group,
MIN_SMALL_CALLS = 8
# the latency fitted from at least this many message sizes (powers of two), each of this many calls,
MIN_SIZES = 2
MIN_CALLS_PER_SIZE = 3
# spanning at least this ratio of sizes.
MIN_SIZE_SPAN = 16.0


@dataclass
class Advice:
    """One item of advice. ``rule``: the rule's name (stable); ``title``: one line; ``evidence``: the
    measurements behind it, name -> number (units in the names: _us, _bytes, _share, _mib); ``change``:
    the exact argument or code to change; ``setting``: the same, machine-readable (argument -> value;
    {} when the change is code); ``gain_us``: expected gain per step (an upper estimate: NaN when
    unknown), ``gain_share``: of the median steady-state step; ``text``: why, in a sentence or two;
    ``section``: the report table behind it."""

    rule: str
    title: str
    evidence: dict
    change: str
    setting: dict = field(default_factory=dict)
    gain_us: float = math.nan
    gain_share: float = math.nan
    text: str = ""
    section: str = "steps"

    def as_dict(self) -> dict:
        """A plain dict for JSON (NaN as None)."""

        def clean(value):
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, (float, np.floating)):
                return None if math.isnan(value) else float(value)
            if isinstance(value, np.integer):
                return int(value)
            return value

        return clean(asdict(self))


KEYS = tuple(Advice.__dataclass_fields__)


def advice(df, steps_table, cross=None, by_rank=None) -> list:
    """Every rule's advice for one run's log (``df`` with its pattern steps, as ``build_report`` has
    it; ``steps_table``: ``per_step(df, by_rank=False)``; ``cross``: ``matching.cross_rank(df)`` or
    None). ``df`` None (the report at scale): the straggler rule only, from ``by_rank`` (the
    engine's ``per_step(by_rank=True)``); the other rules read the rows (``ROW_RULES``)."""
    if df is None and by_rank is None or df is not None and not len(df):
        return []
    st = steady_state(steps_table)
    if st["steps"] < MIN_STEPS or not st["step_p50_us"] > 0:
        return []
    out = []
    if df is not None:
        for rule in (ddp_bucket_size, ddp_grad_copy, small_messages):
            out += rule(df, steps_table, st)
    out += straggler(df, steps_table, st, cross, by_rank)
    return out


ROW_RULES = ("ddp_bucket_size", "ddp_grad_copy", "small_messages")  # the rules that read every row


# ---- DDP ------------------------------------------------------------------------------------------
def bucket_steps(df, steps_table):
    """Per steady-state (rank, step) with DDP gradient buckets: buckets, bucket_bytes, last_bytes and
    last_params (the bucket issued last: the end of the backward), issue_span_us (first to last issue),
    tail_us (the last issue to the end of DDP's finalize, else of the last all-reduce: exposed),
    comm_us (the buckets' arrival-free transfer time summed), finalize_us (the end of the finalize
    after the last all-reduce's completion)."""
    import pandas as pd

    rows = steady_rows(df, steps_table)
    mask = _bucket_mask(rows)
    b = rows[mask]
    if not len(b):
        return pd.DataFrame(
            columns=[
                "rank",
                "step",
                "buckets",
                "bucket_bytes",
                "last_bytes",
                "last_params",
                "issue_span_us",
                "tail_us",
                "comm_us",
                "finalize_us",
            ]
        )
    start_ns = b["start_ns"].to_numpy(np.int64)
    start = (start_ns - start_ns.min()).astype(np.float64) / 1e3  # us: exact enough as float
    dur = np.nan_to_num(b["duration_us"].to_numpy(np.float64))
    sync = b["sync_end_us"].to_numpy(np.float64) if "sync_end_us" in b.columns else np.full(len(b), np.nan)
    work = pd.DataFrame(
        {
            "rank": b["rank"].to_numpy(),
            "step": b["step"].to_numpy(),
            "start": start,
            "end": start + dur,
            "sync_end": start + np.nan_to_num(sync, nan=-np.inf),
            "bytes": b["bytes"].to_numpy(np.float64),
            "params": b["bucket_params"].to_numpy() if "bucket_params" in b.columns else 0,
            "comm": np.nan_to_num(transfer_durations(b)),
        }
    )
    work = work.sort_values(["rank", "step", "start"], kind="stable")
    g = work.groupby(["rank", "step"], sort=True)
    last = g.tail(1).set_index(["rank", "step"])
    out = g.agg(
        buckets=("bytes", "size"),
        bucket_bytes=("bytes", "sum"),
        first=("start", "min"),
        end=("end", "max"),
        sync_end=("sync_end", "max"),
        comm_us=("comm", "sum"),
    )
    finish = np.fmax(out["end"], out["sync_end"])
    out["last_bytes"] = last["bytes"]
    out["last_params"] = last["params"]
    out["issue_span_us"] = last["start"] - out["first"]
    out["tail_us"] = finish - last["start"]
    out["finalize_us"] = np.clip(finish - out["end"], 0, None)
    return out.drop(columns=["first", "end", "sync_end"]).reset_index()


def _step_times(steps_table):
    """step_us per steady (rank, step): the per-step table's mean over ranks (by_rank=False) or its own."""
    cols = (
        ["rank", "step", "step_us", "exposed_us"]
        if "rank" in steps_table.columns
        else ["step", "step_us", "exposed_us"]
    )
    return steps_table.loc[steps_table["stage"] == "steady", cols]


def ddp_bucket_size(df, steps_table, st) -> list:
    """A smaller ``bucket_cap_mb`` when the exposed tail is the all-reduce of one large last bucket."""
    bs = bucket_steps(df, steps_table)
    if bs["step"].nunique() < MIN_STEPS:
        return []
    bs = bs.merge(_step_times(steps_table), on=[c for c in ("rank", "step") if c in steps_table.columns])
    step_us = float(np.nanmedian(bs["step_us"]))
    tail_us = float(np.nanmedian(bs["tail_us"]))
    total = float(np.median(bs["bucket_bytes"]))
    last = float(np.median(bs["last_bytes"]))
    params = float(np.median(bs["last_params"]))
    comm_us = float(np.nanmedian(bs["comm_us"]))
    if not (step_us > 0 and total > 0 and comm_us > 0) or tail_us < BUCKET_TAIL_SHARE * step_us:
        return []
    us_per_byte = comm_us / total
    cap_mb = _nice_mb(max(total / TARGET_BUCKETS / MIB, MIN_BUCKET_MB))
    cap = cap_mb * MIB
    if last < LAST_BUCKET_FACTOR * cap:
        return []
    # the new last bucket: about the cap, or one parameter where a parameter is larger
    new_last = min(last, max(cap, last / max(params, 1.0)))
    compute_us = float(np.nanmedian(bs["step_us"] - bs["exposed_us"]))
    backward_us = max(float(np.median(bs["issue_span_us"])), BACKWARD_SHARE * compute_us)
    backlog_us = max(0.0, (total - new_last) * us_per_byte - backward_us)
    predicted_us = new_last * us_per_byte + backlog_us + float(np.nanmedian(bs["finalize_us"]))
    gain = tail_us - predicted_us
    if gain < max(MIN_GAIN_SHARE * step_us, MIN_GAIN_US):
        return []
    hidden = 1.0 - tail_us / max(float(np.nanmedian(bs["comm_us"] + bs["finalize_us"])), tail_us)
    evidence = dict(
        steps=int(bs["step"].nunique()),
        step_us=step_us,
        buckets=float(np.median(bs["buckets"])),
        bucket_bytes=total,
        last_bucket_bytes=last,
        last_bucket_params=params,
        tail_us=tail_us,
        tail_share=tail_us / step_us,
        hidden_share=max(hidden, 0.0),
        comm_us=comm_us,
        us_per_mib=us_per_byte * MIB,
        issue_span_us=float(np.median(bs["issue_span_us"])),
        backward_estimate_us=backward_us,
        predicted_tail_us=predicted_us,
    )
    text = (
        f"the last gradient bucket ({_mb(last)} of the step's {_mb(total)}, {_n(evidence['buckets'])} bucket(s)) "
        f"is all-reduced only when the backward is over: the training thread waits {_ms(tail_us)} per step for it "
        f"({_pct(tail_us / step_us)} of the {_ms(step_us)} step; {_pct(evidence['hidden_share'])} of the buckets' "
        f"time is hidden under the backward). With buckets of {cap_mb:g} MiB the last one is about "
        f"{_mb(new_last)}; at the measured {_ms(us_per_byte * MIB)} per MiB the tail would be about "
        f"{_ms(predicted_us)}, if the other buckets' all-reduce ({_ms((total - new_last) * us_per_byte)}) fits "
        f"under the backward (taken as {_ms(backward_us)})."
    )
    if "device" in df.columns and (df.loc[_bucket_mask(df), "device"].astype(str) == "cpu").all():
        text += (
            " On CPU the all-reduce under the backward competes with it for the cores: on a busy machine the "
            "step gains less than the tail loses."
        )
    return [
        Advice(
            "ddp_bucket_size",
            f"DDP: buckets of {cap_mb:g} MiB to overlap the gradient all-reduce with the backward",
            evidence,
            f"DistributedDataParallel(model, bucket_cap_mb={cap_mb:g})",
            {"bucket_cap_mb": cap_mb},
            gain,
            gain / step_us,
            text,
            "steps",
        )
    ]


def ddp_grad_copy(df, steps_table, st) -> list:
    """``gradient_as_bucket_view=True`` when DDP's finalize (its copy into .grad) costs a share of the step."""
    bs = bucket_steps(df, steps_table)
    if bs["step"].nunique() < MIN_STEPS:
        return []
    finalize_us = float(np.nanmedian(bs["finalize_us"]))
    step_us = st["step_p50_us"]
    if finalize_us < max(GRAD_COPY_SHARE * step_us, MIN_GAIN_US):
        return []
    total = float(np.median(bs["bucket_bytes"]))
    evidence = dict(
        steps=int(bs["step"].nunique()),
        step_us=step_us,
        finalize_us=finalize_us,
        finalize_share=finalize_us / step_us,
        bucket_bytes=total,
    )
    text = (
        f"after its last all-reduce DDP spends {_ms(finalize_us)} per step ({_pct(finalize_us / step_us)}) "
        f"finishing the backward, copying the averaged gradients ({_mb(total)}) from its buckets into .grad; "
        "with gradient_as_bucket_view=True .grad is a view of the bucket and that copy (and its memory) goes "
        "(gradients then alias the buckets: no .grad = None / detach_() of them by hand)."
    )
    return [
        Advice(
            "ddp_grad_copy",
            f"DDP: gradient_as_bucket_view=True saves a copy of {_mb(total)} per step",
            evidence,
            "DistributedDataParallel(model, gradient_as_bucket_view=True)",
            {"gradient_as_bucket_view": True},
            finalize_us,
            finalize_us / step_us,
            text,
            "steps",
        )
    ]


# ---- small messages ------------------------------------------------------------------------------
def latency_fit(times, nbytes):
    """(latency_us, us_per_byte) of ``time = latency + bytes x us_per_byte`` fitted to the median time
    of each message size (power of two) with enough calls; None when the sizes are too few or too
    close, or the fit is not a positive latency and bandwidth."""
    fits = latency_fits(np.zeros(len(times), np.int64), times, nbytes)
    return (float(fits["latency_us"].iloc[0]), float(fits["us_per_byte"].iloc[0])) if len(fits) else None


def latency_fits(key, times, nbytes):
    """``latency_fit`` for every key at once (``key``: an integer per call): a DataFrame indexed by
    the keys that have a fit, columns latency_us and us_per_byte. One groupby and a closed-form
    least-squares line per key: the cost is linear in the calls, however many keys they have."""
    import pandas as pd

    t = pd.DataFrame({"k": key, "t": times, "s": size_bucket(nbytes), "b": np.asarray(nbytes, np.float64)})
    t = t[np.isfinite(t["t"]) & (t["b"] > 0)]
    per = t.groupby(["k", "s"], sort=False).agg(t=("t", "median"), b=("b", "median"), n=("t", "size"))
    per = per[per["n"] >= MIN_CALLS_PER_SIZE].reset_index()
    by = per.groupby("k", sort=True)
    mean = by[["b", "t"]].transform("mean")
    dx, dy = per["b"] - mean["b"], per["t"] - mean["t"]
    sxx, sxy = (dx * dx).groupby(per["k"]).sum(), (dx * dy).groupby(per["k"]).sum()
    fit = pd.DataFrame({"n": by.size(), "lo": by["b"].min(), "hi": by["b"].max(), "bm": by["b"].mean()})
    fit["tm"] = by["t"].mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        fit["us_per_byte"] = sxy / sxx
    fit["latency_us"] = fit["tm"] - fit["us_per_byte"] * fit["bm"]
    ok = (fit["n"] >= MIN_SIZES) & (fit["hi"] >= MIN_SIZE_SPAN * fit["lo"]) & (sxx > 0)
    ok &= (fit["us_per_byte"] > 0) & (fit["latency_us"] > 0)
    return fit.loc[ok, ["latency_us", "us_per_byte"]]


def small_messages(df, steps_table, st) -> list:
    """Coalesce the calls below the latency-bound size on a group when they are many per step.
    Vectorised over the (group, collective) keys: a log with as many keys as calls costs no more
    than one with a handful (issue 33)."""
    import pandas as pd

    rows = steady_rows(df, steps_table)
    rows = rows[~_bucket_mask(rows) & (rows["bytes"].to_numpy() > 0)].reset_index(drop=True)
    if not len(rows):
        return []
    times = transfer_durations(rows)  # by position: rows' index is 0..n-1
    step_us = st["step_p50_us"]
    steps = rows["step"].nunique()
    keys = rows[["group", "collective"]].astype(str)
    code, pairs = pd.factorize(pd.MultiIndex.from_frame(keys), sort=True)
    fits = latency_fits(code, times, rows["bytes"])
    if not len(fits):
        return []
    bound = np.full(len(pairs), -np.inf)  # the latency-bound size: latency = transfer time
    bound[fits.index.to_numpy()] = (fits["latency_us"] / fits["us_per_byte"]).to_numpy()
    is_small = rows["bytes"].to_numpy() < bound[code]
    small = pd.DataFrame(
        {
            "k": code[is_small],
            "rank": rows["rank"].to_numpy()[is_small],
            "step": rows["step"].to_numpy()[is_small],
            "t": times[is_small],
            "bytes": rows["bytes"].to_numpy()[is_small],
            "op": rows["op"].astype(str).to_numpy()[is_small],
        }
    )
    per_step = small.groupby(["k", "rank", "step"]).size()
    by_key = pd.DataFrame(
        {
            "calls": per_step.groupby(level=["k", "rank"]).median().groupby(level="k").median(),
            "rank_steps": per_step.groupby(level="k").size(),
            "steps": small.groupby("k")["step"].nunique(),
            "t": small.groupby("k")["t"].sum(),  # NaN skipped (as nansum)
            "bytes": small.groupby("k")["bytes"].median(),
        }
    ).join(fits, how="inner")
    by_key["gain"] = (by_key["calls"] - 1) * by_key["latency_us"]
    by_key = by_key[
        (by_key["calls"] >= MIN_SMALL_CALLS)
        & (by_key["steps"] >= min(MIN_STEPS, steps))
        & (by_key["gain"] >= max(MIN_GAIN_SHARE * step_us, MIN_GAIN_US))
    ]
    ops = small[small["k"].isin(by_key.index)].groupby("k")["op"].unique()
    out = []
    for k, row in by_key.sort_index().iterrows():
        group, collective = pairs[k]
        calls, latency_us, us_per_byte, gain = (float(row[c]) for c in ("calls", "latency_us", "us_per_byte", "gain"))
        bound_k = latency_us / us_per_byte
        small_us = float(row["t"]) / max(int(row["rank_steps"]), 1)
        evidence = dict(
            steps=int(row["steps"]),
            step_us=step_us,
            calls_per_step=float(calls),
            latency_us=float(latency_us),
            us_per_mib=float(us_per_byte) * MIB,
            latency_bound_bytes=float(bound_k),
            small_bytes_median=float(row["bytes"]),
            small_us_per_step=small_us,
            latency_share=min(calls * latency_us / small_us, 1.0) if small_us > 0 else math.nan,
        )
        text = (
            f"{_n(calls)} {collective} calls per step on group {group} ({', '.join(sorted(ops[k]))}) move messages "
            f"below {_bytes(bound_k)}, the size where a call's fixed latency ({_ms(latency_us)}, fitted from this "
            f"group's calls) equals its transfer time; they take {_ms(small_us)} per step, "
            f"{_pct(evidence['latency_share'])} of it latency. One call for all of them saves about "
            f"{_ms(gain)} per step."
        )
        change = (
            f"issue the {_n(calls)} {collective} calls of group {group} inside one "
            f"`with torch.distributed._coalescing_manager(group=...):` block, or flatten them into one tensor "
            f"(torch._utils._flatten_dense_tensors) and make one call"
        )
        out.append(
            Advice(
                "small_messages",
                f"coalesce {_n(calls)} small {collective} calls per step on group {group}",
                evidence,
                change,
                {},
                gain,
                gain / step_us,
                text,
                "summary",
            )
        )
    return out


# ---- stragglers ----------------------------------------------------------------------------------
def straggler(df, steps_table, st, cross, by_rank=None) -> list:
    """A rank late in most steps by a steady amount (``stragglers.verdict``): its own work, with its
    step-time breakdown against the other ranks' (``by_rank``: ``per_step(df, by_rank=True)`` when
    already computed)."""
    v = stragglers.of(cross, steps_table)
    if v is None or not v["straggler"]:
        return []
    r = v["rank"]
    by_rank = per_step(df, by_rank=True) if by_rank is None else by_rank
    steady = by_rank[by_rank["stage"] == "steady"]
    own = steady[steady["rank"] == r]
    others = steady[steady["rank"] != r]
    if not len(own) or not len(others):
        return []

    def med(frame, col):
        return float(np.nanmedian(frame[col])) if frame[col].notna().any() else math.nan

    step_us = st["step_p50_us"]
    ev = dict(
        rank=int(r),
        steps=int(v["steps"]),
        last_steps=int(v["last_steps"]),
        late_us=float(v["late_median_us"]),
        late_share=float(v["share_of_step"]),
        p_value=float(v["p_value"]),
        step_us=step_us,
    )
    for name, frame in (("rank", own), ("others", others)):
        exposed = med(frame, "exposed_us")
        ev[f"{name}_exposed_us"] = exposed
        ev[f"{name}_compute_us"] = med(frame.assign(c=frame["step_us"] - frame["exposed_us"]), "c")
    text = (
        f"rank {r} held the other ranks up a median {_ms(v['late_median_us'])} per step, the longest of all "
        f"ranks in {v['last_steps']} of {v['steps']} steady-state steps (p = {v['p_value']:.2g}): the others wait for it. "
        f"Its step outside communication takes {_ms(ev['rank_compute_us'])} against {_ms(ev['others_compute_us'])} "
        f"on the others, and it waits for communication {_ms(ev['rank_exposed_us'])} per step against "
        f"{_ms(ev['others_exposed_us'])}: the delay comes before it issues its collectives (its compute, data "
        "loading, or the host it runs on), not from the network."
    )
    change = (
        f"find what rank {r} does more than the others before its collectives (uneven data shards or batch "
        "sizes, slower data loading or preprocessing, another process on its CPU / GPU) and even it out"
    )
    return [
        Advice(
            "straggler",
            f"rank {r} is a straggler: {_ms(v['late_median_us'])} late per step, its own work",
            ev,
            change,
            {},
            float(v["late_median_us"]),
            float(v["late_median_us"]) / step_us,
            text,
            "ranks",
        )
    ]


# ---- wording -------------------------------------------------------------------------------------
def _nice_mb(mb: float) -> float:
    """``mb`` rounded down to two significant digits (1.6, 12, 250)."""
    if mb <= 0:
        return mb
    scale = 10 ** (math.floor(math.log10(mb)) - 1)
    return math.floor(mb / scale) * scale if scale >= 1 else round(math.floor(mb / scale) * scale, 6)


def _ms(us) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    return f"{us / 1e3:.3g} ms" if abs(us) >= 100 else f"{us:.3g} us"


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def _mb(nbytes) -> str:
    return f"{nbytes / MIB:.3g} MiB" if nbytes >= 0.1 * MIB else _bytes(nbytes)


def _bytes(nbytes) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", 1024.0)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def _n(x) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


__all__ = [
    "Advice",
    "KEYS",
    "ROW_RULES",
    "advice",
    "bucket_steps",
    "ddp_bucket_size",
    "ddp_grad_copy",
    "latency_fit",
    "small_messages",
    "straggler",
]
