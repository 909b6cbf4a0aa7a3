"""Text of ``commpatch diff`` and ``commpatch check`` (``analysis.diff``'s dicts in, lines out)."""

from __future__ import annotations

import json
import math

from .people import terminal_safe


def fmt(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "unknown"
    if unit == "share":
        return f"{100 * value:.1f}%"
    if unit == "us":
        return f"{value / 1e3:.3g} ms" if abs(value) >= 100 else f"{value:.3g} us"
    if unit == "bytes":
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{value / size:.3g} {name}"
        return f"{value:.3g} B"
    return f"{value:.3g}"


def _signed(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "unknown"
    if unit == "share":
        return f"{100 * value:+.1f} pts"
    text = fmt(abs(value), unit)
    return ("-" if value < 0 else "+") + text


def verdict(c: dict, unit: str) -> str:
    """'+1.5 ms (+6.9%), 95% interval +1.2 to +1.9 ms: significant' / '... no significant change'."""
    if c["a"] != c["a"] or c["b"] != c["b"]:  # NaN: one side has no value
        return "unknown (not measured in both runs)"
    rel = "" if unit == "share" or c["relative"] != c["relative"] else f" ({100 * c['relative']:+.1f}%)"
    head = f"{_signed(c['change'], unit)}{rel}"
    if c["significant"] is None:
        return f"{head}: too few steady steps for an interval ({c['steps_a']} / {c['steps_b']})"
    interval = f"95% interval {_signed(c['lo'], unit)} to {_signed(c['hi'], unit)}"
    return f"{head}, {interval}: " + ("significant" if c["significant"] else "no significant change")


def diff_lines(d: dict) -> list:
    out = [
        f"commpatch diff: A = {terminal_safe(str(d['a']))}, B = {terminal_safe(str(d['b']))}",
        f"medians over the steady-state steps ({d['steps_a']} in A, {d['steps_b']} in B); a change is "
        "significant when its 95% interval (bootstrap over the steps) excludes 0",
        "",
        "Per step:",
    ]
    for s in d["steps"]:
        out.append(f"- {s['name']}: {fmt(s['a'], s['unit'])} -> {fmt(s['b'], s['unit'])}: {verdict(s, s['unit'])}")
    if d["collectives"] or d["only_a"] or d["only_b"]:
        out += ["", "Per collective and message size (per rank and step):"]
    for c in d["collectives"]:
        where = f"{terminal_safe(c['collective'])} <= {fmt(float(c['size_bucket']), 'bytes')}"
        t, n, b = c["time_us"], c["calls"], c["bytes"]
        out.append(f"- {where}: time {fmt(t['a'], 'us')} -> {fmt(t['b'], 'us')}: {verdict(t, 'us')}")
        if n["a"] != n["b"] or b["a"] != b["b"]:
            out.append(
                f"  calls {fmt(n['a'], '')} -> {fmt(n['b'], '')}, bytes {fmt(b['a'], 'bytes')} -> {fmt(b['b'], 'bytes')}"
            )
    for side, key in (("A", "only_a"), ("B", "only_b")):
        if d[key]:
            shown = ", ".join(
                f"{terminal_safe(c['collective'])} <= {fmt(float(c['size_bucket']), 'bytes')}"
                f" ({fmt(c['calls'], '')} calls, {fmt(c['time_us'], 'us')} per step)"
                for c in d[key]
            )
            out.append(f"- only in {side}: {shown}")
    return out


def _no_nan(value):
    """NaN (unknown) as null: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def diff_json(d: dict) -> str:
    """``commpatch diff --format json``: the dict as it is, unknown figures as null."""
    return json.dumps(_no_nan(d), indent=1, allow_nan=False)
