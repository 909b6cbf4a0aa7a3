"""Checking what was read, per file and across files: the columns a file must have and those
filled for an older file (``columns_to_fill``), the SCHEMA's types (``conform``), values that size
what the analysis builds (``check_sizes``), impossible durations turned into unmeasured
(``sanitize_arrow`` / ``sanitize_pandas``), one-line errors for bad values (``bad_value``), and
the job checks across files (``Jobs``: one world size, one process per rank, rows given once)."""

from __future__ import annotations

import math

from ..data.logfile import MAX_WORLD, RANKS_NAMED, rank_count
from ..data.schema import ADDED_IN, COLUMNS, DERIVED_FROM_OP
from .problems import LogFileError, _NotALog

NEUTRAL = {"category": "", "int64": 0, "float64": float("nan"), "bool": False}

NEUTRAL_BY_COLUMN = {"bucket": -1, "peer": -1, "tensors": 1}

_WORDS = {
    "int64": "an integer",
    "float64": "a number",
    "bool": "true or false",
    "double": "a number",
    "bool_": "true or false",
}


def columns_to_fill(path, names, schema, version, notes) -> list[str]:
    """The wanted columns the file lacks, to be filled with neutral values; raises when the file
    is not a commpatch log, or lacks a column that every log of its schema version has."""
    present = set(names)
    base = [c for c in COLUMNS if ADDED_IN.get(c, 1) == 1]
    if sum(c in present for c in base) < len(base) // 2:
        shown = ", ".join(repr(n)[1:-1][:30] for n in names[:6]) + (
            f", ... ({len(names)} columns)" if len(names) > 6 else ""
        )
        raise _NotALog(
            path,
            f"not a commpatch log: its columns are {shown or 'none'}; a log has "
            f"{', '.join(COLUMNS[:4])}, ... (see commpatch.schema())",
        )
    missing = [c.name for c in schema if c.name not in present]
    required = [c for c in missing if ADDED_IN.get(c, 1) <= (version or 1)]
    if required:
        which = f"schema {version}" if version else "commpatch"
        raise LogFileError(
            path,
            f"no {', '.join(map(repr, required))} column: every {which} log has it (the file "
            "was edited, or written by another tool)",
        )
    derivable = {c for c in DERIVED_FROM_OP if "op" in present}
    if {"start_ns", "duration_us", "timing"} <= present:
        derivable.add("own_us")
    lacking = [c for c in missing if c not in derivable]
    if lacking:
        since = min(ADDED_IN.get(c, 1) for c in lacking)
        notes.add(
            path,
            f"written by an older commpatch (schema {since - 1}, before the column(s) "
            f"{', '.join(lacking)}): filled with neutral values",
        )
    return missing


def conform(pa, path, table, schema, fill, where):
    """The SCHEMA's columns (of ``schema``), order and Arrow types; ``fill``: columns the file
    lacks, given neutral values. Raises for a column of the wrong type, or an empty integer."""
    import pyarrow.compute as pc

    n = table.num_rows
    columns = []
    for c in schema:
        target = arrow_type(pa, c.dtype)
        if c.name in fill:
            value = NEUTRAL_BY_COLUMN.get(c.name, NEUTRAL[c.dtype])
            if c.dtype == "category":
                col = pa.DictionaryArray.from_arrays(
                    pa.repeat(pa.scalar(0, pa.int32()), n), pa.array([value] if n else [], pa.string())
                )
            elif c.dtype == "float64":
                col = pa.nulls(n, pa.float64())
            else:
                col = pa.repeat(pa.scalar(value, target), n)
            columns.append(col)
            continue
        col = table.column(c.name)
        try:
            if c.dtype == "category":
                if (
                    col.null_count
                    or not pa.types.is_dictionary(col.type)
                    or not pa.types.is_string(col.type.value_type)
                ):
                    col = pc.dictionary_encode(pc.fill_null(pc.cast(col, pa.string()), ""))
                col = pc.cast(col, target)
            elif col.type != target:
                col = pc.cast(col, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise LogFileError(path, f"column {c.name!r} has type {col.type}, not {c.dtype}") from None
        if c.dtype in ("int64", "bool") and col.null_count:
            first = pc.index(pc.is_null(col), pa.scalar(True)).as_py()
            raise bad_value(path, c.name, "", where(first), c.dtype)
        columns.append(col)
    return pa.table(columns, names=[c.name for c in schema])


def check_sizes(pa, data, path, where) -> None:
    """Refuse the values that size what the analysis builds (a rank, a world, a group's ranks)
    beyond what a job can have: ranks in [0, world_size), world_size at most ``MAX_WORLD``, group
    ranks in range notation below ``MAX_WORLD`` and ``RANKS_NAMED`` in all. Checked before anything
    is built from them."""
    import numpy as np

    names = data.column_names if pa is not None else list(data.columns)

    def column(name):
        return (data.column(name).to_numpy() if pa is not None else data[name].to_numpy()).astype(np.int64)

    world = column("world_size") if "world_size" in names else None
    if world is not None:
        bad = np.flatnonzero((world < -1) | (world > MAX_WORLD) | (world == 0))
        if len(bad):
            raise LogFileError(
                path,
                f"column 'world_size' holds {world[bad[0]]} on {where(int(bad[0]))}: a world "
                f"size is 1 to {MAX_WORLD:,} (-1: not distributed)",
            )
        if "rank" in names:
            rank = column("rank")
            bad = np.flatnonzero((rank < -1) | ((world > 0) & (rank >= world)) | ((world < 0) & (rank >= MAX_WORLD)))
            if len(bad):
                i = int(bad[0])
                raise LogFileError(
                    path, f"column 'rank' holds {rank[i]} on {where(i)}: not a rank of a world of {world[i]}"
                )
    if "group_ranks" in names:  # within MAX_WORLD (a log may outlive a process group), and in all
        col = data.column("group_ranks") if pa is not None else data["group_ranks"]
        named = 0
        for value in col.unique().to_pylist() if pa is not None else col.unique().tolist():
            text = str(value)
            try:
                named += rank_count(text)
                if named > RANKS_NAMED:
                    raise ValueError("too many")
            except ValueError:
                i = (col.to_pylist() if pa is not None else col.astype(str).tolist()).index(text)
                shown = repr(text if len(text) <= 40 else text[:40] + "...")
                raise LogFileError(
                    path,
                    f"column 'group_ranks' holds {shown} on {where(i)}, not ranks (range "
                    f"notation: '0-7', '0-6:2', '0 3 5'; at most {MAX_WORLD:,} ranks, and "
                    f"{RANKS_NAMED:,} named by a file's groups in all)",
                ) from None


# time and bandwidth columns that cannot be infinite or negative, with what a bad value voids
_IMPOSSIBLE = (
    ("duration_us", ("own_us", "algbw_gbps", "busbw_gbps")),
    ("own_us", ("algbw_gbps", "busbw_gbps")),
    ("host_us", ()),
    ("algbw_gbps", ()),
    ("busbw_gbps", ()),
)


def sanitize_arrow(pa, table, path, notes):
    """Infinite or negative durations -> null (unmeasured), with their bandwidth; a warning."""
    import pyarrow.compute as pc

    names = table.column_names

    def impossible(name):
        col = table.column(name)
        low, high = pc.min_max(col).values()  # (NaN and nulls skipped): one pass where all is well
        if low.as_py() is None or math.isnan(low.as_py()) or (low.as_py() >= 0 and high.as_py() < math.inf):
            return None, 0, 0
        inf = pc.fill_null(pc.is_inf(col), False)
        neg = pc.fill_null(pc.less(col, 0.0), False)
        return pc.or_(inf, neg), pc.sum(inf).as_py() or 0, pc.sum(neg).as_py() or 0

    def clear(name, mask):
        return table.set_column(
            names.index(name), name, pc.if_else(mask, pa.scalar(None, pa.float64()), table.column(name))
        )

    for name, derived in _IMPOSSIBLE:
        if name not in names:
            continue
        mask, inf, neg = impossible(name)
        if inf + neg == 0:
            continue
        for target in (name,) + derived:
            if target in names:
                table = clear(target, mask)
        _note_impossible(notes, path, name, inf, neg)
    if "duration_us" in names:
        unknown = pc.fill_null(pc.is_nan(table.column("duration_us")), True)
        if pc.any(unknown).as_py():  # no duration: no bandwidth either, whatever the file says
            for target in ("own_us", "algbw_gbps", "busbw_gbps"):
                if target in names:
                    table = clear(target, unknown)
            if "timing" in names:
                host = pc.fill_null(pc.equal(table.column("timing"), pa.scalar("host")), False)
                _note_host_unmeasured(notes, path, pc.sum(pc.and_(unknown, host)).as_py() or 0)
    return table


def sanitize_pandas(df, path, notes):
    import numpy as np

    for name, derived in _IMPOSSIBLE:
        if name not in df.columns:
            continue
        values = df[name].to_numpy(np.float64)
        inf, neg = np.isinf(values), values < 0
        if not (inf.any() or neg.any()):
            continue
        mask = inf | neg
        for target in (name,) + derived:
            if target in df.columns:
                df[target] = np.where(mask, np.nan, df[target].to_numpy(np.float64))
        _note_impossible(notes, path, name, int(inf.sum()), int(neg.sum()))
    if "duration_us" in df.columns:
        unknown = np.isnan(df["duration_us"].to_numpy(np.float64))
        if unknown.any():  # no duration: no bandwidth either, whatever the file says
            for target in ("own_us", "algbw_gbps", "busbw_gbps"):
                if target in df.columns:
                    df[target] = np.where(unknown, np.nan, df[target].to_numpy(np.float64))
            if "timing" in df.columns:
                _note_host_unmeasured(notes, path, int((unknown & (df["timing"].to_numpy() == "host")).sum()))
    return df


def _note_host_unmeasured(notes, path, n) -> None:
    if n:
        notes.add(
            path,
            f"{n} row(s) with timing 'host' but no duration_us (a host-timed call always has "
            "one: the value was lost or edited): counted as unmeasured",
        )


def _note_impossible(notes, path, name, inf, neg) -> None:
    if name in ("algbw_gbps", "busbw_gbps"):
        return  # derived from duration_us: cleared with it, or on its own without a word
    kinds = " and ".join(f"{k} {what}" for k, what in ((inf, "infinite"), (neg, "negative")) if k)
    effect = "treated as unmeasured (left out of times and bandwidth)" if name == "duration_us" else "set to NaN"
    notes.add(path, f"{inf + neg} impossible {name} value(s) ({kinds}): {effect}")


def bad_value(path, name, value, where, kind) -> LogFileError:
    word = _WORDS.get(kind, kind)
    if value == "":
        return LogFileError(path, f"column {name!r} is empty on {where} ({word} is needed)")
    hint = " (a second header line: files joined together?)" if value == name else ""
    shown = repr(value if len(value) <= 40 else value[:40] + "...")
    return LogFileError(path, f"column {name!r} holds {shown} on {where}, not {word}{hint}")


def short(exc) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."


def arrow_type(pa, dtype):
    return {
        "category": pa.dictionary(pa.int32(), pa.string()),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
    }[dtype]


class Jobs:
    """The (rank, pid) keys of the files read so far: refuses files of another job, and tells a
    copy of a file already read (skipped) from rows given twice (refused)."""

    def __init__(self) -> None:
        self.world: tuple | None = None  # (world_size, file)
        self.ranks: dict[int, list] = {}  # rank -> [(pid, file, key summary)]

    def admit(self, path, keys, notes) -> bool:
        copies = []
        for k in keys:
            for ws in sorted({k["world_size_min"], k["world_size_max"]}):
                if self.world is None:
                    self.world = (ws, path)
                elif ws != self.world[0]:
                    where = "it" if self.world[1] == path else self.world[1]
                    raise LogFileError(
                        path,
                        f"world_size {ws}, but {where} has world_size {self.world[0]}: logs "
                        "of two different jobs. Read one run's files at a time (one directory "
                        "per run; `commpatch report --compare DIR...` compares runs)",
                    )
            for pid, other, o in self.ranks.get(k["rank"], ()):
                if pid != k["pid"]:
                    raise LogFileError(
                        path,
                        f"rank {k['rank']} recorded by pid {k['pid']}, but {other} holds rank "
                        f"{k['rank']} recorded by pid {pid}: logs of two different runs (or a "
                        "restarted job). Read one run's files at a time (one directory per run)",
                    )
                if all(o[f] == k[f] for f in ("seq_count", "seq_min", "seq_max", "start_ns_min", "start_ns_max")):
                    copies.append(other)
                elif k["seq_min"] <= o["seq_max"] and o["seq_min"] <= k["seq_max"]:
                    raise LogFileError(
                        path,
                        f"repeats rows of rank {k['rank']} (pid {pid}, seq {k['seq_min']}-"
                        f"{k['seq_max']}) that {other} also holds: give each rank's rows once",
                    )
        if copies:
            if len(copies) == len(keys) and len(set(copies)) == 1:
                notes.add(path, f"a copy of {copies[0]} (the same rank, process and rows): read once")
                return False
            raise LogFileError(path, f"repeats rows that {copies[0]} also holds: give each rank's rows once")
        for k in keys:
            self.ranks.setdefault(k["rank"], []).append((k["pid"], path, k))
        return True


_KEY_AGGREGATES = (
    ("seq", "count"),
    ("seq", "min"),
    ("seq", "max"),
    ("start_ns", "min"),
    ("start_ns", "max"),
    ("world_size", "min"),
    ("world_size", "max"),
)


def keys_arrow(table) -> list[dict]:
    if table.num_rows == 0:
        return []
    return table.group_by(["rank", "pid"]).aggregate(list(_KEY_AGGREGATES)).to_pylist()


def keys_pandas(df) -> list[dict]:
    if len(df) == 0:
        return []
    spec = {f"{col}_{how}": (col, how) for col, how in _KEY_AGGREGATES}
    out = df.groupby(["rank", "pid"]).agg(**spec).reset_index()
    return [{k: int(v) for k, v in row.items()} for row in out.to_dict("records")]
