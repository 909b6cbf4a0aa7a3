"""The straggler verdict: does one rank hold the others up more than chance and noise explain, in the
steady state?

The evidence is the time the other ranks wait for a rank, per step, at each collective: at each
collective of two or more ranks, the last rank to issue it held it up alone from the latest other
rank's issue to its own (``late_us`` of ``matching._match``'s per-row table: a row's issue time minus
the latest other rank's, positive only for the last). Per step and rank, ``held_us`` is the longest
such wait of the step. A rank that sleeps 30 ms before the step holds the first all-gather up 30 ms
and nothing after it (FSDP absorbs the delay there): 30 ms, not 30 ms divided by the step's 14
collectives (a mean over the step's collectives, as before, called that "too little to matter").
A delay a rank carries over several collectives (DDP's buckets, issued without waiting) is counted
once, and the jitter of many collectives does not add up (a sum of the waits at each collective
made a 5 ms delay carried over 4 buckets 20 ms, and a symmetric job's jitter milliseconds). A rank
released later by a rooted collective that held the host (the root of a gloo reduce receives and
adds while the others only send) issues what follows later with no more work of its own:
``late_us`` leaves that out (``matching.late_released``).

Being the last is what some rank always is, and the collectives of one step are not independent
draws, so the unit of evidence is the steady-state step (a one-off delay in set-up is reported
apart, never decides). Per steady step, the candidate's margin is its held_us minus the largest
other rank's; the candidate is the rank with the largest median margin. The verdict needs all of:

- significance: p below ``ALPHA`` (the smaller p of a one-sided sign test, holding the others up
  longest in more steady steps than the 1/n chance, and of a one-sided trimmed t-test, the margin
  above 0 against its noise over the steps; trimmed: a few steps where the machine held up some
  rank neither hide a straggler nor make one; Bonferroni-corrected for the two tests and the n ranks
  the candidate was picked from);
- consistency: holding the others up longest in at least ``STRAGGLER_SHARE`` of the steady steps;
- an effect above the run's own noise: the candidate's median held_us above ``threshold_us``, the
  ``NOISE_QUANTILE`` quantile of the other ranks' held_us over the same steps (what the other ranks
  hold each other up by in all but the worst tenth of the steps: no constant tuned to one machine),
  and above the clocks' uncertainty. Where p is below ``STRONG_ALPHA`` (a rank last at one place in
  99 of 99 steps), above the median (``STRONG_NOISE_QUANTILE``) of the others' hold-ups when they
  were the last, where that is lower (``_noise``): a delay of 5% of the step that is there in nearly
  every step is a straggler although the machine's worst tenth of steps is as long
  (``noise_quantile`` says which quantile the threshold is).

Where the step's longest hold-up names no one, the same tests run at each collective's place in the
step (the k-th collective of a group in each steady step: ``position_arrivals``,
``position_candidates``): a small delay one collective absorbs stands out there from the noise of
the step's other collectives, which its step maximum carries. The candidate at a place is the rank
that held the collective up in most steps; the correction counts every (place, rank) pair; the
effect threshold is the same rule's, over what the other ranks hold the group's collectives up by.
Each family (the steps', the places') is tested at ``ALPHA``.

Arrivals compare issue times taken on different hosts' wall clocks, aligned to rank 0's where the
offsets were measured (``data.clock``): a held time within the offsets' uncertainty (the candidate's
plus the largest other's) is no evidence (reason ``clock``), nor one involving a rank whose offset
is unknown while others were measured. Logs with no measurement at all (older logs, CSV or
synthetic input) are compared as they are, which the report says.

Pure functions: pandas in, a dict out (``findings`` words it).
"""

from __future__ import annotations

import math

import numpy as np

from ..data.clock import MEASURED, REFERENCE, SAME_MACHINE

# the tests' level, after the Bonferroni correction for the two tests and the ranks a candidate is picked from
ALPHA = 1e-3
# the share of the steps trimmed from each end before the t-test (Yuen's 20%)
TRIM = 0.2
# a straggler holds the others up longest in at least this share of the steady-state steps...
STRAGGLER_SHARE = 0.5
# ... by a median above this quantile of the other ranks' held times over the same steps (their noise)...
NOISE_QUANTILE = 0.9
# ... or, where the evidence is overwhelming (p below STRONG_ALPHA, a thousandth of ALPHA), above this one
STRONG_ALPHA = 1e-6
STRONG_NOISE_QUANTILE = 0.5
# a pipeline stage's extra work per step must exceed this quantile of the other stages' variation
STAGE_NOISE_QUANTILE = 0.5
# a rank that held the others up this much longer than any other in set-up is mentioned (a one-off: it
# never decides the verdict)
SETUP_LATE_US = 1000.0


def step_arrivals(waits):
    """Per (step, rank): ``held_us``, the longest time the rank alone held up one of the step's
    collectives that two or more ranks issued (0 when it was never the last); ``collectives``, how
    many it issued. ``waits``: ``matching._match``'s per-row table (rank, step, late_us, and
    ``ranks``: how many ranks issued the row's collective)."""
    w = waits[waits["ranks"].to_numpy() > 1]
    held = w.assign(held_us=w["late_us"].clip(lower=0.0))
    return (
        held.groupby(["step", "rank"], sort=True)
        .agg(held_us=("held_us", "max"), collectives=("held_us", "size"))
        .reset_index()
    )


def position_arrivals(table, waits):
    """Per collective that two or more ranks issued: its group, ``cseq``, step (its last rank's),
    the last rank and how long it alone held the collective up (``held_us``, the ``late_us`` of its
    row), how many ranks issued it (``n``) and its op: the evidence of ``position_candidates``. ``table`` and
    ``waits``: ``matching._match``'s per-collective and per-row tables."""
    import pandas as pd

    last = waits[waits["last"].to_numpy(bool)]
    coll = last["collective"].to_numpy(np.int64)
    return pd.DataFrame(
        {
            "group": table["group"].astype(str).to_numpy()[coll],
            "cseq": table["coll_seq"].to_numpy(np.int64)[coll],
            "step": last["step"].to_numpy(np.int64),
            "rank": last["rank"].to_numpy(np.int64),
            "held_us": np.maximum(last["late_us"].to_numpy(np.float64), 0.0),
            "n": last["ranks"].to_numpy(np.int64),
            "op": table["op"].astype(str).to_numpy()[coll],
        }
    )


def position_candidates(instances, steady_steps):
    """The evidence at each collective's place in the step, reduced to what ``verdict`` tests: of
    ``position_arrivals`` (or an engine's same columns), the steady-state collectives, each with its
    ``pos`` (its place among its group's collectives of two or more ranks in its step, from 0), of the
    groups that have a position where one rank held the collective up in at least half of the steps
    (no other position can pass the consistency rule; the group's other positions give the noise),
    and the number of (position, rank) pairs the tests choose among (the Bonferroni correction).
    Returns (frame with ``pos``, tests)."""
    t = instances.sort_values(["group", "step", "cseq"], kind="stable")
    t = t.assign(pos=t.groupby(["group", "step"], sort=False).cumcount().to_numpy(np.int64))
    t = t[t["step"].isin(np.asarray(list(steady_steps), np.int64))]
    if not len(t):
        return t, 0
    per = t.groupby(["group", "pos"], sort=False).agg(m=("step", "size"), n=("n", "max"))
    per = per[per["m"] >= 2]
    held = t[t["held_us"].to_numpy() > 0]
    top = held.groupby(["group", "pos", "rank"], sort=False).size().groupby(level=["group", "pos"]).max()
    keep = per.join(top.rename("k"), how="inner")
    groups = keep.index[2 * keep["k"].to_numpy() >= keep["m"].to_numpy()].get_level_values("group").unique()
    t = t[t["group"].isin(groups)]
    return t.sort_values(["group", "pos", "step"], kind="stable").reset_index(drop=True), int(per["n"].sum())


def _padded_quantile(values, total: int, q: float) -> float:
    """``np.quantile`` (linear) of ``values`` (all >= 0) padded with zeros to ``total`` values, without
    the zeros in memory (a world group of 16,384 ranks pads 16,383 a step)."""
    v = np.sort(np.asarray(values, np.float64))
    zeros = total - len(v)
    if total <= 0:
        return 0.0
    idx = q * (total - 1)
    lo = int(math.floor(idx))

    def at(i):
        return 0.0 if i < zeros else float(v[i - zeros])

    return at(lo) + (idx - lo) * (at(min(lo + 1, total - 1)) - at(lo))


def _position_verdict(candidates, tests, unc):
    """(The most significant position's candidate that passes, the most significant one that passes
    the significance and consistency tests only, with its ``reason``: ``effect`` or ``clock``), each a
    dict of its figures or None: at each candidate
    position, the rank that held the collective up in most steps; its margin per step is the time it
    held it up when last, minus the time the last rank held it up when another was last (the others
    hold nothing up there then); the same tests as for the step's longest hold-up, Bonferroni-corrected
    for the two tests and every (position, rank) pair; its effect, its median time holding it up per
    step, above the noise by its p (``_noise``) of the time the other ranks held the group's
    collectives up (at every steady collective of the group, each other rank: the last one's time when
    it was another, else 0) and above the clocks' uncertainty."""
    best = near = None
    if candidates is None or not len(candidates) or tests <= 0:
        return None, None
    by_group = {name: part for name, part in candidates.groupby("group", sort=True)}
    for (group, pos), g in candidates.groupby(["group", "pos"], sort=True):
        last, held = g["rank"].to_numpy(np.int64), g["held_us"].to_numpy(np.float64)
        ranks, counts = np.unique(last[held > 0], return_counts=True)
        if not len(ranks) or 2 * counts.max() < len(g):
            continue  # no rank held it up in half of the steps
        rank = int(ranks[counts.argmax()])  # the smallest rank of a tie
        mine = last == rank
        d = np.where(mine, held, -held)
        m, k, n = len(d), int((d > 0).sum()), int(g["n"].max())
        p = min(1.0, 2 * tests * min(_binom_sf(k, m, 1 / n), _trimmed_t_sf(d)))
        late = float(np.median(np.maximum(d, 0.0)))
        whole = by_group[group]  # the noise: what the other ranks hold the group's collectives up by
        others = whole["held_us"].to_numpy(np.float64)[whole["rank"].to_numpy(np.int64) != rank]
        threshold, quantile = _noise(others, int((whole["n"].to_numpy(np.int64) - 1).sum()), p)
        clock = _relative(unc, rank, list(unc))
        ok = p < ALPHA and k >= STRAGGLER_SHARE * m and late > threshold and late > clock
        first = g.iloc[0]
        cand = dict(
            rank=rank,
            steps=m,
            last_steps=k,
            late_median_us=late,
            margin_median_us=float(np.median(d)),
            threshold_us=threshold,
            noise_quantile=quantile,
            p_value=p,
            clock_us=clock,
            at=dict(group=str(group), position=int(pos) + 1, op=str(first["op"]), cseq=int(first["cseq"])),
            ok=ok,
        )
        if ok and (best is None or (p, -late) < (best["p_value"], -best["late_median_us"])):
            best = cand
        elif not ok and p < ALPHA and k >= STRAGGLER_SHARE * m:  # real, but below the noise or the clocks
            cand["reason"] = "clock" if late > 0 and not late > clock else "effect"
            if near is None or (p, -late) < (near["p_value"], -near["late_median_us"]):
                near = cand
    return best, near


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


def of(cross, steps_table) -> dict | None:
    """The verdict of a cross-rank result (``matching.CrossRank`` or ``engine.Results``): from its
    ``step_arrivals`` and clock offsets; None without per-step arrivals. Every output (findings,
    headline, advice) takes it from here, so that they say the same."""
    arrivals = getattr(cross, "step_arrivals", None) if cross is not None else None
    if arrivals is None:
        return None
    # once per (result, steps table): findings, headline and advice each ask (2 s each at 16,384
    # ranks); the entry holds the tables it was computed from, so an id is never reused for another
    cache = cross.__dict__.setdefault("_straggler_verdicts", {}) if hasattr(cross, "__dict__") else {}
    entry = cache.get(id(steps_table))
    if entry is None or entry[0] is not steps_table or entry[1] is not arrivals:
        clock, p2p = getattr(cross, "clock", None), getattr(cross, "p2p_steps", None)
        positions = getattr(cross, "position_arrivals", None)
        entry = cache[id(steps_table)] = (steps_table, arrivals, verdict(arrivals, steps_table, clock, p2p, positions))
    return dict(entry[2])


def verdict(arrivals, steps_table, clock=None, p2p_steps=None, positions=None) -> dict:
    """The straggler verdict from ``step_arrivals`` and ``per_step`` (either form; its stage column
    says which steps are set-up and steady). Keys: ``rank`` (the candidate, or None), ``straggler``
    (bool), ``steps`` (steady steps with two or more ranks), ``last_steps`` (of them, those in which
    the candidate held the others up longest), ``late_median_us`` (its median held_us per step: how
    long the others waited for it), ``margin_median_us`` (its median held_us minus the largest
    other's), ``threshold_us`` (the effect threshold: the other ranks' held_us at ``noise_quantile``,
    ``NOISE_QUANTILE`` or, past ``STRONG_ALPHA``, ``STRONG_NOISE_QUANTILE``),
    ``p_value`` (Bonferroni corrected), ``share_of_step`` (late_median_us over the median step time),
    ``reason`` (why not, when not: ``steps``, too few steady-state steps; ``collectives``, steady
    steps but fewer than two with a collective of two or more ranks (a pipeline's point-to-point
    calls only); ``significance``, ``consistency``, ``effect``, ``clock``), ``setup_rank`` and ``setup_late_us`` (the rank that held set-up up longest and by how
    much longer than the next), ``clock_us`` (the uncertainty of the candidate's arrival against the
    others' from the clock offsets: NaN when one of them is unknown), ``measure`` (``held``, or
    ``work`` for a pipeline: see ``_pipeline``). ``clock``: the per-rank ``data.clock`` summaries;
    ``p2p_steps``: ``matching.p2p_steps`` (either engine's), for steps of point-to-point calls only.
    ``positions``: ``position_arrivals`` (pandas), or ``position_candidates``' result (an engine's):
    where the step's longest hold-up names no straggler, the same tests at each collective's place in
    the step (``measure`` ``position``, and ``at``: its group, place from 1, op and first ``cseq``);
    where none passes them all, ``near``: the most significant place's candidate that passed the
    significance and consistency tests but not the effect's (or the clocks'), with its figures, ``at``
    and ``reason`` (what the report shows of a real hold-up too small to call), else None."""
    stage = steps_table[["step", "stage"]].drop_duplicates("step").set_index("step")["stage"]
    step_of = arrivals["step"].to_numpy()

    def of_stage(name):  # the arrivals of the steps of a stage (a step the table lacks: neither)
        return arrivals[np.isin(step_of, stage.index[stage.to_numpy() == name].to_numpy())]

    out: dict = dict(
        rank=None,
        straggler=False,
        steps=0,
        last_steps=0,
        late_median_us=math.nan,
        margin_median_us=math.nan,
        threshold_us=math.nan,
        noise_quantile=math.nan,
        p_value=math.nan,
        share_of_step=math.nan,
        reason="steps",
        setup_rank=None,
        setup_late_us=math.nan,
        clock_us=0.0,
        measure="held",
        near=None,
    )
    unc = clock_uncertainty(clock, arrivals["rank"].unique().tolist())
    setup = _held(of_stage("setup"))
    if setup is not None and len(setup.columns):
        margin = _margins(setup.iloc[:1])
        best = margin.iloc[0].idxmax()
        if float(margin.iloc[0][best]) > _relative(unc, best, margin.columns):  # else: within the clocks' uncertainty
            out.update(setup_rank=int(best), setup_late_us=float(margin.iloc[0][best]))
    held = _held(of_stage("steady"))
    if held is None or len(held) < 2:
        out["steps"] = 0 if held is None else len(held)
        if (steps_table["stage"] == "steady").sum() >= 2:  # steady steps, but not two with collectives to compare
            out["reason"] = "collectives"
            work = _pipeline(p2p_steps, stage)
            if work is not None and len(work) >= 2:
                margins = _margins(work)
                rank = margins.median().idxmax()
                others = work.drop(columns=[rank])
                noise = (others - others.median()).abs().to_numpy(np.float64).ravel()
                noise = noise[~np.isnan(noise)]
                late = float(np.nanmedian(margins[rank].to_numpy(np.float64)))
                threshold = float(np.quantile(noise, STAGE_NOISE_QUANTILE)) if len(noise) else 0.0
                _decide(
                    out,
                    margins,
                    rank,
                    late,
                    lambda p: (threshold, STAGE_NOISE_QUANTILE),  # a stage's work, not hold-ups
                    steps_table,
                    clock_uncertainty(clock, list(work.columns)),
                )
                out.update(
                    measure="work",
                    work_us=float(np.nanmedian(work[rank].to_numpy(np.float64))),
                    others_work_us=float(np.nanmedian(others.max(axis=1).to_numpy(np.float64))),
                )
        return out
    margins = _margins(held)
    rank = margins.median().idxmax()
    others = held.drop(columns=[rank]).to_numpy(np.float64).ravel()
    others = others[~np.isnan(others)]
    _decide(
        out,
        margins,
        rank,
        float(np.nanmedian(held[rank].to_numpy(np.float64))),
        lambda p: _noise(others, len(others), p),
        steps_table,
        unc,
    )
    if not out["straggler"] and positions is not None:
        if not isinstance(positions, tuple):
            positions = position_candidates(positions, stage.index[stage.to_numpy() == "steady"])
        at, near = _position_verdict(positions[0], positions[1], unc)
        if at is None and near is not None:
            near.pop("ok")
            out["near"] = dict(near, measure="position")
        if at is not None:
            at.pop("ok")
            step_us = _step_us(steps_table)
            share = at["late_median_us"] / step_us if step_us > 0 else math.nan
            out.update(at, straggler=True, reason=None, measure="position", share_of_step=share)
    return out


def _pipeline(p2p_steps, stage):
    """A pipeline's evidence, per steady step (rows) and rank (columns): the rank's work, its step's
    wall time (from its first point-to-point call of the step to its first of the next) less the time
    its thread waited in its sends and receives (``wait_us``; where the log has no waits, the time its
    receives waited for their sends by the issue times: gloo's sends wait for their receives too, so
    that estimate gives a stage waiting in a send to the work of that stage). A pipeline's stages
    wait for each other by construction (a stage's receive for the sending stage's compute), so who
    holds whom up at the calls says more about the schedule than about the ranks; the stage that
    works longest per step sets the pipeline's pace: the others wait for it. None without such
    steps."""
    if p2p_steps is None or not len(p2p_steps):
        return None
    t = p2p_steps.sort_values(["rank", "step"], kind="stable")
    step, rank = t["step"].to_numpy(np.int64), t["rank"].to_numpy(np.int64)
    first = t["first_ns"].to_numpy(np.int64)
    nxt = np.append(step[1:], -1)
    ok = (np.append(rank[1:], -1) == rank) & (nxt == step + 1)
    span = np.where(ok, (np.append(first[1:], 0) - first) / 1e3, np.nan)
    waited = t["wait_us"].to_numpy(np.float64) if "wait_us" in t.columns else np.full(len(t), np.nan)
    waited = np.where(np.isnan(waited), t["recv_wait_us"].to_numpy(np.float64), waited)
    work = t.assign(work_us=span - waited)
    work = work[work["step"].map(stage).to_numpy() == "steady"]
    wide = work.pivot_table(index="step", columns="rank", values="work_us", aggfunc="sum", dropna=False)
    wide = wide[wide.notna().sum(axis=1) >= 2]
    return wide if len(wide) else None


def _decide(out, margins, rank, late, noise, steps_table, unc) -> None:
    """Fill ``out`` with the candidate ``rank``'s figures (``margins``: per step and rank, the rank's
    measure minus the largest other's; ``late``: its median effect, how long the others waited for it
    per step; ``noise(p)``: the others' noise it must exceed at significance p, and its quantile:
    ``_noise``) and the verdict."""
    ranks = margins.columns
    d = margins[rank].to_numpy(np.float64)
    m = len(d)
    step_us = _step_us(steps_table)
    # Bonferroni: two tests, and the candidate was picked from n ranks
    p = min(1.0, 2 * len(ranks) * min(_binom_sf(int((d > 0).sum()), m, 1 / len(ranks)), _trimmed_t_sf(d)))
    threshold, quantile = noise(p)
    out.update(
        rank=int(rank),
        steps=m,
        last_steps=int((d > 0).sum()),
        late_median_us=late,
        margin_median_us=float(np.nanmedian(d)),
        threshold_us=threshold,
        noise_quantile=quantile,
        p_value=p,
        share_of_step=late / step_us if step_us > 0 else math.nan,
    )
    out["clock_us"] = _relative(unc, rank, ranks)
    if late > 0 and not late > out["clock_us"]:  # NaN (an unknown offset) too
        out["reason"] = "clock"
    elif p >= ALPHA:
        out["reason"] = "significance"
    elif out["last_steps"] < STRAGGLER_SHARE * m:
        out["reason"] = "consistency"
    elif not late > out["threshold_us"]:
        out["reason"] = "effect"
    else:
        out.update(straggler=True, reason=None)


def _noise(values, total: int, p: float) -> tuple:
    """(threshold, its quantile): the other ranks' noise a candidate's effect must exceed at
    significance ``p`` (``values``: the others' held times, 0 or more; ``total``: how many, with the
    zeros not in ``values``). The ``NOISE_QUANTILE`` quantile of all of them (a 0 wherever one was not
    the last); where p is below ``STRONG_ALPHA``, the median (``STRONG_NOISE_QUANTILE``) of those
    above 0, the typical hold-up of a rank last by chance, when that is lower (of all of them the
    median is 0 wherever most ranks are not the last: any delay would pass; of those above 0 alone,
    two spikes in 29 steps would set a bar higher than the usual one)."""
    threshold = _padded_quantile(values, total, NOISE_QUANTILE)
    if p < STRONG_ALPHA:
        v = np.asarray(values, np.float64)
        v = v[v > 0]
        typical = float(np.quantile(v, STRONG_NOISE_QUANTILE)) if len(v) else 0.0
        if typical < threshold:
            return typical, STRONG_NOISE_QUANTILE
    return threshold, NOISE_QUANTILE


def place(v: dict) -> str:
    """Where the verdict's evidence is, for its wording: " at the step's 3rd collective of group 0
    (all_reduce)" for the ``position`` measure, else ""."""
    at = v.get("at") if v.get("measure") == "position" else None
    if not at:
        return ""
    n = int(at["position"])
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f" at the step's {n}{suffix} collective of group {at['group']} ({at['op']})"


def _step_us(steps_table) -> float:
    """The median steady-state step time (as ``steady_state``'s step_p50_us); NaN without one."""
    steady = steps_table[steps_table["stage"] == "steady"]
    if "ranks" not in steps_table.columns:  # per rank: the mean over ranks per step
        steady = steady.groupby("step").mean(numeric_only=True)
    times = steady["step_us"].dropna()
    return float(times.median()) if len(times) else math.nan


def _relative(unc, rank, ranks) -> float:
    """The uncertainty of ``rank``'s arrival against the other ``ranks``' (us): its offset's plus the
    largest other's; NaN when one is unknown."""
    others = [unc.get(r, math.nan) for r in ranks if r != rank]
    return unc.get(rank, math.nan) + (
        max(others) if others and not any(map(math.isnan, others)) else (math.nan if others else 0.0)
    )


def _held(table):
    """held_us per step (rows) and rank (columns) of ``table`` (step_arrivals rows), for the steps
    that two or more ranks reached (a rank with no collective in a step held nothing up: 0); None
    without such steps."""
    import pandas as pd

    steps, row = np.unique(table["step"].to_numpy(np.int64), return_inverse=True)
    ranks, col = np.unique(table["rank"].to_numpy(np.int64), return_inverse=True)
    flat, size = row * len(ranks) + col, len(steps) * len(ranks)
    # as pivot_table(aggfunc="sum") gives it, in numpy (1 s of the report at 1,024 ranks x 2,500 steps)
    seen = np.bincount(flat, minlength=size).reshape(len(steps), len(ranks)) > 0
    held = table["held_us"].to_numpy(np.float64)
    sums = np.bincount(flat, weights=np.where(np.isnan(held), 0.0, held), minlength=size)  # sum: NaN skipped
    keep = seen.sum(axis=1) >= 2
    if not keep.any():
        return None
    values = np.where(seen, sums.reshape(len(steps), len(ranks)), np.nan)[keep]
    return pd.DataFrame(values, index=pd.Index(steps[keep], name="step"), columns=pd.Index(ranks, name="rank"))


def _margins(wide):
    """Per step and rank of a held_us table: the rank's held_us minus the largest other rank's."""
    values = wide.to_numpy(np.float64)
    filled = np.where(np.isnan(values), -np.inf, values)
    if values.shape[1] < 2:
        return wide.__class__(np.full_like(values, np.nan), index=wide.index, columns=wide.columns)
    # the largest other is the row's largest, but for the rank that holds it: the second largest
    # (linear in the ranks: a copy of the table without each rank in turn was 19 s at 1,024 ranks)
    rows = np.arange(len(filled))
    top = filled.argmax(axis=1)
    first = filled[rows, top]
    rest = filled.copy()
    rest[rows, top] = -np.inf
    second = rest.max(axis=1)
    others = np.where(np.arange(values.shape[1])[None, :] == top[:, None], second[:, None], first[:, None])
    return wide.__class__(values - others, index=wide.index, columns=wide.columns)


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
    "NOISE_QUANTILE",
    "SETUP_LATE_US",
    "STRAGGLER_SHARE",
    "STRONG_ALPHA",
    "STRONG_NOISE_QUANTILE",
    "clock_uncertainty",
    "of",
    "place",
    "position_arrivals",
    "position_candidates",
    "step_arrivals",
    "verdict",
]
