"""Steps from a repeating pattern of collectives: the last fallback of step detection, offline.

A rank whose rows carry no step boundary (its ``step`` column is constant: no optimizer.step(),
no DDP / FSDP root forward, no ``commpatch.step()``) still repeats itself when it loops: a
hand-written data-parallel update, an inference / serving loop, a pipeline schedule driven by
hand. ``with_pattern_steps(df)`` finds the period of each such rank's sequence of calls, keyed by
(op, group, bytes), and numbers its iterations; nothing of this runs at record time.

Per rank (rows in ``seq`` order, ``key`` the code of (op, group, bytes)):

- candidate periods: for a few keys (the rarest and the most frequent seen at least 3 times), the
  most common distance between an occurrence and the next 1, 2 and 3 occurrences (a key called
  once, twice or three times per iteration);
- a candidate ``p``: the steady part starts at ``s``, the first position from which a whole
  block of ``p`` calls repeats exactly (``key[s:s+p] == key[s+p:s+2p]``): the calls before it
  are the set-up prefix. Its match rate is the share of positions of the steady part (but its
  last p: a partial last iteration is normal) whose call equals the call one period later (a
  call inserted every 10th iteration of 7 calls costs 8 positions in 71: 91%);
- accepted when the match rate is >= ``MIN_MATCH`` and the steady part holds >= ``MIN_ITERATIONS``
  full periods. Of the accepted, the best match rate wins (ties: the shortest), unless a shorter
  accepted period starts its iterations at gaps as long as the winner's (the median idle time of
  the thread before the iteration's first call, >= ``GAP_RATIO`` of the winner's): then the
  shortest such. A model whose layers repeat (a transformer's blocks: the same all-reduces per
  block) matches almost as well at the block's period, but the calls of one block follow the
  previous block's at once, while iterations start after the forward and backward: the block
  is not taken for the step. An extra call every 10th iteration (a logged loss) makes 10
  iterations plus it an exact period too, but the iterations start after equal idle times: the
  iteration is taken;
- iterations start at the block's first call: found from each occurrence (from ``s`` on) of the
  first call of the block whose key occurs once in it, less its offset in the block (so an
  inserted call joins the iteration it falls in and the next one still starts in place), else
  every ``p`` calls from ``s``. Rows before the first start are step 0 (set-up), then 1, 2, ...

Ranks that run the same pattern find the same block and the same first call, so their step
numbers agree for the same iteration; each rank is analysed on its own.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from ..data.attrs import shared
from ..data.schema import BOUNDARY_SOURCES, S_PATTERN, STEP_SOURCES, STEPLESS_ATTR

MIN_MATCH = 0.9  # share of the steady part's positions that must repeat the period
MIN_ITERATIONS = 3  # full periods the steady part must hold
GAP_RATIO = 0.5  # a shorter period is taken when its iterations start after gaps this long
PATTERN = STEP_SOURCES[S_PATTERN]  # the step_source of the rows numbered here
ATTR = "step_pattern"  # df.attrs key: rank -> Found or the reason it was refused
_KEYS_RARE, _KEYS_COMMON, _OFFSETS = 12, 4, 3


class StepPatternWarning(UserWarning):
    """A rank without step boundaries whose calls show no clear repeating pattern."""


class Found(NamedTuple):
    """A pattern found on a rank."""

    period: int  # calls per iteration
    steps: int  # iterations numbered (the last may be partial)
    match: float  # share of the steady part's positions that repeat the period
    start: int  # where the first iteration starts (the rank's row, in seq order)


def with_pattern_steps(df, warn: bool = True, window=None):
    """``df`` with steps found from the repeating pattern of collectives on every rank whose
    ``step`` is constant and that no recorded source counted (see the module docstring): those
    rows get their iteration number in ``step`` and ``pattern`` in ``step_source``; other rows
    are unchanged. Ranks without a clear pattern are left alone, with one ``StepPatternWarning``
    saying why. The result records what was found per rank in ``attrs['step_pattern']`` (rank ->
    ``Found`` or the reason, a string); a frame that has it is returned as it is, so calling this
    again (``per_step``, ``build_report``, ``scaling`` each do) costs nothing. ``df`` itself is
    not modified (a frame with recorded steps pays only the check for constant ranks).
    ``window``: ``(first, stop)`` (None: open) keeps the rows with ``first <= step < stop``
    afterwards (``io.read(steps=...)`` reads the ranks with no step boundary whole, for this)."""
    out = _find(df, warn)
    if window is None or window == (None, None):
        return out
    step = out["step"].to_numpy()
    keep = np.ones(len(out), bool)
    if window[0] is not None:
        keep &= step >= window[0]
    if window[1] is not None:
        keep &= step < window[1]
    return out if keep.all() else out[keep].reset_index(drop=True)


def _find(df, warn):
    if ATTR in df.attrs or not len(df) or not {"rank", "step", "op", "group", "bytes"} <= set(df.columns):
        return df
    import pandas as pd

    rank = df["rank"].to_numpy(np.int64)
    step = df["step"].to_numpy(np.int64)
    # ranks whose step is constant (O(n), no sort: a log with steps costs only this)
    span = pd.Series(step).groupby(rank, sort=False).agg(["min", "max"])
    flat = span.index.to_numpy()[(span["min"] == span["max"]).to_numpy()]
    if STEPLESS_ATTR in df.attrs:  # read with a window of steps: only the ranks read whole
        flat = flat[np.isin(flat, df.attrs[STEPLESS_ATTR])]
    if not len(flat):
        return df
    rows = np.flatnonzero(np.isin(rank, flat)) if len(flat) < len(span) else np.arange(len(df))
    if "step_source" in df.columns:  # a recorded source counted them: not ours
        counted = np.unique(rank[rows][_recorded(df["step_source"])[rows]])
        if len(counted):
            rows = rows[~np.isin(rank[rows], counted)]
    if not len(rows):
        return df
    seq = df["seq"].to_numpy(np.int64)[rows] if "seq" in df.columns else rows
    order = rows[np.lexsort((seq, rank[rows]))]  # the stepless ranks' rows, by rank then seq
    r = rank[order]
    bounds = np.flatnonzero(np.r_[True, r[1:] != r[:-1], True])
    key = _keys(df, order)
    idle = _idle_ns(df, order, r)
    results: dict = {}
    new_step = step.copy()
    changed = np.zeros(len(df), bool)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        found, numbers = find_steps(key[lo:hi], idle[lo:hi])
        results[int(r[lo])] = found
        if isinstance(found, Found):
            new_step[order[lo:hi]] = numbers
            changed[order[lo:hi]] = True
    out = df.copy(deep=False)
    out.attrs = {**df.attrs, ATTR: shared(results)}
    if changed.any():
        out["step"] = new_step
        if "step_source" in out.columns:
            out["step_source"] = _with_source(out["step_source"], changed)
    if warn:
        warn_refused(results, stacklevel=4)
    return out


def warn_refused(results: dict, stacklevel: int = 2) -> None:
    """One ``StepPatternWarning`` for the ranks of ``results`` (rank -> ``Found`` or the reason,
    ``attrs['step_pattern']``) left without steps, if any."""
    refused = {rank: why for rank, why in results.items() if not isinstance(why, Found)}
    if refused:
        warnings.warn(_refusal(refused), StepPatternWarning, stacklevel=stacklevel)


def find_steps(key, idle=None):
    """The steps of one rank's sequence of calls (``key``: an integer code per call, in issue
    order; ``idle``: the thread's idle time before each call, or None): (``Found``, the step of
    each call) when the pattern is clear, else (the reason, None)."""
    key = np.asarray(key, np.int64)
    n = len(key)
    if n < 2 * MIN_ITERATIONS:
        return f"{n} call(s): too few to repeat", None
    accepted, best_rejected = [], (0.0, 0)
    for p in _candidates(key):
        start = _steady_start(key, p)
        if start is None or (n - start) // p < MIN_ITERATIONS:
            continue
        match = _match_rate(key, p, start)
        if match >= MIN_MATCH:
            accepted.append((p, start, match))
        elif match > best_rejected[0]:
            best_rejected = (match, p)
    if not accepted:
        if best_rejected[1]:
            match, p = best_rejected
            return (
                f"the best period ({p} call{'s' if p > 1 else ''}) repeats in {match:.0%} of the calls "
                f"(under {MIN_MATCH:.0%})"
            ), None
        return f"no period repeats {MIN_ITERATIONS} times", None
    p, start, match = _choose(key, accepted, idle)
    starts = _iteration_starts(key, p, start)
    numbers = np.zeros(n, np.int64)
    numbers[starts] = 1
    numbers = np.cumsum(numbers)
    return Found(int(p), len(starts), float(match), int(starts[0])), numbers


def _choose(key, accepted, idle):
    """The period taken among the accepted (p, start, match): see the module docstring."""
    if idle is None:  # no timing to tell a block of layers from an iteration
        return min(accepted)
    accepted.sort(key=lambda a: (-a[2], a[0]))
    best = accepted[0]
    shorter = sorted(a for a in accepted if a[0] < best[0])
    if not shorter:
        return best
    best_gap = _start_gap(key, best, idle)
    for a in shorter:
        if _start_gap(key, a, idle) >= GAP_RATIO * best_gap:
            return a
    return best


def _start_gap(key, accepted, idle) -> float:
    """The median idle time before the first call of the iterations of an accepted period."""
    p, start, _ = accepted
    gaps = idle[_iteration_starts(key, p, start)]
    gaps = gaps[~np.isnan(gaps)]
    return float(np.median(gaps)) if len(gaps) else 0.0


def _iteration_starts(key, p, start):
    """Where iterations start: at the block's first call, found from the occurrences of the
    block's first call that occurs once in it (an inserted call joins the iteration it falls in,
    the next iteration still starts in place), else every p calls from ``start``."""
    block = key[start : start + p]
    values, first, counts = np.unique(block, return_index=True, return_counts=True)
    once = first[counts == 1]
    if len(once):
        offset = int(once.min())
        anchor = start + offset
        starts = anchor + np.flatnonzero(key[anchor:] == key[anchor]) - offset
        return starts[starts >= start]
    return np.arange(start, len(key), p)  # a partial last iteration is a step of its own


def _candidates(key):
    """Candidate periods: the most common distance to the next 1..3 occurrences of a few keys."""
    n = len(key)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    edges = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1], True])
    counts = np.diff(edges)
    often = np.flatnonzero(counts >= MIN_ITERATIONS)
    if not len(often):
        return []
    by_count = often[np.argsort(counts[often], kind="stable")]
    chosen = np.unique(np.r_[by_count[:_KEYS_RARE], by_count[-_KEYS_COMMON:]])
    out = set()
    for k in chosen:
        pos = order[edges[k] : edges[k + 1]]  # sorted: argsort is stable
        for c in range(1, _OFFSETS + 1):
            if len(pos) <= c:
                break
            d = pos[c:] - pos[:-c]
            d = d[d <= n // MIN_ITERATIONS]
            if len(d):
                out.add(int(np.bincount(d).argmax()))
    out.discard(0)
    return sorted(out)


def _steady_start(key, p):
    """The first position from which a whole block of p calls repeats exactly, or None."""
    same = key[:-p] == key[p:]
    falses = np.flatnonzero(~same)
    run_starts = np.r_[0, falses + 1]
    run_ends = np.r_[falses, len(same)]
    long = np.flatnonzero(run_ends - run_starts >= p)
    return int(run_starts[long[0]]) if len(long) else None


def _match_rate(key, p, start) -> float:
    """Share of the positions from ``start`` (but the last p: a partial last iteration is normal)
    whose call equals the one p calls later."""
    k = key[start:]
    return float((k[:-p] == k[p:]).mean()) if len(k) > p else 0.0


def _keys(df, rows):
    """An integer code for (op, group, bytes) of each of ``rows``."""
    import pandas as pd

    codes = []
    for column in ("op", "group", "bytes"):
        col = df[column]
        values = col.cat.codes.to_numpy()[rows] if col.dtype.name == "category" else col.to_numpy()[rows]
        codes.append(pd.factorize(values, sort=False)[0].astype(np.int64))
    sizes = [int(c.max()) + 2 for c in codes]
    return ((codes[0] + 1) * sizes[1] + codes[1] + 1) * sizes[2] + codes[2] + 1


def _idle_ns(df, rows, rank):
    """For each of ``rows`` (by rank, then seq; ``rank`` their ranks): the calling thread's time
    outside commpatch's calls before it (its issue minus the previous call's issue and time in the
    call), NaN for a rank's first row or without issue times."""
    out = np.full(len(rows), np.nan)
    if "start_ns" not in df.columns or len(rows) < 2:
        return out
    start = df["start_ns"].to_numpy(np.int64)[rows]
    inside = (
        np.nan_to_num(df["host_us"].to_numpy(np.float64)[rows]) * 1e3
        if "host_us" in df.columns
        else np.zeros(len(rows))
    )
    gap = (start[1:] - start[:-1]).astype(np.float64) - inside[:-1]
    gap[rank[1:] != rank[:-1]] = np.nan
    out[1:] = gap
    return out


def _recorded(source):
    """Rows whose step a recorded boundary counted (user, optimizer, forward)."""
    if source.dtype.name == "category":
        cats = np.array([str(c) in BOUNDARY_SOURCES for c in source.cat.categories] + [False])
        return cats[source.cat.codes.to_numpy()]
    return source.astype(str).isin(BOUNDARY_SOURCES).to_numpy()


def _with_source(source, changed):
    """The step_source column with ``pattern`` on the changed rows (categorical kept)."""
    import pandas as pd

    cat = source if source.dtype.name == "category" else source.astype(str).astype("category")
    categories = list(cat.cat.categories)
    if PATTERN not in categories:
        categories.append(PATTERN)
    codes = cat.cat.codes.to_numpy().astype(np.int64)
    codes[changed] = categories.index(PATTERN)
    result = pd.Categorical.from_codes(codes, categories=categories)
    return pd.Series(result, index=source.index, name=source.name).cat.reorder_categories(sorted(categories))


def _refusal(refused: dict) -> str:
    """One sentence for every rank left without steps."""
    by_reason: dict = {}
    for rank, why in sorted(refused.items()):
        by_reason.setdefault(why, []).append(rank)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}: {why}" for why, ranks in by_reason.items()]
    shown = "; ".join(parts[:3]) + (f"; {len(parts) - 3} other reason(s)" if len(parts) > 3 else "")
    return (
        "no step boundary (optimizer.step(), DDP / FSDP forward, commpatch.step()) and no clear repeating "
        f"pattern of collectives, steps not numbered ({shown}); figures are over the whole run"
    )


def _ranks(ranks) -> str:
    return ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")


__all__ = [
    "Found",
    "MIN_ITERATIONS",
    "MIN_MATCH",
    "StepPatternWarning",
    "find_steps",
    "warn_refused",
    "with_pattern_steps",
]
