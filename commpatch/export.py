"""Files: per-rank path templates, CSV / Parquet write and read, merge of many files,
and the writers that run at exit (normal exit, SIGTERM, destroy_process_group).

pyarrow writes CSV ~10x faster than ``DataFrame.to_csv`` (1M rows: ~1.5 s vs ~15 s) and
gives Parquet for free; it is an optional extra (``commpatch[arrow]``), with pandas as the
fallback writer/reader.
"""

from __future__ import annotations

import atexit
import glob
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from . import _runtime
from ._config import ConfigError
from ._log import COLUMNS, apply_schema

if TYPE_CHECKING:
    import pandas as pd


def rank_path(template: str, rank: int | None = None, pid: int | None = None) -> str:
    rank = _best_rank() if rank is None else rank
    return template.format(rank=rank, pid=os.getpid() if pid is None else pid)


def _best_rank() -> int:
    from ._session import LOG

    if LOG.rank >= 0:
        return LOG.rank
    env = os.environ.get("RANK")
    return int(env) if env and env.isdigit() else 0


def check_writable(template: str, setting: str = "COMMPATCH_OUTPUT") -> None:
    """Fail at enable() time, not at exit, when the output directory cannot be written."""
    path = rank_path(template)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{setting}={template!r}: cannot create directory {directory!r}: {exc.strerror}") from None
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{setting}={template!r}: {path!r} is not writable")


# nthreads=1 in every Table.from_pandas: the exit writer runs after the interpreter started
# shutting down, when thread pools refuse new work ("cannot schedule new futures").


def append_csv(df, path: str, header: bool) -> None:
    """Append rows to a CSV log (``header``: start the file anew). Crash safe: every flushed
    chunk is complete on disk, so the file is readable whenever the process dies."""
    pa = _pyarrow()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if pa is None:
        df.to_csv(path, mode="w" if header else "a", header=header, index=False)
        return
    import pyarrow.csv as pacsv

    table = pa.Table.from_pandas(df, preserve_index=False, nthreads=1)
    options = pacsv.WriteOptions(include_header=header)
    with open(path, "wb" if header else "ab") as f:
        try:
            pacsv.write_csv(table, f, write_options=options)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            table = table.cast(pa.schema([
                pa.field(x.name, pa.string()) if pa.types.is_dictionary(x.type) else x for x in table.schema]))
            pacsv.write_csv(table, f, write_options=options)


def stream_flush(force: bool = False) -> int:
    """Move the rows whose timing is final from memory to the output file (or drop them when
    no file is configured: the hard cap). Returns the rows moved; never raises."""
    from ._session import LOG, TIMING

    template = _runtime.STATE.settings.get("output")
    df = None
    try:
        TIMING.resolve(block=force)
        df = LOG.pop_final_rows(force=force)
        if df is None:
            return 0
        if not template:
            LOG.dropped += len(df)
            if not _dropped_warned:
                _warn_dropped()
            return len(df)
        path = rank_path(template)
        if path != LOG.stream_path:           # a new file: start it with the header
            LOG.stream_path, LOG.flushed = path, 0
        append_csv(df, path, header=LOG.flushed == 0)
        LOG.flushed += len(df)
        return len(df)
    except Exception as exc:  # noqa: BLE001 - the user's collective must not fail because of us
        _runtime.fail("export.stream", exc, rows=0 if df is None else len(df))
        return 0


_dropped_warned = False


def _warn_dropped() -> None:
    global _dropped_warned
    import warnings

    _dropped_warned = True
    warnings.warn(f"commpatch: COMMPATCH_MAX_ROWS={_runtime.STATE.settings.get('max_rows')} with no output file: "
                  "the oldest rows are dropped (counted in log().attrs['dropped_rows'])", RuntimeWarning, stacklevel=2)


def streaming() -> bool:
    settings = _runtime.STATE.settings
    return bool(settings.get("max_rows")) and bool(settings.get("output"))


def write(df, path: str) -> str:
    """Write a log DataFrame to ``path`` (.csv or .parquet); returns the path."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        pa = _pyarrow()
        if path.endswith(".parquet"):
            if pa is None:
                raise RuntimeError("Parquet output needs pyarrow: pip install 'commpatch[arrow]'")
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pandas(df, preserve_index=False, nthreads=1), tmp)
        elif pa is not None:
            import pyarrow.csv as pacsv

            table = pa.Table.from_pandas(df, preserve_index=False, nthreads=1)
            try:
                pacsv.write_csv(table, tmp)          # categorical columns written as their strings
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
                # older pyarrow cannot write dictionary columns: decode them first
                table = table.cast(pa.schema([
                    pa.field(f.name, pa.string()) if pa.types.is_dictionary(f.type) else f for f in table.schema]))
                pacsv.write_csv(table, tmp)
        else:
            df.to_csv(tmp, index=False)
        os.replace(tmp, path)   # readers never see a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read(paths, progress=None, columns=None) -> "pd.DataFrame":
    """Read per-rank files (a file, a directory, a glob, or a list of them) into one DataFrame
    with the SCHEMA's dtypes; ``read(write(df, p)) == df``.

    With pyarrow each file is parsed straight into typed and dictionary-encoded columns and the
    files are joined in Arrow (64 ranks x 100k rows: ~3x faster and ~3x less memory than parsing
    strings then converting). ``progress(done, total)`` is called after each file. ``columns``:
    read only these (in SCHEMA order). Columns an older file lacks get neutral values.
    """
    from ._log import SCHEMA

    schema = SCHEMA if columns is None else tuple(c for c in SCHEMA if c.name in set(columns))
    files = expand(paths)
    if not files:
        raise FileNotFoundError(f"no commpatch log files in {paths!r}")
    pa = _pyarrow()
    if pa is None:
        import pandas as pd

        frames = []
        for i, f in enumerate(files):
            frames.append(_read_pandas(f))
            if progress is not None:
                progress(i + 1, len(files))
        df = apply_schema(pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0])
        return df[[c.name for c in schema]]
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    arrow_type = {"category": pa.dictionary(pa.int32(), pa.string()), "int64": pa.int64(),
                  "float64": pa.float64(), "bool": pa.bool_()}
    types = {c.name: arrow_type[c.dtype] for c in schema}
    tables = []
    for i, path in enumerate(files):
        if path.endswith(".parquet"):
            table = pq.read_table(path)
        else:
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
                column_types=types, include_columns=list(types), include_missing_columns=True,
                strings_can_be_null=False, quoted_strings_can_be_null=False))
        tables.append(_conform(pa, table, schema, arrow_type))
        if progress is not None:
            progress(i + 1, len(files))
    table = pa.concat_tables(tables).unify_dictionaries()
    del tables
    df = table.to_pandas(self_destruct=True, split_blocks=True)
    del table
    for c in schema:   # sorted categories, as the in-memory log gives
        if c.dtype == "category":
            df[c.name] = df[c.name].cat.reorder_categories(sorted(df[c.name].cat.categories))
    return df


def _conform(pa, table, schema, arrow_type):
    """The SCHEMA's columns, order and types; missing (all-null) columns get neutral values."""
    import pyarrow.compute as pc

    neutral = {"category": "", "int64": 0, "float64": float("nan"), "bool": False}
    columns = []
    for c in schema:
        if c.name in table.column_names:
            col = table.column(c.name)
        else:
            col = pa.nulls(table.num_rows, arrow_type[c.dtype])
        if col.null_count == len(col) and len(col) and c.dtype != "float64":
            col = pa.array([neutral[c.dtype]] * len(col), type=arrow_type[c.dtype].value_type
                           if c.dtype == "category" else arrow_type[c.dtype])
        if c.dtype == "category":
            col = pc.cast(col, pa.string()) if not pa.types.is_dictionary(col.type) else col
            col = col if pa.types.is_dictionary(col.type) else pc.dictionary_encode(col)
            col = pc.cast(col, arrow_type["category"])
        elif col.type != arrow_type[c.dtype]:
            col = pc.cast(col, arrow_type[c.dtype])
        columns.append(col)
    return pa.table(columns, names=[c.name for c in schema])


def expand(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    for p in map(str, paths):
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "*.csv")) + glob.glob(os.path.join(p, "*.parquet")))
        elif any(ch in p for ch in "*?["):
            files += sorted(glob.glob(p))
        else:
            files.append(p)
    return files


def _read_pandas(path: str):
    import pandas as pd

    if path.endswith(".parquet"):
        raise RuntimeError(f"reading {path} needs pyarrow: pip install 'commpatch[arrow]'")
    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def _pyarrow():
    try:
        import pyarrow

        return pyarrow
    except ImportError:
        return None


# ---- at exit --------------------------------------------------------------------------
_exit_lock = threading.Lock()
_handlers_installed = False
_previous_sigterm = None


def write_at_exit(reason: str = "exit") -> str | None:
    """Write this rank's file to the configured template; never raises."""
    from ._session import LOG, TIMING, summary_text

    settings = _runtime.STATE.settings
    template = settings.get("output")
    if not _exit_lock.acquire(timeout=30):
        return None
    try:
        TIMING.resolve(block=True)
        if not template or (len(LOG) == 0 and LOG.rank < 0 and not LOG.flushed):
            return None
        path = rank_path(template)
        if streaming():             # the file holds the flushed rows: append the rest, once
            stream_flush(force=True)
            if not os.path.exists(path):
                write(LOG.to_dataframe(), path)
            df = None
        else:
            df = LOG.to_dataframe()
            write(df, path)
        if settings.get("summary") and reason == "exit":
            sys.stderr.write(summary_text(read(path) if df is None else df) + "\n")
        return path
    except Exception as exc:  # noqa: BLE001 - the user's exit must not fail because of us
        _runtime.fail(f"export.{reason}", exc, rows=len(LOG))
        return None
    finally:
        _exit_lock.release()


def after_fork() -> None:
    global _exit_lock
    _exit_lock = threading.Lock()
    _runtime.after_fork()


def install_exit_handlers() -> None:
    """atexit always; SIGTERM chained to the user's handler (or the default: die by SIGTERM)."""
    global _handlers_installed, _previous_sigterm
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(write_at_exit)
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return
        _previous_sigterm = previous
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError) as exc:   # embedded interpreters without signals
        _runtime.fail("signal", exc, rows=0)


def _on_sigterm(signum, frame):
    write_at_exit(reason="sigterm")
    previous = _previous_sigterm
    if callable(previous):
        return previous(signum, frame)
    # default action: restore it and die by the same signal, as the launcher expects
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


__all__ = ["COLUMNS", "read", "write", "rank_path", "expand"]
