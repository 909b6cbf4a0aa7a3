"""Exporters to other tools' formats: a Chrome trace / Perfetto timeline, and the per-module
collective tree that CommDebugMode's browser visualiser reads.

Both build plain dicts (``chrome_trace``, ``module_tree``) from a log DataFrame; the ``write_*``
functions serialise them. No plotting, no printing.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import json
import math

import numpy as np

from ..analysis.arrays import lexsort, running_max
from ..data.publish import publish, write_bytes

# per-event details copied into the trace's "args" (when the column exists)
TRACE_ARGS = (
    "bytes",
    "dtype",
    "group_seq",
    "step",
    "timing",
    "duration_us",
    "host_us",
    "busbw_gbps",
    "async_op",
    "status",
    "peer",
    "tag",
    "module",
    "phase",
    "seq",
)


def chrome_trace(df) -> dict:
    """The log as a Chrome trace (JSON object format): one process per rank, one track per group.

    Every row is one complete event (``ph: "X"``) named after its op, starting at ``start_ns``
    and lasting ``duration_us`` (``host_us`` where the duration is unknown, flagged in args).
    Times are microseconds from the earliest call in the log, whose Unix time in ns is in
    ``otherData.origin_unix_ns``. Calls that overlap on one rank and group (async ops) go to
    extra lanes of that group ("group 0 #2") so that every track nests properly, as Perfetto
    requires. Each rank's step starts (its first call of each step) are instant events "step N"
    on a "steps" track above its groups. Open the file in https://ui.perfetto.dev or chrome://tracing.
    """
    n = len(df)
    start = df["start_ns"].to_numpy(np.int64)
    origin = int(start.min()) if n else 0
    ts = (start - origin) / 1e3
    measured = df["duration_us"].to_numpy(np.float64)
    dur = np.where(np.isnan(measured), df["host_us"].to_numpy(np.float64), measured)
    dur = np.nan_to_num(dur, nan=0.0).clip(min=0.0)
    rank = df["rank"].to_numpy(np.int64)
    groups = df["group"].astype(str).to_numpy()
    group_names = sorted(set(groups.tolist()), key=_group_order)
    gindex = {g: i for i, g in enumerate(group_names)}
    gcode = np.array([gindex[g] for g in groups], np.int64) if n else np.zeros(0, np.int64)
    lanes = _lanes(rank, gcode, ts, dur)
    tid = gcode * 64 + np.minimum(lanes, 63) + 1  # tid 0 is reserved by some viewers
    ranks_of = dict(zip(groups, df["group_ranks"].astype(str))) if n else {}

    events = []
    for r in np.unique(rank).tolist():
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    events += _step_markers(df, rank, ts)
    for r, t in sorted(set(zip(rank.tolist(), tid.tolist()))):
        g, lane = group_names[(t - 1) // 64], (t - 1) % 64
        name = f"group {g} (ranks {ranks_of[g]})" + (f" #{lane + 1}" if lane else "")
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": t, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": t, "args": {"sort_index": t}})
    columns = [c for c in TRACE_ARGS if c in df.columns]
    values = [_plain(df[c]) for c in columns]
    ops = df["op"].astype(str).tolist()
    unknown = np.isnan(measured).tolist()
    for i, (op, r, t, s, d) in enumerate(zip(ops, rank.tolist(), tid.tolist(), ts.tolist(), dur.tolist())):
        args = {c: v[i] for c, v in zip(columns, values) if v[i] is not None and v[i] != ""}
        if unknown[i]:
            args["duration_unknown"] = True
        events.append({"ph": "X", "name": op, "cat": "commpatch", "pid": r, "tid": t, "ts": s, "dur": d, "args": args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "commpatch", "origin_unix_ns": origin, "rows": n},
    }


STEPS_TID = 0x7FFF0000  # the "steps" track of each rank, above its groups' tracks


def _step_markers(df, rank, ts) -> list:
    """One instant event "step N" per rank and step, at the rank's first call of that step, on a
    "steps" track of its own (the log's ``step`` column; nothing for a log without steps)."""
    if "step" not in df.columns or not len(df):
        return []
    import pandas as pd

    first = pd.DataFrame({"rank": rank, "step": df["step"].to_numpy(np.int64), "ts": ts})
    first = first[first["step"] >= 0].groupby(["rank", "step"], sort=True)["ts"].min().reset_index()
    if first["step"].nunique() < 2:
        return []
    out = []
    for r in first["rank"].unique().tolist():
        out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": STEPS_TID, "args": {"name": "steps"}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": STEPS_TID, "args": {"sort_index": -1}})
    out += [
        {
            "ph": "i",
            "s": "t",
            "name": f"step {s}",
            "cat": "step",
            "pid": r,
            "tid": STEPS_TID,
            "ts": t,
            "args": {"step": s},
        }
        for r, s, t in zip(first["rank"].tolist(), first["step"].tolist(), first["ts"].tolist())
    ]
    return out


def write_chrome_trace(df, path: str) -> str:
    """Write ``chrome_trace(df)`` as JSON (``.json``; ``.json.gz`` is gzip-compressed)."""
    import gzip

    trace = chrome_trace(df)

    def fill(f):
        with gzip.GzipFile(fileobj=f, mode="wb") if str(path).endswith(".gz") else contextlib.nullcontext(f) as out:
            text = io.TextIOWrapper(out, encoding="utf-8")
            json.dump(trace, text, separators=(",", ":"), allow_nan=False)
            text.flush()
            text.detach()

    return publish(path, fill)


def _group_order(name: str):
    return (0, int(name), name) if name.isdigit() else (1, 0, name)


def _plain(series) -> list:
    """Column values as JSON-safe Python scalars (NaN -> None)."""
    values = series.astype(object).tolist() if series.dtype.name == "category" else series.tolist()
    return [None if isinstance(v, float) and math.isnan(v) else v for v in values]


def _lanes(rank, group, ts, dur):
    """Lane per row so that calls on one (rank, group) track never overlap within a lane."""
    lanes = np.zeros(len(ts), np.int64)
    if not len(ts):
        return lanes
    order = lexsort((ts, group, rank))
    r, g, s, e = rank[order], group[order], ts[order], ts[order] + dur[order]
    new_track = np.concatenate(([True], (r[1:] != r[:-1]) | (g[1:] != g[:-1])))
    track_id = np.cumsum(new_track) - 1
    # a row overlaps when it starts before the furthest end seen earlier on its track
    furthest = running_max(e, track_id)
    prev = np.concatenate(([-np.inf], furthest[:-1]))
    prev[new_track] = -np.inf
    busy_tracks = np.unique(track_id[s < prev])
    for t in busy_tracks.tolist():  # greedy interval colouring, only where calls overlap
        idx = np.flatnonzero(track_id == t)
        free: list[tuple[float, int]] = []  # (end, lane) of the lanes in use
        used = 0
        for i in idx.tolist():
            if free and free[0][0] <= s[i]:
                _, lane = heapq.heappop(free)
            else:
                lane, used = used, used + 1
            lanes[order[i]] = lane
            heapq.heappush(free, (e[i], lane))
    return lanes


# ---- CommDebugMode's module tree ----------------------------------------------------------
def module_tree(df) -> dict:
    """The per-module collective tree in the JSON form of ``CommDebugMode.generate_json_dump``.

    Needs the log's ``module`` column (module attribution); ``phase`` decides forward vs
    backward when present (everything else counts as forward). As in CommDebugMode, a module's
    counts include those of its submodules and the root is "Global"; collective names are
    torch's function names. Each node also carries what CommDebugMode cannot measure:
    ``commpatch`` with count, total_us, bytes per (phase, op), and the node's totals.
    """
    if "module" not in df.columns:
        raise ValueError("module_tree needs the 'module' column (module attribution); this log has none")
    import pandas as pd

    phase = df["phase"].astype(str) if "phase" in df.columns else pd.Series("forward", index=df.index)
    work = pd.DataFrame(
        {
            "module": df["module"].astype(str).to_numpy(),
            "direction": np.where(phase.to_numpy() == "backward", "backward", "forward"),
            "op": df["op"].astype(str).to_numpy(),
            "duration_us": df["duration_us"].to_numpy(),
            "bytes": df["bytes"].to_numpy(),
        }
    )
    per = (
        work.groupby(["module", "direction", "op"], sort=True)
        .agg(count=("op", "size"), total_us=("duration_us", "sum"), bytes=("bytes", "sum"))
        .reset_index()
    )
    nodes: dict[str, dict] = {}

    def node(fqn: str) -> dict:
        if fqn not in nodes:
            nodes[fqn] = {
                "fqn": fqn,
                "module_type": "",
                "parameters": [],
                "children": [],
                "collectives_forward": [],
                "collectives_backward": [],
                "operations_forward": [],
                "operations_backward": [],
                "operations_checkpointing": [],
                "_acc": {},
            }
            if fqn != "Global":
                parent = fqn.rsplit(".", 1)[0] if "." in fqn else "Global"
                node(parent)["children"].append(nodes[fqn])
        return nodes[fqn]

    node("Global")
    for row in per.itertuples(index=False):
        parts = row.module.split(".") if row.module else []
        chain = ["Global"] + [".".join(parts[: i + 1]) for i in range(len(parts))]
        for fqn in chain:  # inclusive, like CommDebugMode's counts
            acc = node(fqn)["_acc"].setdefault((row.direction, row.op), [0, 0.0, 0])
            acc[0] += int(row.count)
            acc[1] += float(row.total_us)
            acc[2] += int(row.bytes)
    for n in nodes.values():
        acc = n.pop("_acc")
        details = []
        for (direction, op), (count, total_us, nbytes) in sorted(acc.items()):
            n[f"collectives_{direction}"].append([op, count])
            details.append({"phase": direction, "op": op, "count": count, "total_us": total_us, "bytes": nbytes})
        n["commpatch"] = {
            "collectives": details,
            "count": sum(d["count"] for d in details),
            "total_us": sum(d["total_us"] for d in details),
            "bytes": sum(d["bytes"] for d in details),
        }
    return nodes["Global"]


def write_module_tree(df, path: str) -> str:
    return write_bytes(json.dumps(module_tree(df), indent=2).encode("utf-8"), path, exclusive=False)
