"""Writing logs: a DataFrame (or Arrow Table) to CSV / Parquet, published atomically; a binary
rank log (``.cplog``) converted to CSV / Parquet.

pyarrow writes CSV ~10x faster than ``DataFrame.to_csv`` (1M rows: ~1.5 s vs ~15 s) and
gives Parquet for free; it is an optional extra (``commpatch[arrow]``), with pandas as the
fallback writer.
"""

from __future__ import annotations

import io
import os
import sys
import threading

from ..data.frame import Cat, arrow_table, columns, dataframe, parse_log
from ..data.publish import publish, write_bytes
from ..data.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY
from .paths import export_path
from .problems import warn_damage


def convert(path: str, out: str | None = None, exclusive: bool = True) -> str:
    """Write the CSV (or, for an ``out`` ending in .parquet, Parquet) of a binary rank log; by
    default beside it with the same stem. Never replaces an existing file when ``exclusive``."""
    parsed = _parse_file(path)
    out = out or export_path(path)
    if out.endswith(".csv") and len(parsed.rows) <= SMALL_ROWS and "pyarrow" not in sys.modules:
        return write_small_csv(parsed, out, exclusive)
    if _pyarrow() is not None:  # straight to Arrow: no pandas import, no DataFrame
        return write(arrow_table(parsed), out, exclusive=exclusive)
    return write(dataframe(parsed), out, exclusive=exclusive)


def convert_to_dataset(path: str, dataset: str) -> str:
    """Write a binary rank log into a rank-partitioned Parquet dataset: ``dataset/rank=R/<stem>.parquet``
    (hive layout: the rank is in the path, not in the file, as Spark, Trino, DuckDB and pyarrow
    expect), row groups of up to 1M rows; returns the file written (never over an existing one)."""
    import pyarrow.parquet as pq

    parsed = _parse_file(path)
    table = arrow_table(parsed)
    rank = parsed.header.get("rank", -1)
    out = os.path.join(dataset, f"rank={rank}", os.path.basename(export_path(path, ".parquet")))
    table = with_schema_version(table.drop_columns(["rank"]))
    return publish(out, lambda f: pq.write_table(table, f, row_group_size=DATASET_ROW_GROUP), True)


def _parse_file(path: str):
    """A binary rank log parsed; what a damaged one lost is said as a LogFileWarning."""
    with open(path, "rb") as f:
        parsed = parse_log(f.read(), name=path)
    warn_damage(path, parsed)
    return parsed


DATASET_ROW_GROUP = 1 << 20  # rows per row group of the dataset: big enough to scan, small enough to skip
SMALL_ROWS = 20_000  # up to this many rows, a CSV is written without importing pyarrow or pandas


def write_small_csv(parsed, out: str, exclusive: bool = True) -> str:
    """The CSV of a small rank log with the standard library: importing pyarrow (or pandas) costs
    more than the writing itself at a process's exit (0.2-0.3 s measured, see design notes)."""
    import csv
    import io

    import numpy as np

    cols = columns(parsed)
    text = []
    for c in cols.values():
        if isinstance(c, Cat):
            names = np.array(list(c.categories) + [""], dtype=object)
            text.append(names[c.codes])  # code -1 picks the trailing ""
        elif c.dtype == bool:
            text.append(np.where(c, "true", "false"))
        elif c.dtype.kind == "f":
            text.append(np.where(np.isnan(c), "", c.astype(str)))
        else:
            text.append(c.astype(str))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(list(cols))
    writer.writerows(zip(*text))
    return write_bytes(buf.getvalue().encode("utf-8", "backslashreplace"), out, exclusive)


# nthreads=1 in every Table.from_pandas: the exit writer runs after the interpreter started
# shutting down, when thread pools refuse new work ("cannot schedule new futures").


def write(df, path: str, exclusive: bool = False) -> str:
    """Write a log DataFrame to ``path`` (.csv or .parquet); returns the path. The data goes to a
    temporary file created exclusively (never through a link), then takes the final name:
    ``exclusive`` refuses to replace an existing file (FileExistsError)."""
    return publish(path, lambda f: _write_to(df, path, f), exclusive)


def _write_to(df, path: str, f) -> None:
    """``df``: a log DataFrame, or the same columns as a pyarrow Table."""
    pa = _pyarrow()
    if path.endswith(".parquet"):
        if pa is None:
            raise RuntimeError("Parquet output needs pyarrow: pip install 'commpatch[arrow]'")
        import pyarrow.parquet as pq

        # statistics (row groups' min / max, for readers that skip row groups) only where a query
        # filters: computing them for all 36 columns is ~40% of the write (design notes, issue 11)
        pq.write_table(with_schema_version(_as_table(pa, df)), f, write_statistics=STATISTICS)
    elif pa is not None:
        import pyarrow.csv as pacsv

        table = _as_table(pa, df)
        try:
            _write_csv_blocks(pacsv, table, f)  # categorical columns written as their strings
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            # older pyarrow cannot write dictionary columns: decode them first
            table = table.cast(
                pa.schema(
                    [pa.field(x.name, pa.string()) if pa.types.is_dictionary(x.type) else x for x in table.schema]
                )
            )
            pacsv.write_csv(table, f)
    else:
        df.to_csv(f, index=False)


CSV_BLOCK_ROWS = 1 << 18
STATISTICS = ["seq", "rank", "step", "start_ns"]  # the Parquet export's columns with row-group statistics


def _write_csv_blocks(pacsv, table, f) -> None:
    """pyarrow's CSV writer is single-threaded but releases the GIL: blocks of rows are formatted
    by two threads while this one writes the finished ones, in order (the writes overlap the
    formatting); memory holds three blocks of text at most. Where threads cannot start
    (interpreter shutdown), one block at a time."""
    n = table.num_rows
    if n <= CSV_BLOCK_ROWS:
        pacsv.write_csv(table, f)
        return

    def render(start):
        buf = io.BytesIO()
        pacsv.write_csv(
            table.slice(start, CSV_BLOCK_ROWS), buf, write_options=pacsv.WriteOptions(include_header=start == 0)
        )
        return buf.getvalue()

    starts = list(range(0, n, CSV_BLOCK_ROWS))
    done: dict[int, bytes] = {}
    threads: dict[int, threading.Thread] = {}

    def start_render(i) -> None:
        if i < len(starts):
            thread = threading.Thread(target=lambda: done.__setitem__(i, render(starts[i])), daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new threads at interpreter shutdown
                done[i] = render(starts[i])
                return
            threads[i] = thread

    start_render(0)
    start_render(1)
    for i in range(len(starts)):
        thread = threads.pop(i, None)
        if thread is not None:
            thread.join()
        chunk = done.pop(i, None)
        if chunk is None:  # the thread failed: format it here (raises its error)
            chunk = render(starts[i])
        start_render(i + 2)
        f.write(chunk)


def _as_table(pa, df):
    return df if isinstance(df, pa.Table) else pa.Table.from_pandas(df, preserve_index=False, nthreads=1)


def with_schema_version(table):
    """A pyarrow Table with the schema version in its key-value metadata, as Parquet logs carry it
    (``pq.write_table(with_schema_version(table), path)``); other metadata is kept."""

    return table.replace_schema_metadata(
        {**(table.schema.metadata or {}), SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()}
    )


def _pyarrow():
    try:
        import pyarrow

        return pyarrow
    except ImportError:
        return None
