"""The report's headline: its key figures as numbers, computed once from the report's tables and
shown the same by every output (text, JSON, HTML).

``headline(steps_table, summary_table, cross, ranks, calls)`` returns a plain dict (JSON-ready:
unknown figures are None, never 0):

- ``step_us`` / ``step_p95_us``: median and p95 of the steady-state step time (``steady_state``);
  ``steady_steps`` of ``steps`` steps;
- ``comm_share`` / ``exposed_share``: medians over the steady state, as in the per-step table;
  ``shares_at_least``: True when some steady-state calls have no duration (the shares are lower
  bounds);
- ``wait_share`` / ``framework_share``: ``exposed_share`` split in two: a framework's own work on
  the training thread counted exposed (DDP's packing of gradients into its buckets and its
  finalize after the last bucket: copies, not waiting; the median over the steady state), and the
  rest, the thread waiting for communication; None where unknown;
- ``top_collective``: the row with the most communication time of the steady-state summary
  (``steady_summary``: set-up steps and set-up calls left out, as everywhere else; the whole
  log's summary where there is no steady state: ``steady_state`` False): its key columns,
  ``time_share``, ``total_us``, ``busbw_gbps``, ``count``; calls without a duration (unknown
  time) are never the top;
- ``straggler``: ``verdict`` straggler / none / unknown with the evidence of
  ``stragglers.verdict`` (rank, last_steps of steps, late_median_us, share_of_step, p_value, reason);
- ``hang``: ``verdict`` hang (the logs say who waits in which call: ``analysis.hangs``) / possible
  (calls in flight too briefly to call a hang, a send never received, or some ranks' logs stop
  before collectives the others issued) /
  none_seen (every log reaches its groups' last collective) / unknown (one rank's log);
- ``mismatches``: how many, and the first (kind, group, coll_seq, step, op).
"""

from __future__ import annotations

import math

import numpy as np

from ..data.schema import compact_ranks
from . import stragglers
from .steps import steady_state

KEY_COLUMNS = ("collective", "op", "api", "size_bucket", "group", "dtype")
HANG_PREFIX = "hang: "  # the start of a definite hang finding (findings.hang_findings)


def _num(x):
    """A JSON number, or None for unknown (NaN, None)."""
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def headline(
    steps_table,
    summary_table,
    cross=None,
    ranks: int = 1,
    calls: int = 0,
    findings=(),
    missing_logs=(),
    steady_summary=None,
) -> dict:
    st = steady_state(steps_table)
    out = dict(
        ranks=int(ranks),
        calls=int(calls),
        steps=int(steps_table["step"].nunique()),
        steady_steps=int(st["steps"]),
        step_us=_num(st["step_p50_us"]),
        step_p95_us=_num(st["step_p95_us"]),
        comm_share=_num(st["comm_share"]),
        exposed_share=_num(st["exposed_share"]),
        shares_at_least=bool(st["unmeasured"] > 0) if not math.isnan(st["unmeasured"]) else False,
        **_exposed_split(steps_table, st["exposed_share"]),
    )
    steady = _top(steady_summary)
    out["top_collective"] = steady if steady is not None else _top(summary_table)
    if out["top_collective"] is not None:
        out["top_collective"]["steady_state"] = steady is not None
    out["straggler"] = _straggler(cross, steps_table)
    out["missing_logs"] = [int(r) for r in missing_logs]  # ranks of the job with no log here (findings.missing_ranks)
    if missing_logs and out["straggler"]["verdict"] == "unknown":
        why = out["straggler"]["reason"]
        out["straggler"]["reason"] = f"no log for rank(s) {compact_ranks(missing_logs)}" + (
            ": only one rank's log read" if why == "one rank" else f"; {why}" if why else ""
        )
    out["hang"] = _hang(cross, findings)
    mm = getattr(cross, "mismatches", None) if cross is not None else None
    out["mismatches"] = int(len(mm)) if mm is not None else None
    out["first_mismatch"] = None
    if mm is not None and len(mm):
        m = mm.iloc[0]
        out["first_mismatch"] = dict(
            kind=str(m["kind"]),
            group=str(m["group"]),
            coll_seq=int(m["coll_seq"]),
            step=int(m["step"]) if _num(m["step"]) is not None else None,
            op=str(m["op"]),
        )
    return out


def _exposed_split(steps_table, exposed_share: float) -> dict:
    """``exposed_share`` (the steady state's median) split into waiting and framework work, which
    add up to it."""
    steady = steps_table[steps_table["stage"] == "steady"]
    if not len(steady) or "ddp_pack_us" not in steady or _num(exposed_share) is None:
        return dict(wait_share=None, framework_share=None)
    own = (steady["ddp_pack_us"].fillna(0) + steady["ddp_finalize_us"].fillna(0)).to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        framework = own / steady["step_us"].to_numpy(float)
    framework = framework[np.isfinite(framework)]
    if not len(framework):
        return dict(wait_share=None, framework_share=None)
    part = min(float(np.median(framework)), exposed_share)
    return dict(wait_share=exposed_share - part, framework_share=part)


def _top(summary_table):
    if summary_table is None or not len(summary_table) or "total_us" not in summary_table:
        return None
    if not summary_table["total_us"].notna().any():  # no call with a duration: no top
        return None
    row = summary_table.loc[summary_table["total_us"].idxmax()]
    top = {c: (row[c].item() if hasattr(row[c], "item") else row[c]) for c in KEY_COLUMNS if c in summary_table.columns}
    top = {c: (str(v) if not isinstance(v, (int, float)) else v) for c, v in top.items()}
    for col in ("time_share", "total_us", "busbw_gbps", "count"):
        top[col] = _num(row[col]) if col in summary_table.columns else None
    return top


def _straggler(cross, steps_table) -> dict:
    v = stragglers.of(cross, steps_table)
    if v is None:
        return dict(verdict="unknown", reason="one rank" if cross is None else "no per-step arrivals", rank=None)
    if v["rank"] is None:
        state = "unknown"
    else:
        state = "straggler" if v["straggler"] else "none"
    return dict(
        verdict=state,
        **_evidence(v),
        share_of_step=_num(v["share_of_step"]),
        reason=None if v["straggler"] else v["reason"],
        # held: the others' wait at the step's collectives (its longest); position: at one collective's
        # place in the step (``at``: group, position from 1, op); work: a pipeline stage's work per step
        measure=v["measure"],
        at=_at(v) if v["measure"] == "position" else None,
        near=_near(v),
    )


def _evidence(v) -> dict:
    """A straggler candidate's figures (the verdict's, or its ``near``)."""
    return dict(
        rank=v["rank"],
        last_steps=int(v["last_steps"]),
        steps=int(v["steps"]),
        late_median_us=_num(v["late_median_us"]),
        threshold_us=_num(v["threshold_us"]),
        noise_quantile=_num(v.get("noise_quantile", math.nan)),
        p_value=_num(v["p_value"]),
    )


def _at(v) -> dict:
    return {k: v["at"][k] for k in ("group", "position", "op")}


def _near(v) -> dict | None:
    """Where no straggler is named: a rank that held one place of the step up significantly, in
    most steps, but by less than the noise (or the clocks' uncertainty) there, with its figures."""
    near = v.get("near") if not v["straggler"] else None
    return dict(_evidence(near), reason=near["reason"], at=_at(near)) if near else None


def _hang(cross, findings) -> dict:
    told = next((f for f in findings if getattr(f, "kind", None) == "hang"), None)
    if told is not None:  # a hang finding of its own: it has the last word (definite when it says 'hang: ')
        definite = told.text.startswith(HANG_PREFIX)
        return dict(
            verdict="hang" if definite else "possible",
            text=told.text[len(HANG_PREFIX) :] if definite else told.text,
            group=None,
            ranks=None,
            last_coll_seq=None,
            group_last=None,
        )
    if cross is None:
        return dict(
            verdict="unknown",
            text="one rank's log: nothing to compare",
            group=None,
            ranks=None,
            last_coll_seq=None,
            group_last=None,
        )
    ends = getattr(cross, "log_ends", None)
    if ends is None or not len(ends):
        return dict(
            verdict="none_seen",
            text="every rank's log reaches its groups' last collective",
            group=None,
            ranks=None,
            last_coll_seq=None,
            group_last=None,
        )
    e = ends.iloc[0]
    return dict(
        verdict="possible",
        text=f"in group {e['group']} the log of rank(s) {e['ranks']} stops before "
        f"collective #{int(e['group_last']) + 1}, which other ranks issued",
        group=str(e["group"]),
        ranks=str(e["ranks"]),
        last_coll_seq=int(e["last_coll_seq"]),
        group_last=int(e["group_last"]),
    )


__all__ = ["headline"]
