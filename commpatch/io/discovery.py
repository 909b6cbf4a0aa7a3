"""Finding the files to read: the paths given (a file, a directory, a glob, a list) expanded to
log files, the run directories of a directory of runs (``runs``, ``latest_run``, ``one_run`` for a
directory per host, ``chosen_run``), and the rank a file holds told from its first bytes
(``file_rank``, ``partition_rank``). Reads no rows."""

from __future__ import annotations

import glob
import os
import reprlib

from ..config import ConfigError
from ..data.logfile import SUFFIX, parse_header
from .problems import LogFileNotFoundError

SNIFF = 1 << 16  # bytes looked at to tell what a file is

PARQUET_MAGIC = b"PAR1"


def file_rank(path) -> int | None:
    """The rank a log file holds, from its first bytes (a binary log's header, a CSV's first row,
    a Parquet file's statistics); None when that cannot be told cheaply (reading will say why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF)
        if head.startswith(b"CPLOG"):
            return parse_header(head).get("rank")
        if head.startswith(PARQUET_MAGIC):
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


def select_ranks(files, ranks):
    """``files`` without those whose rank (told from their first bytes) is not in ``ranks``."""
    if ranks is None:
        return files
    out = []
    for path, scanned in files:
        rank = file_rank(path)
        if rank is None or rank in ranks:
            out.append((path, scanned))
    return out


def path_list(paths, name: str = "paths") -> list[str]:
    """A path, a glob or several of them (a list, a tuple, any iterable: ``Path.glob(...)``) -> a list
    of str; anything else (a number, None, bytes, an iterable holding one) is a one-line
    ``ConfigError`` naming ``name``."""
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    if not isinstance(paths, (bytes, bytearray)):
        try:
            items = list(paths)
        except TypeError:
            items = None
        if items is not None and all(isinstance(p, (str, os.PathLike)) for p in items):
            out = [os.fspath(p) for p in items]
            if all(isinstance(p, str) for p in out):  # a PathLike may give bytes
                return out
        paths = items if items is not None else paths
    raise ConfigError(f"{name} {reprlib.repr(paths)}: give a log file, a directory, a glob or a list of them")


def expand(paths) -> list[str]:
    paths = path_list(paths)
    files: list[str] = []
    matched = [(str(p), _matches(str(p))) for p in paths]
    paths = [f for p, found in matched for f in (found if found is not None else [p])]
    chosen = one_run([p for p in paths if os.path.isdir(p) and not log_files(p)])
    for p in paths:
        if os.path.isdir(p):
            files += log_files(p) or log_files(chosen.get(p) or p)
        else:
            files.append(p)
    return files


def _globs(paths) -> tuple[list[str], set]:
    """``paths`` with each glob pattern (that names no file itself) replaced by what it matches,
    files and directories (a directory per host: ``logs/node*``, ``/shared/*/parquet``), and the
    set of those found by a pattern (read as a directory's files are: a foreign file is skipped)."""
    out, globbed = [], set()
    for p in paths:
        found = _matches(p)
        if found is None:
            out.append(p)
            continue
        if not found:
            raise LogFileNotFoundError(p, "matches no file or directory")
        out += found
        globbed.update(found)
    return out, globbed


def _matches(path) -> list[str] | None:
    """The files and directories a glob pattern matches, sorted; None when ``path`` is no pattern (or
    names an existing file itself)."""
    if os.path.exists(path) or not any(ch in path for ch in "*?["):
        return None
    return [f for f in sorted(glob.glob(path)) if os.path.isfile(f) or os.path.isdir(f)]


def describe_paths(paths) -> str:
    if isinstance(paths, (str, os.PathLike)):
        return str(paths)
    paths = [str(p) for p in paths]
    return paths[0] if len(paths) == 1 else ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")


def resolve(paths, notes) -> list[tuple[str, bool]]:
    """The files to read, each with whether a directory / glob found it (else it was named);
    each file once. Raises LogFileNotFoundError for a path that names nothing readable."""
    paths = path_list(paths)
    out: list[tuple[str, bool]] = []
    seen: dict[str, str] = {}
    paths, globbed = _globs([str(os.fspath(p)) for p in paths])
    chosen = one_run([p for p in paths if os.path.isdir(p) and not log_files(p)], notes)
    for p in paths:
        if p in globbed and os.path.isfile(p):
            found, scanned = [p], True
        elif os.path.isdir(p):
            found = log_files(p)
            if not found:
                run = chosen.get(p)
                found = log_files(run) if run else []
            if not found:
                raise LogFileNotFoundError(
                    p, "no .cplog, .csv or .parquet file in this directory (nor in a run directory under it)"
                )
            scanned = True
        elif os.path.exists(p):
            found, scanned = [p], False
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
        raise LogFileNotFoundError(describe_paths(paths), "no log file given")
    return out


PARTITION = "rank="  # the subdirectories of a rank-partitioned Parquet dataset (``commpatch convert --to parquet``)


def partition_rank(path) -> int | None:
    """The rank of a file of a rank-partitioned dataset (``.../rank=7/part.parquet``), else None."""
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    value = parent[len(PARTITION) :] if parent.startswith(PARTITION) else ""
    return int(value) if value.isdigit() else None


def log_files(directory: str) -> list[str]:
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
    found = [d for d in subdirs if os.path.isdir(d) and log_files(d)]
    return sorted(found, key=lambda d: (run_started(d), d))


def run_started(directory: str) -> float:
    """When the run of a directory started, in Unix seconds: the earliest creation time in the
    headers of its binary rank logs; else the ``YYYYmmdd-HHMMSS`` in its name (``{run}``: local
    time); else the time of change of its oldest log file."""
    import re
    import time

    created = []
    files = log_files(directory)
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
        if all(os.path.isdir(d) and not log_files(d) for d in dirs):
            chosen = one_run(dirs)
            first = chosen.get(dirs[0])
            if first and all(os.path.basename(r or "") == os.path.basename(first) for r in chosen.values()):
                return first, max(len(runs(d)) for d in dirs), len(dirs)
        return None
    if not isinstance(paths, (str, os.PathLike)) or not os.path.isdir(paths) or log_files(str(paths)):
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
