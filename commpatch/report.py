"""Renderers: analysis DataFrames -> text. Each renderer declares its file extension."""

from __future__ import annotations

import math

_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def human_bytes(n) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fmt(value, col: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if col == "bytes" or col == "size_bucket":
        return human_bytes(value)
    if col == "time_share":
        return f"{100 * value:.1f}%"
    if col.endswith("_us"):
        return f"{value:,.1f}"
    if col.endswith("_gbps"):
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render_text(df, title: str = "commpatch summary") -> str:
    """A plain aligned table (no colours), one row per summary row."""
    cols = list(df.columns)
    cells = [[_fmt(v, c) for v, c in zip(row, cols)] for row in df.itertuples(index=False)]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    numeric = [df[c].dtype.kind in "iuf" for c in cols]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))

    out = [title, line(cols), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


render_text.extension = ".txt"


def render_markdown(df) -> str:
    cols = list(df.columns)
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if df[c].dtype.kind in "iuf" else "---" for c in cols) + "|"]
    out += ["| " + " | ".join(_fmt(v, c) for v, c in zip(row, cols)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(out)


render_markdown.extension = ".md"
