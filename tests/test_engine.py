"""The analytic engine (DuckDB) gives the pandas path's answers: summary, per-step, stragglers,
largest skews, point-to-point channels and mismatches are equal on logs with a straggler, planted
size / op mismatches, a skipped collective, unmatched sends, several groups and binary rank logs;
`commpatch report` slices ranks and steps with one-line errors for bad values; the scale
benchmark runs end to end on a small size."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from commpatch import io as cpio
from commpatch.analysis import cross_rank, engine
from commpatch.cli import main
from commpatch.render import text as report
from commpatch.testing import make_log, write_binary_run, write_rank_files

pytestmark = pytest.mark.skipif(not engine.available(), reason="needs duckdb (commpatch[scale])")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine_report(paths, by=("collective", "size_bucket"), workers=1, **read):
    by = list(by)
    with engine.Engine(by=by) as eng:
        import functools

        stage = functools.partial(engine.stage, directory=eng.directory, by=by)
        columns = set(report.REPORT_COLUMNS) | set(by) - {"size_bucket"}
        for staged in cpio.read_ranks(paths, stage, columns=columns, workers=workers, **read):
            eng.add(staged)
        pre = eng.results(arrivals_bins=200)
        pre.by_op_size = eng.summary(["op", "size_bucket"])
    return report.build_report(None, by=by, precomputed=pre), pre


def _same(a, b, name):
    assert list(a.columns) == list(b.columns), name
    assert len(a) == len(b), name
    for col in a.columns:
        x, y = a[col].reset_index(drop=True), b[col].reset_index(drop=True)
        if x.dtype.kind in "fiu" and y.dtype.kind in "fiu":
            # the same math, summed in another order (the engine: exactly, tests/test_engine_parity.py)
            np.testing.assert_allclose(
                x.to_numpy(np.float64), y.to_numpy(np.float64), rtol=1e-12, equal_nan=True, err_msg=f"{name}.{col}"
            )
        else:
            assert x.astype(str).tolist() == y.astype(str).tolist(), f"{name}.{col}"


def _compare(paths, by=("collective", "size_bucket"), **read):
    df = cpio.read(paths, **read)
    cross = cross_rank(df)
    want = report.build_report(df, by=list(by), cross=cross)
    got, pre = _engine_report(paths, by, **read)
    assert want.title == got.title and want.errors == got.errors and want.notes == got.notes
    assert set(want.sections) == set(got.sections)
    for key in want.sections:
        _same(want.sections[key], got.sections[key], key)
    _same(cross.arrivals.reset_index(), pre.arrivals.reset_index(), "arrivals")
    _same(cross.step_arrivals, pre.step_arrivals, "step_arrivals")
    _same(cross.log_ends, pre.log_ends, "log_ends")
    verdicts = [[f.text for f in rep.findings if f.kind in ("straggler", "ends")] for rep in (want, got)]
    assert verdicts[0] == verdicts[1] and len(verdicts[0]) in (1, 2)
    return want


def test_engine_and_pandas_paths_give_the_same_report(tmp_path, monkeypatch):
    # CSV logs with p2p, a straggler and a size mismatch; then a skipped collective and a lost receive
    write_rank_files(str(tmp_path / "a"), 4, 6, p2p=True, straggler=2, mismatch=(1, 7), seed=3)
    rep = _compare(str(tmp_path / "a"))
    assert rep.sections["ranks"]["rank"].iloc[0] == 2 and len(rep.errors) == 1
    df = make_log(4, 5, p2p=True, missing=(3, 6), seed=1)
    df.loc[(df["rank"] == 1) & (df["op"] == "recv") & (df["step"] == 2), "op"] = "broadcast"  # a lost receive
    df.loc[(df["rank"] == 0) & (df["seq"] == 3), "dtype"] = "bfloat16"
    # rank 3's skipped collective makes its log end one collective before the others' (not a mismatch,
    # issue 24.7); a subgroup whose collective rank 3 never issues while its log goes on: missing
    extra = df[(df["seq"] == 3) & (df["rank"] < 3)].assign(group="g", group_seq=0, seq=10_000)
    df = pd.concat([df.astype({"group": str}), extra.astype({"group": str})], ignore_index=True)
    for rank, part in df.groupby("rank"):
        cpio.write(part, str(tmp_path / "b" / f"rank{rank}.parquet"))
    rep = _compare(str(tmp_path / "b"), by=("op", "dtype"))
    assert {"missing", "bytes", "dtype", "p2p_unmatched", "op"} <= set(rep.sections["mismatches"]["kind"])
    assert any(f.kind == "ends" and "rank(s) 3 (#" in f.text for f in rep.findings)
    monkeypatch.setattr(engine.Engine, "SMALL_DIFFERS", 3)  # many disagreeing collectives: found in SQL
    assert _compare(str(tmp_path / "b"), by=("op", "dtype")).errors == rep.errors
    monkeypatch.undo()
    # binary rank logs as a run writes them: groups of three sizes, p2p pairs, a straggler, a mismatch
    write_binary_run(str(tmp_path / "c"), 16, 400, straggler=9, mismatch=(5, 7))
    rep = _compare(str(tmp_path / "c"))
    assert rep.sections["ranks"]["rank"].iloc[0] == 9
    assert rep.errors and "8192 on rank(s) 5" in rep.errors[0]
    # a slice: ranks 0-7 and steps 2-4 of the same run, read in two processes
    want = _compare(str(tmp_path / "c"), ranks={0, 1, 2, 3, 4, 5, 6, 7}, steps=(2, 5))
    got, _ = _engine_report(str(tmp_path / "c"), ranks={0, 1, 2, 3, 4, 5, 6, 7}, steps=(2, 5), workers=2)
    assert got.title == want.title == "commpatch report: 240 calls, 8 rank(s) 0-7"
    assert sorted(want.sections["steps"]["step"]) == [2, 3, 4]


def _cli(capsys, *argv):
    code = main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_report_slices_ranks_and_steps_and_says_what_is_wrong(tmp_path, capsys):
    write_binary_run(str(tmp_path), 16, 300, straggler=3, mismatch=None)
    code, out, err = _cli(
        capsys, tmp_path, "--ranks", "0-3,12", "--steps", "10:20", "--format", "json", "--engine", "duckdb"
    )
    rep = json.loads(out)
    assert code == 0 and rep["title"] == "commpatch report: 500 calls, 5 rank(s) 0,1,2,3,12"
    assert [s["step"] for s in rep["sections"]["steps"]] == list(range(10, 20))
    assert rep["sections"]["ranks"][0]["rank"] == 3
    code, out2, _ = _cli(
        capsys, tmp_path, "--ranks", "0-3,12", "--steps", "10:20", "--format", "json", "--engine", "pandas"
    )
    assert (
        json.loads(out2)["title"] == rep["title"] and json.loads(out2)["sections"]["ranks"] == rep["sections"]["ranks"]
    )
    trace = tmp_path / "out" / "window.json"
    code, _, err = _cli(capsys, tmp_path, "--ranks", "1", "--steps", "5:6", "--trace", trace, "--engine", "duckdb")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert code == 0 and len(events) == 10
    for argv, message in (
        (["--ranks", "3-1"], "--ranks '3-1': '3-1' is not a range of ranks"),
        (["--ranks", "a,2"], "--ranks 'a,2': 'a' is not a rank or a range of ranks (e.g. 0-7,12)"),
        (["--steps", "9:3"], "--steps 9:3: no step in this window"),
        (["--steps", "x:y"], "--steps x:y: give a window of steps A:B"),
        (["--ranks", "100-200"], "no collective calls recorded in the log file(s) for the ranks / steps asked"),
        (["--steps", "5000:"], "no collective calls recorded in the log file(s) for the ranks / steps asked"),
    ):
        code, out, err = _cli(capsys, tmp_path, *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)


def test_scale_benchmark_runs_a_small_size(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "merge_scale.py"),
            "--sizes",
            "16",
            "--rows",
            "2000",
            "--engine",
            "duckdb",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    row = [line for line in out.stdout.splitlines() if line.startswith("| 16 |")]
    assert row and row[0].split("|")[7:9] == [" found ", " found "]


def test_convert_to_a_rank_partitioned_parquet_dataset_that_report_and_duckdb_read_as_is(tmp_path, capsys):
    write_binary_run(str(tmp_path), 8, 300, straggler=6, mismatch=(2, 3))
    assert main(["convert", str(tmp_path), "--to", "parquet"]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "parquet" / f"rank={r}" / f"rank{r}.parquet") for r in range(8)]
    assert main(["convert", str(tmp_path), "--to", "parquet"]) == 0  # never over an existing file
    assert capsys.readouterr().err.count("exists: kept as it is") == 8
    dataset = str(tmp_path / "parquet")
    assert _compare(dataset).title == _compare(str(tmp_path)).title == "commpatch report: 2400 calls, 8 rank(s) 0-7"
    assert cpio.file_rank(os.path.join(dataset, "rank=5", "rank5.parquet")) == 5
    import duckdb  # the README's query

    top = duckdb.sql(f"""SELECT rank, count(*) AS calls, sum(duration_us) / 1e6 AS comm_s
                         FROM read_parquet('{dataset}/*/*.parquet', hive_partitioning = true)
                         WHERE collective = 'all_reduce' GROUP BY rank ORDER BY comm_s DESC""").fetchall()
    assert len(top) == 8 and all(calls == 120 for _, calls, _ in top)


def test_the_engine_keeps_to_its_memory_limit(tmp_path):
    """The collectives' table is built within the engine's memory limit (DuckDB spills): a top-2
    aggregate per collective (the second-latest arrival) kept a list per collective in memory and
    failed at 1,024 ranks x 25,000 rows within 2 GB (here: 64 ranks x 20,000 rows within 64 MB)."""
    write_binary_run(str(tmp_path / "logs"), 64, 20_000, straggler=3)
    with engine.Engine(memory_limit="64MB") as eng:
        import functools

        stage = functools.partial(engine.stage, directory=eng.directory)
        for staged in cpio.read_ranks([str(tmp_path / "logs")], stage, columns=report.REPORT_COLUMNS, workers=2):
            eng.add(staged)
        pre = eng.results()
    assert pre.calls > 1_000_000
    assert int(pre.ranks["rank"].iloc[0]) == 3  # the straggler: the longest late
    held = pre.step_arrivals.groupby("rank")["held_us"].median()
    assert int(held.idxmax()) == 3 and held[3] > 300  # it issues every call 400 us late


def _ranks_and_rows(df):
    return sorted(set(df["rank"].tolist())), len(df)


@pytest.mark.parametrize("workers", [1, 2])
def test_ranks_read_in_batches_give_what_ranks_read_alone_give(tmp_path, workers):
    """``read_ranks(batch_bytes=...)``: the same rows, ranks and notes as one rank per task, in fewer
    tasks; a file holding several ranks' rows (a merged CSV) sends its batch back to one rank per
    task (its rows may repeat another task's file: the job checks see it before the transform)."""
    import warnings

    paths = write_rank_files(str(tmp_path), 8, steps=5)
    with open(paths[6], "a") as out, open(paths[7]) as src:
        out.writelines(src.readlines()[1:])  # rank6.csv holds ranks 6 and 7
    os.remove(paths[7])
    seen = []
    for batch in (0, 1 << 30, 3 * max(os.path.getsize(p) for p in paths[:6])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(cpio.read_ranks([str(tmp_path)], _ranks_and_rows, workers=workers, batch_bytes=batch))
        ranks = sorted(r for rs, _ in got for r in rs)
        seen.append((got, ranks, sum(n for _, n in got), sorted(str(w.message) for w in caught)))
    assert seen[0][1] == list(range(8)) and seen[0][0][-1][0] == [6, 7]
    for got in seen[1:]:
        assert got[1:] == seen[0][1:]
    assert [r for r, _ in seen[0][0]] == [[0], [1], [2], [3], [4], [5], [6, 7]]  # one rank per task
    assert [r for r, _ in seen[1][0]] == [[0], [1], [2], [3], [4], [5], [6, 7]]  # its batch: back to that
    assert [r for r, _ in seen[2][0]][:2] == [[0, 1, 2], [3, 4, 5]]  # other batches: one frame each


@pytest.mark.parametrize("engine_name", ["pandas", "duckdb"])
def test_each_host_converts_its_ranks_and_the_report_reads_their_directories(tmp_path, engine_name, capsys):
    """The logs of a job on several hosts: each host converts its own ranks to a rank-partitioned
    Parquet dataset where they are (``commpatch convert --to parquet``); the report reads the list of
    the hosts' directories, or a glob over them, as the whole job (the same findings as the binary
    logs in one directory); a host whose directory is missing is named by its ranks."""
    import shutil

    import commpatch

    whole = tmp_path / "whole"
    write_binary_run(str(whole), 8, 400, straggler=5, mismatch=(2, 7))
    for host, ranks in (("node0", range(4)), ("node1", range(4, 8))):
        (tmp_path / host).mkdir()
        for r in ranks:
            shutil.copy(whole / f"rank{r}.cplog", tmp_path / host)
        assert main(["convert", str(tmp_path / host), "--to", "parquet", "--no-progress"]) == 0
        assert sorted(os.listdir(tmp_path / host / "parquet")) == [f"rank={r}" for r in ranks]
    capsys.readouterr()

    def findings(*paths):
        with commpatch.open(list(map(str, paths)), engine=engine_name) as run:
            report = run.to_dict()
        return [f["kind"] for f in report["findings"]], report

    want, report = findings(whole)
    assert report["headline"]["straggler"]["rank"] == 5
    for paths in ([tmp_path / "node0" / "parquet", tmp_path / "node1" / "parquet"], [tmp_path / "node*" / "parquet"]):
        got, other = findings(*paths)
        assert got == want and other["headline"]["straggler"] == report["headline"]["straggler"]
        assert other["sections"]["mismatches"] == report["sections"]["mismatches"]
    got, other = findings(tmp_path / "node0" / "parquet")  # node1's directory not given
    missing = [f for f in other["findings"] if f["kind"] == "missing_logs"]
    assert missing and missing[0]["text"].startswith("no log for rank(s) 4-7 of this job")


def test_quantiles_from_a_sort_equal_the_quantile_states(tmp_path):
    """When the summary's quantile states do not fit the engine's memory (164 M durations in a few
    groups at 16,384 ranks x 10,000 rows: out of memory within 2 GB), the engine takes p50 / p95
    from a sort of the durations, which spills: the same figures as ``quantile_cont``, group by group."""
    import functools

    write_binary_run(str(tmp_path / "logs"), 16, 4000, straggler=3)
    with engine.Engine() as eng:
        stage = functools.partial(engine.stage, directory=eng.directory)
        for staged in cpio.read_ranks([str(tmp_path / "logs")], stage, columns=report.REPORT_COLUMNS):
            eng.add(staged)
        want = eng.summary(["op", "size_bucket"])
        raw = eng._df(
            "SELECT op AS _k0, CASE WHEN bytes > 0 THEN (2.0 ^ ceil(log2(bytes)))::BIGINT ELSE 0 END AS _k1,"
            " quantile_cont(dur, [0.5, 0.95]) AS _q FROM rows GROUP BY ALL ORDER BY ALL"
        )
        cols = '"op" AS _k0, CASE WHEN bytes > 0 THEN (2.0 ^ ceil(log2(bytes)))::BIGINT ELSE 0 END AS _k1'
        got = eng._sorted_quantiles(raw, ["_k0", "_k1"], cols, "rows", "true")
    assert len(want) == len(raw) > 3
    for q, expected in zip(got, raw["_q"]):
        np.testing.assert_allclose(q, list(expected), rtol=1e-12)
