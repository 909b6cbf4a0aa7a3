"""Figures of a job while it runs, from the recent rows of each rank (a window of its last steps):
the current step, the last complete step's time and shares (``steps.per_step``, the same
definitions as the report), the slowest rank now, and the calls in flight too long.
Pure functions of DataFrames and numbers; no I/O, no printing."""

from __future__ import annotations

import math

import numpy as np

from ..data.schema import BOUNDARY_SOURCES
from .steps import per_step
from .summaries import durations

LIVE_COLUMNS = (
    "rank",
    "current_step",
    "calls",
    "last_step",
    "step_us",
    "comm_share",
    "exposed_share",
    "work_us",
    "last_start_ns",
)


def counted_steps(df) -> bool:
    """Whether the rows' steps were counted by a step boundary (optimizer.step, a DDP / FSDP root
    forward, commpatch.step()). Without one, steps can only be found from the pattern of calls,
    numbered from the start of what is read: in a window of recent rows, not the job's steps."""
    return bool(len(df)) and bool(df["step_source"].isin(BOUNDARY_SOURCES).any())


def rank_live(df) -> dict:
    """One rank's figures from its window of rows: current_step (of its latest call; -1, unknown,
    without a step boundary in the log: then every step figure is unknown), last_step (the
    latest step whose time is known: the next step has begun) with its step_us, comm_share,
    exposed_share and work_us (the step outside the thread's communication and waits for it:
    step_us - exposed_us; NaN: unknown), calls in the current step, last_start_ns (its latest
    call's issue). Empty dict for no rows."""
    if not len(df):
        return {}
    if not counted_steps(df):  # no step boundary: the figures of steps are unknown
        return dict(
            rank=int(df["rank"].iloc[0]),
            current_step=-1,
            calls=-1,
            last_step=-1,
            step_us=math.nan,
            comm_share=math.nan,
            exposed_share=math.nan,
            work_us=math.nan,
            last_start_ns=int(df["start_ns"].max()),
        )
    table = per_step(df)
    current = int(df["step"].max())
    known = table[table["step_us"].notna()]
    last = known.iloc[-1] if len(known) else None
    return dict(
        rank=int(df["rank"].iloc[0]),
        current_step=current,
        calls=int((df["step"] == current).sum()),
        last_step=int(last["step"]) if last is not None else -1,
        step_us=float(last["step_us"]) if last is not None else math.nan,
        comm_share=float(last["comm_share"]) if last is not None else math.nan,
        exposed_share=float(last["exposed_share"]) if last is not None else math.nan,
        work_us=float(last["step_us"] - last["exposed_us"]) if last is not None else math.nan,
        last_start_ns=int(df["start_ns"].max()),
    )


def slowest(ranks: list) -> dict:
    """The rank the others wait for: the one whose last known step has the most time outside
    communication and its waits (``work_us``), with the median of the others' (a fact, not a
    straggler verdict); {} with fewer than two ranks of known figures. Not the longest step: in
    lockstep every rank's step is as long, and the ranks that wait have the most exposed time."""
    known = [r for r in ranks if r and not math.isnan(r.get("work_us", math.nan))]
    if len(known) < 2:
        return {}
    top = max(known, key=lambda r: r["work_us"])
    others = [r["work_us"] for r in known if r is not top]
    return dict(
        rank=top["rank"],
        step=top["last_step"],
        step_us=top["step_us"],
        work_us=top["work_us"],
        others_work_median_us=float(np.median(others)),
    )


def in_flight(df, now_ns: int, threshold_s: float):
    """Calls of a rank's window that were issued more than ``threshold_s`` ago and have no
    completion yet (async calls whose duration has not arrived): rank, seq, op, group, age_s.
    What the log holds today; a record of every call at issue (the hang issue) will make
    synchronous calls visible here too."""
    import pandas as pd

    if not len(df):
        return pd.DataFrame(columns=["rank", "seq", "op", "group", "age_s"])
    waiting = (
        np.isnan(durations(df))
        & df["async_op"].to_numpy(bool)
        & (df["status"] == "ok").to_numpy()
        & df["timing"].isin(("future", "device_event", "nccl")).to_numpy()
    )
    age = (now_ns - df["start_ns"].to_numpy(np.int64)) / 1e9
    stuck = waiting & (age > threshold_s)
    out = df.loc[stuck, ["rank", "seq", "op", "group"]].assign(age_s=age[stuck])
    for col in ("op", "group"):
        out[col] = out[col].astype(str)
    return out.reset_index(drop=True)


__all__ = ["LIVE_COLUMNS", "counted_steps", "in_flight", "rank_live", "slowest"]
