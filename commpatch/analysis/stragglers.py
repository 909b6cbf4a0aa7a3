"""The straggler verdict: is one rank late more than chance and noise explain, in the steady state?

Being the last to issue a collective is what some rank always is: on a symmetric run each rank is
last about 1/n of the time, and the collectives of one step are not independent draws (a rank
held up at the start of a step is late for all of them). So the unit of evidence is the step, and
only steady-state steps count (a one-off delay in set-up is reported apart, never decides):

- per step and rank, the rank's mean arrival: its issue time minus the first rank's, averaged over
  the step's collectives of two or more ranks (``step_arrivals``, from the matched collectives);
- per steady step, ``late_us``: how much later the candidate arrived than the latest other rank
  (negative when another was later). The candidate is the rank with the largest median late_us;
- the verdict needs all of: significance (p below ``ALPHA``: the smaller p of a one-sided sign test,
  last in more steady steps than the 1/n chance, and of a one-sided trimmed t-test, late_us above
  0 against its noise over the steps (trimmed: a few steps where the machine held up some rank
  neither hide a straggler nor make one); Bonferroni-corrected for the two tests and the n ranks
  the candidate was picked from), consistency (last in at least ``STRAGGLER_SHARE`` of the steady
  steps) and an effect that matters (a median late_us of at least ``STRAGGLER_LATE`` of the median
  step time and at least ``MIN_LATE_US``).

Arrivals compare issue times taken on different hosts' wall clocks, aligned to rank 0's where the
offsets were measured (``data.clock``): a lateness within the offsets' uncertainty (the candidate's
plus the largest other's) is no evidence (reason ``clock``), nor one involving a rank whose offset
is unknown while others were measured. Logs with no measurement at all (older logs, CSV or
synthetic input) are compared as they are, which the report says.

A run of a few short steps cannot tell: one preemption of one process by the operating system can
cover all of it (measured: with 11 steady steps of ~2 ms on a loaded machine, 4 of 80 verdicts
were wrong; with 29 steps, 0 of 160).

Pure functions: pandas in, a dict out (``findings`` words it).
"""

from __future__ import annotations

import math

import numpy as np

from ..data.clock import MEASURED, REFERENCE, SAME_MACHINE

# the tests' level, after the Bonferroni correction for the two tests and the ranks a candidate is picked from
ALPHA = 1e-2
# the share of the steps trimmed from each end before the t-test (Yuen's 20%)
TRIM = 0.2
# a straggler is last in at least this share of the steady-state steps...
STRAGGLER_SHARE = 0.5
# ... by a median of at least this share of the steady-state step time...
STRAGGLER_LATE = 0.05
# ... and of at least this much: below the time slices in which an operating system shares its
# cores (Linux CFS: a minimum slice of 0.75 ms x (1 + log2 CPUs), 1.5 ms on 2 CPUs), a rank's lateness
# on a loaded machine is the machine, not the job. Measured (2-rank DDP on gloo, 2 cores shared by
# other jobs, 240 jobs of 30 steps): the median lateness of the latest rank of symmetric jobs 0.002-1.34
# ms (significant in a few), with a 5 ms delay per step 3.2-8.3 ms
MIN_LATE_US = 2000.0
# a rank this much later than the others in set-up is mentioned (a one-off: it never decides the verdict)
SETUP_LATE_US = 1000.0


def step_arrivals(waits):
    """Per (step, rank): ``arrival_us``, the rank's issue time minus the first rank's, averaged over
    its collectives of the step that two or more ranks issued; ``collectives``, how many.
    ``waits``: ``matching._match``'s per-row table (rank, step, arrival_us, and ``ranks``: how many
    ranks issued the row's collective)."""
    w = waits[waits["ranks"].to_numpy() > 1]
    out = w.groupby(["step", "rank"], sort=True).agg(
        arrival_us=("arrival_us", "mean"), collectives=("arrival_us", "size")
    )
    return out.reset_index()


def clock_uncertainty(clock, ranks) -> dict:
    """{rank: uncertainty of its offset to rank 0 (us)} from a ``data.clock`` summary per rank
    (``CLOCK_ATTR``): NaN for a rank whose offset was not measured when others were; all 0 when
    none was (no clock information: the arrivals are compared as they are)."""
    clock = clock or {}
    if not any(c.get("status") in (MEASURED, SAME_MACHINE) for c in clock.values()):
        return {r: 0.0 for r in ranks}
    out = {}
    for r in ranks:
        c = clock.get(r, {})
        out[r] = float(c["uncertainty_us"]) if c.get("status") in (MEASURED, SAME_MACHINE, REFERENCE) else math.nan
    return out


def verdict(arrivals, steps_table, clock=None) -> dict:
    """The straggler verdict from ``step_arrivals`` and ``per_step`` (either form; its stage column
    says which steps are set-up and steady). Keys: ``rank`` (the candidate, or None), ``straggler``
    (bool), ``steps`` (steady steps with two or more ranks), ``last_steps`` (of them, those the
    candidate was last in), ``late_median_us`` (its median late_us), ``p_value`` (Bonferroni
    corrected), ``share_of_step`` (late_median_us over the median step time), ``reason`` (why not,
    when not: ``steps``, ``significance``, ``consistency``, ``effect``, ``clock``), ``setup_rank`` and
    ``setup_late_us`` (the latest rank of set-up and by how much it was later than the next),
    ``clock_us`` (the uncertainty of the candidate's arrival against the others' from the clock
    offsets: NaN when one of them is unknown). ``clock``: the per-rank ``data.clock`` summaries."""
    stage = steps_table[["step", "stage"]].drop_duplicates("step").set_index("step")["stage"]
    table = arrivals.assign(stage=arrivals["step"].map(stage).fillna("end").to_numpy())
    out: dict = dict(
        rank=None,
        straggler=False,
        steps=0,
        last_steps=0,
        late_median_us=math.nan,
        p_value=math.nan,
        share_of_step=math.nan,
        reason="steps",
        setup_rank=None,
        setup_late_us=math.nan,
        clock_us=0.0,
    )
    unc = clock_uncertainty(clock, arrivals["rank"].unique().tolist())
    setup = _late(table[table["stage"] == "setup"])
    if setup is not None and len(setup.columns):
        best = setup.iloc[0].idxmax()
        if float(setup.iloc[0][best]) > _relative(unc, best, setup.columns):  # else: within the clocks' uncertainty
            out.update(setup_rank=int(best), setup_late_us=float(setup.iloc[0][best]))
    late = _late(table[table["stage"] == "steady"])
    if late is None or len(late) < 2:
        out["steps"] = 0 if late is None else len(late)
        return out
    ranks = late.columns
    medians = late.median()
    rank = medians.idxmax()
    d = late[rank].to_numpy(np.float64)
    m = len(d)
    steady = steps_table[steps_table["stage"] == "steady"]
    if "ranks" not in steps_table.columns:  # per rank: the mean over ranks per step
        steady = steady.groupby("step").mean(numeric_only=True)
    times = steady["step_us"].dropna()
    step_us = float(times.median()) if len(times) else math.nan  # as steady_state's step_p50_us
    # Bonferroni: two tests, and the candidate was picked from n ranks
    p = min(1.0, 2 * len(ranks) * min(_binom_sf(int((d > 0).sum()), m, 1 / len(ranks)), _trimmed_t_sf(d)))
    out.update(
        rank=int(rank),
        steps=m,
        last_steps=int((d > 0).sum()),
        late_median_us=float(medians[rank]),
        p_value=p,
        share_of_step=float(medians[rank]) / step_us if step_us > 0 else math.nan,
    )
    out["clock_us"] = _relative(unc, rank, ranks)
    if out["late_median_us"] > 0 and not out["late_median_us"] > out["clock_us"]:  # NaN (an unknown offset) too
        out["reason"] = "clock"
    elif p >= ALPHA:
        out["reason"] = "significance"
    elif out["last_steps"] < STRAGGLER_SHARE * m:
        out["reason"] = "consistency"
    elif not (out["share_of_step"] >= STRAGGLER_LATE and out["late_median_us"] >= MIN_LATE_US):
        out["reason"] = "effect"
    else:
        out.update(straggler=True, reason=None)
    return out


def _relative(unc, rank, ranks) -> float:
    """The uncertainty of ``rank``'s arrival against the other ``ranks``' (us): its offset's plus the
    largest other's; NaN when one is unknown."""
    others = [unc.get(r, math.nan) for r in ranks if r != rank]
    return unc.get(rank, math.nan) + (
        max(others) if others and not any(map(math.isnan, others)) else (math.nan if others else 0.0)
    )


def _late(table):
    """Per step (rows) and rank (columns) of ``table`` (step_arrivals rows): the rank's mean arrival
    minus the latest mean arrival of the other ranks; None without steps of two or more ranks."""
    wide = table.pivot_table(index="step", columns="rank", values="arrival_us", aggfunc="mean")
    wide = wide[wide.notna().sum(axis=1) >= 2]
    if not len(wide):
        return None
    values = wide.to_numpy(np.float64)
    filled = np.where(np.isnan(values), -np.inf, values)
    out = np.empty_like(values)
    for j in range(values.shape[1]):
        others = np.delete(filled, j, axis=1)
        out[:, j] = values[:, j] - others.max(axis=1)
    return wide.__class__(out, index=wide.index, columns=wide.columns)


def _binom_sf(k: int, m: int, p: float) -> float:
    """P(K >= k) for K ~ Binomial(m, p): the one-sided sign test of being last in k of m steps."""
    if k <= 0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1) + i * log_p + (m - i) * log_q
        for i in range(k, m + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _trimmed_t_sf(d, trim: float = TRIM) -> float:
    """One-sided p-value that the ``trim``-trimmed mean of ``d`` is above 0: Yuen's trimmed t-test
    (the mean of the middle values over its standard error from the winsorized variance, with
    h - 1 degrees of freedom for h values kept). A few steps where another rank happened to be
    held up (the machine, not the job) neither hide a straggler nor make one."""
    d = np.sort(np.asarray(d, np.float64)[~np.isnan(np.asarray(d, np.float64))])
    m = len(d)
    g = int(math.floor(trim * m))
    h = m - 2 * g
    if h < 2:
        return 1.0
    kept = d[g : m - g]
    mean = float(kept.mean())
    winsorized = np.clip(d, kept[0], kept[-1])
    sd = float(winsorized.std(ddof=1))
    if sd == 0:
        return 0.0 if mean > 0 else 1.0
    t = mean / (sd / ((1 - 2 * g / m) * math.sqrt(m)))
    nu = h - 1
    tail = 0.5 * _betainc(nu / 2, 0.5, nu / (nu + t * t))  # P(T > |t|)
    return tail if t > 0 else 1.0 - tail


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (continued fraction, Numerical Recipes)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for i in range(1, 300):
        for num in (
            i * (b - i) * x / ((a + 2 * i - 1) * (a + 2 * i)),
            -(a + i) * (a + b + i) * x / ((a + 2 * i) * (a + 2 * i + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return front * h / a


__all__ = [
    "ALPHA",
    "MIN_LATE_US",
    "SETUP_LATE_US",
    "STRAGGLER_LATE",
    "STRAGGLER_SHARE",
    "clock_uncertainty",
    "step_arrivals",
    "verdict",
]
