"""Reading one CSV log: with pyarrow (typed, dictionary-encoded columns straight from the text;
``read_csv_arrow``) or with pandas alone (``read_csv_pandas``); invalid UTF-8 replaced with a
warning, every parse error said as a one-line ``LogFileError`` naming the line."""

from __future__ import annotations

import os

from .discovery import SNIFF
from .problems import LogFileError, _NotALog
from .validation import (
    NEUTRAL,
    NEUTRAL_BY_COLUMN,
    arrow_type,
    bad_value,
    short,
)


def csv_header(path, head) -> list[str]:
    import csv

    nl = head.find(b"\n")
    if nl < 0 and len(head) == SNIFF:
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


def read_csv_arrow(pa, path, names, schema, fill, size, end, notes):
    import re

    import pyarrow.csv as pacsv

    cols = [c.name for c in schema if c.name not in fill]
    types = {c.name: arrow_type(pa, c.dtype) for c in schema if c.name not in fill}

    nul_free = None  # the bytes with NUL replaced, when pyarrow split a quoted field at a NUL byte

    def source():
        if nul_free is not None:
            return pa.BufferReader(nul_free)
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

    def read():
        try:
            return parse(True)
        except pa.ArrowInvalid as exc:
            if "invalid UTF8" not in str(exc):
                raise
            return _fix_utf8(pa, parse(False), path, notes)

    try:
        try:
            table = read()
        except pa.ArrowInvalid as exc:
            if not re.search(r"Expected \d+ columns, got \d+", str(exc)):
                raise
            damaged = _first_damaged_line(path, len(names), end)
            with open(path, "rb") as f:
                data = f.read(end)
            if damaged is not None or b"\x00" not in data:
                raise damaged or _damaged_file(path) from None
            # every line has the header's fields: some pyarrow releases (25) end a quoted field at a
            # NUL byte; read again with each NUL as U+FFFD (the report never shows a NUL anyway)
            nul_free = data.replace(b"\x00", "\ufffd".encode())
            table = read()
            notes.add(path, "NUL bytes in its text: replaced by U+FFFD")
    except pa.ArrowInvalid as exc:
        m = re.search(
            r"In CSV column #(\d+): (?:Row #\d+: )?CSV conversion error to (\w+): invalid value '(.*)'", str(exc), re.S
        )
        if m is None:
            raise LogFileError(path, f"not a valid CSV log ({short(exc)})") from None
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
        raise bad_value(path, name, value, where, kind) from None
    except (pa.ArrowException, OSError) as exc:
        raise LogFileError(path, f"cannot be read as CSV ({short(exc)})") from None
    return table


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


def read_csv_pandas(path, names, schema, fill, size, end, notes):
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
        raise LogFileError(path, f"not a valid CSV log ({short(exc)})") from None
    except OSError as exc:
        raise LogFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    out = {}
    for c in schema:
        if c.name in fill:
            value = NEUTRAL_BY_COLUMN.get(c.name, NEUTRAL[c.dtype])
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
        raise bad_value(path, name, text.iloc[first], f"line {first + 2}", dtype)
    return values().reset_index(drop=True)


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


def _first_damaged_line(path, expected, end=None) -> LogFileError | None:
    """The error for the first line whose number of fields is not the header's, None when every line
    has them (the error path only; ``end``: the bytes read, the longest a field can be); a file
    Python's csv cannot read either is damaged."""
    import csv

    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(max(limit, end if end is not None else os.path.getsize(path)))  # a field may be that long
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            reader = csv.reader(f)
            for fields in reader:
                if len(fields) != expected and reader.line_num > 1:
                    return _damaged_line(path, f"line {reader.line_num}", len(fields), expected)
    except (OSError, csv.Error):
        return _damaged_file(path)
    finally:
        csv.field_size_limit(limit)
    return None


def _damaged_file(path) -> LogFileError:
    return LogFileError(
        path, "a line has a number of fields other than the header's: the file is damaged (or two files were joined)"
    )
