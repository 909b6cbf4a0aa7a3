"""Renderers: analysis DataFrames -> text (summary tables, the report as text, Markdown or JSON)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from .. import analysis as _analysis
from ..analysis import advice as _advice
from ..analysis import findings as _findings
from ..analysis import hangs, matching, pattern, summaries
from ..analysis import steps as _steps
from ..analysis.headline import headline as _headline
from ..data.clock import MEASURED, SAME_MACHINE
from ..data.logfile import JOB_ATTR
from . import people
from .people import human_bytes, terminal_safe


def render_csv(df) -> str:
    """A table as CSV text, its strings made ``terminal_safe`` (``commpatch report --format csv``)."""

    def safe(value):
        return terminal_safe(value) if isinstance(value, str) else value

    text = [c for c in df.columns if df[c].dtype.kind not in "iufbmM"]
    return df.assign(**{c: df[c].map(safe) for c in text}).to_csv(index=False)


def _fmt(value, col: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if col == "size_bucket":  # an upper bound, in the units of the bytes column (decimal)
        return "<= " + human_bytes(value)
    if col == "bytes" or col.endswith("_bytes"):
        return human_bytes(value)
    if col == "time_share" or col.endswith("_share"):
        return f"{100 * value:.1f}%"
    if col.endswith("_us"):
        return f"{value:,.1f}"
    if col.endswith("_gbps"):  # 3 significant digits: an 8-byte call is 0.000123, not 0.000
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.3f}"
    if col.endswith("_per_s") or col in ("efficiency", "speedup"):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return terminal_safe(value)


def render_text(df, title: str = "commpatch summary") -> str:
    """A plain aligned table (no colours), one row per summary row; strings ``terminal_safe``."""
    cols = [terminal_safe(c) for c in df.columns]
    cells = [[_fmt(v, c) for v, c in zip(row, df.columns)] for row in df.itertuples(index=False)]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    numeric = [df[c].dtype.kind in "iuf" for c in df.columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))

    out = [terminal_safe(title), line(cols), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def render_markdown(df) -> str:
    cols = list(df.columns)
    out = [
        "| " + " | ".join(map(terminal_safe, cols)) + " |",
        "|" + "|".join("---:" if df[c].dtype.kind in "iuf" else "---" for c in cols) + "|",
    ]
    out += ["| " + " | ".join(_fmt(v, c) for v, c in zip(row, cols)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(out)


# ---- the full report ----------------------------------------------------------------------
SECTIONS = {  # key -> title, in the order they are rendered
    "hangs": "Calls in flight at the end of the logs (hangs first; who never joined them: in the findings)",
    "mismatches": "Mismatches (the same collective differs across ranks: jobs hang here)",
    "summary": "Per collective and message size (count, total_us, own_us, bytes: summed over all ranks' calls; "
    "per_rank: count per rank; mean, p50, p95, max: per call)",
    "steps": "Per step (mean over ranks; stage setup / steady / end)",
    "ranks": "Ranks by how long and how often they arrived last (stragglers first; per rank: sums over its "
    "collectives)",
    "rank_steps": "Ranks' steps (per rank: medians over its steady-state steps; outside_us = step_us - busy_us, "
    "busy_us: communication in flight, async calls included; cpu_us: its training thread's CPU time; input_us: "
    "from the step's start to its first forward)",
    "skew": "Collectives with the largest arrival skew (one row per collective, over the ranks that issued it)",
    "p2p": "Point-to-point channels (matched pairwise; per channel: summed over its pairs)",
    "clock": "Clocks (per rank: its wall clock's offset to rank 0's, as measured during the run; rank 0's clock "
    "minus the rank's, added to its issue times)",
}


# columns of a section left out of the text and Markdown tables (said in its findings; in JSON and CSV)
_NOT_IN_TABLES = {"hangs": ("detail", "issued_ns", "end_ns")}


def _table(key, frame):
    hidden = [c for c in _NOT_IN_TABLES.get(key, ()) if c in frame.columns]
    return frame.drop(columns=hidden) if hidden else frame


# the log columns build_report reads: enough to load for a report of a very large log
REPORT_COLUMNS = _analysis.REPORT_COLUMNS


@dataclass
class Report:
    """Data of a full report: named DataFrames, error lines and notes. Renderers turn it into text."""

    title: str
    sections: dict = field(default_factory=dict)  # key of SECTIONS -> DataFrame
    errors: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    findings: list = field(default_factory=list)  # analysis.findings.Finding, rendered first
    headline: dict = field(default_factory=dict)  # analysis.headline.headline: the key figures, shown first
    advice: list = field(default_factory=list)  # analysis.advice.Advice, rendered after the findings


def build_report(
    df, by=("collective", "size_bucket"), steps=None, top: int = 10, cross=None, precomputed=None, run=None
) -> Report:
    """Run every analysis that applies to ``df`` and collect the results (nothing is printed).

    ``steps``: optional user step times (see ``summaries.per_step``). ``cross``: a precomputed
    ``matching.cross_rank(df)``; computed here when the log has more than one rank.
    ``precomputed``: the same tables from the analytic engine (``analysis.engine.Results``),
    for logs too large for one DataFrame; ``df`` is then not used.
    """

    pre = precomputed
    # step marks, DDP / FSDP settings: the advice's
    job = df.attrs.get(JOB_ATTR) if df is not None else getattr(precomputed, "job", None)
    if df is not None:
        df = pattern.with_pattern_steps(df)  # a log without step boundaries: steps from its calls' pattern
    ranks = pre.rank_list if pre is not None else sorted(df["rank"].unique().tolist())
    calls = pre.calls if pre is not None else len(df)
    run = run if run is not None or df is None else df.attrs.get("run")  # (run read, runs in its directory)
    rep = Report(title=f"commpatch report: {_run_text(run)}{calls} calls, {len(ranks)} rank(s) {_span(ranks)}")
    if pre is None and len(ranks) > 1:  # the bandwidth from the arrival-free transfer time
        cross = cross if cross is not None else matching.cross_rank(df)
        df = matching.with_transfer(df, cross)
    table = pre.summary if pre is not None else summaries.summary(df, by=by)
    table.insert(table.columns.get_loc("count") + 1, "per_rank", table["count"] / max(len(ranks), 1))
    rep.sections["summary"] = table
    unmeasured = pre.unmeasured if pre is not None else int(np.isnan(summaries.durations(df)).sum())
    if unmeasured:
        rep.notes.append(
            f"{unmeasured} call(s) have no duration (timing 'none', or not known): counted, not in times or bandwidth."
        )
    per_step = pre.per_step if pre is not None else _steps.per_step(df, steps=steps, by_rank=False)
    rep.sections["steps"] = per_step
    rep.notes += _step_notes(per_step)
    cr = by_rank = None
    if len(ranks) > 1:
        cr = pre if pre is not None else cross if cross is not None else matching.cross_rank(df)
        rep.sections["mismatches"] = cr.mismatches
        rep.errors += [
            f"{m.kind} mismatch in group {m.group} at collective #{m.coll_seq + 1} (step {m.step}, {m.op}): "
            f"{m.detail}; {m.affected} collective(s) affected"
            for m in cr.mismatches.itertuples()
        ]
        rep.sections["ranks"] = cr.ranks
        by_rank = pre.by_rank_steps if pre is not None else _steps.per_step(df, steps=steps, by_rank=True)
        if by_rank is not None:
            rep.sections["rank_steps"] = _advice.rank_steps(by_rank, _advice.step_marks(job))
        rep.sections["skew"] = pre.skew if pre is not None else matching.top_skew(cr.collectives, top)
        if pre is not None and pre.p2p is not None and len(pre.p2p):
            rep.sections["p2p"] = pre.p2p
        elif pre is None and len(cr.p2p):
            rep.sections["p2p"] = _p2p_channels(cr.p2p)
        excluded = pre.p2p_calls if pre is not None else int(df["op"].isin(matching.P2P_OPS).sum())
        if excluded:
            batch = pre.batch_calls if pre is not None else int((df["op"] == "batch_isend_irecv").sum())
            rep.notes.append(
                f"{excluded} point-to-point call(s) are matched pairwise, not across all ranks"
                + (f"; {batch} batch_isend_irecv call(s) carry no peer and are not matched." if batch else ".")
            )
        for e in cr.log_ends.itertuples() if getattr(cr, "log_ends", None) is not None else ():
            rep.notes.append(
                f"group {e.group}: the log of rank(s) {e.ranks} ends before the others' last collective "
                f"#{e.group_last + 1}: the {e.unmatched} collective(s) after the first end are matched "
                "over the ranks whose log reaches them, not reported as missing (a log cut short, a write "
                "failure, or a rank that stopped)."
            )
        if cr.missing_logs:
            rep.notes.append(
                f"no log for rank(s) {_span(cr.missing_logs)} (members of a group): their collectives are not checked."
            )
        rep.notes.append(
            "bandwidth (algbw, busbw): bytes over transfer_us, from the last rank's issue to completion "
            "(where every member of the group has a log; else own_us); busbw_with_wait_gbps: over "
            "own_us, which counts each rank's wait for the ranks that issued later."
        )
        clock = getattr(cr, "clock", None) or {}
        if clock:
            rep.sections["clock"] = _clock_table(clock)
        rep.notes.append(
            "skew = latest minus earliest issue time (start_ns) of the same collective; "
            + (
                "issue times are on rank 0's wall clock, each rank's aligned by its measured offset "
                "(table: Clocks; a skew within the offsets' uncertainty is not a straggler)"
                if any(c.get("status") in (MEASURED, SAME_MACHINE) for c in clock.values())
                else "no clock offset was measured in these logs (older logs, CSV or Parquet input): the "
                "issue times are compared as each host's wall clock gave them, which includes clock "
                "differences between hosts"
            )
            + ". wait = time a rank's call spent until the last rank issued it (bounded by its measured "
            "duration)."
        )
    else:
        rep.notes.append(
            "one rank only: no cross-rank matching (give every rank's file for stragglers and mismatches)."
        )
    rep.findings = _findings.findings(df, per_step, cr, pre=pre)
    # first: what the ranks wait in at the end of the logs (analysis.hangs; the engine's from its digests)
    waits = hangs.hangs(df) if df is not None else getattr(pre, "hangs", None)
    if waits is not None and len(waits):
        rep.sections["hangs"] = waits
        rep.findings[:0] = _findings.hang_findings(waits)
        _explained_ends(rep, waits, cr)
    missing = _findings.missing_ranks(df, pre)
    if missing:  # first of all: what the report cannot say (a host's directory left out)
        rep.findings.insert(0, _findings.missing_logs_finding(missing, ranks))
    rep.headline = _headline(
        per_step,
        table,
        cr,
        ranks=len(ranks),
        calls=calls,
        findings=rep.findings,
        missing_logs=missing,
        steady_summary=_steady_summary(df, per_step, by, pre),
    )
    rows = df if pre is None else pre.advice_rows  # the engine's: the rows the rules read (engine._advice_rows)
    rep.advice = _advice.advice(rows, per_step, cr, by_rank=by_rank, job=job)
    return rep


def _explained_ends(rep: Report, waits, cross) -> None:
    """Logs that end early in groups where a hang says who waits for whom: the hang finding explains
    them (the ranks are alive, waiting); the 'ends' finding would suggest a log cut short."""
    ends = getattr(cross, "log_ends", None)
    hung = set(waits.loc[waits["verdict"] == "hang", "group"].astype(str))
    if ends is not None and len(ends) and set(ends["group"].astype(str)) <= hung:
        rep.findings = [f for f in rep.findings if f.kind != "ends"]


def _steady_summary(df, per_step, by, pre):
    """The summary of the steady state (set-up steps and calls left out) by ``by``, for the
    headline; None where there is no steady state (the engine has it by collective and size)."""
    if not (per_step["stage"] == "steady").any():
        return None
    if pre is not None:
        return pre.bus_summary if list(by) == ["collective", "size_bucket"] else None
    rows = _steps.steady_rows(df, per_step)
    return summaries.summary(rows, by=by) if len(rows) else None


def _clock_table(clock):
    """The Clocks section: rank, status (``data.clock``: reference, same_machine, measured,
    unmeasured), offset_us (the median applied), uncertainty_us, min_offset_us / max_offset_us (the
    offsets applied over the run), jumps (rounds whose offset left the previous one's interval),
    measurements (rounds of the exchange in the log)."""
    import pandas as pd

    return pd.DataFrame(
        [dict(rank=r, **c) for r, c in sorted(clock.items())],
        columns=[
            "rank",
            "status",
            "offset_us",
            "uncertainty_us",
            "min_offset_us",
            "max_offset_us",
            "jumps",
            "measurements",
        ],
    )


def _run_text(run) -> str:
    """'run NAME (the latest of N in DIR; N-1 other(s)): ' for a report of a directory of runs."""
    if not run:
        return ""
    import os

    path, n = run[:2]
    where = os.path.dirname(os.path.normpath(path)) or "."
    if len(run) > 2 and run[2] > 1:  # one directory of runs per host
        return f"run {os.path.basename(os.path.normpath(path))} (from {run[2]} directories, one per host): "
    return (
        f"run {os.path.basename(os.path.normpath(path))} (the latest of {n} in {where}; {n - 1} other(s)): "
        if n > 1
        else f"run {os.path.basename(os.path.normpath(path))} (the only one in {where}): "
    )


def _span(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and all(b - a == 1 for a, b in zip(ranks, ranks[1:])):  # no list as long as the span
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _step_notes(per_step) -> list:
    notes = []
    source = set(per_step["step_time_from"])
    if "user" in source:
        notes.append("step time: given by the user.")
    elif "log" in source:
        notes.append(
            "step time: from the first call of a step to the first call of the next on the same rank "
            "(the last step has none); steady-state figures are medians over the steady steps."
        )
    else:
        notes.append("step time: unknown (one step, or no step boundaries): no share of step.")
    notes.append(
        "comm_share: communication under way (busy_us: each call from its issue to its completion, its wait in "
        "the backend's queue included, as DDP's buckets before gloo starts them; DDP's finalize and packing "
        "included) / step time. "
        "exposed_share: time the training thread spent on communication or waited for it / step time (the "
        "overhead): blocking calls for their whole duration, functional collectives (DTensor, tensor parallel) "
        "for the thread's wait_tensor on them (wait_us), DDP gradient buckets from the issue of the last "
        "bucket to the end of DDP's finalize (its wait for the buckets and copy into .grad), DDP's packing "
        "of gradients into its buckets (ddp_pack_us, CPU models). overlap_unknown_us: "
        "other async or device-timed calls, whose wait the log does not show."
    )
    return notes


def _p2p_channels(pairs):
    g = pairs.groupby(["group", "channel", "src", "dst"], sort=True)
    out = g.agg(
        pairs=("k", "size"),
        matched=("matched", "sum"),
        bytes_mismatch=("bytes_mismatch", "sum"),
        mean_skew_us=("skew_us", "mean"),
        max_skew_us=("skew_us", "max"),
    )
    return out.reset_index()


def render_report_text(rep: Report, max_rows: int = 20, wide: bool = False) -> str:
    """The report as text: headline, findings, tables, notes. By default every line fits
    ``people.WIDTH`` (120) columns: sentences wrapped, each table cut to its key columns
    (``people.COMPACT``); ``wide``: every column, sentences on one line each."""
    width = None if wide else people.WIDTH

    def para(text, first="", rest="  "):
        return [first + text] if wide else people.wrap(text, first, rest)

    title = terminal_safe(rep.title)
    out = para(title, rest="")
    out.append("=" * min(len(title), width or len(title)))
    if rep.headline:
        out += people.headline_text(rep.headline, width=width or 10**6)
    shown = _shown_findings(rep)
    if shown:
        out += ["", "Findings:"]
        for text, section in shown:
            out += para(f"{text} [table: {section}]", first="- ")
    out += advice_lines(rep, para)
    for key, title in SECTIONS.items():
        frame = rep.sections.get(key)
        if frame is None or (key == "mismatches"):
            continue
        head = _head(_table(key, frame), max_rows)
        if wide:
            out += ["", render_text(head, title=title) + _more(frame, max_rows)]
            continue
        table = people.fitted(people.compact(head, key), lambda f: render_text(f, title=""), width or people.WIDTH)
        more = "" if head.shape[1] == people.compact(head, key).shape[1] else " (key columns; --wide for all)"
        out += [""] + para(title + more, rest="") + table.splitlines()[1:]
        out += _more(frame, max_rows).splitlines()[1:]
    if rep.notes:
        out += ["", "Notes:"]
        for n in rep.notes:
            out += para(terminal_safe(n), first="- ")
    return "\n".join(out)


def render_report_markdown(rep: Report, max_rows: int = 50) -> str:
    out = [f"# {terminal_safe(rep.title)}"]
    if rep.headline:
        out += ["", "## Headline", ""] + [f"- **{k}**: {v}" for k, v in people.headline_lines(rep.headline)]
    shown = _shown_findings(rep)
    if shown:
        out += ["", "## Findings", ""] + [
            f"- {text} (table: {SECTIONS[section].split(' (')[0]})" for text, section in shown
        ]
    if rep.advice:
        out += ["", "## Advice", ""] + [
            f"- **{terminal_safe(a.title)}**: {terminal_safe(a.text)} Change: "
            f"`{terminal_safe(a.change)}`; expected gain: {_gain(a)} (rule `{a.rule}`)."
            for a in rep.advice
        ]
    for key, title in SECTIONS.items():
        frame = rep.sections.get(key)
        if frame is None or key == "mismatches":
            continue
        out += ["", f"## {title}", "", render_markdown(_head(_table(key, frame), max_rows)) + _more(frame, max_rows)]
    if rep.notes:
        out += ["", "## Notes", ""] + [f"- {terminal_safe(n)}" for n in rep.notes]
    return "\n".join(out)


def render_report_json(rep: Report) -> str:
    sections = {key: json.loads(frame.to_json(orient="records")) for key, frame in rep.sections.items()}
    return json.dumps(
        {
            "title": rep.title,
            "findings": [f._asdict() for f in rep.findings],
            "advice": [a.as_dict() for a in rep.advice],
            "errors": rep.errors,
            "notes": rep.notes,
            "headline": rep.headline,
            "sections": sections,
        },
        indent=1,
    )


def advice_lines(rep: Report, para=lambda text, first="", rest="  ": [first + text]) -> list:
    """The text report's advice section (none without advice): per item its title and why, the change and
    the expected gain, each a paragraph made lines by ``para(text, first, rest)`` (one line each by default)."""
    if not rep.advice:
        return []
    out = ["", "Advice (each from the measurements quoted; the gain is an estimate: run again to check):"]
    for a in rep.advice:
        out += para(f"{terminal_safe(a.title)}: {terminal_safe(a.text)}", first="- ")
        out += para(f"change: {terminal_safe(a.change)}", first="  ", rest="    ")
        out += para(f"expected gain: {_gain(a)} [rule: {a.rule}; table: {a.section}]", first="  ", rest="    ")
    return out


def _gain(a) -> str:
    """'about 3.2 ms per step (12% of the step)' for an advice item (an estimate, not a bound: in
    ``benchmarks/advice_loop.py`` predicted / measured was 0.54 to 1.21 per rule); 'unknown' without one."""
    if not a.gain_us == a.gain_us:  # NaN
        return "unknown"
    ms = f"{a.gain_us / 1e3:.3g} ms" if a.gain_us >= 100 else f"{a.gain_us:.3g} us"
    return f"about {ms} per step ({100 * a.gain_share:.0f}% of the step)"


def _shown_findings(rep: Report) -> list:
    """(text, section) of the findings, errors (mismatches) first and marked as such; ``terminal_safe``."""
    errors = [(f"ERROR: {terminal_safe(e)}", "mismatches") for e in rep.errors]
    return errors + [(terminal_safe(f.text), f.section) for f in rep.findings if f.kind != "mismatch" or not rep.errors]


def _head(frame, max_rows):
    return frame.head(max_rows) if len(frame) > max_rows else frame


def _more(frame, max_rows) -> str:
    return f"\n... {len(frame) - max_rows} more row(s) (--format json or csv for all)" if len(frame) > max_rows else ""
