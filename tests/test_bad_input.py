"""`commpatch report` and `commpatch.read_csv` on bad input, as a new user would try it.

Every case ends either in one line on stderr naming the file and what is wrong, exit status 2
and no traceback (``commpatch.read_csv``: a ``LogFileError``, a ValueError, naming the file),
or in a correct best-effort report with a ``warning:`` line: the numbers are checked against
the report of a clean log holding what should have been read. Options that point at paths
(``--trace``, ``--plots``, ``--module-tree``, ``--steps``) are checked before any log is read.
The CLI runs in-process; the Python API runs with both readers (pyarrow, and pandas alone).
"""

import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import commpatch
from commpatch import analysis, cli
from commpatch import io as cpio
from commpatch.data.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY
from commpatch.io import LogFileError, LogFileWarning
from commpatch.testing import rank_logs


@pytest.fixture(scope="module")
def frames():
    """Two ranks' logs of a 3-step job: 15 rows each."""
    return list(rank_logs(2, 3))


def write_csv(df, path):
    cpio.write(df, str(path))
    return str(path)


def write_ranks(d, frames, suffix=".csv"):
    d.mkdir(parents=True, exist_ok=True)
    return [cpio.write(f, str(d / f"rank{r}{suffix}")) for r, f in enumerate(frames)]


def replace_line(path, number, edit):
    """Apply ``edit`` to line ``number`` (1 = the header) of a text file."""
    lines = Path(path).read_text().split("\n")
    lines[number - 1] = edit(lines[number - 1])
    Path(path).write_text("\n".join(lines))


def set_field(line, index, value):
    parts = line.split(",")
    parts[index] = value
    return ",".join(parts)


COL = {name: i for i, (name, *_) in enumerate(commpatch.schema())}


def run_cli(capsys, *argv):
    code = cli.main(["report", *map(str, argv), "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


# ---- refused: one line naming the file, exit status 2 ------------------------------------
# case -> builder(dir, frames) returning (the paths to read, the path the message must name,
# a phrase of the message, more CLI options)


def _wrong_dtype(d, fr):
    f = write_ranks(d, fr)[1]
    replace_line(f, 4, lambda line: set_field(line, COL["bytes"], "abc"))
    return [d], f, "column 'bytes' holds 'abc' on line 4, not an integer", []


def _random_binary(d, fr):
    write_ranks(d, fr[:1])
    f = str(d / "rank1.csv")
    Path(f).write_bytes(b"\x00" + np.random.default_rng(0).bytes(4096))
    return [d], f, "binary data", []


def _parquet_truncated(d, fr):
    f = write_ranks(d, fr, ".parquet")[1]
    data = Path(f).read_bytes()
    Path(f).write_bytes(data[: len(data) // 2])
    return [d], f, "not a readable Parquet file (truncated or corrupt", []


def _parquet_garbage(d, fr):
    write_ranks(d, fr[:1], ".parquet")
    f = str(d / "rank1.parquet")
    Path(f).write_bytes(b"PAR1" + np.random.default_rng(1).bytes(2000) + b"PAR1")
    return [d], f, "not a readable Parquet file", []


def _foreign_csv_named(d, fr):
    d.mkdir()
    f = str(d / "metrics.csv")
    Path(f).write_text("name,value,when\nloss,0.5,2024\n")
    return [f], f, "not a commpatch log: its columns are name, value, when", []


def _no_rank_column(d, fr):
    d.mkdir()
    write_csv(fr[0], d / "rank0.csv")
    f = write_csv(fr[1].drop(columns="rank"), d / "rank1.csv")
    return [d], f, "no 'rank' column", []


def _missing_core_column(d, fr):
    d.mkdir()
    write_csv(fr[0], d / "rank0.csv")
    f = write_csv(fr[1].drop(columns="group_seq"), d / "rank1.csv")
    return [d], f, "no 'group_seq' column", []


def _parquet_version_without_its_column(d, fr):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir()
    f = str(d / "rank0.parquet")
    table = pa.Table.from_pandas(fr[0].drop(columns="module"), preserve_index=False)
    pq.write_table(table.replace_schema_metadata({SCHEMA_VERSION_KEY: b"2"}), f)
    # the report alone does not read the module column: the trace (every column) does
    return [d], f, "no 'module' column: every schema 2 log has it", ["--trace", d / "trace.json"]


def _two_jobs_world_sizes(d, fr):
    write_ranks(d, fr)
    other = list(rank_logs(4, 3))
    f = write_csv(other[2], d / "rank2.csv")
    write_csv(other[3], d / "rank3.csv")
    return [d], f, "world_size 4, but", []


def _two_jobs_same_rank(d, fr):
    write_ranks(d, fr)
    f = write_csv(fr[1].assign(pid=4242), d / "rank1_rerun.csv")
    return [d], f, "rank 1 recorded by pid 4242", []


def _rows_given_twice(d, fr):
    write_ranks(d, fr)  # rank 1's first 10 rows exported again: overlapping, not a copy
    f = write_csv(fr[1].iloc[:10], d / "rank1_early.csv")
    return [d], f, "repeats rows of rank 1", []


def _damaged_middle_line(d, fr):
    f = write_ranks(d, fr)[1]
    replace_line(f, 5, lambda line: ",".join(line.split(",")[:10]))
    return [d], f, "line 5 has 10 field(s) where the header has", []


def _empty_integer_cell(d, fr):
    f = write_ranks(d, fr)[1]
    replace_line(f, 3, lambda line: set_field(line, COL["rank"], ""))
    return [d], f, "column 'rank' is empty on line 3", []


def _files_joined_with_their_headers(d, fr):
    f = write_ranks(d, fr)[1]
    text = Path(f).read_text()
    Path(f).write_text(text + text)
    return [d], f, "second header line", []


def _nonexistent_path(d, fr):
    return [d / "nope"], str(d / "nope"), "no such file or directory", []


def _empty_directory(d, fr):
    d.mkdir()
    return [d], str(d), "no .cplog, .csv or .parquet file in this directory", []


def _glob_matching_nothing(d, fr):
    write_ranks(d, fr)
    return [d / "*.parquet"], str(d / "*.parquet"), "matches no file", []


def _only_header_only_files(d, fr):
    write_ranks(d, [f.iloc[:0] for f in fr])
    return [d], str(d), "no collective calls recorded", []


REFUSED = {
    "wrong dtype (text in an integer column)": _wrong_dtype,
    "random binary": _random_binary,
    "truncated Parquet": _parquet_truncated,
    "corrupt Parquet": _parquet_garbage,
    "foreign CSV given by name": _foreign_csv_named,
    "no rank column": _no_rank_column,
    "a core column missing": _missing_core_column,
    "Parquet of schema 2 without a schema-2 column": _parquet_version_without_its_column,
    "two jobs: different world sizes": _two_jobs_world_sizes,
    "two jobs: two pids for one rank": _two_jobs_same_rank,
    "the same rank's rows given twice": _rows_given_twice,
    "damaged line in the middle": _damaged_middle_line,
    "empty integer cell": _empty_integer_cell,
    "two files joined with their headers": _files_joined_with_their_headers,
    "nonexistent path": _nonexistent_path,
    "empty directory": _empty_directory,
    "glob matching nothing": _glob_matching_nothing,
    "header-only files only": _only_header_only_files,
}


def assert_one_line_error(code, err, named, phrase):
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("commpatch report: ") and named in last and phrase in last, err
    assert all(line.startswith("commpatch report: ") for line in err.strip().splitlines()), err


@pytest.mark.parametrize("case", list(REFUSED))
def test_cli_refuses(case, frames, tmp_path, capsys):
    paths, named, phrase, options = REFUSED[case](tmp_path / "logs", frames)
    assert_one_line_error(*run_cli(capsys, *paths, *options)[::2], named, phrase)


@pytest.fixture(params=["pyarrow", "pandas"])
def reader(request, monkeypatch):
    """The reader to use: ``reader.use()`` once the files are written (with pyarrow)."""

    class Reader(str):
        def use(self):
            if self == "pandas":
                monkeypatch.setattr(cpio.writer, "_pyarrow", lambda: None)

    return Reader(request.param)


@pytest.mark.parametrize("case", [c for c in REFUSED if REFUSED[c] is not _only_header_only_files])
def test_read_csv_refuses(case, frames, tmp_path, reader):
    argv, named, phrase, _ = REFUSED[case](tmp_path / "logs", frames)
    if reader == "pandas" and "Parquet" in case:  # the first Parquet file is the one named
        named, phrase = sorted(str(p) for p in (tmp_path / "logs").glob("*.parquet"))[0], "needs pyarrow"
    reader.use()
    with pytest.raises(LogFileError) as info:
        commpatch.read_csv([str(a) for a in argv])
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "\n" not in message and message.startswith(named) and phrase in message, message
    assert info.value.path == named


def test_a_missing_path_is_also_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        commpatch.read_csv(str(tmp_path / "nope.csv"))


# ---- options that point at paths: checked before any log is read -------------------------
@pytest.fixture
def no_reading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the logs were read before the options were checked")

    monkeypatch.setattr(cpio, "read", fail)


def _blocker(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


OPTIONS = {
    "--by unknown column": (lambda t: ["--by", "op,nope"], "--by: unknown column(s) 'nope'"),
    "--by nothing": (lambda t: ["--by", ","], "give one or more columns"),
    "--trace under a file": (lambda t: ["--trace", _blocker(t) / "trace.json"], "is a file, not a directory"),
    "--trace is a directory": (lambda t: ["--trace", t], "is a directory"),
    "--plots under a file": (lambda t: ["--plots", _blocker(t) / "plots"], "is a file, not a directory"),
    "--plots is a file": (lambda t: ["--plots", _blocker(t)], "exists and is not a directory"),
    "--module-tree under a file": (lambda t: ["--module-tree", _blocker(t) / "m.json"], "is a file, not a directory"),
    "--steps missing": (lambda t: ["--steps", t / "steps.csv"], "--steps"),
    "--steps empty": (lambda t: ["--steps", _write(t / "steps.csv", b"")], "empty file"),
    "--steps binary": (lambda t: ["--steps", _write(t / "steps.csv", b"\x00\xff\xfe" * 50)], "--steps"),
    "--steps wrong columns": (
        lambda t: ["--steps", _write(t / "steps.csv", b"a,b\n1,2\n")],
        "needs columns step and duration_us",
    ),
    "--steps text in duration_us": (
        lambda t: ["--steps", _write(t / "steps.csv", b"step,duration_us\n0,5\n1,slow\n")],
        "column 'duration_us' holds 'slow' on line 3, not a number",
    ),
    "--top negative": (lambda t: ["--top", "-1"], "--top -1"),
}


def _write(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(OPTIONS))
def test_bad_option_is_refused_before_reading(case, tmp_path, capsys, no_reading):
    build, phrase = OPTIONS[case]
    argv = build(tmp_path)
    code, _, err = run_cli(capsys, tmp_path / "logs", *argv)
    named = str(argv[1]) if not case.startswith("--by") else "--by"
    assert_one_line_error(code, err, named, phrase)


def test_module_tree_of_a_log_without_modules_is_refused(frames, tmp_path, capsys):
    d = tmp_path / "logs"
    d.mkdir()
    for r, f in enumerate(frames):
        write_csv(f.drop(columns=["module", "phase", "bucket", "bucket_params"]), d / f"rank{r}.csv")
    code, _, err = run_cli(capsys, d, "--module-tree", tmp_path / "tree.json")
    assert_one_line_error(code, err, "--module-tree", "no module column (written by an older commpatch)")
    assert "warning: " in err and "written by an older commpatch" in err
    assert not (tmp_path / "tree.json").exists()


# ---- best effort: a warning, and the numbers of the clean log of what could be read -------
# case -> builder(dir, frames) returning (CLI arguments, extra CLI options, the frames that
# should have been read, the path the warning names, a phrase of the warning)


def _empty_file(d, fr):
    write_ranks(d, fr[:1])
    f = d / "rank1.csv"
    f.write_bytes(b"")
    return [d], [], fr[:1], str(f), "empty file"


def _header_only(d, fr):
    write_ranks(d, fr[:1])
    f = write_csv(fr[1].iloc[:0], d / "rank1.csv")
    return [d], [], fr[:1], f, "no rows (header only)"


def _truncated_mid_line(d, fr):
    f = write_ranks(d, fr)[1]
    data = Path(f).read_bytes()
    Path(f).write_bytes(data[:-40])
    return [d], [], [fr[0], fr[1].iloc[:-1]], f, "last line is incomplete"


def _foreign_csv_in_the_directory(d, fr):
    write_ranks(d, fr)
    f = d / "metrics.csv"
    f.write_text("name,value\nloss,0.5\n")
    return [d], [], fr, str(f), "not a commpatch log: its columns are name, value"


def _non_utf8_bytes(d, fr):
    tagged = [f.assign(tag=pd.Categorical(np.where(np.arange(len(f)) % 2, "caf\u00e9", ""))) for f in fr]
    f = write_ranks(d, tagged)[1]
    data = Path(f).read_bytes()
    Path(f).write_bytes(data.replace("caf\u00e9".encode(), b"caf\xe9"))  # latin-1, not UTF-8
    expected = [tagged[0], tagged[1].assign(tag=tagged[1]["tag"].cat.rename_categories({"caf\u00e9": "caf\ufffd"}))]
    return [d], ["--by", "op,tag"], expected, f, "invalid UTF-8 bytes in column 'tag'"


def _older_schema(d, fr):
    d.mkdir()
    for r, f in enumerate(fr):
        write_csv(f.drop(columns=["module", "phase", "bucket", "bucket_params"]), d / f"rank{r}.csv")
    return (
        [d],
        ["--trace", d.parent / "trace.json"],
        fr,
        str(d / "rank0.csv"),
        "written by an older commpatch (schema 1, before the column(s) module, phase, bucket, bucket_params)",
    )


def _newer_parquet(d, fr):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir()
    for r, f in enumerate(fr):
        table = pa.Table.from_pandas(f.assign(future_column=1.5), preserve_index=False)
        pq.write_table(table.replace_schema_metadata({SCHEMA_VERSION_KEY: b"99"}), str(d / f"rank{r}.parquet"))
    return [d], [], fr, str(d / "rank0.parquet"), "written by a newer commpatch (schema 99"


def _same_path_twice(d, fr):
    files = write_ranks(d, fr)
    return [d, files[1]], [], fr, files[1], "given twice"


def _a_copy_of_a_rank_file(d, fr):
    files = write_ranks(d, fr)
    f = write_csv(fr[1], d / "rank1_copy.csv")
    return [d], [], fr, f, f"a copy of {files[1]}"


def _durations(value, phrase):
    def build(d, fr):
        bad = fr[1].copy()
        bad.loc[[0, 3], "duration_us"] = value
        f = write_ranks(d, [fr[0], bad])[1]
        clean = fr[1].copy()
        clean.loc[[0, 3], ["duration_us", "algbw_gbps", "busbw_gbps"]] = np.nan
        return [d], [], [fr[0], clean], f, phrase

    return build


def _steps_with_impossible_times(d, fr):
    write_ranks(d, fr)
    steps = d.parent / "steps.csv"
    steps.write_text("step,duration_us\n0,50000\n1,-3\n2,inf\n")
    return [d], ["--steps", steps], fr, str(steps), "2 step time(s) missing, infinite or negative"


BEST_EFFORT = {
    "empty CSV": _empty_file,
    "header-only CSV": _header_only,
    "CSV truncated mid-line": _truncated_mid_line,
    "foreign CSV in the directory": _foreign_csv_in_the_directory,
    "non-UTF-8 bytes": _non_utf8_bytes,
    "older schema (columns added since)": _older_schema,
    "Parquet of a newer schema": _newer_parquet,
    "the same file given twice": _same_path_twice,
    "a copy of a rank file": _a_copy_of_a_rank_file,
    "infinite durations": _durations(np.inf, "2 impossible duration_us value(s) (2 infinite)"),
    "negative durations": _durations(-5000.0, "2 impossible duration_us value(s) (2 negative)"),
    "NaN durations": _durations(np.nan, "2 row(s) with timing 'host' but no duration_us"),
    "--steps with impossible step times": _steps_with_impossible_times,
}


def reference_report(capsys, tmp_path, expected, options):
    d = tmp_path / "reference"
    write_ranks(d, expected)
    options = [o if not str(o).endswith(".json") else tmp_path / "ref_trace.json" for o in options]
    code, out, err = run_cli(capsys, d, "--format", "json", *options)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("case", list(BEST_EFFORT))
def test_cli_best_effort(case, frames, tmp_path, capsys):
    argv, options, expected, named, phrase = BEST_EFFORT[case](tmp_path / "logs", frames)
    code, out, err = run_cli(capsys, *argv, "--format", "json", *options)
    assert code == 0, err
    assert "Traceback" not in err and "RuntimeWarning" not in err
    warnings = [line for line in err.splitlines() if line.startswith("commpatch report: warning: ")]
    assert any(named in line and phrase in line for line in warnings), err
    got, ref = json.loads(out), reference_report(capsys, tmp_path, expected, options)
    assert got["title"] == ref["title"] and got["errors"] == ref["errors"]
    assert got["sections"] == ref["sections"]
    text = json.dumps(got["sections"])
    assert "Infinity" not in text and all(
        row["busbw_gbps"] is None or 0 < row["busbw_gbps"] < 100 for row in got["sections"]["summary"]
    )


@pytest.mark.parametrize("case", [c for c in BEST_EFFORT if not c.startswith("--steps")])
def test_read_csv_best_effort(case, frames, tmp_path, reader):
    if reader == "pandas" and "Parquet" in case:
        pytest.skip("Parquet needs pyarrow")
    argv, _, expected, named, phrase = BEST_EFFORT[case](tmp_path / "logs", frames)
    with warnings.catch_warnings():  # the clean log has its NaN durations too
        warnings.simplefilter("ignore", LogFileWarning)
        ref = cpio.read(write_ranks(tmp_path / "reference", expected))
    reader.use()
    with pytest.warns(LogFileWarning) as record:
        df = commpatch.read_csv([str(a) for a in argv])
    messages = [str(w.message) for w in record if issubclass(w.category, LogFileWarning)]
    if reader == "pandas" and case == "non-UTF-8 bytes":
        phrase = "invalid UTF-8 bytes"
    assert any(m.startswith(named) and phrase in m for m in messages), messages
    df.attrs, ref.attrs = {}, {}
    pd.testing.assert_frame_equal(df, ref)
    assert np.isfinite(df["duration_us"].dropna()).all() and (df["duration_us"].dropna() >= 0).all()


def test_older_schema_columns_are_filled_and_listed(frames, tmp_path):
    _older_schema(tmp_path / "logs", frames)
    with pytest.warns(LogFileWarning, match=r"rank0.csv \(and 1 other file\(s\)\): written by an older"):
        df = commpatch.read_csv(str(tmp_path / "logs"))
    assert df.attrs["filled_columns"] == ["bucket", "bucket_params", "module", "phase"]
    assert (df["bucket"] == -1).all() and (df["bucket_params"] == 0).all() and (df["module"] == "").all()


def test_header_only_file_alone_reads_as_an_empty_log(frames, tmp_path):
    f = write_csv(frames[0].iloc[:0], tmp_path / "rank0.csv")
    with pytest.warns(LogFileWarning, match="no rows"):
        df = commpatch.read_csv(f)
    assert len(df) == 0 and list(df.columns) == [c[0] for c in commpatch.schema()]
    assert list(df.dtypes.astype(str)) == [c[1] for c in commpatch.schema()]


def test_analysis_never_counts_impossible_durations(frames):
    """In-memory logs too (not read from a file): inf / negative durations are unmeasured."""
    df = pd.concat(frames, ignore_index=True)
    df = df.assign(op=df["op"].astype("category"))
    bad = df.copy()
    bad.loc[[0, 1], "duration_us"] = [np.inf, -1.0]
    s, ref = analysis.summary(bad, by="op"), analysis.summary(df.drop(index=[0, 1]), by="op")
    assert np.isfinite(s["total_us"]).all() and (s["total_us"] >= 0).all()
    assert s["total_us"].sum() == pytest.approx(ref["total_us"].sum())
    assert s["unmeasured"].sum() == 2


def test_parquet_with_the_schema_version_reads_without_a_warning(frames, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "rank0.parquet")
    table = cpio.with_schema_version(pa.Table.from_pandas(frames[0], preserve_index=False))
    pq.write_table(table, path)
    assert pq.read_schema(path).metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LogFileWarning)
        df = commpatch.read_csv(path)
    assert len(df) == len(frames[0]) and df.attrs["filled_columns"] == []


# ---- damaged binary logs: torn frames, zeros, sizes beyond the file (issue 24) ---------------
@pytest.fixture(scope="module")
def writer_log(tmp_path_factory):
    """A real rank log of commpatch's writer (many frames: rows in several chunks) and its CSV."""
    from tests import writer_logs

    return writer_logs.write(str(tmp_path_factory.mktemp("writer")))


def _layout(data):
    """(kind, frame start, payload start, frame stop) of each frame of an undamaged rank log."""
    import struct

    from commpatch.data import logfile

    out, pos = [], len(logfile.MAGIC)
    while pos < len(data):
        kind, length = struct.unpack_from("<cI", data, pos)
        out.append((kind, pos, pos + 5, pos + 5 + length))
        pos += 5 + length
    return out


def _row_frames(data, least=1):
    """The row frames of an undamaged rank log that hold at least ``least`` rows: the writer's
    flusher may split a step's rows over two frames on a loaded machine, so a test that damages
    a frame's n-th row picks among these, never by position alone."""
    return [f for f in _layout(data) if f[0] == b"R" and (f[3] - f[2]) // 59 >= least]


def _seqs(payload):
    from commpatch.data.schema import row_dtype

    return np.frombuffer(payload, dtype=row_dtype(np))["seq"].tolist()


STABLE = ["seq", "op", "group", "dtype", "bytes", "start_ns", "duration_us", "step", "tag", "status"]


def _torn(data, frame, cut):
    """The file a full disk leaves: ``frame`` written up to ``cut`` bytes of it, and the writer
    appending the next frames after it (the disk freed again)."""
    _, lo, _, hi = frame
    return data[: lo + cut] + data[hi:]


@pytest.mark.parametrize("where", ["header", "first row", "mid row", "last row"])
@pytest.mark.parametrize("which", [0, 2, -1])
def test_a_torn_frame_mid_file_loses_only_its_cut_rows(writer_log, tmp_path, which, where):
    data = Path(writer_log[0]).read_bytes()
    frames = [f for f in _layout(data) if f[0] == b"R"]
    frame = frames[which]
    n = (frame[3] - frame[2]) // 59
    whole = {"header": -1, "first row": 0, "mid row": n // 2, "last row": n - 1}[where]
    cut = 3 if whole < 0 else 5 + 59 * whole + 30
    path = tmp_path / "rank0.cplog"
    path.write_bytes(_torn(data, frame, cut))
    lost = set(_seqs(data[frame[2] : frame[3]])[max(whole, 0) :])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogFileWarning)
        ref = commpatch.read_csv(writer_log[0])
    with pytest.warns(LogFileWarning) as record:
        df = commpatch.read_csv(str(path))
    said = " ".join(str(w.message) for w in record)
    assert ("1 frame(s) cut short" if whole >= 0 else "1 stretch(es) of bytes that hold no frame") in said, said
    expected = ref[~ref["seq"].isin(lost)].reset_index(drop=True)
    pd.testing.assert_frame_equal(df[STABLE].reset_index(drop=True), expected[STABLE], check_categorical=False)


def test_a_torn_frame_mid_file_report_and_convert_go_on(writer_log, tmp_path, capsys):
    data = Path(writer_log[0]).read_bytes()
    frame = _row_frames(data, least=2)[1]
    path = tmp_path / "rank0.cplog"
    path.write_bytes(_torn(data, frame, 5 + 59 + 11))
    code, out, err = run_cli(capsys, path)
    assert code == 0 and "Traceback" not in err and "all_reduce" in out, err
    assert f"commpatch report: warning: {path}: 1 frame(s) cut short" in err, err
    assert cli.main(["convert", str(path), "--no-progress"]) == 0
    _, err = capsys.readouterr()
    assert f"commpatch convert: warning: {path}: 1 frame(s) cut short" in err, err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogFileWarning)
        converted = commpatch.read_csv(str(tmp_path / "rank0.csv"))
        ref = commpatch.read_csv(writer_log[0])
    lost = set(_seqs(data[frame[2] : frame[3]])[1:])
    assert converted["seq"].tolist() == [s for s in ref["seq"] if s not in lost]


@pytest.mark.parametrize("span", ["rows", "frames"])
def test_a_block_of_zeros_in_the_rows_is_skipped_and_counted(writer_log, tmp_path, span):
    """What a crash leaves on some filesystems: a block of zeros over whole rows of a frame (read
    before as all_reduce calls with seq 0, again), or over rows and the next frames' headers."""
    data = Path(writer_log[0]).read_bytes()
    frame = _row_frames(data, least=4)[1]
    at = frame[2] + 59  # from the frame's second row on: rows 2 and 3 of 4 or more
    length = 2 * 59 if span == "rows" else 512
    damaged = bytearray(data)
    damaged[at : at + length] = bytes(length)
    path = tmp_path / "rank0.cplog"
    path.write_bytes(bytes(damaged))
    with pytest.warns(LogFileWarning) as record:
        df = commpatch.read_csv(str(path))
    said = [str(w.message) for w in record]
    # rows wholly in the zeros are gone; rows before and after them, in any frame, are all there
    untouched, edge = set(), set()
    for kind, _lo, start, hi in _layout(data):
        if kind != b"R":
            continue
        for i, seq in enumerate(_seqs(data[start:hi])):
            a, b = start + 59 * i, start + 59 * (i + 1)
            (untouched if b <= at or a >= at + length else edge if a < at or b > at + length else set()).add(seq)
    assert df["seq"].is_unique and untouched <= set(df["seq"]) <= untouched | edge
    assert (df["op"] != "").all() and (df["start_ns"] > 0).all()
    if span == "rows":
        assert any("2 row(s) of zeros" in m for m in said) and len(df) == len(untouched), said
    else:
        assert any("1 stretch(es) of bytes that hold no frame" in m for m in said), said


def _append_tag_code(data):
    from commpatch.data import logfile

    return data + logfile.meta("tag", code=10**12, name="x"), "1 registry record(s) that are not valid"


def _row_tag(data):
    import struct

    frame = _row_frames(data, least=2)[1]
    at = frame[2] + 59 + 51  # the second row's tag (int32 at offset 51)
    return data[:at] + struct.pack("<i", 2**31 - 1) + data[at + 4 :], "1 row(s) with impossible values"


def _group_ranks(data):
    from commpatch.data import logfile

    for kind, lo, start, hi in _layout(data):
        record = json.loads(data[start:hi]) if kind == b"M" else {}
        if record.get("k") == "group" and record["gid"] == 0:
            record.update(ranks="0-99999999999", size=10**11)
            return (
                data[:lo] + logfile.frame(logfile.META, json.dumps(record).encode()) + data[hi:],
                "code(s) used by rows but never registered",
            )


def _nested_json(data):
    from commpatch.data import logfile

    nested = b'{"code":' + b"[" * 5_000 + b"]" * 5_000 + b',"name":"x","k":"tag"}'
    return data + logfile.frame(logfile.META, nested), "1 registry record(s) that are not valid"


@pytest.mark.parametrize("build", [_append_tag_code, _row_tag, _group_ranks, _nested_json])
def test_sizes_in_a_binary_log_are_bounded_by_the_file(writer_log, tmp_path, build):
    """A registry code of 1e12, a row's tag of 2^31-1, a group of 1e11 ranks, JSON nested past the
    recursion limit: read best-effort, with little memory (tracemalloc: numpy and Python)."""
    import tracemalloc

    data, phrase = build(Path(writer_log[0]).read_bytes())
    path = tmp_path / "rank0.cplog"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.warns(LogFileWarning) as record:
            df = commpatch.read_csv(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any(phrase in str(w.message) for w in record), [str(w.message) for w in record]
    assert peak < 64 << 20 and len(df) > 0
    assert df["group_ranks"].astype(str).map(len).max() < 20


@pytest.mark.parametrize(
    "column, value, phrase",
    [
        ("rank", str(2**40), "column 'rank' holds 1099511627776 on line 2: not a rank of a world of 1"),
        ("world_size", str(2**40), "column 'world_size' holds 1099511627776 on line 2: a world size is 1 to"),
        (
            "group_ranks",
            "0-99999999999",
            "column 'group_ranks' holds '0-99999999999' on line 2, not ranks (range notation",
        ),
        ("group_ranks", "0-3:0", "column 'group_ranks' holds '0-3:0' on line 2"),
    ],
)
def test_sizes_in_a_csv_beyond_the_world_are_refused(writer_log, tmp_path, capsys, column, value, phrase):
    path = tmp_path / "rank0.csv"
    path.write_text(Path(writer_log[1]).read_text())
    replace_line(path, 2, lambda line: set_field(line, COL[column], value))
    with pytest.raises(LogFileError, match=re.escape(phrase)):
        commpatch.read_csv(str(path))
    code, _, err = run_cli(capsys, path)
    assert_one_line_error(code, err, str(path), phrase)


ESC = ("\x1b", "\x9b", "\x07", "\u202e")


def test_report_never_prints_terminal_escapes_from_a_log(frames, tmp_path, capsys):
    """Names from a log (group, op, tag, module, dtype) and file names reach the terminal escaped."""
    d = tmp_path / "logs\x1b[2J"
    hostile = [
        f.assign(group="\x1b]0;owned\x07g", tag="\x9b31mtag", module="m\u202eod", dtype="f\x1b[31m32") for f in frames
    ]
    write_ranks(d, hostile)
    (d / "rank1.csv").write_text((d / "rank1.csv").read_text() + "1,al")  # a warning naming the file
    outputs = []
    for options in (
        [],
        ["--by", "group,tag,module,dtype"],
        ["--format", "markdown"],
        ["--format", "csv", "--section", "summary", "--by", "tag,dtype"],
    ):
        code, out, err = run_cli(capsys, d, *options)
        assert code == 0, err
        outputs.append(out + err)
    text = "".join(outputs)
    assert not any(e in text for e in ESC), [e for e in ESC if e in text]
    assert "\\x1b]0;owned\\x07g" in text and "\\x9b31mtag" in text and "m\\u202eod" in text
    assert "logs\\x1b[2J" in text and "warning" in text


# ---- a real fault: a disk that fills up in the middle of a write, then frees space ----------
def build_shim(tmp_path, source):
    """``source`` (C) built as an LD_PRELOAD library: its path (the test is skipped without gcc)."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the write() shim")
    (tmp_path / "shim.c").write_text(source)
    shim = tmp_path / "shim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"], check=True)
    return shim


SHORT_WRITE_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

/* The write() whose bytes hold MARK writes half of them (a short write: the disk is full), the
   next write() to that file fails with ENOSPC, then the disk has room again. */
static int state = 0, fd_hit = -1;

ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (state == 0 && n > 16 && memmem(buf, n, "FULLDISK", 8)) {
        state = 1; fd_hit = fd;
        return real(fd, buf, n / 2);
    }
    if (state == 1 && fd == fd_hit) {
        state = 2;
        errno = ENOSPC;
        return -1;
    }
    return real(fd, buf, n);
}
"""

FULL_DISK_JOB = r"""
import os, sys, tempfile, time
import torch, torch.distributed as dist
import commpatch

commpatch.enable(output=os.path.join(sys.argv[1], "rank{rank}.csv"))
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
t = torch.ones(8)
for name in ("before", "FULLDISK", "after", "later"):
    with commpatch.tag(name):
        for _ in range(25):
            dist.all_reduce(t)
    time.sleep(0.6)          # the flusher writes each phase on its own
dist.destroy_process_group()
"""


@pytest.mark.faults
def test_rows_around_a_write_cut_short_by_a_full_disk_are_read(tmp_path, capsys):
    """A real short write then ENOSPC (an LD_PRELOAD shim of write()) in the flush that carries the
    'FULLDISK' phase; the job goes on writing after it. Every row of the other phases is read
    back from the .cplog, by read_csv and the report, with no traceback."""
    import subprocess
    import sys

    shim = build_shim(tmp_path, SHORT_WRITE_SHIM)
    out = tmp_path / "run"
    env = dict(__import__("os").environ, LD_PRELOAD=str(shim), COMMPATCH_OUTPUT="none")
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_JOB, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    path = out / "rank0.cplog"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", LogFileWarning)
        df = commpatch.read_csv(str(path))
    said = [str(w.message) for w in record if issubclass(w.category, LogFileWarning)]
    assert df["seq"].is_unique
    for name in ("before", "after", "later"):
        assert (df["tag"] == name).sum() == 25, (name, said, df["tag"].value_counts())
    if (df["tag"] == "FULLDISK").sum() < 25:  # lost in the failed write: said, never silent
        assert any("cut short" in m or "hold no frame" in m for m in said), said
    code, text, err = run_cli(capsys, path, "--by", "tag")
    assert code == 0 and "Traceback" not in err and "later" in text, err


ENOSPC_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

/* A full disk for the CSV being written: every write() of its header or rows fails with ENOSPC. */
ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (n > 8 && (memmem(buf, n, "seq,op,", 7) || memmem(buf, n, "all_reduce", 10))) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, buf, n);
}
"""


def test_convert_on_a_full_disk_says_so_in_one_line(writer_log, tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    shim = build_shim(tmp_path, ENOSPC_SHIM)
    path = tmp_path / "rank0.cplog"
    shutil.copy(writer_log[0], path)
    done = subprocess.run(
        [sys.executable, "-m", "commpatch", "convert", str(path), "--no-progress"],
        env=dict(os.environ, LD_PRELOAD=str(shim)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip()
        == f"commpatch convert: {tmp_path / 'rank0.csv'}: cannot be written (No space left on device)"
    )
    assert sorted(os.listdir(tmp_path)) == ["rank0.cplog", "shim.c", "shim.so"]  # no partial file left


def test_the_in_process_api_refuses_bad_arguments_in_one_line(frames, tmp_path):
    """``export_csv`` with something that is no log or no file name, ``step`` with no integer: one-line
    ConfigErrors naming the argument (before: AttributeError, IsADirectoryError, ValueError of int());
    a refused ``step`` leaves the step count and its source as they were."""
    from commpatch.record import state

    df = frames[0]
    for kwargs, said in (
        (dict(path=str(tmp_path / "x.csv"), df=5), "export_csv df 5: not a log"),
        (dict(path=5), "export_csv path 5: give a file name ending in .csv or .parquet, or None"),
        (dict(path=str(tmp_path), df=df), "is a directory (give a file name ending in .csv or .parquet)"),
    ):
        with pytest.raises(commpatch.ConfigError) as raised:
            commpatch.export_csv(**kwargs)
        assert said in str(raised.value) and "\n" not in str(raised.value), raised.value
    assert os.listdir(tmp_path) == []
    before = (state.STATE.step, state.STATE.step_source)
    with pytest.raises(commpatch.ConfigError, match=r"commpatch.step\('x'\): give the step as an integer"):
        commpatch.step("x")
    assert (state.STATE.step, state.STATE.step_source) == before


def test_the_in_process_summary_and_enable_refuse_what_is_no_log_or_no_list(frames):
    """``summary`` / ``summary_text`` of something that is no log, by no column, and ``enable(ops=)`` of no
    list: one-line ConfigErrors (before: TypeError / KeyError from inside pandas)."""
    df = frames[0]
    for call, said in (
        (lambda: commpatch.summary(df=5), "summary df 5: not a log"),
        (lambda: commpatch.summary_text(5), "summary df 5: not a log"),
        (lambda: commpatch.summary(df, by=5), "summary by 5: give columns of the log or size_bucket"),
        (lambda: commpatch.summary(df, by=["nope", "op"]), "('nope' is not one)"),
        (lambda: commpatch.enable(ops=5), "(setting 'ops') is not a list of ops"),
    ):
        try:
            with pytest.raises(commpatch.ConfigError) as raised:
                call()
        finally:
            commpatch.disable()
        assert said in str(raised.value) and "\n" not in str(raised.value), raised.value
    assert len(commpatch.summary(df, by="op")) == df["op"].nunique()  # a column name alone is taken
