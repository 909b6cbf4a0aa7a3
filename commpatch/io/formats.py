"""Reading one log file of any format: what the file is (told from its first bytes: a binary
``.cplog``, Parquet, CSV, or something else), read by the reader of its format, validated
(``validation``) into the SCHEMA's columns and types.

Every problem with a file is either a ``LogFileError`` (one line: the file, then what is wrong)
or, where a correct best-effort result exists, a note (a ``LogFileWarning`` once read) and the rest
of the data. Nothing else escapes from here for bad input: no raw pyarrow / pandas error."""

from __future__ import annotations

import os
from collections import Counter

from ..data.frame import arrow_table, dataframe, parse_log, parsed_clock
from ..data.logfile import in_flight, job_notes
from ..data.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY
from .csvlog import csv_header, read_csv_arrow, read_csv_pandas
from .discovery import PARQUET_MAGIC, SNIFF, partition_rank
from .problems import LogFileError
from .validation import (
    check_sizes,
    columns_to_fill,
    conform,
    keys_arrow,
    keys_pandas,
    sanitize_arrow,
    sanitize_pandas,
    short,
)


def read_file(pa, path, schema, notes, clocks=None):
    """(data, key summary, filled columns) of one file, or None when it holds no row.
    ``data`` is a conformed Arrow table (or, without pyarrow, a DataFrame). ``clocks``: a dict
    that gets the clock of a binary log's rank (``data.clock``)."""
    size, head, end = _sniff(path)
    where = (lambda i: f"row {i + 1}") if head.startswith((PARQUET_MAGIC, b"CPLOG")) else (lambda i: f"line {i + 2}")
    if not head.strip():
        notes.add(path, "empty file (no header, no rows): skipped" if size == 0 else "blank file: skipped")
        return None
    if head.startswith(PARQUET_MAGIC):
        if pa is None:
            raise LogFileError(path, "reading Parquet needs pyarrow: pip install 'commpatch[arrow]'")
        table, fill = _read_parquet(pa, path, schema, notes)
        data = conform(pa, path, table, schema, fill, where)
    elif str(path).endswith(".parquet"):
        raise LogFileError(
            path, "not a Parquet file (no Parquet magic bytes at its start; truncated to nothing, or another format)"
        )
    elif head.startswith(b"CPLOG"):
        data, fill = _read_binary(pa, path, schema, notes, clocks)
    elif b"\0" in head:
        raise LogFileError(path, "binary data, not a CSV (or Parquet) commpatch log")
    else:
        names = csv_header(path, head)
        fill = columns_to_fill(path, names, schema, None, notes)
        if 0 < end < size:
            notes.add(
                path,
                "its last line is incomplete (the file was cut short, e.g. the process was killed "
                "while writing): that partial row is left out",
            )
        else:
            end = size
        if pa is not None:
            table = read_csv_arrow(pa, path, names, schema, fill, size, end, notes)
            data = conform(pa, path, table, schema, fill, where)
        else:
            data = read_csv_pandas(path, names, schema, fill, size, end, notes)
    if pa is not None:
        data = sanitize_arrow(pa, data, path, notes)
        rows = data.num_rows
    else:
        data = sanitize_pandas(data, path, notes)
        rows = len(data)
    check_sizes(pa, data, path, where)
    keys = keys_arrow(data) if pa is not None else keys_pandas(data)
    if rows == 0:
        notes.add(path, "no rows (header only): nothing was recorded in this file")
        return None
    return data, keys, fill


def _sniff(path):
    """(size, first bytes, offset just past the last line break: 0 when none near the end)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF)
            size = os.fstat(f.fileno()).st_size
            if size > len(head):
                f.seek(max(0, size - SNIFF))
                tail, tail_at = f.read(), max(0, size - SNIFF)
            else:
                tail, tail_at = head, 0
    except IsADirectoryError:
        raise LogFileError(path, "is a directory") from None
    except OSError as exc:
        raise LogFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    last = tail.rfind(b"\n")
    return size, head, (tail_at + last + 1) if last >= 0 else 0


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
    notes.job.append(job_notes(parsed))
    rank = parsed.header.get("rank")
    if clocks is not None and isinstance(rank, int) and rank >= 0 and len(parsed.rows):
        clocks[rank] = parsed_clock(parsed).summary()
    names = [c.name for c in schema]
    if pa is not None:
        table = arrow_table(parsed, set(names)).select(names)
        return conform(pa, path, table, schema, set(), lambda i: f"row {i + 1}"), set()
    return dataframe(parsed, set(names))[names], set()


def _read_parquet(pa, path, schema, notes):
    import pyarrow.parquet as pq

    pf = None
    try:
        try:
            pf = pq.ParquetFile(path)
            arrow_schema = pf.schema_arrow
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise LogFileError(path, f"not a readable Parquet file (truncated or corrupt: {short(exc)})") from None
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
        twice = sorted(n for n, k in Counter(names).items() if k > 1)
        if twice:  # which of them would be the column? (pyarrow refuses to pick one)
            raise LogFileError(
                path, f"column(s) {', '.join(map(repr, twice[:5]))} appear more than once: not a commpatch log"
            )
        part_rank = partition_rank(path) if "rank" not in names else None
        if part_rank is not None:  # a file of a rank-partitioned dataset: the rank is in its path
            names.append("rank")
        fill = columns_to_fill(path, names, schema, version and min(version, SCHEMA_VERSION), notes)
        try:
            table = pf.read(
                columns=[
                    c.name for c in schema if c.name not in fill and not (c.name == "rank" and part_rank is not None)
                ]
            )
            if part_rank is not None and any(c.name == "rank" for c in schema):
                table = table.append_column("rank", pa.repeat(pa.scalar(part_rank, pa.int64()), table.num_rows))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise LogFileError(path, f"corrupt Parquet data ({short(exc)})") from None
        return table, fill
    finally:
        if pf is not None and hasattr(pf, "close"):
            pf.close()
