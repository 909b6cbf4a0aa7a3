"""TensorBoard scalars of a log (``commpatch report --tensorboard OUTDIR``; optional extra
``tensorboard``): one TensorBoard run per rank (``OUTDIR/rank{r}``), one point per step (the step
is TensorBoard's step; its wall time is the step's first call), from the report's own tables:
``analysis.per_step`` (step time, communication and exposed share) and ``analysis.summary`` by
rank, step and collective (bus bandwidth)."""

from __future__ import annotations

import glob
import os

import numpy as np

from ..analysis.steps import per_step
from ..analysis.summaries import summary

EVENTS = "events.out.tfevents.*"
# tag -> column of per_step
STEP_TAGS = (
    ("step/time_ms", "step_us", 1e-3),
    ("step/comm_share", "comm_share", 1.0),
    ("step/exposed_share", "exposed_share", 1.0),
    ("step/comm_ms", "busy_us", 1e-3),
    ("step/exposed_ms", "exposed_us", 1e-3),
)


def rank_dirs(outdir: str, ranks) -> dict:
    return {int(r): os.path.join(outdir, f"rank{int(r)}") for r in ranks}


def taken(outdir: str) -> list[str]:
    """Rank directories under ``outdir`` that already hold TensorBoard events (an earlier report:
    TensorBoard would show both as one)."""
    return sorted(d for d in glob.glob(os.path.join(outdir, "rank*")) if glob.glob(os.path.join(d, EVENTS)))


def write_tensorboard(df, outdir: str, steps=None) -> list[str]:
    """Write the scalars of ``df`` (one or many ranks; with cross-rank ``transfer_us`` when the
    caller added it, as the report does) under ``outdir``; returns the directories written.
    Unknown values (NaN: a step without a known time, a collective never measured) are left out,
    never written as 0."""
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    table = per_step(df, steps=steps)
    starts = df.groupby(["rank", "step"], observed=True)["start_ns"].min()
    # in step order per tag (the summary is ordered by time): TensorBoard's server takes a step lower
    # than the last one for a restarted job and drops the points after it
    bw = summary(df, by=["rank", "step", "collective"]).sort_values(["rank", "collective", "step"], kind="stable")
    written = []
    for rank, directory in rank_dirs(outdir, sorted(table["rank"].unique())).items():
        writer = SummaryWriter(log_dir=directory)
        try:
            mine = table[table["rank"] == rank]
            for row in mine.itertuples(index=False):
                wall = float(starts.get((rank, row.step), np.nan)) / 1e9
                for tag, column, scale in STEP_TAGS:
                    value = float(getattr(row, column))
                    if not np.isnan(value):
                        writer.add_scalar(tag, value * scale, global_step=int(row.step), walltime=wall)
            for row in bw[bw["rank"] == rank].itertuples(index=False):
                value = float(row.busbw_gbps)
                if not np.isnan(value):
                    wall = float(starts.get((rank, row.step), np.nan)) / 1e9
                    writer.add_scalar(f"busbw_gbps/{row.collective}", value, global_step=int(row.step), walltime=wall)
            writer.flush()
        finally:
            writer.close()
        written.append(directory)
    return written
