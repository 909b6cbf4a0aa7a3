"""The live view's screen (``commpatch watch``): a ``rich`` table of the ranks' figures from
``analysis.live``, and the lines under it. Data in, a renderable out: no I/O."""

from __future__ import annotations

import math

from .people import _cut, terminal_safe


def _ms(us: float) -> str:
    return "?" if us is None or math.isnan(us) else f"{us / 1e3:.1f} ms"


def _share(value: float) -> str:
    return "?" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def screen(snapshot: dict):
    """A rich renderable of ``snapshot``: title, ranks (list of ``analysis.live.rank_live`` dicts),
    slowest (``analysis.live.slowest``), stuck (``analysis.live.in_flight`` rows), idle_s (seconds
    since a file last grew), notes (lines)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    # names and paths come from the files: only printable text reaches the terminal, names cut
    table = Table(title=terminal_safe(snapshot.get("title", "commpatch watch")), title_justify="left", expand=False)
    for name, justify in (
        ("rank", "right"),
        ("step", "right"),
        ("calls", "right"),
        ("step time", "right"),
        ("comm", "right"),
        ("exposed", "right"),
        ("last call", "right"),
    ):
        table.add_column(name, justify="right" if justify == "right" else "left")
    now_ns = snapshot.get("now_ns", 0)
    slow = snapshot.get("slowest") or {}
    for r in snapshot.get("ranks", []):
        if not r:
            continue
        age = (now_ns - r["last_start_ns"]) / 1e9 if now_ns else math.nan
        style = "bold red" if slow and r["rank"] == slow.get("rank") else None
        table.add_row(
            str(r["rank"]),
            str(r["current_step"]) if r["current_step"] >= 0 else "?",
            str(r["calls"]) if r["calls"] >= 0 else "?",
            _ms(r["step_us"]) + (f" (step {r['last_step']})" if r["last_step"] >= 0 else ""),
            _share(r["comm_share"]),
            _share(r["exposed_share"]),
            "?" if math.isnan(age) else f"{age:.1f} s ago",
            style=style,
        )
    lines = []
    if slow:
        lines.append(
            f"slowest now: rank {slow['rank']} (the others wait for it): {_ms(slow['work_us'])} of its step "
            f"{slow['step']} ({_ms(slow['step_us'])}) outside communication, the other ranks' median "
            f"{_ms(slow['others_work_median_us'])}"
        )
    stuck = snapshot.get("stuck")
    if stuck is not None and len(stuck):
        worst = stuck.sort_values("age_s", ascending=False).head(5)
        for row in worst.itertuples():
            lines.append(
                f"in flight for {row.age_s:.1f} s: rank {row.rank} {_cut(str(row.op))} on group "
                f"{_cut(str(row.group))} (seq {row.seq})"
            )
    idle = snapshot.get("idle_s")
    if idle is not None and idle >= 2:
        lines.append(f"no rank's log grew for {idle:.0f} s")
    lines += snapshot.get("notes", [])
    return Group(table, *(Text(terminal_safe(line)) for line in lines))
