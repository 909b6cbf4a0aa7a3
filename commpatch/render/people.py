"""The report for people in a terminal: the headline first, then findings and tables that fit
``WIDTH`` (120) columns: short wrapped sentences and the key columns of each table. The full
tables are behind ``--wide``, ``--format csv`` and ``--format json``.

``headline_lines(headline)`` turns ``analysis.headline.headline`` into (label, text) pairs, the
same words for the text, Markdown and HTML reports (names from the log ``terminal_safe``). Also
the formatting every renderer shares: ``terminal_safe``, ``human_bytes``.
"""

from __future__ import annotations

import math
import re
import textwrap

from ..analysis.findings import _ms, _pct
from ..analysis.stragglers import place

WIDTH = 120

# the columns each table shows in the default (narrow) text report, in order; the summary's
# grouping columns (before "count") are always shown first
COMPACT = {
    "summary": ("per_rank", "total_us", "p50_us", "p95_us", "bytes", "busbw_gbps", "time_share"),
    "steps": (
        "step",
        "stage",
        "calls",
        "comm_us",
        "busy_us",
        "exposed_us",
        "step_us",
        "comm_share",
        "exposed_share",
        "max_rank",
    ),
    "ranks": ("rank", "collectives", "last_count", "last_share", "late_us", "wait_us", "measured_us", "wait_share"),
    "skew": ("group", "coll_seq", "step", "op", "bytes", "ranks", "skew_us", "straggler", "max_duration_us"),
    "p2p": ("group", "channel", "src", "dst", "pairs", "matched", "bytes_mismatch", "mean_skew_us", "max_skew_us"),
}
MAX_CELL = 28  # a longer name (group, op, tag) is cut, ending in '~'
MAX_WORD = 1_000  # a longer word of a sentence (a name from a log) is cut, ending in '~'
_LONG_WORD = re.compile(rf"\S{{{MAX_WORD + 1},}}")

STRAGGLER_WHY = {
    "significance": "not more than chance",
    "consistency": "not the longest in most steps",
    "effect": "within the other ranks' own noise",
    "steps": "too few steady-state steps",
    "collectives": "no collective of two or more ranks in the steady state: point-to-point calls only",
}


# What a terminal may act on: C0 and C1 controls (ESC starts a sequence, CSI is U+009B), DEL, the
# line and paragraph separators and the bidirectional overrides (text shown in another order).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(m) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text) -> str:
    """``text`` (any string that came from a file: a group, op, tag, module or dtype name, a file
    name) with every character a terminal could act on shown as a backslash escape (ESC as
    ``\\x1b``): what reaches the terminal is only printable text, on one line."""
    text = str(text)
    return _UNSAFE.sub(_escaped, text) if _UNSAFE.search(text) else text


_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def human_bytes(n) -> str:
    """Bytes in decimal units with two decimals ('4.19 MB'), as the tables show them."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def wrap(text: str, first: str = "", rest: str = "  ", width: int = WIDTH) -> list:
    """``text`` as lines of at most ``width`` characters; a word longer than a line (a path) is kept
    whole, on a line of its own, up to ``MAX_WORD`` characters (a longer one, a name of 200,000
    characters in a log, is cut, ending in '~')."""
    if len(text) > MAX_WORD:
        text = _LONG_WORD.sub(lambda m: m.group()[: MAX_WORD - 1] + "~", text)
    return textwrap.wrap(
        text, width=width, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    ) or [first.rstrip()]


def headline_lines(h: dict) -> list:
    """(label, sentence) pairs of the headline; unknown figures are said to be unknown."""
    out = []
    if h.get("step_us") is not None:
        out.append(
            (
                "step time",
                f"{_ms(h['step_us'])} median, p95 {_ms(h['step_p95_us'])} "
                f"({h['steady_steps']} steady-state steps of {h['steps']})",
            )
        )
    else:
        out.append(("step time", f"unknown ({h['steps']} step(s), {h['steady_steps']} steady-state)"))
    if h.get("comm_share") is not None:
        least = "at least " if h.get("shares_at_least") else ""
        out.append(
            (
                "communication",
                f"in flight {least}{_pct(h['comm_share'])} of the step (issue to completion, backend queue included); "
                f"exposed {least}{_pct(h['exposed_share'])} (the overhead{_exposed_parts(h, least)})",
            )
        )
    else:
        out.append(("communication", "share of the step unknown (no step time, or no measured call)"))
    top = h.get("top_collective")
    if top:
        name = " ".join(
            terminal_safe(top[c]) if c != "size_bucket" else "<= " + human_bytes(top[c])
            for c in ("collective", "op", "api", "group", "dtype", "size_bucket")
            if c in top
        )
        bw = f", busbw {top['busbw_gbps']:.3g} GB/s" if top.get("busbw_gbps") is not None else ""
        steady = "steady state, " if top.get("steady_state") else ""
        out.append(
            (
                "top collective",
                f"{name}: {_pct(top['time_share'])} of communication time ({steady}{_ms(top['total_us'])} over all "
                f"ranks){bw}",
            )
        )
    s = h.get("straggler") or {}
    if s.get("verdict") == "straggler":
        out.append(
            (
                "straggler",
                f"rank {s['rank']}: "
                + (
                    f"works {_ms(s['late_median_us'])}/step longer than any other pipeline stage, others wait for it "
                    if s.get("measure") == "work"
                    else f"others wait {_ms(s['late_median_us'])}/step for it{place(s)} "
                )
                + f"({_pct(s['share_of_step'])} "
                f"of step; longest in {s['last_steps']}/{s['steps']} steps; p = {s['p_value']:.2g}; noise "
                f"{_ms(s.get('threshold_us'))})",
            )
        )
    elif s.get("verdict") == "none":
        near = s.get("near")
        out.append(
            (
                "straggler",
                f"none: rank {s['rank']} longest in {s['last_steps']}/{s['steps']} steps, "
                f"{_ms(s['late_median_us'])}/step (noise {_ms(s.get('threshold_us'))}); "
                f"{STRAGGLER_WHY.get(str(s.get('reason')), s.get('reason'))} (p = {s['p_value']:.2g})"
                + (
                    f"; rank {near['rank']} {_ms(near['late_median_us'])}/step"
                    f"{place(dict(measure='position', at=near['at']))} in {near['last_steps']}/{near['steps']} "
                    f"steps (noise there {_ms(near['threshold_us'])}): "
                    f"{STRAGGLER_WHY.get(str(near['reason']), near['reason'])}"
                    if near
                    else ""
                ),
            )
        )
    elif s.get("reason") in ("steps", "collectives") and s.get("steps") is not None:  # which steps it could compare
        out.append(
            (
                "straggler",
                f"unknown: {s['steps']} of the {h['steady_steps']} steady-state steps have a collective that two or "
                "more ranks issued to compare their arrivals (point-to-point calls are matched pairwise, not "
                "compared); too few",
            )
        )
    else:
        why = s.get("reason")
        out.append(("straggler", "unknown" + (f" ({STRAGGLER_WHY.get(str(why), why)})" if why else "")))
    if h.get("missing_logs") and s.get("verdict") in ("straggler", "none"):
        out[-1] = ("straggler", f"{out[-1][1]}; among the ranks with a log (none for {len(h['missing_logs'])} rank(s))")
    hang = h.get("hang") or {}
    word = {"hang": "yes", "possible": "possible", "none_seen": "no sign", "unknown": "unknown"}.get(
        str(hang.get("verdict")), "unknown"
    )
    out.append(("hang", f"{word}: {terminal_safe(hang['text'])}" if hang.get("text") else word))
    n = h.get("mismatches")
    if n is None:
        out.append(("mismatches", "not checked (one rank's log)"))
    elif n == 0:
        out.append(("mismatches", "none: every rank issued the same collectives"))
    else:
        m = h["first_mismatch"]
        out.append(
            (
                "mismatches",
                f"{n}: first a {m['kind']} mismatch in group {terminal_safe(m['group'])} at "
                f"collective #{m['coll_seq'] + 1} (step {m['step']}, {terminal_safe(m['op'])})",
            )
        )
    return out


def _exposed_parts(h: dict, least: str) -> str:
    """What the exposed share is: the thread waiting, and a framework's own work apart."""
    wait, own = h.get("wait_share"), h.get("framework_share")
    if wait is None or not own:
        return ""
    return f": the training thread waits {least}{_pct(wait)}, DDP's packing and finalize on it {_pct(own)}"


def headline_text(h: dict, width: int = WIDTH) -> list:
    pairs = headline_lines(h)
    label = max(len(k) for k, _ in pairs) + 2
    out = ["Headline:"]
    for key, text in pairs:
        out += wrap(text, first=f"  {key + ':':<{label}}", rest=" " * (label + 2), width=width)
    return out


def compact(frame, key: str):
    """The columns of ``frame`` the narrow report shows (all of them for a table not in COMPACT),
    long names cut to MAX_CELL characters."""
    cols = COMPACT.get(key)
    if cols is not None:
        lead = (
            list(frame.columns[: list(frame.columns).index("count")]) if key == "summary" and "count" in frame else []
        )
        frame = frame[lead + [c for c in cols if c in frame.columns and c not in lead]]
    text = [c for c in frame.columns if frame[c].dtype.kind not in "iufbmM"]
    if not text:
        return frame
    return frame.assign(**{c: frame[c].map(_cut) for c in text})


def _cut(value):
    return value[: MAX_CELL - 1] + "~" if isinstance(value, str) and len(value) > MAX_CELL else value


def fitted(frame, render, width: int = WIDTH):
    """``render(frame)`` with the rightmost columns left out until every line fits ``width`` (the
    caller chose the key columns: this guards against many grouping columns or long names)."""
    text = render(frame)
    while frame.shape[1] > 1 and max(map(len, text.splitlines()[1:]), default=0) > width:
        frame = frame.iloc[:, :-1]
        text = render(frame)
    return text
