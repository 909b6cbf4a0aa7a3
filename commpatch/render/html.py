"""The report as one self-contained HTML page (``commpatch report DIR --html FILE``).

The page holds its data as one JSON block and draws it with a small script of its own
(``html_assets/report.js``, SVG charts and a canvas heatmap, no library) and a style sheet
(``html_assets/report.css``), both embedded: it needs no network and no package beyond
commpatch's own. Its size follows the report's aggregates, not the log's rows: the tables of
the report (the per-step table up to ``MAX_TABLE_ROWS`` rows), the bandwidth per collective and
message size, the arrival matrix (ranks x at most 200 bins), and a timeline excerpt of one step
on at most ``EXCERPT_RANKS`` ranks (at most ``EXCERPT_CALLS`` calls).

``page(rep, ...)`` returns the HTML text; ``compare_page(table, by_op, ...)`` the page of
``--compare``. The headline's words are ``people.headline_lines``: the same as the text report.
"""

from __future__ import annotations

import html as _html
import json
import math
import os

import numpy as np

from ..analysis.advice import Advice
from ..data.publish import write_bytes
from . import people
from .diffs import fmt, verdict
from .text import SECTIONS, _gain, terminal_safe

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "html_assets")
MAX_TABLE_ROWS = 2000  # rows of one table in the page (the per-step table of a long run); JSON has all
EXCERPT_RANKS = 16
EXCERPT_CALLS = 5000
TABLE_KEYS = ("mismatches", "summary", "steps", "ranks", "rank_steps", "skew", "p2p")


def _asset(name: str) -> str:
    with open(os.path.join(ASSETS, name), encoding="utf-8") as f:
        return f.read()


def _value(v):
    """A JSON-safe cell: numbers as numbers (NaN, inf -> None), the rest as text."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return None if not math.isfinite(float(v)) else float(f"{float(v):.6g}")
    return str(v)


def table_data(frame, title: str, max_rows: int = MAX_TABLE_ROWS) -> dict:
    """A DataFrame as {title, columns, numeric, rows, total}: at most ``max_rows`` rows."""
    head = frame.head(max_rows)
    cols = [str(c) for c in head.columns]
    numeric = [head[c].dtype.kind in "iuf" for c in head.columns]
    rows = [[_value(v) for v in row] for row in head.itertuples(index=False)]
    return dict(title=title, columns=cols, numeric=numeric, rows=rows, total=int(len(frame)))


def bandwidth_data(by_op) -> list:
    """Series of busbw against size bucket, one per collective (from summary(by=[op or collective, size_bucket]))."""
    if by_op is None or not len(by_op):
        return []
    s = by_op[by_op["busbw_gbps"].notna() & (by_op["size_bucket"] > 0) & (by_op["busbw_gbps"] > 0)]
    key = next((c for c in ("collective", "op", "api") if c in s.columns), s.columns[0])
    out = []
    for name, part in s.groupby(s[key].astype(str), sort=True):
        part = part.sort_values("size_bucket")
        out.append(
            dict(
                name=name,
                x=[int(v) for v in part["size_bucket"]],
                y=[_value(v) for v in part["busbw_gbps"]],
                calls=[int(v) for v in part["count"]],
            )
        )
    return out


def steps_data(steps, max_rows: int = MAX_TABLE_ROWS) -> dict | None:
    if steps is None or not len(steps):
        return None
    s = steps.head(max_rows)
    cols = (
        "step",
        "stage",
        "exposed_us",
        "overlapped_us",
        "overlap_unknown_us",
        "comm_share",
        "exposed_share",
        "step_us",
    )
    return {c: [_value(v) for v in s[c]] for c in cols if c in s.columns}


def heatmap_data(arrivals) -> dict | None:
    """The arrival matrix (ranks x collective bins, us) with values in ms, 3 significant digits."""
    if arrivals is None or not arrivals.size or len(arrivals) < 2:
        return None
    values = arrivals.to_numpy(np.float64) / 1e3
    cells = [[None if not math.isfinite(v) else float(f"{v:.3g}") for v in row] for row in values.tolist()]
    steps = arrivals.attrs.get("steps")
    return dict(
        ranks=[int(r) for r in arrivals.index],
        columns=[int(c) for c in arrivals.columns],
        steps=[int(s) for s in steps] if steps is not None and len(steps) == len(arrivals.columns) else None,
        ms=cells,
    )


def timeline_excerpt(df, steps_table, straggler=None, max_ranks: int = EXCERPT_RANKS, of_ranks=None) -> dict | None:
    """The calls of one steady-state step (the one whose step time is nearest the median; else the
    first step) on at most ``max_ranks`` ranks (the straggler candidate first, then the lowest
    ranks), in ms from the step's first call, with each rank's step start as a marker."""
    if df is None or not len(df):
        return None
    step = pick_step(steps_table)
    rows = df[df["step"] == step] if step is not None else df
    chosen = excerpt_ranks(rows["rank"].unique().tolist(), straggler, max_ranks)
    rows = rows[rows["rank"].isin(chosen)].sort_values("start_ns").head(EXCERPT_CALLS)
    if not len(rows):
        return None
    t0 = int(rows["start_ns"].min())
    dur = rows["duration_us"].to_numpy(np.float64)
    dur = np.where(np.isnan(dur), rows["host_us"].to_numpy(np.float64), dur)
    calls = [
        [int(r), str(g), str(op), float(f"{(s - t0) / 1e6:.6g}"), _value(d / 1e3), int(b)]
        for r, g, op, s, d, b in zip(
            rows["rank"],
            rows["group"].astype(str),
            rows["op"].astype(str),
            rows["start_ns"].tolist(),
            np.nan_to_num(dur),
            rows["bytes"],
        )
    ]
    starts = rows.groupby("rank")["start_ns"].min()
    of_ranks = int(df["rank"].nunique()) if of_ranks is None else int(of_ranks)
    stage = steps_table.loc[steps_table["step"] == step, "stage"] if step is not None else None
    return dict(
        step=None if step is None else int(step),
        stage=str(stage.iloc[0]) if stage is not None and len(stage) else None,
        ranks=chosen,
        of_ranks=of_ranks,
        calls=calls,
        step_starts={str(r): float(f"{(s - t0) / 1e6:.6g}") for r, s in starts.items()},
        cut=bool(len(rows) >= EXCERPT_CALLS),
    )


def excerpt_ranks(ranks, straggler=None, max_ranks: int = EXCERPT_RANKS) -> list:
    """At most ``max_ranks`` of ``ranks``: the straggler candidate, then the lowest ranks; sorted."""
    ranks = sorted(ranks)
    return sorted((([straggler] if straggler in ranks else []) + [r for r in ranks if r != straggler])[:max_ranks])


def pick_step(steps_table):
    """The steady-state step whose time is nearest the median (else the first step), or None."""
    if steps_table is None or not len(steps_table):
        return None
    steady = steps_table[(steps_table["stage"] == "steady") & steps_table["step_us"].notna()]
    if not len(steady):
        return int(steps_table["step"].iloc[0])
    median = steady["step_us"].median()
    return int(steady.loc[(steady["step_us"] - median).abs().idxmin(), "step"])


def _items(advice) -> list:
    """Advice items as the page shows them: ``analysis.advice.Advice`` as the text report words it
    (title and why, the change, the expected gain, rule and table; its evidence apart, NaN as None);
    other items (dicts, named tuples, objects) as {field: text}, rendered generically."""
    out = []
    for item in advice or ():
        if isinstance(item, Advice):
            out.append(
                dict(
                    title=item.title,
                    text=item.text,
                    change=item.change,
                    gain=_gain(item),
                    rule=item.rule,
                    section=item.section,
                    evidence=item.as_dict()["evidence"],
                )
            )
            continue
        if hasattr(item, "as_dict"):
            item = item.as_dict()
        elif hasattr(item, "_asdict"):
            item = item._asdict()
        elif not isinstance(item, dict):
            item = {k: v for k, v in vars(item).items() if not k.startswith("_")}
        out.append({str(k): _value(v) if not isinstance(v, (list, dict)) else v for k, v in item.items()})
    return out


def _advice(rep):
    """The report's advice items: ``rep.advice`` (a list), or an ``advice`` section (a table)."""
    items = getattr(rep, "advice", None)
    if items is None and rep.sections.get("advice") is not None:
        items = rep.sections["advice"].to_dict("records")
    return items


def report_data(rep, by_op=None, arrivals=None, excerpt=None) -> dict:
    findings = [dict(kind="error", text=terminal_safe(e), section="mismatches") for e in rep.errors]
    findings += [
        dict(kind=f.kind, text=f.text, section=f.section)
        for f in rep.findings
        if f.kind != "mismatch" or not rep.errors
    ]
    tables = {key: table_data(rep.sections[key], SECTIONS[key]) for key in TABLE_KEYS if key in rep.sections}
    return dict(
        title=rep.title,
        headline=rep.headline,
        headline_text=[[k, v] for k, v in people.headline_lines(rep.headline)] if rep.headline else [],
        findings=findings,
        advice=_items(_advice(rep)),
        tables=tables,
        plots=dict(
            bandwidth=bandwidth_data(by_op),
            steps=steps_data(rep.sections.get("steps")),
            heatmap=heatmap_data(arrivals),
            timeline=excerpt,
        ),
        notes=list(rep.notes),
    )


def compare_data(table, by_op, title: str) -> dict:
    runs = table.sort_values("world_size")
    series = {
        c: [_value(v) for v in runs[c]]
        for c in ("world_size", "step_us", "efficiency", "speedup", "comm_share", "exposed_share")
        if c in runs.columns
    }
    bw = []
    steady = by_op[by_op["busbw_gbps"].notna()]
    for (coll, size), part in steady.groupby(["collective", "size_bucket"], sort=True):
        part = part.sort_values("world_size")
        bw.append(
            dict(
                name=f"{coll} <= {int(size)} B",
                collective=str(coll),
                size=int(size),
                x=[int(v) for v in part["world_size"]],
                y=[_value(v) for v in part["busbw_gbps"]],
            )
        )
    return dict(
        title=title,
        headline=None,
        headline_text=[],
        findings=[],
        advice=[],
        tables=dict(
            scaling=table_data(table, "Runs by world size"),
            by_op=table_data(by_op, "Steady-state collectives per message size and world size"),
        ),
        plots=dict(scaling=dict(series, busbw=bw)),
        notes=[],
    )


def diff_page(d: dict) -> str:
    """``commpatch diff --html``: the diff (``analysis.diff``'s dict) as a page of the report's kind,
    worded as the text (``diffs.fmt`` / ``diffs.verdict``): the significant changes as findings, per
    step and per collective and message size as sortable tables."""
    import pandas as pd

    change = "change (95% interval over the steady steps)"
    steps = pd.DataFrame(
        [
            {
                "figure": x["name"],
                "A": fmt(x["a"], x["unit"]),
                "B": fmt(x["b"], x["unit"]),
                change: verdict(x, x["unit"]),
            }
            for x in d["steps"]
        ]
    )
    rows, found = [], []
    for x in d["steps"]:
        if x["significant"]:
            text = f"{x['name']}: {fmt(x['a'], x['unit'])} -> {fmt(x['b'], x['unit'])}: {verdict(x, x['unit'])}"
            found.append(dict(kind="change", text=text, section="steps"))
    for c in d["collectives"]:
        t, n, b = c["time_us"], c["calls"], c["bytes"]
        where = f"{c['collective']} <= {fmt(float(c['size_bucket']), 'bytes')}"
        rows.append(
            {
                "collective and size": where,
                "time A (per rank and step)": fmt(t["a"], "us"),
                "time B": fmt(t["b"], "us"),
                change: verdict(t, "us"),
                "calls A": fmt(n["a"], ""),
                "calls B": fmt(n["b"], ""),
                "bytes A": fmt(b["a"], "bytes"),
                "bytes B": fmt(b["b"], "bytes"),
            }
        )
        if t["significant"]:
            text = f"{where}: time {fmt(t['a'], 'us')} -> {fmt(t['b'], 'us')}: {verdict(t, 'us')}"
            found.append(dict(kind="change", text=text, section="collectives"))
    only = [
        {
            "run": side,
            "collective and size": f"{c['collective']} <= {fmt(float(c['size_bucket']), 'bytes')}",
            "calls": fmt(c["calls"], ""),
            "time per step": fmt(c["time_us"], "us"),
        }
        for side, key in (("only in A", "only_a"), ("only in B", "only_b"))
        for c in d[key]
    ]
    tables = dict(steps=table_data(steps, "Per step (medians over the steady-state steps)"))
    if rows:
        tables["collectives"] = table_data(pd.DataFrame(rows), "Per collective and message size")
    if only:
        tables["only"] = table_data(pd.DataFrame(only), "Collectives of one run only")
    return render(
        dict(
            title=f"commpatch diff: A = {d['a']}, B = {d['b']}",
            headline=None,
            headline_text=[],
            findings=found or [dict(kind="change", text="no significant change", section="steps")],
            advice=[],
            tables=tables,
            plots={},
            notes=[
                f"medians over the steady-state steps ({d['steps_a']} in A, {d['steps_b']} in B); a change is "
                "significant when its 95% interval (bootstrap over the steps) excludes 0"
            ],
        )
    )


# Inside <script> the HTML parser looks for "</script" and, after "<!--", for "<script" (its
# "double escaped" state, where "</script>" no longer ends the block): a name holding "<!--<script>"
# would swallow report.js. No "<" may reach the block, nor ">" or "&"; U+2028 / U+2029 (line ends
# to older JavaScript) are escaped by ensure_ascii already and here again. JSON reads the same.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def script_json(data) -> str:
    """``data`` as JSON that no string in it can end or re-open the ``<script>`` block holding it."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).translate(_SCRIPT_SAFE)


def render(data: dict) -> str:
    """The page: the data as JSON (``script_json``: no markup character in it), the style sheet and
    the script inline."""
    blob = script_json(data)
    title = _html.escape(data["title"])
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # nothing may load from elsewhere: the page is whole as it is
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        '<link rel="icon" href="data:,">'
        f"<title>{title}</title><style>{_asset('report.css')}</style></head>\n"
        f'<body><main id="app"><h1>{title}</h1><noscript>This report draws its tables and plots with '
        "JavaScript: enable it, or read commpatch report --format json.</noscript></main>\n"
        f'<script type="application/json" id="data">{blob}</script>\n'
        f"<script>{_asset('report.js')}</script></body></html>\n"
    )


def page(rep, by_op=None, arrivals=None, excerpt=None) -> str:
    return render(report_data(rep, by_op, arrivals, excerpt))


def write(text: str, path: str) -> str:
    """Write the page to a new file or replace a regular file (never through a symlink)."""
    if os.path.islink(path):
        raise OSError(f"{path} is a symbolic link: not written through")
    return write_bytes(text.encode("utf-8"), path, exclusive=False)


__all__ = ["page", "compare_page", "diff_page", "render", "report_data", "compare_data", "write", "timeline_excerpt"]


def compare_page(table, by_op, title: str = "commpatch scaling") -> str:
    return render(compare_data(table, by_op, title))
