"""Two runs of one job compared: what changed in its communication, and whether the change is more
than the steps' own spread (``commpatch diff A B``, ``commpatch check --baseline``).

The unit of evidence is the steady-state step, as in the rest of the report: per step, the step
time, the communication and exposed time per rank, and per collective and message size the calls,
bytes and time per rank. Each figure is compared by its median over the steady steps; the 95%
interval of the change (B's median minus A's) comes from a percentile bootstrap over the steps of
each run (``BOOTSTRAP`` resamples, a fixed seed: the same logs give the same interval). A change
is significant when its interval excludes 0; "no change" is said as such, never as a 0 that was
not measured. A figure one run does not have (a collective only in A) is listed apart.

Pure functions: pandas in, plain dicts out (the CLI prints them; JSON as is).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .summaries import durations, size_bucket

BOOTSTRAP = 2000
LEVEL = 0.95
MIN_STEPS = 3  # fewer steady steps in either run: a change is given without an interval
SEED = 20261126

# per-step figures: (key, column of the steps table, what it is, unit)
STEP_FIGURES = (
    ("step_us", "step_us", "step time", "us"),
    ("comm_us", "comm_us", "communication per rank", "us"),
    ("exposed_us", "exposed_us", "exposed (the training thread waits)", "us"),
    ("comm_share", "comm_share", "communication share of the step", "share"),
    ("exposed_share", "exposed_share", "exposed share of the step", "share"),
)


def change(a, b, seed: int = SEED) -> dict:
    """The change of the median from samples ``a`` to ``b`` (NaN dropped): medians, the change and
    its share of A's median, the bootstrap interval, ``significant`` (the interval excludes 0);
    ``significant`` is None when either side has fewer than ``MIN_STEPS`` values."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    out: dict = dict(a=math.nan, b=math.nan, change=math.nan, relative=math.nan, lo=math.nan, hi=math.nan)
    out.update(significant=None, steps_a=len(a), steps_b=len(b))
    if not len(a) or not len(b):
        return out
    ma, mb = float(np.median(a)), float(np.median(b))
    out.update(a=ma, b=mb, change=mb - ma, relative=(mb - ma) / ma if ma else math.nan)
    if len(a) < MIN_STEPS or len(b) < MIN_STEPS:
        return out
    rng = np.random.default_rng(seed)
    da = np.median(a[rng.integers(0, len(a), (BOOTSTRAP, len(a)))], axis=1)
    db = np.median(b[rng.integers(0, len(b), (BOOTSTRAP, len(b)))], axis=1)
    lo, hi = np.quantile(db - da, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    out.update(lo=float(lo), hi=float(hi), significant=bool(lo > 0 or hi < 0))
    return out


def steady_steps(steps) -> pd.DataFrame:
    """The steady-state rows of a steps table (``per_step(by_rank=False)``); all rows when none is
    marked steady (a run too short for a steady state: said by the caller through the step counts)."""
    if steps is None or not len(steps):
        return pd.DataFrame(columns=[c for _, c, _, _ in STEP_FIGURES] + ["step"])
    steady = steps[steps["stage"] == "steady"] if "stage" in steps else steps
    return steady if len(steady) else steps


def per_step_collectives(df, steps) -> pd.DataFrame:
    """Per steady step and (collective, size bucket): calls and bytes per rank, time per rank (us):
    the rows of every rank summed, divided by the ranks that have rows in that step."""
    keep = set(steady_steps(steps)["step"].tolist())
    rows = df[df["step"].isin(keep)] if keep else df.iloc[:0]
    if not len(rows):
        return pd.DataFrame(columns=["step", "collective", "size_bucket", "calls", "bytes", "time_us"])
    time = durations(rows)  # damaged values (infinite, negative) as unmeasured, as every analysis reads them
    rows = rows.assign(
        collective=rows["collective"].astype(str),
        size_bucket=size_bucket(rows["bytes"].to_numpy()),
        time_us=time,
        unmeasured=np.isnan(time).astype(np.int64),
    )
    ranks = rows.groupby("step")["rank"].nunique()
    out = (
        rows.groupby(["step", "collective", "size_bucket"], observed=True)
        .agg(
            calls=("bytes", "size"),
            bytes=("bytes", "sum"),
            time_us=("time_us", "sum"),
            unmeasured=("unmeasured", "sum"),
        )
        .reset_index()
    )
    per = out["step"].map(ranks).to_numpy(np.float64)
    for col in ("calls", "bytes", "time_us"):
        out[col] = out[col].to_numpy(np.float64) / per
    out.loc[out["unmeasured"] > 0, "time_us"] = np.nan  # a call without a duration: the step's time is unknown
    return out.drop(columns="unmeasured")


def diff(a: dict, b: dict) -> dict:
    """The comparison of two runs, each given as {"name", "steps": the steps table, "rows": the
    rows (None: per-collective figures left out)}: ``steps`` (per step figure: ``change``'s dict plus
    name and unit), ``collectives`` (per collective and size present in both: calls, bytes and time
    per rank and step, each a ``change``), ``only_a`` / ``only_b`` ((collective, size bucket) in one
    run's steady steps only, with its median calls, bytes and time per rank and step there),
    ``steps_a`` / ``steps_b`` (steady steps compared)."""
    sa, sb = steady_steps(a.get("steps")), steady_steps(b.get("steps"))
    out: dict = dict(a=a.get("name", "A"), b=b.get("name", "B"), steps_a=len(sa), steps_b=len(sb))
    out["steps"] = [
        dict(key=key, name=name, unit=unit, **change(_col(sa, col), _col(sb, col)))
        for key, col, name, unit in STEP_FIGURES
    ]
    out["collectives"], out["only_a"], out["only_b"] = [], [], []
    if a.get("rows") is None or b.get("rows") is None:
        return out
    ca, cb = per_step_collectives(a["rows"], a.get("steps")), per_step_collectives(b["rows"], b.get("steps"))
    keys_a = set(map(tuple, ca[["collective", "size_bucket"]].drop_duplicates().to_numpy().tolist()))
    keys_b = set(map(tuple, cb[["collective", "size_bucket"]].drop_duplicates().to_numpy().tolist()))
    for key, per, steady, keys in (("only_a", ca, sa, keys_a - keys_b), ("only_b", cb, sb, keys_b - keys_a)):
        for coll, size in sorted(keys):
            mine = _filled(per, coll, size, steady)
            medians = {col: float(np.median(mine[col].to_numpy(np.float64))) for col in ("calls", "bytes", "time_us")}
            out[key].append(dict(collective=coll, size_bucket=int(size), **medians))
    for coll, size in sorted(keys_a & keys_b):
        pa = _filled(ca, coll, size, sa)
        pb = _filled(cb, coll, size, sb)
        item = dict(collective=coll, size_bucket=int(size))
        for col in ("calls", "bytes", "time_us"):
            item[col] = change(pa[col], pb[col])
        out["collectives"].append(item)
    out["collectives"].sort(key=lambda it: -abs(_num(it["time_us"]["change"])))
    return out


def _col(frame, col) -> np.ndarray:
    return frame[col].to_numpy(np.float64) if col in frame else np.array([], np.float64)


def _num(x) -> float:
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _filled(per, coll, size, steady) -> pd.DataFrame:
    """One (collective, size)'s per-step figures over every steady step of its run (a step without
    that collective: 0 calls, 0 bytes, 0 us: it was measured, and there were none)."""
    mine = per[(per["collective"] == coll) & (per["size_bucket"] == size)].set_index("step")
    return mine[["calls", "bytes", "time_us"]].reindex(steady["step"].to_numpy(), fill_value=0.0)
