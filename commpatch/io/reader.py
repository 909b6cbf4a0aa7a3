"""Reading logs: per-rank CSV / Parquet / binary (``.cplog``) files, a directory, a glob or a list,
into one DataFrame with the SCHEMA's dtypes; every problem with the input is a one-line
``LogFileError`` or, where a correct best-effort result exists, a ``LogFileWarning``. Also the
run directories (``runs``, ``latest_run``)."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from ..data.clock import CLOCK_ATTR
from ..data.frame import arrow_table, dataframe, own_times, parse_log, parsed_clock
from ..data.logfile import IN_FLIGHT_ATTR, MAX_WORLD, RANKS_NAMED, SUFFIX, in_flight, parse_header, rank_count
from ..data.ops import describe_op
from ..data.schema import (
    ADDED_IN,
    BOUNDARY_SOURCES,
    COLUMNS,
    DERIVED_FROM_OP,
    OLD_TIMING_NAMES,
    SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    STEPLESS_ATTR,
    TIMINGS,
)
from . import writer as _writer
from .dumps import dumps_beside
from .problems import LogFileError, LogFileNotFoundError, LogFileWarning, _NotALog

if TYPE_CHECKING:
    import pandas as pd


# ---- reading --------------------------------------------------------------------------
# Every problem with the files given to ``read`` is either a LogFileError (one line: the file,
# then what is wrong) or, where a correct best-effort result exists, a LogFileWarning and the
# rest of the data. Nothing else escapes from here for bad input: no raw pyarrow / pandas error.

_SNIFF = 1 << 16  # bytes looked at to tell what a file is
_PARQUET_MAGIC = b"PAR1"
_IDENTITY = ("seq", "rank", "world_size", "start_ns", "pid")  # read always: duplicate / mixed-job checks
_NEUTRAL = {"category": "", "int64": 0, "float64": float("nan"), "bool": False}
_NEUTRAL_BY_COLUMN = {"bucket": -1, "peer": -1, "tensors": 1}
_WORDS = {
    "int64": "an integer",
    "float64": "a number",
    "bool": "true or false",
    "double": "a number",
    "bool_": "true or false",
}


def read(paths, progress=None, columns=None, ranks=None, steps=None) -> pd.DataFrame:
    """Read per-rank files (a file, a directory, a glob, or a list of them) into one DataFrame
    with the SCHEMA's dtypes; ``read(write(df, p)) == df``.

    With pyarrow each file is parsed straight into typed and dictionary-encoded columns and the
    files are joined in Arrow (64 ranks x 100k rows: ~3x faster and ~3x less memory than parsing
    strings then converting). ``progress(done, total)`` is called after each file. ``columns``:
    read only these (in SCHEMA order). ``ranks``: a set of ranks to read (the files of other
    ranks are not read at all when their rank can be told from their first bytes); ``steps``:
    ``(first, stop)`` keeps the rows with ``first <= step < stop`` (None: open), and every row of
    a rank with no step boundary (its step constant, no recorded source: the analysis numbers its
    steps from its pattern of calls, ``analysis.with_pattern_steps``, and cuts the window then),
    listed in ``df.attrs["stepless_ranks"]``.

    Bad input raises ``LogFileError`` (a ValueError; ``LogFileNotFoundError``, also a
    FileNotFoundError, for paths that do not exist) naming the file and the problem. What can be
    read correctly anyway is, with a ``LogFileWarning``: empty files and the partial last line of
    a file cut short are skipped; a copy of a file already read is read once; columns a file
    predates (an older commpatch) get neutral values, listed in ``df.attrs["filled_columns"]``;
    infinite or negative durations become NaN (unmeasured); non-UTF-8 bytes in names are
    replaced; files found in a directory that are not commpatch logs are skipped. Files of two
    different jobs (different world sizes, or two processes for one rank) are refused.
    """
    plan = _Plan(columns, ranks, steps)
    notes = _Notes()
    try:
        files = _select(_resolve(paths, notes), ranks)
        parts = _Parts(plan, notes)
        for i, (path, scanned) in enumerate(files):
            parts.load(path, scanned)
            if progress is not None:
                progress(i + 1, len(files))
        parts.check(paths, len(files))
    finally:
        notes.emit()
    df = parts.frame()
    if notes.run is not None:  # the report's first line names the run read and the others
        df.attrs[RUN_ATTR] = notes.run
    return df


# df.attrs key: (the run directory read, how many runs its parent holds), when a directory of runs was given
RUN_ATTR = "run"


class _Plan:
    """What to read: the columns (and the identity columns the job checks need), a rank set and
    a window of steps."""

    def __init__(self, columns=None, ranks=None, steps=None) -> None:
        wanted = set(c.name for c in SCHEMA) if columns is None else set(columns)
        self.wanted = wanted
        self.schema = tuple(c for c in SCHEMA if c.name in wanted)
        self.read_schema = tuple(c for c in SCHEMA if c.name in wanted or c.name in _IDENTITY)
        self.names = [c.name for c in self.schema]
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.steps = steps if steps is not None and steps != (None, None) else None


class _Parts:
    """The files read so far (conformed Arrow tables, or DataFrames without pyarrow), checked as
    one job (``_Jobs``), cut to the plan's ranks and steps; ``frame()`` joins them."""

    def __init__(self, plan: _Plan, notes: _Notes, jobs: _Jobs | None = None) -> None:
        self.plan, self.notes = plan, notes
        self.jobs = jobs if jobs is not None else _Jobs()
        self.pa = _writer._pyarrow()
        self.parts: list = []
        self.filled: set = set()
        self.foreign: list = []
        self.keys: list = []
        self.whole: set = set()  # ranks read whole despite a window of steps: no step boundary
        self.clocks: dict = {}  # rank -> data.clock RankClock.summary() (binary logs only)

    def load(self, path, scanned) -> None:
        plan, pa = self.plan, self.pa
        try:
            part = _read_file(pa, path, plan.read_schema, self.notes, self.clocks)
        except _NotALog as exc:
            if not scanned:
                raise
            self.notes.add(path, f"{exc.problem}: skipped")
            self.foreign.append(exc)
            return
        if part is None:
            return
        data, keys, fill = part
        if not self.jobs.admit(path, keys, self.notes):
            return
        self.keys.append((path, keys))
        data, whole = _cut(pa, data, plan.ranks, plan.steps)
        self.whole.update(whole)
        if len(plan.schema) != len(plan.read_schema):  # the identity columns were for admit()
            data = data.select(plan.names) if pa is not None else data[plan.names]
        self.parts.append(data)
        self.filled.update(fill)

    def check(self, paths, n_files) -> None:
        if self.foreign and len(self.foreign) == n_files:
            raise LogFileNotFoundError(
                _describe(paths), f"no commpatch log among {n_files} file(s) ({self.foreign[0]})"
            )

    def frame(self) -> pd.DataFrame:
        pa, schema, filled = self.pa, self.plan.schema, set(self.filled)
        df = _arrow_frame(pa, self.parts, schema) if pa is not None else _pandas_frame(self.parts, schema)
        derived = [c for c in DERIVED_FROM_OP if c in filled and c in df.columns]
        if derived and "op" in df.columns:  # an older file: from its op column, not neutral values
            _derive_from_op(df, derived)
            filled -= set(derived)
        if "own_us" in filled and "own_us" in df.columns and {"start_ns", "duration_us", "timing"} <= set(df.columns):
            _derive_own(df)  # an older file: from its durations (host clock)
            filled.discard("own_us")
        filled -= {"sync_end_us", "pack_us", "pack_alone_us"}  # an older file measured no DDP finalize or
        # packing: NaN is its value
        if "timing" in df.columns and df["timing"].dtype.name == "category":
            old = [c for c in df["timing"].cat.categories if c in OLD_TIMING_NAMES]
            if old:
                df["timing"] = df["timing"].cat.rename_categories({c: OLD_TIMING_NAMES[c] for c in old})
        df.attrs["filled_columns"] = sorted(filled & self.plan.wanted)
        here = {k["rank"] for _, keys in self.keys for k in keys}  # the ranks read: their dumps only
        flight = self.notes.flight + [d for d in dumps_beside([path for path, _ in self.keys]) if d["rank"] in here]
        df.attrs[IN_FLIGHT_ATTR] = [f for f in flight if self.plan.ranks is None or f["rank"] in self.plan.ranks]
        if self.clocks:
            df.attrs[CLOCK_ATTR] = dict(sorted(self.clocks.items()))
        if self.plan.steps is not None:
            df.attrs[STEPLESS_ATTR] = sorted(self.whole)
        return df


def _cut(pa, data, ranks, steps):
    """The rows of ``data`` (Arrow table or DataFrame) of the given ranks and window of steps (the
    ranks with no step boundary whole: see ``read``), and those ranks."""
    if ranks is None and steps is None:
        return data, []
    whole = _stepless_ranks(pa, data) if steps is not None else []
    if pa is not None:
        import pyarrow.compute as pc

        mask = None
        if ranks is not None:
            mask = pc.is_in(data.column("rank"), value_set=pa.array(sorted(ranks), pa.int64()))
        window = None
        for bound, test in ((steps or (None, None))[0], pc.greater_equal), ((steps or (None, None))[1], pc.less):
            if bound is not None:
                m = test(data.column("step"), pa.scalar(int(bound), pa.int64()))
                window = m if window is None else pc.and_(window, m)
        if window is not None and whole:
            window = pc.or_(window, pc.is_in(data.column("rank"), value_set=pa.array(whole, pa.int64())))
        mask = window if mask is None else mask if window is None else pc.and_(mask, window)
        return (data if mask is None else data.filter(mask)), whole
    keep = data["rank"].isin(sorted(ranks)) if ranks is not None else data["rank"] == data["rank"]
    window = data["rank"] == data["rank"]
    if steps is not None and steps[0] is not None:
        window &= data["step"] >= steps[0]
    if steps is not None and steps[1] is not None:
        window &= data["step"] < steps[1]
    return data[(keep & (window | data["rank"].isin(whole))).to_numpy()].reset_index(drop=True), whole


def _stepless_ranks(pa, data) -> list:
    """The ranks of ``data`` whose step is constant and that no recorded source counted."""
    if pa is not None:
        import pyarrow.compute as pc

        span = data.group_by("rank").aggregate([("step", "min"), ("step", "max")])
        rank = span.column("rank").to_numpy()
        flat = set(rank[span.column("step_min").to_numpy() == span.column("step_max").to_numpy()].tolist())
        if flat and "step_source" in data.column_names:
            counted = pc.is_in(pc.cast(data.column("step_source"), pa.string()), value_set=pa.array(BOUNDARY_SOURCES))
            flat -= set(pc.unique(pc.filter(data.column("rank"), counted)).to_pylist())
        return sorted(flat)
    span = data.groupby("rank")["step"].agg(["min", "max"])
    flat = set(span.index[span["min"] == span["max"]].tolist())
    if flat and "step_source" in data.columns:
        flat -= set(data.loc[data["step_source"].astype(str).isin(BOUNDARY_SOURCES), "rank"].unique().tolist())
    return sorted(flat)


def file_rank(path) -> int | None:
    """The rank a log file holds, from its first bytes (a binary log's header, a CSV's first row,
    a Parquet file's statistics); None when that cannot be told cheaply (reading will say why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
        if head.startswith(b"CPLOG"):
            return parse_header(head).get("rank")
        if head.startswith(_PARQUET_MAGIC):
            if partition_rank(path) is not None:
                return partition_rank(path)
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            index = meta.schema.to_arrow_schema().get_field_index("rank")
            stats = [meta.row_group(i).column(index).statistics for i in range(meta.num_row_groups)]
            values = {v for s in stats if s is not None and s.has_min_max for v in (s.min, s.max)}
            return int(values.pop()) if len(values) == 1 and len(stats) == meta.num_row_groups else None
        lines = head.split(b"\n", 2)
        if len(lines) < 3:
            return None
        import csv

        header, first = (next(csv.reader([x.decode("utf-8", "replace").strip("\r\ufeff")])) for x in lines[:2])
        return int(first[[h.strip() for h in header].index("rank")])
    except Exception:  # noqa: BLE001 - any problem: unknown here, reported when the file is read
        return None


def _select(files, ranks):
    """``files`` without those whose rank (told from their first bytes) is not in ``ranks``."""
    if ranks is None:
        return files
    out = []
    for path, scanned in files:
        rank = file_rank(path)
        if rank is None or rank in ranks:
            out.append((path, scanned))
    return out


def read_ranks(paths, transform, columns=None, ranks=None, steps=None, progress=None, workers: int = 1):
    """Yield ``transform(df)`` for the rows of each rank in turn (``df`` as ``read`` gives it for
    that rank's file(s)): memory for ``workers`` ranks at a time, whatever the number of ranks.
    With ``workers`` > 1 the files are read and transformed in that many processes (``transform``
    must then be picklable: a module-level function or a ``functools.partial`` of one). The same
    checks and warnings as ``read``; ``progress(done, total)`` after each rank."""
    plan = _Plan(columns, ranks, steps)
    notes = _Notes()
    try:
        files = _select(_resolve(paths, notes), ranks)
        by_rank: dict = {}
        for path, scanned in files:
            rank = file_rank(path)
            by_rank.setdefault(("rank", rank) if rank is not None else ("file", path), []).append((path, scanned))
        tasks = list(by_rank.values())
        jobs, foreign = _Jobs(), 0
        for done, (result, problems, keys, n_foreign) in enumerate(_run_tasks(tasks, plan, transform, workers), 1):
            for problem, where in problems.items():
                for path in where:
                    notes.add(path, problem)
            admitted = [jobs.admit(path, k, notes) for path, k in keys]  # all: every check runs
            foreign += n_foreign
            if progress is not None:
                progress(done, len(tasks))
            if result is not None and all(admitted):
                yield result
        if foreign and foreign == len(files):
            raise LogFileNotFoundError(_describe(paths), f"no commpatch log among {len(files)} file(s)")
    finally:
        notes.emit()


def _run_tasks(tasks, plan, transform, workers):
    if workers <= 1 or len(tasks) < 2:
        for task in tasks:
            yield _rank_task(task, plan, transform)
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        pending, queue = [], list(tasks)
        queue.reverse()
        try:
            while queue or pending:
                while queue and len(pending) < 2 * workers:  # a bounded window: memory for a few ranks
                    pending.append(pool.submit(_rank_task, queue.pop(), plan, transform))
                yield pending.pop(0).result()
        finally:
            for future in pending:
                future.cancel()


def _rank_task(files, plan, transform):
    """Read one rank's file(s) and transform the rows: (result or None, problems, keys, foreign)."""
    notes = _Notes()
    parts = _Parts(plan, notes)
    for path, scanned in files:
        parts.load(path, scanned)
    result = transform(parts.frame()) if parts.parts else None
    return result, notes.problems, parts.keys, len(parts.foreign)


def _derive_own(df) -> None:
    """``own_us`` for a file that predates it, as the frame builder computes it from the log."""
    import numpy as np

    by = [c for c in ("rank", "pid", "group") if c in df.columns]
    key = df.groupby(by, observed=True, sort=False).ngroup().to_numpy(np.int64) if by else np.zeros(len(df), np.int64)
    order = np.argsort(df["seq"].to_numpy(), kind="stable") if "seq" in df.columns else np.arange(len(df))
    names = df["timing"].astype("category")
    code_of = [
        TIMINGS.index(OLD_TIMING_NAMES.get(t, t)) if OLD_TIMING_NAMES.get(t, t) in TIMINGS else -1
        for t in names.cat.categories.astype(str)
    ]  # per category, not per row
    codes = names.cat.codes.to_numpy()
    timing = np.where(codes >= 0, np.asarray(code_of + [-1], np.int64)[codes], -1)
    dur_ns = df["duration_us"].to_numpy(np.float64) * 1e3
    own = np.full(len(df), np.nan)
    own[order] = own_times(np, key[order], df["start_ns"].to_numpy(np.int64)[order], dur_ns[order], timing[order])
    df["own_us"] = own / 1e3


def _derive_from_op(df, names) -> None:
    import numpy as np
    import pandas as pd

    ops = df["op"].astype("category")
    described = [describe_op(str(op)) for op in ops.cat.categories]
    codes = ops.cat.codes.to_numpy()
    for name in names:
        i = DERIVED_FROM_OP.index(name)
        values = [d[i] for d in described]
        categories = sorted(set(values))
        lut = [categories.index(v) for v in values] or [0]
        df[name] = pd.Categorical.from_codes(np.asarray(lut)[codes] if len(codes) else codes, categories=categories)


def expand(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    paths = [str(p) for p in paths]
    chosen = one_run([p for p in paths if os.path.isdir(p) and not _log_files(p)])
    for p in paths:
        if os.path.isdir(p):
            files += _log_files(p) or _log_files(chosen.get(p) or p)
        elif any(ch in p for ch in "*?["):
            files += sorted(glob.glob(p))
        else:
            files.append(p)
    return files


def _describe(paths) -> str:
    if isinstance(paths, (str, os.PathLike)):
        return str(paths)
    paths = [str(p) for p in paths]
    return paths[0] if len(paths) == 1 else ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")


def _resolve(paths, notes) -> list[tuple[str, bool]]:
    """The files to read, each with whether a directory / glob found it (else it was named);
    each file once. Raises LogFileNotFoundError for a path that names nothing readable."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[tuple[str, bool]] = []
    seen: dict[str, str] = {}
    paths = [str(os.fspath(p)) for p in paths]
    chosen = one_run([p for p in paths if os.path.isdir(p) and not _log_files(p)], notes)
    for p in paths:
        if os.path.isdir(p):
            found = _log_files(p)
            if not found:
                run = chosen.get(p)
                found = _log_files(run) if run else []
            if not found:
                raise LogFileNotFoundError(
                    p, "no .cplog, .csv or .parquet file in this directory (nor in a run directory under it)"
                )
            scanned = True
        elif os.path.exists(p):
            found, scanned = [p], False
        elif any(ch in p for ch in "*?["):
            found = [f for f in sorted(glob.glob(p)) if os.path.isfile(f)]
            if not found:
                raise LogFileNotFoundError(p, "matches no file")
            scanned = True
        else:
            raise LogFileNotFoundError(p, "no such file or directory")
        for f in found:
            key = os.path.realpath(f)
            if key in seen:
                also = f" (also as {seen[key]})" if seen[key] != f else ""
                notes.add(f, f"given twice{also}: read once")
                continue
            seen[key] = f
            out.append((f, scanned))
    if not out:
        raise LogFileNotFoundError(_describe(paths), "no log file given")
    return out


PARTITION = "rank="  # the subdirectories of a rank-partitioned Parquet dataset (``commpatch convert --to parquet``)


def partition_rank(path) -> int | None:
    """The rank of a file of a rank-partitioned dataset (``.../rank=7/part.parquet``), else None."""
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    value = parent[len(PARTITION) :] if parent.startswith(PARTITION) else ""
    return int(value) if value.isdigit() else None


def _log_files(directory: str) -> list[str]:
    """The log files of a directory: binary rank logs, and CSV / Parquet files except those that
    are the export of a binary log beside them (the same rows twice); or the Parquet files of a
    rank-partitioned dataset (``rank=R/*.parquet``)."""
    entries = os.listdir(directory)
    parts = sorted(
        (
            d
            for d in entries
            if partition_rank(os.path.join(directory, d, "x")) is not None and os.path.isdir(os.path.join(directory, d))
        ),
        key=lambda d: int(d[len(PARTITION) :]),
    )
    if parts:
        return [
            os.path.join(directory, d, f)
            for d in parts
            for f in sorted(os.listdir(os.path.join(directory, d)))
            if f.endswith(".parquet") and os.path.isfile(os.path.join(directory, d, f))
        ]
    names = [
        f for f in entries if f.endswith((SUFFIX, ".csv", ".parquet")) and os.path.isfile(os.path.join(directory, f))
    ]
    binary = {f[: -len(SUFFIX)] for f in names if f.endswith(SUFFIX)}
    keep = [f for f in names if f.endswith(SUFFIX) or os.path.splitext(f)[0] not in binary]
    return [os.path.join(directory, f) for f in sorted(keep)]


def runs(directory: str) -> list[str]:
    """Run directories (one per job and restart attempt) directly under ``directory``, oldest first
    by the time each run started (``run_started``), not by the directory's time of change (converting
    an old run, or copying it, would make it the latest)."""
    subdirs = [os.path.join(directory, d) for d in os.listdir(directory)]
    found = [d for d in subdirs if os.path.isdir(d) and _log_files(d)]
    return sorted(found, key=lambda d: (run_started(d), d))


def run_started(directory: str) -> float:
    """When the run of a directory started, in Unix seconds: the earliest creation time in the
    headers of its binary rank logs; else the ``YYYYmmdd-HHMMSS`` in its name (``{run}``: local
    time); else the time of change of its oldest log file."""
    import re
    import time

    created = []
    files = _log_files(directory)
    for path in files:
        if path.endswith(SUFFIX):
            try:
                with open(path, "rb") as f:
                    ns = parse_header(f.read(1 << 16)).get("created_ns")
            except OSError:
                continue
            if isinstance(ns, int) and ns > 0:
                created.append(ns / 1e9)
    if created:
        return min(created)
    m = re.search(r"(\d{8}-\d{6})", os.path.basename(os.path.normpath(directory)))
    if m:
        try:
            return time.mktime(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
        except (ValueError, OverflowError):
            pass
    times = []
    for path in files:
        try:
            times.append(os.path.getmtime(path))
        except OSError:
            continue
    return min(times, default=0.0)


def one_run(directories, notes=None) -> dict:
    """{directory of runs: the run directory to read in it}. One directory: its latest run. Several
    (one per host, each holding its ranks' files under the run's name, agreed by every rank of a
    job: ``{run}``): the same run in each, the latest one that all of them hold (by the first
    one's order); when they hold none in common, the latest of each, said in a note."""
    if len(directories) <= 1:
        return {d: latest_run(d, notes) for d in directories}
    found = {d: runs(d) for d in directories}
    names = [{os.path.basename(r) for r in rs} for rs in found.values()]
    common = [r for r in found[directories[0]] if all(os.path.basename(r) in n for n in names)]
    if common:
        name = os.path.basename(common[-1])
        out: dict = {d: os.path.join(d, name) for d in directories}
        if notes is not None:
            counts = sorted({len(rs) for rs in found.values()})
            notes.add(
                directories[0],
                f"{len(directories)} directories of runs: reading run {name}, held by all of "
                f"them ({'/'.join(map(str, counts))} run(s) each)",
            )
            notes.run = (out[directories[0]], max(counts), len(directories))
        return out
    out = {d: latest_run(d) for d in directories}
    if notes is not None:
        notes.add(
            directories[0],
            "the directories given hold no run of the same name (each host of a job writes "
            "its ranks' files under the run's one name): reading the latest of each: "
            + ", ".join(os.path.basename(r) for r in out.values() if r),
        )
    return out


def chosen_run(paths):
    """(the run directory, how many runs) when ``paths`` is one directory of runs (no log file of
    its own: its latest run is read), else None; what ``read`` keeps in ``df.attrs["run"]``."""
    if isinstance(paths, (list, tuple)) and len(paths) == 1:
        paths = paths[0]
    if isinstance(paths, (list, tuple)) and len(paths) > 1:  # one directory of runs per host
        dirs = [str(os.fspath(p)) for p in paths]
        if all(os.path.isdir(d) and not _log_files(d) for d in dirs):
            chosen = one_run(dirs)
            first = chosen.get(dirs[0])
            if first and all(os.path.basename(r or "") == os.path.basename(first) for r in chosen.values()):
                return first, max(len(runs(d)) for d in dirs), len(dirs)
        return None
    if not isinstance(paths, (str, os.PathLike)) or not os.path.isdir(paths) or _log_files(str(paths)):
        return None
    found = runs(str(paths))
    return (found[-1], len(found)) if found else None


def latest_run(directory: str, notes=None) -> str | None:
    """The newest run directory under ``directory`` (None if there is none), said in a note and
    kept in ``notes.run`` ((the run, how many runs)) for the report's first line."""
    found = runs(directory)
    if not found:
        return None
    if notes is not None:
        others = f"; the other run(s): {', '.join(os.path.basename(d) for d in found[:-1])}" if len(found) > 1 else ""
        notes.add(directory, f"holds {len(found)} run(s): reading the latest, {os.path.basename(found[-1])}{others}")
        notes.run = (found[-1], len(found))
    return found[-1]


class _Notes:
    """Warnings collected while reading, one per problem: the same problem in many files (64
    ranks written by an older commpatch) is one warning naming the first file and a count."""

    def __init__(self) -> None:
        self.problems: dict[str, list[str]] = {}
        self.run = None  # (the run directory read, how many runs its parent holds): latest_run
        self.flight: list[dict] = []  # per binary log read: data.logfile.in_flight (its calls in flight at the end)

    def add(self, path, problem: str) -> None:
        self.problems.setdefault(problem, []).append(str(path))

    def emit(self) -> None:
        import warnings

        problems, self.problems = self.problems, {}
        for problem, where in problems.items():
            more = f" (and {len(where) - 1} other file(s))" if len(where) > 1 else ""
            warnings.warn(f"{where[0]}{more}: {problem}", LogFileWarning, stacklevel=4)


class _Jobs:
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


def _read_file(pa, path, schema, notes, clocks=None):
    """(data, key summary, filled columns) of one file, or None when it holds no row.
    ``data`` is a conformed Arrow table (or, without pyarrow, a DataFrame). ``clocks``: a dict
    that gets the clock of a binary log's rank (``data.clock``)."""
    size, head, end = _sniff(path)
    where = (lambda i: f"row {i + 1}") if head.startswith((_PARQUET_MAGIC, b"CPLOG")) else (lambda i: f"line {i + 2}")
    if not head.strip():
        notes.add(path, "empty file (no header, no rows): skipped" if size == 0 else "blank file: skipped")
        return None
    if head.startswith(_PARQUET_MAGIC):
        if pa is None:
            raise LogFileError(path, "reading Parquet needs pyarrow: pip install 'commpatch[arrow]'")
        table, fill = _read_parquet(pa, path, schema, notes)
        data = _conform(pa, path, table, schema, fill, where)
    elif str(path).endswith(".parquet"):
        raise LogFileError(
            path, "not a Parquet file (no Parquet magic bytes at its start; truncated to nothing, or another format)"
        )
    elif head.startswith(b"CPLOG"):
        data, fill = _read_binary(pa, path, schema, notes, clocks)
    elif b"\0" in head:
        raise LogFileError(path, "binary data, not a CSV (or Parquet) commpatch log")
    else:
        names = _csv_header(path, head)
        fill = _plan(path, names, schema, None, notes)
        if 0 < end < size:
            notes.add(
                path,
                "its last line is incomplete (the file was cut short, e.g. the process was killed "
                "while writing): that partial row is left out",
            )
        else:
            end = size
        if pa is not None:
            table = _read_csv_arrow(pa, path, names, schema, fill, size, end, notes)
            data = _conform(pa, path, table, schema, fill, where)
        else:
            data = _read_csv_pandas(path, names, schema, fill, size, end, notes)
    if pa is not None:
        data = _sanitize_arrow(pa, data, path, notes)
        rows = data.num_rows
    else:
        data = _sanitize_pandas(data, path, notes)
        rows = len(data)
    _check_sizes(pa, data, path, where)
    keys = _keys_arrow(data) if pa is not None else _keys_pandas(data)
    if rows == 0:
        notes.add(path, "no rows (header only): nothing was recorded in this file")
        return None
    return data, keys, fill


def _check_sizes(pa, data, path, where) -> None:
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


def _read_binary(pa, path, schema, notes, clocks=None):
    """A binary rank log (``data.logfile``), as it stands on disk, also that of a process that died;
    its ``start_ns`` on rank 0's wall clock where the log measured the offset (``data.clock``)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        parsed = parse_log(data, name=str(path))
    except ValueError as exc:
        raise LogFileError(path, str(exc).split(": ", 1)[-1]) from None
    for problem in parsed.damage():
        notes.add(path, problem)
    notes.flight.append(in_flight(parsed))
    rank = parsed.header.get("rank")
    if clocks is not None and isinstance(rank, int) and rank >= 0 and len(parsed.rows):
        clocks[rank] = parsed_clock(parsed).summary()
    names = [c.name for c in schema]
    if pa is not None:
        table = arrow_table(parsed, set(names)).select(names)
        return _conform(pa, path, table, schema, set(), lambda i: f"row {i + 1}"), set()
    return dataframe(parsed, set(names))[names], set()


def _sniff(path):
    """(size, first bytes, offset just past the last line break: 0 when none near the end)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
            size = os.fstat(f.fileno()).st_size
            if size > len(head):
                f.seek(max(0, size - _SNIFF))
                tail, tail_at = f.read(), max(0, size - _SNIFF)
            else:
                tail, tail_at = head, 0
    except IsADirectoryError:
        raise LogFileError(path, "is a directory") from None
    except OSError as exc:
        raise LogFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    last = tail.rfind(b"\n")
    return size, head, (tail_at + last + 1) if last >= 0 else 0


def _csv_header(path, head) -> list[str]:
    import csv

    nl = head.find(b"\n")
    if nl < 0 and len(head) == _SNIFF:
        raise _NotALog(path, "not a commpatch log: no header line in its first 64 KiB")
    line = head[: nl if nl >= 0 else len(head)].rstrip(b"\r")
    if line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]
    text = line.decode("utf-8", "replace")
    try:
        names = next(csv.reader([text]), [])
    except csv.Error:
        names = [text]
    return [n.strip() for n in names]


def _plan(path, names, schema, version, notes) -> list[str]:
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


def _bad_value(path, name, value, where, kind) -> LogFileError:
    word = _WORDS.get(kind, kind)
    if value == "":
        return LogFileError(path, f"column {name!r} is empty on {where} ({word} is needed)")
    hint = " (a second header line: files joined together?)" if value == name else ""
    shown = repr(value if len(value) <= 40 else value[:40] + "...")
    return LogFileError(path, f"column {name!r} holds {shown} on {where}, not {word}{hint}")


def _short(exc) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _arrow_type(pa, dtype):
    return {
        "category": pa.dictionary(pa.int32(), pa.string()),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
    }[dtype]


def _read_csv_arrow(pa, path, names, schema, fill, size, end, notes):
    import re

    import pyarrow.csv as pacsv

    cols = [c.name for c in schema if c.name not in fill]
    types = {c.name: _arrow_type(pa, c.dtype) for c in schema if c.name not in fill}

    def source():
        return path if end == size else pa.BufferReader(pa.memory_map(path).read_buffer(end))

    # no invalid_row_handler: pyarrow decodes the row for it and prints a raw traceback on stderr
    # when the row is not UTF-8; a row of the wrong width is found again below (the error path)
    def parse(check_utf8, include=cols, column_types=types):
        return pacsv.read_csv(
            source(),
            convert_options=pacsv.ConvertOptions(
                column_types=column_types,
                include_columns=include,
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
                check_utf8=check_utf8,
            ),
        )

    try:
        try:
            table = parse(True)
        except pa.ArrowInvalid as exc:
            if "invalid UTF8" not in str(exc):
                raise
            table = _fix_utf8(pa, parse(False), path, notes)
    except pa.ArrowInvalid as exc:
        if re.search(r"Expected \d+ columns, got \d+", str(exc)):
            raise _first_damaged_line(path, len(names)) from None
        m = re.search(
            r"In CSV column #(\d+): (?:Row #\d+: )?CSV conversion error to (\w+): invalid value '(.*)'", str(exc), re.S
        )
        if m is None:
            raise LogFileError(path, f"not a valid CSV log ({_short(exc)})") from None
        index, kind, value = int(m.group(1)), m.group(2), m.group(3)
        name = names[index] if index < len(names) else f"#{index}"
        where = "a line"
        try:  # the error path only: find the line of the first bad value
            import pyarrow.compute as pc

            column = parse(False, [name], {name: pa.string()}).column(name)
            row = pc.index(column, value).as_py()
            where = f"line {row + 2}" if row >= 0 else where
        except Exception:  # noqa: BLE001 - the message without a line number is still right
            pass
        raise _bad_value(path, name, value, where, kind) from None
    except (pa.ArrowException, OSError) as exc:
        raise LogFileError(path, f"cannot be read as CSV ({_short(exc)})") from None
    return table


def _damaged_line(path, where, fields, expected) -> LogFileError:
    return LogFileError(
        path,
        f"{where} has {fields} field(s) where the header has {expected}: the file is "
        "damaged (or two files were joined)",
    )


def _fields_on_line(path, number) -> int:
    """How many fields line ``number`` has (the error path only)."""
    import csv
    import itertools

    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        line = next(itertools.islice(f, number - 1, None), "")
    return len(next(csv.reader([line.rstrip("\r\n")]), []))


def _first_damaged_line(path, expected) -> LogFileError:
    """The error for the first line whose number of fields is not the header's (the error path only)."""
    import csv

    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            reader = csv.reader(f)
            for fields in reader:
                if len(fields) != expected and reader.line_num > 1:
                    return _damaged_line(path, f"line {reader.line_num}", len(fields), expected)
    except (OSError, csv.Error):
        pass
    return LogFileError(
        path, "a line has a number of fields other than the header's: the file is damaged (or two files were joined)"
    )


def _fix_utf8(pa, table, path, notes):
    """Replace invalid UTF-8 in the text (dictionary) columns by U+FFFD, with a warning."""
    import pyarrow.compute as pc

    for i, name in enumerate(table.column_names):
        col = table.column(i)
        if not pa.types.is_dictionary(col.type):
            continue
        broken = []
        for chunk in col.chunks:
            try:
                chunk.dictionary.validate(full=True)
            except pa.ArrowInvalid:
                broken.append(chunk)
        if not broken:
            continue
        chunks, examples = [], []
        for chunk in col.chunks:
            raw = pc.cast(chunk.dictionary, pa.binary()).to_pylist()
            fixed = [v.decode("utf-8", "replace") for v in raw]
            examples += [f for f, v in zip(fixed, raw) if f.encode("utf-8") != v]
            chunks.append(pc.take(pa.array(fixed, pa.string()), chunk.indices))
        col = pc.cast(pc.dictionary_encode(pa.chunked_array(chunks, pa.string())), col.type)
        table = table.set_column(i, name, col)
        notes.add(path, f"invalid UTF-8 bytes in column {name!r} (e.g. {examples[0]!r}): replaced by U+FFFD")
    return table


def _read_parquet(pa, path, schema, notes):
    import pyarrow.parquet as pq

    pf = None
    try:
        try:
            pf = pq.ParquetFile(path)
            arrow_schema = pf.schema_arrow
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise LogFileError(path, f"not a readable Parquet file (truncated or corrupt: {_short(exc)})") from None
        version = None
        raw = (arrow_schema.metadata or {}).get(SCHEMA_VERSION_KEY)
        if raw is not None:
            try:
                version = int(raw)
            except ValueError:
                notes.add(path, f"unreadable schema version {raw[:20]!r} in its metadata: ignored")
        if version is not None and version > SCHEMA_VERSION:
            notes.add(
                path,
                f"written by a newer commpatch (schema {version}; this one knows up to "
                f"{SCHEMA_VERSION}): the columns added since are ignored",
            )
        names = list(arrow_schema.names)
        part_rank = partition_rank(path) if "rank" not in names else None
        if part_rank is not None:  # a file of a rank-partitioned dataset: the rank is in its path
            names.append("rank")
        fill = _plan(path, names, schema, version and min(version, SCHEMA_VERSION), notes)
        try:
            table = pf.read(
                columns=[
                    c.name for c in schema if c.name not in fill and not (c.name == "rank" and part_rank is not None)
                ]
            )
            if part_rank is not None and any(c.name == "rank" for c in schema):
                table = table.append_column("rank", pa.repeat(pa.scalar(part_rank, pa.int64()), table.num_rows))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise LogFileError(path, f"corrupt Parquet data ({_short(exc)})") from None
        return table, fill
    finally:
        if pf is not None and hasattr(pf, "close"):
            pf.close()


def _conform(pa, path, table, schema, fill, where):
    """The SCHEMA's columns (of ``schema``), order and Arrow types; ``fill``: columns the file
    lacks, given neutral values. Raises for a column of the wrong type, or an empty integer."""
    import pyarrow.compute as pc

    n = table.num_rows
    columns = []
    for c in schema:
        target = _arrow_type(pa, c.dtype)
        if c.name in fill:
            value = _NEUTRAL_BY_COLUMN.get(c.name, _NEUTRAL[c.dtype])
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
            raise _bad_value(path, c.name, "", where(first), c.dtype)
        columns.append(col)
    return pa.table(columns, names=[c.name for c in schema])


# time and bandwidth columns that cannot be infinite or negative, with what a bad value voids
_IMPOSSIBLE = (
    ("duration_us", ("own_us", "algbw_gbps", "busbw_gbps")),
    ("own_us", ("algbw_gbps", "busbw_gbps")),
    ("host_us", ()),
    ("algbw_gbps", ()),
    ("busbw_gbps", ()),
)


def _sanitize_arrow(pa, table, path, notes):
    """Infinite or negative durations -> null (unmeasured), with their bandwidth; a warning."""
    import pyarrow.compute as pc

    names = table.column_names

    def impossible(name):
        col = table.column(name)
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


_KEY_AGGREGATES = (
    ("seq", "count"),
    ("seq", "min"),
    ("seq", "max"),
    ("start_ns", "min"),
    ("start_ns", "max"),
    ("world_size", "min"),
    ("world_size", "max"),
)


def _keys_arrow(table) -> list[dict]:
    if table.num_rows == 0:
        return []
    return table.group_by(["rank", "pid"]).aggregate(list(_KEY_AGGREGATES)).to_pylist()


def _keys_pandas(df) -> list[dict]:
    if len(df) == 0:
        return []
    spec = {f"{col}_{how}": (col, how) for col, how in _KEY_AGGREGATES}
    out = df.groupby(["rank", "pid"]).agg(**spec).reset_index()
    return [{k: int(v) for k, v in row.items()} for row in out.to_dict("records")]


def _arrow_frame(pa, tables, schema):
    if not tables:
        tables = [pa.table([pa.array([], _arrow_type(pa, c.dtype)) for c in schema], names=[c.name for c in schema])]
    table = pa.concat_tables(tables).unify_dictionaries()
    del tables[:]
    df = table.to_pandas(self_destruct=True, split_blocks=True)
    del table
    for c in schema:  # sorted categories, as the in-memory log gives
        if c.dtype == "category":
            df[c.name] = df[c.name].cat.reorder_categories(sorted(df[c.name].cat.categories))
    return df


# ---- reading without pyarrow (pandas) -----------------------------------------------------
def _read_csv_pandas(path, names, schema, fill, size, end, notes):
    import io

    import pandas as pd

    cols = [c.name for c in schema if c.name not in fill]

    def parse(errors):
        if end == size:
            source = path
        else:
            with open(path, "rb") as f:
                source = io.BytesIO(f.read(end))
        return pd.read_csv(
            source,
            usecols=cols,
            dtype=str,
            keep_default_na=False,
            na_filter=False,
            encoding="utf-8",
            encoding_errors=errors,
        )

    try:
        try:
            raw = parse("strict")
        except UnicodeDecodeError:
            raw = parse("replace")
            notes.add(path, "invalid UTF-8 bytes: replaced by U+FFFD")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as exc:
        import re

        m = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(exc))
        if m is not None:
            raise _damaged_line(path, f"line {m.group(2)}", int(m.group(3)), int(m.group(1))) from None
        raise LogFileError(path, f"not a valid CSV log ({_short(exc)})") from None
    except OSError as exc:
        raise LogFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    out = {}
    for c in schema:
        if c.name in fill:
            value = _NEUTRAL_BY_COLUMN.get(c.name, _NEUTRAL[c.dtype])
            out[c.name] = pd.Series([value] * len(raw), dtype=object if c.dtype == "category" else c.dtype)
        else:
            out[c.name] = _typed_pandas(path, c.name, raw[c.name], c.dtype, len(names))
    return pd.DataFrame(out)


def _exact_floats(text):
    """Text to float64 as Python's ``float`` parses it (round-trip exact, like pyarrow's reader:
    pandas' ``to_numeric`` before pandas 3 can be off in the last digit); NaN where it is no number."""
    import numpy as np
    import pandas as pd

    try:
        values = text.to_numpy(dtype=object).astype(np.float64)
    except (ValueError, OverflowError):
        values = np.array([_float_or_nan(v) for v in text.to_numpy(dtype=object)], dtype=np.float64)
    return pd.Series(values, index=text.index)


def _float_or_nan(value) -> float:
    try:
        return float(value)
    except (ValueError, OverflowError):
        return float("nan")


def _typed_pandas(path, name, s, dtype, fields):
    """A column read as text, converted to ``dtype``; raises on the first value that is not one."""
    import numpy as np
    import pandas as pd

    text = s.fillna("").astype(str).str.strip()
    if dtype == "category":
        return text.astype(object)
    low = text.str.lower()
    if dtype == "int64":
        ok = text.str.fullmatch(r"[+-]?\d+").fillna(False)
        values = lambda: pd.to_numeric(text.where(ok, "0")).astype(np.int64)  # noqa: E731
    elif dtype == "bool":
        ok = low.isin(("true", "false", "1", "0"))
        values = lambda: low.isin(("true", "1")).astype(bool)  # noqa: E731
    else:
        nan = low.isin(("", "nan", "-nan", "+nan", "na", "n/a", "null", "none"))
        number = _exact_floats(text.where(~nan, "nan"))
        ok = nan | number.notna()
        values = lambda: number  # noqa: E731
    ok = ok.to_numpy(bool)
    if not ok.all():
        first = int(np.flatnonzero(~ok)[0])
        if text.iloc[first] == "":  # pandas gives "" for the fields a short line lacks
            found = _fields_on_line(path, first + 2)
            if found < fields:
                raise _damaged_line(path, f"line {first + 2}", found, fields)
        raise _bad_value(path, name, text.iloc[first], f"line {first + 2}", dtype)
    return values().reset_index(drop=True)


def _sanitize_pandas(df, path, notes):
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


def _pandas_frame(frames, schema):
    import pandas as pd

    if frames:
        df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    else:
        df = pd.DataFrame({c.name: pd.Series([], dtype=object if c.dtype == "category" else c.dtype) for c in schema})
    for c in schema:
        if c.dtype == "category":
            df[c.name] = pd.Categorical(df[c.name].astype(str))
        else:
            df[c.name] = df[c.name].astype(c.dtype)
    return df[[c.name for c in schema]]


def _read_pandas(path: str):
    """One CSV file read by pandas, every column as the SCHEMA's dtype (no pyarrow needed)."""
    part = _read_file(None, path, SCHEMA, _Notes())
    return _pandas_frame([part[0]] if part is not None else [], SCHEMA)
