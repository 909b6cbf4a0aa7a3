"""The readers on fuzzed input: a seeded mutation loop over real logs written by commpatch's
writer (``tests/writer_logs.py``; binary, CSV, and Parquet made of its CSV: issue 33), and the inputs that once crashed a reader, kept in
``tests/fuzz_corpus/``. What must hold on every input (issue 24): ``commpatch.read_csv`` gives a
DataFrame or one ``LogFileError``; ``commpatch report`` (and ``convert`` for binary logs) exits 0
or 2 with no traceback and no terminal escape sequence from the file; no case runs past
``HANG_S`` (a hang); the peak memory of the process reading them stays below 256 MB above what
it held before the first case (files under 1 MB).

The cases run in one child process, so that its peak resident memory is measured (``ru_maxrss``),
under an address-space limit (a runaway allocation fails there, it does not swap the machine).
A case that fails is copied into the test's directory and named in the failure: add it to
``tests/fuzz_corpus/`` once fixed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

CORPUS = Path(__file__).parent / "fuzz_corpus"
SEED = 24
BINARY_CASES, CSV_CASES, PARQUET_CASES = 200, 100, 60
HANG_S = 20  # a case taking longer than this is a hang (they take ~0.1 s)
PEAK_MB = 256
ESCAPES = ("\x1b", "\x9b", "\x07")

# ---- the child: runs every case, says what happened to each ----------------------------------


def _run_case(path: str, convert: bool) -> str:
    """'ok', 'refused' (one LogFileError line), or what went wrong."""
    import contextlib
    import io
    import warnings

    import commpatch
    from commpatch import cli
    from commpatch.io import LogFileError

    outcome = "ok"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            commpatch.read_csv(path)
    except LogFileError as exc:
        if "\n" in str(exc):
            return f"read_csv: a LogFileError of more than one line: {exc!r}"
        outcome = "refused"
    except Exception as exc:  # noqa: BLE001 - what the test is looking for
        return f"read_csv: raw {type(exc).__name__}: {exc}"[:300]
    runs = [["report", path, "--no-progress"], ["report", path, "--no-progress", "--by", "group,tag,module,dtype"]]
    if convert:
        runs.append(["convert", path, "--no-progress"])
    for argv in runs:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exc:
                code = exc.code
            except Exception as exc:  # noqa: BLE001
                return f"{argv[0]}: raw {type(exc).__name__}: {exc}"[:300]
        text = out.getvalue() + err.getvalue()
        if code not in (0, 2) or "Traceback" in text:
            return f"{argv[0]}: exit {code}: {err.getvalue()[-300:]}"
        if any(e in text for e in ESCAPES):
            return f"{argv[0]}: a terminal escape sequence printed raw"
    return outcome


def child(cases: list[str]) -> dict:
    limit_memory()
    import numpy  # noqa: F401 - the libraries a case loads, loaded before the baseline
    import pandas  # noqa: F401
    import pyarrow.compute  # noqa: F401
    import pyarrow.csv  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import commpatch.io  # noqa: F401
    from commpatch import analysis, cli  # noqa: F401
    from commpatch.render import text  # noqa: F401

    return each_case(cases, lambda path, _: _run_case(path, path.endswith(".cplog")))


def limit_memory() -> None:
    """An address-space limit 3 GB above what this process maps now: a runaway allocation fails
    there (it does not swap the machine)."""
    import resource

    vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
    limit = vm + (3 << 30)  # imports still to come, the arenas of numpy / Arrow: a bound, not the check
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _hwm_mb() -> float:
    """This process's peak resident memory (VmHWM: its own, where ru_maxrss counts the parent's too)."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024


def each_case(cases: list[str], run) -> dict:
    """``run(path, index)`` for every case, each stopped after ``HANG_S``: what each gave, and the
    peak resident memory before the first case and after the last."""
    import signal

    class Hang(Exception):
        pass

    def alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    baseline = _hwm_mb()
    results = {}
    for i, path in enumerate(cases):
        signal.alarm(HANG_S)
        try:
            results[path] = run(path, i)
        except Hang:
            results[path] = f"hang: more than {HANG_S} s"
        except MemoryError:
            results[path] = "MemoryError (past the address-space bound)"
        finally:
            signal.alarm(0)
    return {"results": results, "baseline_mb": baseline, "peak_mb": _hwm_mb()}


def run_child(cases: list[str], timeout: float, reader: str = "pyarrow") -> dict:
    """``child(cases)`` in a new process; ``reader`` "pandas": as without pyarrow installed."""
    root = str(Path(__file__).parent.parent)
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_fuzz", reader, *cases],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
        env=dict(os.environ, COMMPATCH_OUTPUT="none"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


# ---- mutations of real logs -------------------------------------------------------------------
EXTREMES = [0, -1, 1, 2**15 - 1, 2**31 - 1, -(2**31), 2**40, 2**63 - 1, -(2**63), 10**12]
JSON_VALUES = [
    10**12,
    2**31 - 1,
    -1,
    2**63,
    2**64,
    1e308,
    "0-99999999999",
    "0-3:0",
    "3-1",
    None,
    [],
    {},
    True,
    "x" * 2000,
    "\x1b[2J\x1b[31mred",
    "\u202eevil",
    0.5,
]
CSV_VALUES = [
    "-1",
    "0",
    str(2**31 - 1),
    str(2**40),
    str(2**63 - 1),
    str(-(2**63)),
    "9" * 30,
    "1e308",
    "-inf",
    "nan",
    "",
    "abc",
    "\x1b[31mred\x1b[0m",
    "\x9b2J",
    "0-99999999999",
    "0-3:0",
    "3-1",
    "0 1 2",
    "true",
    "[[[[",
    "9" * 5000,
]


def _frames(data: bytes) -> list[tuple[bytes, int, int]]:
    """(kind, frame start, frame stop) of an undamaged rank log."""
    from commpatch.data import logfile

    out, pos = [], len(logfile.MAGIC)
    while pos + 5 <= len(data):
        kind, length = struct.unpack_from("<cI", data, pos)
        out.append((kind, pos, pos + 5 + length))
        pos += 5 + length
    return out


def mutate_binary(rng: random.Random, data: bytes) -> bytes:
    from commpatch.data import logfile
    from commpatch.data.schema import _FIELDS, ROW

    frames = _frames(data)
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        k = rng.randrange(11)
        i = rng.randrange(len(b)) if b else 0
        if k == 0:  # flip bytes
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif k == 1:  # cut bytes out
            del b[i : i + rng.randint(1, 200)]
        elif k == 2:  # random bytes in
            b[i:i] = rng.randbytes(rng.randint(1, 64))
        elif k == 3:  # an extreme integer over the bytes
            size = rng.choice((2, 4, 8))
            v = rng.choice(EXTREMES)
            b[i : i + size] = (v % (1 << (8 * size))).to_bytes(size, "little")
        elif k == 4:  # a block of zeros
            b[i : i + rng.choice((64, 512, 4096))] = bytes(rng.choice((64, 512, 4096)))
        elif k == 5:  # truncated
            del b[i:]
        elif k in (6, 7) and frames:  # a frame torn mid-file (a full disk), or repeated
            kind, lo, hi = rng.choice(frames)
            if k == 6:
                b = bytearray(data[: lo + rng.randint(1, max(1, hi - lo - 1))] + data[hi:])
            else:
                b = bytearray(data[:hi] + data[lo:hi] + data[hi:])
        elif k == 8 and frames:  # a registry record with a hostile field
            metas = [f for f in frames if f[0] == logfile.META]
            _, lo, hi = rng.choice(metas)
            record = json.loads(data[lo + 5 : hi])
            key = rng.choice(sorted(record))
            record[key] = rng.choice(JSON_VALUES)
            payload = json.dumps(record).encode()
            if rng.random() < 0.1:
                payload = b"[" * 5_000 + b"]" * 5_000  # nested past the recursion limit
            b = bytearray(data[:lo] + logfile.frame(logfile.META, payload) + data[hi:])
        elif k == 9 and frames:  # a row with a hostile field
            rows = [f for f in frames if f[0] == logfile.ROWS and f[2] - f[1] > 5]
            _, lo, hi = rng.choice(rows)
            at = lo + 5 + ROW.size * rng.randrange((hi - lo - 5) // ROW.size)
            name, code = rng.choice(_FIELDS)
            offset = sum(struct.calcsize("<" + c) for _, c in _FIELDS[: [f[0] for f in _FIELDS].index(name)])
            size = struct.calcsize("<" + code)
            v = rng.choice(EXTREMES)
            b = bytearray(data)
            b[at + offset : at + offset + size] = (v % (1 << (8 * size))).to_bytes(size, "little")
        else:  # a chunk of the file again, elsewhere
            j = rng.randrange(len(b)) if b else 0
            b[i:i] = b[j : j + rng.randint(1, 300)]
        data = bytes(b)
        frames = []
    return bytes(b)


def mutate_csv(rng: random.Random, text: str) -> bytes:
    import csv
    import io

    if rng.random() < 0.3:  # bytes, not cells
        b = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            if rng.random() < 0.5:
                b[i] = rng.randrange(256)
            else:
                b[i:i] = rng.randbytes(rng.randint(1, 16))
        return bytes(b)
    rows = list(csv.reader(io.StringIO(text)))
    header, body = rows[0], rows[1:]
    for _ in range(rng.randint(1, 3)):
        k = rng.randrange(5)
        if k == 0 and len(body) > 1:
            del body[rng.randrange(len(body))]
        elif k == 1:
            body.insert(rng.randrange(len(body)), list(rng.choice(body)))
        elif k == 2:
            header[rng.randrange(len(header))] = rng.choice(("seq", "", "rank", "\x1b[31m"))
        else:
            c = rng.randrange(len(header))
            value = rng.choice(CSV_VALUES)
            for row in body if rng.random() < 0.3 else [rng.choice(body)]:
                if c < len(row):
                    row[c] = value
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header] + body)
    return out.getvalue().encode("utf-8", "surrogateescape")


PARQUET_VALUES = [
    2**63 - 1,
    -(2**63),
    2**31,
    -1,
    None,
    float("nan"),
    float("inf"),
    "\x1b[2J\x1b[31mred",
    "\u202eevil",
    "<!--<script>",
    "0-99999999999",
    "x" * 5000,
    b"\xff\xfe",
    True,
]


def mutate_parquet(rng: random.Random, table) -> bytes:
    """A Parquet file of ``table`` (the writer's log read back) with hostile columns: a column's
    values replaced (other types than the schema's, extremes, escapes, nulls), a column dropped or
    renamed, or the file's bytes damaged afterwards."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    for _ in range(rng.randint(1, 3)):
        k = rng.randrange(4)
        i = rng.randrange(table.num_columns)
        name = table.column_names[i]
        if k == 0:  # a column of one hostile value (any type)
            value = rng.choice(PARQUET_VALUES)
            try:
                column = pa.array([value] * table.num_rows)
            except (pa.ArrowInvalid, OverflowError):
                column = pa.array([str(value)] * table.num_rows)
            table = table.set_column(i, name, column)
        elif k == 1 and table.num_columns > 1:
            table = table.remove_column(i)
        elif k == 2:
            table = table.rename_columns(
                [rng.choice(("seq", "", "rank", "\x1b[31m")) if j == i else c for j, c in enumerate(table.column_names)]
            )
        else:  # some rows only: a value of the column's own type at an extreme
            rows = [rng.randrange(table.num_rows) for _ in range(rng.randint(1, 5))]
            values = table.column(i).to_pylist()
            for r in rows:
                values[r] = rng.choice(EXTREMES) if pa.types.is_integer(table.schema.field(i).type) else None
            try:
                table = table.set_column(i, name, pa.array(values, type=table.schema.field(i).type))
            except (pa.ArrowInvalid, OverflowError):
                pass
    out = io.BytesIO()
    pq.write_table(table, out)
    data = bytearray(out.getvalue())
    if rng.random() < 0.3:  # bytes, not columns: flipped, or cut
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            del data[rng.randrange(len(data)) :]
    return bytes(data)


@pytest.fixture(scope="module")
def writer_log(tmp_path_factory):
    from tests import writer_logs

    return writer_logs.write(str(tmp_path_factory.mktemp("writer")))


def _report(results: dict, tmp_path: Path) -> list[str]:
    failed = []
    keep = tmp_path / "failed"
    for path, outcome in results.items():
        if outcome in ("ok", "refused"):
            continue
        keep.mkdir(exist_ok=True)
        kept = keep / Path(path).parent.name
        shutil.copytree(Path(path).parent, kept, dirs_exist_ok=True)
        failed.append(f"{kept / Path(path).name}: {outcome}")
    return failed


@pytest.mark.slow
def test_fuzzed_logs_never_crash_hang_or_blow_memory(writer_log, tmp_path):
    cplog, csv_path = writer_log
    binary, text = Path(cplog).read_bytes(), Path(csv_path).read_text()
    rng = random.Random(SEED)
    cases = []
    for i in range(BINARY_CASES + CSV_CASES):
        d = tmp_path / f"case{i:03d}"  # a directory each: convert writes beside the file
        d.mkdir()
        if i < BINARY_CASES:
            path, data = d / "rank0.cplog", mutate_binary(rng, binary)
        else:
            path, data = d / "rank0.csv", mutate_csv(rng, text)
        assert len(data) < 1 << 20
        path.write_bytes(data)
        cases.append(str(path))
    got = run_child(cases, timeout=HANG_S * 10 + 600)
    results = got["results"]
    failed = _report(results, tmp_path)
    assert not failed, "\n".join(failed)
    outcomes = list(results.values())
    # the mutations reach both ends: files read (best effort) and files refused
    assert outcomes.count("ok") > 20 and outcomes.count("refused") > 20, outcomes
    assert got["peak_mb"] - got["baseline_mb"] < PEAK_MB, got


def test_fuzzed_parquet_never_crashes_hangs_or_blows_memory(writer_log, tmp_path):
    """Issue 33: the Parquet reader on the writer's log with hostile columns (other types, extremes,
    escapes, nulls, columns dropped or renamed) and damaged bytes: read or refused in one line."""
    import pyarrow.csv

    table = pyarrow.csv.read_csv(writer_log[1])
    rng = random.Random(SEED)
    cases = []
    for i in range(PARQUET_CASES):
        d = tmp_path / f"case{i:03d}"
        d.mkdir()
        path, data = d / "rank0.parquet", mutate_parquet(rng, table)
        assert len(data) < 1 << 20
        path.write_bytes(data)
        cases.append(str(path))
    got = run_child(cases, timeout=HANG_S * 5 + 300)
    failed = _report(got["results"], tmp_path)
    assert not failed, "\n".join(failed)
    outcomes = list(got["results"].values())
    assert outcomes.count("ok") > 5 and outcomes.count("refused") > 5, outcomes
    assert got["peak_mb"] - got["baseline_mb"] < PEAK_MB, got


@pytest.mark.slow  # every saved case, through both readers
@pytest.mark.parametrize("reader", ["pyarrow", "pandas"])
def test_corpus_replays(tmp_path, reader):
    """Every input that once crashed a reader (or hung it, or printed escapes): now fine, with
    either reader (pyarrow, or pandas alone)."""
    cases = []
    for f in sorted(CORPUS.iterdir()):
        if f.suffix in (".cplog", ".csv"):
            d = tmp_path / f.stem
            d.mkdir()
            shutil.copy(f, d / ("rank0" + f.suffix))
            cases.append(str(d / ("rank0" + f.suffix)))
    assert len(cases) >= 10
    got = run_child(cases, timeout=HANG_S * len(cases) + 120, reader=reader)
    failed = _report(got["results"], tmp_path)
    assert not failed, "\n".join(failed)
    assert got["peak_mb"] - got["baseline_mb"] < PEAK_MB, got


if __name__ == "__main__":
    if sys.argv[1] == "pandas":
        from commpatch.io import writer

        writer._pyarrow = lambda: None
    print(json.dumps(child(sys.argv[2:])))
