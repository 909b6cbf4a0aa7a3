"""Plots (matplotlib, optional extra ``commpatch[plots]``): each function takes analysis
DataFrames and returns a ``matplotlib.figure.Figure``; ``write_plots`` saves the standard set
as PNG. Figures are built without pyplot, so nothing here touches global GUI state.
"""

from __future__ import annotations

import os

import numpy as np

from ..data.publish import publish
from .text import human_bytes


def _figure(*size):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "commpatch plots need matplotlib: pip install 'commpatch[plots]' (or pip install matplotlib)"
        ) from None
    return Figure(figsize=size or (8, 4.5), layout="constrained")


def bandwidth_vs_size(summary_by_op_size):
    """Bus bandwidth against message size, one line per collective (from summary(by=[KEY, 'size_bucket'])
    with KEY the first column other than size_bucket: collective by default, or op, api...)."""
    fig = _figure()
    ax = fig.add_subplot()
    s = summary_by_op_size[summary_by_op_size["busbw_gbps"].notna() & (summary_by_op_size["size_bucket"] > 0)]
    key = next((c for c in ("collective", "op", "api") if c in s.columns), s.columns[0])
    for op, part in s.groupby(s[key].astype(str), sort=True):
        part = part.sort_values("size_bucket")
        ax.plot(part["size_bucket"], part["busbw_gbps"], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # small messages reach a small fraction of the large ones' bandwidth
    ax.set_xlabel("message size bucket (bytes, upper bound)")
    ax.set_ylabel("busbw (GB/s, log scale)")
    ax.set_title("Bus bandwidth vs message size")
    if len(s):
        ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    return fig


def comm_per_step(steps):
    """Communication time per step (from per_step(by_rank=False)): exposed, overlapped and of
    unknown overlap, stacked; the communication and exposed shares of the step on the right axis.
    The y range fits the steady state: a set-up step far above it is cut and labelled."""
    fig = _figure()
    ax = fig.add_subplot()
    x = steps["step"].to_numpy()
    bottom = np.zeros(len(steps))
    parts = (
        ("exposed_us", "exposed (the training thread's)", "tab:red"),
        ("overlapped_us", "overlapped with compute", "tab:green"),
        ("overlap_unknown_us", "async / device-timed (overlap unknown)", "tab:orange"),
    )
    for col, label, color in parts:
        if col in steps:
            values = steps[col].to_numpy(np.float64) / 1e3
            ax.bar(x, values, bottom=bottom, label=label, color=color)
            bottom = bottom + values
    steady = bottom[(steps["stage"] == "steady").to_numpy()] if "stage" in steps else bottom
    top = float(steady.max()) if len(steady) and steady.max() > 0 else float(bottom.max()) if len(bottom) else 0.0
    ax.set_ylim(0, top * 1.25 if top > 0 else 1)
    for xi, total in zip(x, bottom):
        if top > 0 and total > top * 1.25:
            ax.annotate(
                f"{total:.0f} ms (set-up)" if xi == x[0] else f"{total:.0f} ms",
                (xi, top * 1.17),
                fontsize="x-small",
                ha="left",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("communication per rank (ms, mean over ranks)")
    ax.set_title("Communication time per step")
    handles, labels = ax.get_legend_handles_labels()
    if steps["comm_share"].notna().any():
        ax2 = ax.twinx()
        # wide and light under thin and dashed: both show where they coincide (all the wait exposed)
        ax2.plot(
            x, 100 * steps["comm_share"], color="k", linewidth=4, alpha=0.45, label="communication share of step (%)"
        )
        ax2.plot(
            x,
            100 * steps["exposed_share"],
            color="maroon",  # darker than the exposed bars it crosses
            linestyle="--",
            linewidth=1.5,
            marker=".",
            label="exposed share of step (%)",
        )
        ax2.set_ylabel("share of step time (%)")
        ax2.set_ylim(0, 100)
        more_handles, more_labels = ax2.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    fig.legend(
        handles, labels, loc="outside lower center", ncols=2, fontsize="small"
    )  # below the axes, never on the data
    return fig


def step_ticks(steps, most: int = 10) -> list[int]:
    """The columns to tick on a heatmap whose columns start at ``steps`` (per column, its first
    step): each at the first column of a step, on whole steps only, every k-th step so that at most
    ``most`` show."""
    starts = [i for i in range(len(steps)) if i == 0 or steps[i] != steps[i - 1]]
    every = max(1, -(-len(starts) // most))
    return starts[::every]


def skew_heatmap(arrivals):
    """Arrival delay per rank (rows) and collective bin (columns), from merge.arrival_matrix."""
    fig = _figure(9, max(3.0, min(12.0, 0.25 * len(arrivals) + 2)))
    ax = fig.add_subplot()
    data = arrivals.to_numpy(np.float64) / 1e3
    image = ax.imshow(
        data,
        aspect="auto",
        interpolation="nearest",
        cmap="magma",
        extent=(-0.5, data.shape[1] - 0.5, len(arrivals) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(arrivals)))
    ax.set_yticklabels([str(r) for r in arrivals.index], fontsize="small" if len(arrivals) <= 32 else 4)
    steps = arrivals.attrs.get("steps")
    if steps is not None and len(steps) == data.shape[1]:
        ticks = step_ticks(steps)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(steps[t]) for t in ticks])
        ax.set_xlabel("step (a tick at the step's first collective; columns: the collectives in order, binned)")
    else:
        ticks = np.linspace(0, data.shape[1] - 1, num=min(8, data.shape[1])).astype(int) if data.shape[1] else []
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(arrivals.columns[t] + 1) for t in ticks])  # counted from 1, as users do
        ax.set_xlabel("collective (in order, binned)")
    ax.set_ylabel("rank")
    ax.set_title("Arrival delay behind the earliest rank (ms)")
    fig.colorbar(image, ax=ax, label="ms")
    return fig


def scaling(table, by_op):
    """Step time, efficiency, communication and exposed shares, and busbw against world size
    (from analysis.scaling / scaling_by_op); integer world-size ticks."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(14, 4)
    a, b, c, d = fig.subplots(1, 4)
    sizes = table["world_size"].to_numpy()
    a.plot(sizes, table["step_us"] / 1e3, marker="o")
    a.set_ylabel("ms (median steady-state step)")
    a.set_title("Step time")
    b.plot(sizes, table["efficiency"], marker="o", label="efficiency")
    b.plot(sizes, table["speedup"], marker="s", label="speed-up")
    b.set_title("Scaling efficiency and speed-up")
    b.legend(fontsize="x-small")
    c.plot(sizes, 100 * table["comm_share"], marker="o", label="communication in flight")
    c.plot(sizes, 100 * table["exposed_share"], marker="s", label="exposed (overhead)")
    c.set_ylabel("% of step")
    c.set_title("Communication share of step")
    c.legend(fontsize="x-small")
    steady = by_op[by_op["busbw_gbps"].notna()]
    for (coll, size), part in steady.groupby(["collective", "size_bucket"], sort=True):
        if part["world_size"].nunique() > 1 or len(steady) < 8:
            d.plot(part["world_size"], part["busbw_gbps"], marker="o", label=f"{coll} <= {human_bytes(size)}")
    d.set_ylabel("busbw (GB/s)")
    d.set_title("Bus bandwidth (steady state)")
    if d.get_legend_handles_labels()[0]:
        d.legend(fontsize="xx-small")
    for ax in (a, b, c, d):
        ax.set_xlabel("world size")
        if len(set(sizes.tolist())) <= 12:
            ax.set_xticks(sorted(set(sizes.tolist())))  # the world sizes themselves: 1, 2, 4
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    return fig


def save(fig, path: str) -> str:
    return publish(path, lambda f: fig.savefig(f, dpi=110, format="png"))


def write_plots(directory: str, summary_by_op_size=None, steps=None, arrivals=None) -> list[str]:
    """Save the plots whose inputs are given (and not empty) as PNG files; returns their paths."""
    written = []
    if summary_by_op_size is not None and len(summary_by_op_size):
        written.append(save(bandwidth_vs_size(summary_by_op_size), os.path.join(directory, "bandwidth_vs_size.png")))
    if steps is not None and len(steps):
        written.append(save(comm_per_step(steps), os.path.join(directory, "comm_per_step.png")))
    if arrivals is not None and arrivals.size and len(arrivals) > 1:
        written.append(save(skew_heatmap(arrivals), os.path.join(directory, "skew_heatmap.png")))
    return written
