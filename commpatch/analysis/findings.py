"""Findings: the report's verdict as short sentences, each naming the table behind it.

``findings(...)`` returns a list of ``Finding`` (kind, text, section): section is the key of the
report table that holds the numbers (``steps``, ``ranks``, ``mismatches``, ``summary``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..data.clock import MEASURED, SAME_MACHINE, UNMEASURED
from ..data.schema import compact_ranks, expand_ranks
from . import stragglers
from .pattern import ATTR as PATTERN_ATTR
from .pattern import PATTERN, Found
from .steps import setup_cost, steady_rows, steady_state
from .stragglers import NOISE_QUANTILE, SETUP_LATE_US
from .summaries import summary

# a collective's busbw below this fraction of the best of the same message size is named
SLOW_RATIO = 0.5
# a rank's wall clock this far from rank 0's (us; and beyond the offset's uncertainty) is a finding
CLOCK_NOTED_US = 1000.0
# a world_size above this is not taken as a count of ranks whose logs are missing (a corrupt row)
MAX_WORLD = 1 << 20


class Finding(NamedTuple):
    kind: str  # missing_logs, hang, steps, overhead, setup, ends, clock, straggler, mismatch, bandwidth, engine
    text: str
    section: str  # the report table behind it


def _ms(us) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    return f"{us / 1e3:.3g} ms" if us >= 100 else f"{us:.3g} us"


def _pct(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "<1%" if 0 < x < 0.005 else f"{100 * x:.0f}%"


_SOURCES = {
    "optimizer": "each optimizer.step() (counted automatically)",
    "forward": "each forward of the DDP / FSDP root module (counted automatically: no optimizer step seen)",
    "user": "commpatch.step()",
    PATTERN: "the repeating pattern of collectives",
}


def findings(df, steps_table, cross=None, pre=None) -> list:
    """The findings of one run's log. ``steps_table``: ``per_step(df, by_rank=False)``;
    ``cross``: ``matching.cross_rank(df)`` for a log of several ranks. ``df`` None (the report
    computed at scale by the engine, without the rows in memory): what the findings need of the rows
    comes from ``pre`` (``engine.Results``: setup, ops, unmeasured_ops, bus_summary), and a
    finding says what the engine's report leaves out (``pre.left_out``: ``ENGINE_LEFT_OUT``)."""
    out: list[Finding] = []
    st = steady_state(steps_table)
    # what counted the steps of the steady state (the set-up's may differ: forwards counted before the
    # first optimizer.step() was seen)
    counted = steps_table[steps_table["stage"] == "steady"]
    counted = counted if len(counted) else steps_table
    sources = [s for s in counted["step_source"].astype(str).unique() if s in _SOURCES]
    setup_steps = _steps_text(steps_table.loc[steps_table["stage"] == "setup", "step"])
    found = df.attrs.get(PATTERN_ATTR, {}) if df is not None else {}
    if steps_table["step"].nunique() <= 1:
        why = next((f" ({why})" for why in found.values() if not isinstance(why, Found)), "")
        out.append(
            Finding(
                "steps",
                "no step boundary in the log (no optimizer.step(), DDP / FSDP forward or "
                f"commpatch.step()) and no clear repeating pattern of collectives{why}: figures "
                "are over the whole run, not per step.",
                "steps",
            )
        )
    else:
        how = [f"counted by {_SOURCES[s]}" for s in sources if s != PATTERN]
        if PATTERN in sources:
            how.append(
                f"steps found from the repeating pattern of collectives ({_periods(found, steps_table)}; "
                "no optimizer.step(), DDP / FSDP forward or commpatch.step() in the log)"
            )
        out.append(
            Finding(
                "steps",
                f"{st['steps']} steady-state step(s) of {steps_table['step'].nunique()}, "
                f"{'; '.join(how) or 'from the step column'}; {setup_steps} set-up and the last "
                "one is not timed.",
                "steps",
            )
        )
    if st["steps"] and math.isnan(st["comm_share"]):
        out.append(
            Finding(
                "overhead",
                f"steady-state step: median {_ms(st['step_p50_us'])} (p95 "
                f"{_ms(st['step_p95_us'])}); its communication is unknown: none of its "
                f"{st['calls']:.3g} calls per step has a duration"
                f"{_unmeasured_ops(df, steps_table, pre)}.",
                "steps",
            )
        )
    elif st["steps"]:
        overlapped = st["busy_us"] - st["exposed_us"] - st["overlap_unknown_us"]
        least = "at least " if st["unmeasured"] > 0 else ""
        text = (
            f"steady-state step: median {_ms(st['step_p50_us'])} (p95 {_ms(st['step_p95_us'])}); communication "
            f"is in flight {least}{_pct(st['comm_share'])} of it and the training thread waits for it "
            f"{least}{_pct(st['exposed_share'])} of it (exposed: the overhead)"
        )
        if least:
            text += (
                f"; {st['unmeasured']:.3g} of its {st['calls']:.3g} calls per step have no duration"
                f"{_unmeasured_ops(df, steps_table, pre)}, not counted"
            )
        if st["overlap_unknown_us"] > 0.05 * max(st["busy_us"], 1e-9):
            text += f"; {_ms(st['overlap_unknown_us'])} per step are async calls whose overlap the log cannot tell"
        elif overlapped > 0:
            text += "; the rest overlaps compute"
        text += "."
        if _has_ddp_buckets(df, st, pre):
            packed = st.get("ddp_pack_us", 0) > 0
            if packed:
                text += (
                    f" DDP's packing of gradients into its buckets ({_ms(st['ddp_pack_us'])} per step, "
                    "work of the training thread during the backward) is in both."
                )
            text += (
                " Not in these figures: "
                + (
                    ""
                    if packed
                    else "DDP's copy of each gradient into its bucket (per parameter, during the backward), "
                )
                + "DDP's forward bookkeeping, the compute slowed by communication competing for the CPU or "
                "memory, and what the comm hook commpatch sees the buckets through costs outside their "
                "windows; comparing with a no_sync() step measures them."
            )
        out.append(Finding("overhead", text, "steps"))
    setup = setup_cost(df, steps_table) if df is not None else getattr(pre, "setup", None) or {"setup_comm_us": 0}
    if setup["setup_comm_us"] > 0 and steps_table["step"].nunique() > 1:
        top = setup["by_op"].head(2)
        parts = ", ".join(f"{op} {_ms(us)}" for op, us in top.items() if us > 0)
        share = setup["setup_comm_us"] / setup["comm_total_us"] if setup["comm_total_us"] > 0 else float("nan")
        measured = " measured communication" if setup["unmeasured"] else ""  # unknown is not 0
        what = (
            f"{setup_steps.rsplit(' ', 1)[0]}, up to the first step of the steady state: process group, model "
            "wrapping, first iteration"
        )
        if PATTERN in sources:
            first = int(steps_table["step"].min())
            what = f"step {first}: " + (
                "the calls before the repeating pattern starts" if first == 0 else "the pattern's first iteration"
            )
        out.append(
            Finding(
                "setup",
                f"set-up ({what}) took "
                f"{_ms(setup['setup_us'])}; its communication, {_ms(setup['setup_comm_us'])} per "
                f"rank, is {_pct(share)} of the run's{measured} and left out of the steady state"
                + (f" (largest: {parts})." if parts else "."),
                "steps",
            )
        )
    if cross is not None:
        out += _cross_findings(cross, st, steps_table)
    if df is not None:
        rows = steady_rows(df, steps_table) if st["steps"] else df
        slow = _slowest_bus(summary(rows, by=["collective", "size_bucket"]) if len(rows) else None)
    else:
        slow = _slowest_bus(getattr(pre, "bus_summary", None))
    if slow is not None:
        out.append(slow)
    left_out = str(getattr(pre, "left_out", None) or "")
    if df is None and left_out:  # never a finding left out silently
        out.append(Finding("engine", left_out, "summary"))
    return out


# what the report computed by the DuckDB engine (df None) does not look at, said in its findings: the
# small-message advice beyond engine.ADVICE_ROWS calls (it reads them into memory)
ENGINE_LEFT_OUT = (
    "not looked at by the DuckDB engine: the advice on small messages ({rows:,} steady-state calls with "
    "bytes, more than the {most:,} it reads into memory); `commpatch report --engine pandas` gives it "
    "(docs/reporting.md)."
)


def _steps_text(steps) -> str:
    """'step 0 is' or 'steps 0-1 are' (the set-up steps); 'no step is' without any."""
    steps = sorted({int(x) for x in steps})
    if not steps:
        return "no step is"
    if len(steps) == 1:
        return f"step {steps[0]} is"
    run = steps[-1] - steps[0] == len(steps) - 1  # consecutive (no list of the range: a damaged step is huge)
    return f"steps {steps[0]}-{steps[-1]} are" if run else f"steps {', '.join(map(str, steps))} are"


def _unmeasured_ops(df, steps_table, pre=None) -> str:
    """' (op, op: ...)': the ops of the steady-state calls without a duration (``pre.unmeasured_ops``:
    the engine's)."""
    if df is None:
        ops = list(getattr(pre, "unmeasured_ops", None) or ())
    else:
        rows = steady_rows(df, steps_table)
        ops = sorted(set(rows.loc[rows["duration_us"].isna(), "op"].astype(str)))
    if not ops:
        return ""
    why = []
    if "batch_isend_irecv" in ops:
        why.append("gloo's batch_isend_irecv gives no completion time")
    if {"isend", "irecv"} & set(ops):  # timed at their Work.wait() since: not waited for, or an older log
        why.append("gloo's isend / irecv have one only from the wait() on them: not waited for, or an older log")
    return f" ({'; '.join([', '.join(ops), *why])})"


def _has_ddp_buckets(df, st, pre=None) -> bool:
    if df is not None:
        return bool((df["op"].astype(str) == "ddp_bucket_allreduce").any())
    if getattr(pre, "ops", None) is not None:  # the ops of the engine's rows
        return "ddp_bucket_allreduce" in pre.ops
    return st.get("ddp_finalize_us", 0) > 0


def _periods(found, steps_table) -> str:
    """'period N calls' of the pattern the steps were found from: per rank from ``with_pattern_steps``
    when known, else the calls of the steady-state steps it numbered (one period each)."""
    periods = sorted({f.period for f in found.values() if isinstance(f, Found)})
    if not periods:
        rows = steps_table[(steps_table["step_source"].astype(str) == PATTERN) & (steps_table["stage"] == "steady")]
        periods = [int(round(rows["calls"].median()))] if len(rows) else []
    if not periods:
        return "period unknown"
    return f"period{'s' if len(periods) > 1 else ''} {', '.join(map(str, periods))} calls"


def _cross_findings(cross, st, steps_table) -> list:
    out = []
    for m in cross.mismatches.head(3).itertuples():
        out.append(
            Finding(
                "mismatch",
                f"{m.kind} mismatch in group {m.group}, first at collective #{m.coll_seq + 1} "
                f"(step {m.step}, {m.op}): {m.detail}; {m.affected} collective(s) affected.",
                "mismatches",
            )
        )
    ends = getattr(cross, "log_ends", None)
    if ends is not None and len(ends):
        e = ends.iloc[0]
        more = f" (and in {len(ends) - 1} more group(s))" if len(ends) > 1 else ""
        out.append(
            Finding(
                "ends",
                f"the logs end at different points: in group {e['group']} the log of rank(s) "
                f"{e['ranks']} ends before the others' last collective #{e['group_last'] + 1}{more}; "
                "matching stops at each log's end (a log cut short or a rank that stopped), no "
                "mismatch is inferred after it.",
                "ranks",
            )
        )
    clock = clock_finding(getattr(cross, "clock", None))
    if clock:
        out.append(Finding("clock", clock, "clock"))
    ranks = cross.ranks
    if len(ranks) > 1:
        out.append(Finding("straggler", _straggler_text(ranks, cross, steps_table), "ranks"))
    return out


def clock_finding(clock) -> str:
    """The clocks' finding ('' when there is nothing to say): ranks whose offset to rank 0 is
    unknown while others were measured, and wall clocks that differ by more than ``CLOCK_NOTED_US``."""
    clock = clock or {}
    if not any(c.get("status") in (MEASURED, SAME_MACHINE) for c in clock.values()):
        return ""
    measured = {r: c for r, c in clock.items() if c.get("status") == MEASURED}
    parts = []
    unknown = sorted(r for r, c in clock.items() if c.get("status") == UNMEASURED)
    if unknown:
        parts.append(
            f"the clock offset of rank(s) {_ranks_text(unknown)} to rank 0 is unknown (not measured): their "
            "arrivals are not compared with the other ranks'"
        )
    far = {r: c for r, c in measured.items() if abs(c["offset_us"]) > max(CLOCK_NOTED_US, c["uncertainty_us"])}
    if far:
        r, c = max(far.items(), key=lambda kv: abs(kv[1]["offset_us"]))
        way = "behind" if c["offset_us"] > 0 else "ahead"  # offset: rank 0's clock minus the rank's
        largest = max(m["uncertainty_us"] for m in measured.values())
        parts.append(
            f"the wall clocks of rank(s) {_ranks_text(sorted(far))} differ from rank 0's (the most: rank {r}, "
            f"{_ms(abs(c['offset_us']))} {way}, measured to +/-{_ms(c['uncertainty_us'])}); issue times are "
            f"aligned to rank 0's clock (largest uncertainty +/-{_ms(largest)})"
        )
    jumped = {r: c for r, c in measured.items() if c.get("jumps")}
    if jumped:
        r, c = max(jumped.items(), key=lambda kv: kv[1]["max_offset_us"] - kv[1]["min_offset_us"])
        parts.append(
            f"the offset of rank(s) {_ranks_text(sorted(jumped))} to rank 0 jumped between rounds of the exchange "
            f"beyond their uncertainty (the most: rank {r}, from {_signed_ms(c['min_offset_us'])} to "
            f"{_signed_ms(c['max_offset_us'])}): a stepped clock, or an exchange rewritten through the job's store "
            "(not authenticated). The offsets are applied as measured (table: Clocks) and the rank's uncertainty "
            "covers the jump: no straggler is named within it"
        )
    odd = {r: c for r, c in clock.items() if c.get("status") == SAME_MACHINE and c.get("inconsistent")}
    if odd:
        parts.append(
            f"rank(s) {_ranks_text(sorted(odd))} run on rank 0's machine (same boot id): one wall clock, offset 0, "
            f"though {sum(c['inconsistent'] for c in odd.values())} round(s) of their exchange excluded 0 (a "
            "per-process clock shim, or an exchange rewritten through the job's store): not applied"
        )
    return ("Clocks: " + "; ".join(parts) + ".") if parts else ""


def missing_ranks(df, pre=None) -> list:
    """The ranks of the job with no log here: the members of the groups the rows name, and every
    rank below the rows' world_size, that have no row of their own (a host's directory left out of
    ``commpatch report``: issue 33). ``pre``: the engine's results (its ``missing_logs``, from the
    groups' members), ``df`` then None."""
    if pre is not None:
        return sorted(getattr(pre, "missing_logs", None) or [])
    if df is None or not len(df):
        return []
    import numpy as np

    world: set = set()
    if "group_ranks" in df.columns:
        for s in df["group_ranks"].astype("category").cat.categories:
            world.update(expand_ranks(s))
    if "world_size" in df.columns:
        size = int(np.nanmax(np.asarray(df["world_size"], np.float64), initial=0))
        if size <= MAX_WORLD:
            world.update(range(size))
    return sorted(world - set(np.unique(df["rank"]).tolist()))


def missing_logs_finding(missing, present) -> Finding:
    """The first finding when some ranks of the job have no log: what the rest of the report cannot say."""
    return Finding(
        "missing_logs",
        f"no log for rank(s) {compact_ranks(missing)} of this job: its rows name {len(missing) + len(present)} "
        f"rank(s) (world size, group members), and only rank(s) {compact_ranks(present)} have a log here. "
        "Their collectives, stragglers, hangs and mismatches are not checked: give every host's directory "
        "(`commpatch report HOST_A_DIR HOST_B_DIR`, docs/multi-host.md).",
        "summary",
    )


def _ranks_text(ranks) -> str:
    return ",".join(map(str, ranks[:16])) + (f",... ({len(ranks)} ranks)" if len(ranks) > 16 else "")


def _straggler_text(ranks, cross, steps_table) -> str:
    """The straggler finding: who arrived last how often (descriptive: the verdict's candidate, else
    the first rank of the ranks table), then the verdict of ``stragglers.verdict`` (significance,
    consistency and size over the steady-state steps)."""
    v = stragglers.of(cross, steps_table)
    rows = ranks[ranks["rank"] == v["rank"]] if v is not None and v["rank"] is not None else ranks
    r = rows.iloc[0] if len(rows) else ranks.iloc[0]
    text = (
        f"rank {int(r['rank'])} arrived last in {int(r['last_count'])} of {int(r['collectives'])} "
        f"collectives, {_ms(r['late_us'])} late in total"
    )
    if v is None or v["rank"] is None:
        if v is None:
            text += "; no per-step arrivals to tell a straggler from chance"
        elif v["reason"] == "collectives":
            text += (
                "; no straggler verdict: the steady-state steps have no collective that two or more ranks issued "
                "(point-to-point calls only) to compare the ranks' arrivals"
            )
        else:
            text += "; too few steady-state steps to tell a straggler from chance"
    elif not v["margin_median_us"] > 0:  # no rank holds the others up longest in most steps (symmetric)
        text += (
            f"; no straggler: no rank holds the others up longest in most of the {v['steps']} steady-state "
            f"steps (rank {v['rank']}, the longest by its median, in {v['last_steps']})"
        )
    else:
        if v.get("measure") == "work":
            evidence = (
                f"rank {v['rank']} worked a median {_ms(v['late_median_us'])} per step longer than any other "
                f"pipeline stage ({_pct(v['share_of_step'])} of the step; its step less its receives' waits "
                f"for their sends: {_ms(v['work_us'])} against {_ms(v['others_work_us'])}), the longest of all "
                f"ranks in {v['last_steps']} of {v['steps']} steady-state steps (p = {v['p_value']:.2g} against "
                f"chance; threshold {_ms(v['threshold_us'])}: the other ranks' median variation from step to step)"
            )
            role = "the straggler (the pipeline runs at its pace; the other stages wait for it)"
            text = "a pipeline (steps of point-to-point calls only)"  # arrivals at set-up's collectives: nothing here
        else:
            there = stragglers.place(v)
            noise = _noise(v) + (" at the group's collectives" if there else "")
            evidence = (
                f"rank {v['rank']} held the other ranks up a median {_ms(v['late_median_us'])} per step{there} "
                f"({_pct(v['share_of_step'])} of the step), the longest of all ranks {'there ' if there else ''}in "
                f"{v['last_steps']} of {v['steps']} steady-state steps (p = {v['p_value']:.2g} against chance; "
                f"threshold {_ms(v['threshold_us'])}: {noise})"
            )
            role = "the straggler, the other ranks wait for it"
        if v["straggler"] and v.get("measure") == "work":
            text += f": {evidence}: {role}"
        elif v["straggler"]:
            text += f". {evidence[0].upper()}{evidence[1:]}: {role}"
        else:
            text += f"; no straggler: {evidence}, {_why_not(v['reason'], v['clock_us'])}"
    near = v.get("near") if v is not None and not v["straggler"] else None
    if near:  # a real hold-up at one place, too small to call: said, with its figures
        text += (
            f"; rank {near['rank']} held the other ranks up a median {_ms(near['late_median_us'])} per "
            f"step{stragglers.place(near)}, the longest there in {near['last_steps']} of {near['steps']} "
            f"steps (p = {near['p_value']:.2g}; threshold {_ms(near['threshold_us'])}: {_noise(near)} "
            f"at the group's collectives), {_why_not(near['reason'], near['clock_us'])}"
        )
    if (
        v is not None
        and v["setup_rank"] is not None
        and v["setup_late_us"] >= SETUP_LATE_US
        and not (v["straggler"] and v["setup_rank"] == v["rank"])
    ):
        text += (
            f"; in set-up (not counted) rank {v['setup_rank']} held the others up {_ms(v['setup_late_us'])} "
            "longer than any other rank"
        )
    return text + "."


def _noise(v) -> str:
    """The effect threshold, in words: "the other ranks' 90% quantile", or where the evidence is
    overwhelming "the other ranks' median hold-up when last (p < 1e-06)" (``stragglers._noise``)."""
    q = v.get("noise_quantile", NOISE_QUANTILE)
    if q == stragglers.STRONG_NOISE_QUANTILE and v.get("p_value", 1.0) < stragglers.STRONG_ALPHA:
        return f"the other ranks' median hold-up when last (p < {stragglers.STRONG_ALPHA:.0e})"
    return f"the other ranks' {NOISE_QUANTILE:.0%} quantile"


def _why_not(reason: str, clock_us: float) -> str:
    """Why a straggler candidate was not named (``stragglers.verdict``'s ``reason``), in words."""
    if reason == "clock":
        if math.isnan(clock_us):
            return "not comparable: a clock offset to rank 0 is unknown (not measured)"
        return f"within the uncertainty of the clocks' offsets (+/-{_ms(clock_us)})"
    return {
        "significance": "not more than chance and noise explain",
        "consistency": "not in most steps",
        "effect": "within the other ranks' own noise",
    }[reason]


def _signed_ms(us) -> str:
    return ("-" + _ms(-us)) if us < 0 else _ms(us)


def hang_findings(table, most: int = 3) -> list:
    """The hang findings (``hangs.hangs``'s table), first in the report: the hangs and unmatched
    sends, then calls in flight too briefly to call a hang."""
    out = []
    for h in table.head(most).itertuples():
        when = f"issued {'' if h.issued_exact else 'at least '}{h.waited_s:.3g} s before the end of the logs"
        where = f"{h.op} #{h.number} of group {h.group}"
        if h.kind == "p2p":
            where = (
                f"{h.op} #{h.number} {'to' if h.op in ('send', 'isend', 'send_object_list') else 'from'} "
                f"rank {h.peer} of group {h.group}"
            )
        if h.verdict == "unmatched":
            text = f"unmatched {h.op}: rank {h.waiting}'s {where} ({when}) was never received"
        else:
            many = "-" in h.waiting or " " in h.waiting
            text = f"rank{'s' if many else ''} {h.waiting} wait{'' if many else 's'} in {where} ({when})"
            if h.verdict != "hang":
                text = f"in flight at the end of the logs, too briefly to call a hang: {text}"
        out.append(Finding("hang", f"{'hang: ' if h.verdict == 'hang' else ''}{text}; {h.detail}.", "hangs"))
    return out


def _slowest_bus(s):
    """The collective whose bus bandwidth is lowest relative to the best of the same message size
    (``s``: the summary by collective and size_bucket of the steady-state rows)."""
    if s is None or not len(s):
        return None
    s = s[s["busbw_gbps"].notna() & (s["busbw_gbps"] > 0) & (s["size_bucket"] > 0)]
    if not len(s):
        return None
    best = s.groupby("size_bucket")["busbw_gbps"].transform("max")
    others = s.groupby("size_bucket")["collective"].transform("size")
    s = s.assign(ratio=s["busbw_gbps"] / best)[others > 1]
    if not len(s) or s["ratio"].min() >= SLOW_RATIO:
        return None
    r = s.loc[s["ratio"].idxmin()]
    best_row = s[(s["size_bucket"] == r["size_bucket"])].sort_values("busbw_gbps").iloc[-1]
    return Finding(
        "bandwidth",
        f"{r['collective']} of {_size(r['size_bucket'])} messages reaches "
        f"{r['busbw_gbps']:.3g} GB/s bus bandwidth, {r['ratio']:.0%} of {best_row['collective']} "
        f"at the same size ({best_row['busbw_gbps']:.3g} GB/s).",
        "summary",
    )


def _size(nbytes) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"<= {nbytes / scale:.3g} {unit}"
    return f"<= {int(nbytes)} B"


__all__ = ["ENGINE_LEFT_OUT", "Finding", "clock_finding", "findings", "hang_findings"]
