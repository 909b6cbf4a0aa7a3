"""Reading logs: per-rank CSV / Parquet / binary (``.cplog``) files, a directory, a glob or a list,
into one DataFrame with the SCHEMA's dtypes (``read``), or rank by rank (``read_ranks``): the plan
(columns, ranks, window of steps), the files read (``formats``) and checked as one job
(``validation``), cut and joined. Every problem with the input is a one-line ``LogFileError`` or,
where a correct best-effort result exists, a ``LogFileWarning``.

The package's and the users' entry point: the names of ``discovery`` (``runs``, ``latest_run``,
``file_rank``, ...) and ``problems`` are importable from here too."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from ..data.attrs import shared
from ..data.clock import CLOCK_ATTR
from ..data.frame import own_times
from ..data.logfile import IN_FLIGHT_ATTR, JOB_ATTR
from ..data.ops import describe_op
from ..data.schema import BOUNDARY_SOURCES, DERIVED_FROM_OP, OLD_TIMING_NAMES, SCHEMA, STEPLESS_ATTR, TIMINGS
from . import writer as _writer
from .discovery import (
    PARTITION,
    chosen_run,
    describe_paths,
    expand,
    file_rank,
    latest_run,
    one_run,
    partition_rank,
    resolve,
    run_started,
    runs,
    select_ranks,
)
from .dumps import dumps_beside
from .formats import read_file
from .problems import LogFileError, LogFileNotFoundError, LogFileWarning, Notes, _NotALog
from .validation import Jobs, arrow_type

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "PARTITION",
    "RUN_ATTR",
    "LogFileError",
    "LogFileNotFoundError",
    "LogFileWarning",
    "chosen_run",
    "expand",
    "file_rank",
    "latest_run",
    "one_run",
    "partition_rank",
    "read",
    "read_ranks",
    "run_started",
    "runs",
]

_IDENTITY = ("seq", "rank", "world_size", "start_ns", "pid")  # read always: duplicate / mixed-job checks


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
    notes = Notes()
    try:
        files = select_ranks(resolve(paths, notes), ranks)
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
    one job (``Jobs``), cut to the plan's ranks and steps; ``frame()`` joins them."""

    def __init__(self, plan: _Plan, notes: Notes, jobs: Jobs | None = None) -> None:
        self.plan, self.notes = plan, notes
        self.jobs = jobs if jobs is not None else Jobs()
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
            part = read_file(pa, path, plan.read_schema, self.notes, self.clocks)
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
                describe_paths(paths), f"no commpatch log among {n_files} file(s) ({self.foreign[0]})"
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
        filled -= {"sync_end_us", "pack_us", "pack_alone_us", "wait_us"}  # an older file measured no DDP
        # finalize, packing or wait: NaN is its value
        if "timing" in df.columns and df["timing"].dtype.name == "category":
            old = [c for c in df["timing"].cat.categories if c in OLD_TIMING_NAMES]
            if old:
                df["timing"] = df["timing"].cat.rename_categories({c: OLD_TIMING_NAMES[c] for c in old})
        df.attrs["filled_columns"] = shared(sorted(filled & self.plan.wanted))
        here = {k["rank"] for _, keys in self.keys for k in keys}  # the ranks read: their dumps only
        flight = self.notes.flight + [d for d in dumps_beside([path for path, _ in self.keys]) if d["rank"] in here]
        df.attrs[IN_FLIGHT_ATTR] = shared(
            [f for f in flight if self.plan.ranks is None or f["rank"] in self.plan.ranks]
        )
        df.attrs[JOB_ATTR] = shared([j for j in self.notes.job if j["rank"] in here])
        if self.clocks:
            df.attrs[CLOCK_ATTR] = shared(dict(sorted(self.clocks.items())))
        if self.plan.steps is not None:
            df.attrs[STEPLESS_ATTR] = shared(sorted(self.whole))
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


def read_ranks(
    paths,
    transform,
    columns=None,
    ranks=None,
    steps=None,
    progress=None,
    workers: int = 1,
    batch_bytes: int = 0,
    run_tasks=None,
):
    """Yield ``transform(df)`` for the rows of each rank in turn (``df`` as ``read`` gives it for
    that rank's file(s)): memory for ``workers`` ranks at a time, whatever the number of ranks.
    With ``workers`` > 1 the files are read and transformed in that many processes (``transform``
    must then be picklable: a module-level function or a ``functools.partial`` of one). The same
    checks and warnings as ``read``; ``progress(done, total)`` after each rank, or each batch (``done``: ranks read).
    ``batch_bytes``: ranks whose files together hold up to that many bytes (at most
    ``BATCH_RANKS``) are read and transformed as one frame (``transform`` must then take any
    ranks): a rank's fixed cost in pandas (~0.1 s) is paid once per batch. ``run_tasks(tasks, run)``:
    another way to run the tasks (e.g. on a Spark cluster's executors: ``analysis.spark``), which
    gives ``run(task)`` of each task, in order (``run`` is picklable)."""
    plan = _Plan(columns, ranks, steps)
    notes = Notes()
    try:
        files = select_ranks(resolve(paths, notes), ranks)
        by_rank: dict = {}
        for path, scanned in files:
            rank = file_rank(path)
            by_rank.setdefault(("rank", rank) if rank is not None else ("file", path), []).append((path, scanned))
        tasks = _batches(list(by_rank.items()), batch_bytes)
        jobs, foreign, done = Jobs(), 0, 0
        run = functools.partial(_rank_task, plan=plan, transform=transform)
        results = (run_tasks or functools.partial(_run_tasks, workers=workers))(tasks, run)
        for task, (result, problems, keys, n_foreign) in zip(tasks, results):
            if result is _UNBATCHED:  # a file of the batch holds rows of a rank it is not named after
                outcomes = [_rank_task([entry], plan, transform) for entry in task]
            else:
                outcomes = [(result, problems, keys, n_foreign)]
            for result, problems, keys, n_foreign in outcomes:
                for problem, where in problems.items():
                    for path in where:
                        notes.add(path, problem)
                admitted = [jobs.admit(path, k, notes) for path, k in keys]  # all: every check runs
                foreign += n_foreign
                if result is not None and all(admitted):
                    yield result
            done += len(task)
            if progress is not None:
                progress(done, len(by_rank))
        if foreign and foreign == len(files):
            raise LogFileNotFoundError(describe_paths(paths), f"no commpatch log among {len(files)} file(s)")
    finally:
        notes.emit()


BATCH_RANKS = 256  # ranks in a batch of read_ranks at most


def _batches(groups, batch_bytes):
    """The tasks of ``read_ranks``: each a list of (key, files) of ``groups`` (key: ("rank", r) or
    ("file", path)), ranks together up to ``batch_bytes`` of files; files that name no rank alone."""
    tasks, batch, size = [], [], 0
    for key, files in groups:
        if batch_bytes <= 0 or key[0] != "rank":
            tasks.append([(key, files)])
            continue
        try:
            n = sum(os.path.getsize(path) for path, _ in files)
        except OSError:
            n = batch_bytes
        if batch and (size + n > batch_bytes or len(batch) >= BATCH_RANKS):
            tasks.append(batch)
            batch, size = [], 0
        batch.append((key, files))
        size += n
    return tasks + ([batch] if batch else [])


_UNBATCHED = "unbatched"  # _rank_task's result for a batch to read one rank at a time


def _run_tasks(tasks, run, workers):
    """``run(task)`` of each task, in order: here, or in ``workers`` processes."""
    if workers <= 1 or len(tasks) < 2:
        for task in tasks:
            yield run(task)
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_keep_freed_memory
    ) as pool:
        pending, queue = [], list(tasks)
        queue.reverse()
        try:
            while queue or pending:
                while queue and len(pending) < 2 * workers:  # a bounded window: memory for a few ranks
                    pending.append(pool.submit(run, queue.pop()))
                yield pending.pop(0).result()
        finally:
            for future in pending:
                future.cancel()


def _keep_freed_memory() -> None:
    """In a reading process of ``_run_tasks`` (never the job's, nor the caller's): glibc's malloc
    keeps the memory a rank's arrays freed for the next rank's (blocks up to 32 MB from the heap, up
    to 256 MB kept free at its top), rather than returning each block to the system and faulting it
    in again page by page. Measured on the DuckDB engine's staging of 25,000 rows a rank: 7% less
    CPU (33 against 36 ms a rank; keeping 64 MB: 2%). Where there is no glibc (musl, macOS): nothing."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError, TypeError):
        pass


def _rank_task(task, plan, transform):
    """Read the file(s) of each entry of ``task`` (``_batches``: (key, list of (path, scanned))) and
    transform their rows as one frame: (result or None, problems, keys, foreign)."""
    notes = Notes()
    parts = _Parts(plan, notes)
    named = {}  # path -> the rank its first bytes name
    for key, files in task:
        for path, scanned in files:
            named[path] = key[1]
            parts.load(path, scanned)
    if len(task) > 1 and any(k["rank"] != named[path] for path, keys in parts.keys for k in keys):
        # a file with another rank's rows may repeat a file read in another task: the checks of
        # ``Jobs`` (in read_ranks) must see it before its rows are transformed, as unbatched
        return _UNBATCHED, {}, [], 0
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


def _arrow_frame(pa, tables, schema):
    if not tables:
        tables = [pa.table([pa.array([], arrow_type(pa, c.dtype)) for c in schema], names=[c.name for c in schema])]
    table = pa.concat_tables(tables).unify_dictionaries()
    del tables[:]
    df = table.to_pandas(self_destruct=True, split_blocks=True)
    del table
    for c in schema:  # sorted categories, as the in-memory log gives
        if c.dtype == "category":
            df[c.name] = df[c.name].cat.reorder_categories(sorted(df[c.name].cat.categories))
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
