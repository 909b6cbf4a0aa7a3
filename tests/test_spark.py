"""The report on Apache Spark (``--engine spark``) equals the DuckDB engine's, key by key (every
section, finding, headline and advice of ``Run.to_dict()``), on a 64-rank run with a straggler, a
size mismatch and a hang, the ranks read and staged by Spark's executors: in local mode, and on a real standalone cluster (a master and two
workers, each its own JVM process on 127.0.0.1, started and stopped here). The dialect rewrite is
checked on its own, and a missing PySpark is named in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest

import commpatch
from commpatch import cli
from commpatch.analysis import engine, spark
from commpatch.testing import write_binary_run
from tests.test_engine_parity import differences

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_spark = pytest.mark.skipif(
    not (spark.available() and engine.available() and shutil.which("java")),
    reason="needs pyspark (commpatch[spark]), duckdb and Java (ci/apt-packages.txt)",
)


def test_the_duckdb_forms_are_rewritten_for_spark():
    sql = """SELECT "group" AS g, arg_max(rank, (start_ns::HUGEINT * 1048576 + rank)) AS s,
             arg_max_null(r.rel, x) AS o, arg_min(stage, rank) AS st, quantile_cont(dur, [0.5, 0.95]) AS _q,
             sum(CASE WHEN isfinite(least(a, (b))) THEN 1 END), (-max({'c': coalesce(c, '-infinity'::DOUBLE), 'r': -rank}).r),
             (i * 4 // 7) FROM rows WHERE name = 'a {b}: [c]'"""
    got = spark.to_spark(sql)
    assert "SELECT `group` AS g, max_by(rank, (start_ns::DECIMAL(38, 0) * 1048576 + rank)) AS s" in got
    assert "max_by(r.rel, x) AS o, min_by(stage, rank) AS st, percentile(dur, array(0.5, 0.95)) AS _q" in got
    assert "WHEN (NOT isnan(least(a, (b))) AND abs(least(a, (b))) < double('inf')) THEN" in got
    assert "(-max(named_struct('c', coalesce(c, '-infinity'::DOUBLE), 'r', -rank)).r)" in got
    assert "(i * 4  div  7)" in got and "WHERE name = 'a {b}: [c]'" in got  # a literal is left alone
    assert "arg_m" not in got and "isfinite" not in got and '"' not in got


def test_a_missing_pyspark_or_java_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    write_binary_run(str(tmp_path), 2, 40)
    monkeypatch.setattr(spark, "available", lambda: False)
    assert cli.main(["report", str(tmp_path), "--engine", "spark"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"commpatch report: --engine spark: PySpark is not installed: {spark.INSTALL}", err
    monkeypatch.setattr(spark, "available", lambda: True)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))
    assert cli.main(["report", str(tmp_path), "--engine", "spark"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--engine spark: no Java found (PySpark runs on Java 17 or newer): install it or set JAVA_HOME")
    with pytest.raises(commpatch.ConfigError, match="spark_master / spark_dir"):
        commpatch.open(str(tmp_path), engine="pandas", spark_master="local[1]")


def test_a_bad_master_url_or_a_jvm_that_does_not_start_is_one_line(tmp_path, capsys):
    write_binary_run(str(tmp_path / "run"), 2, 40)
    assert cli.main(["report", str(tmp_path / "run"), "--engine", "spark", "--spark-master", "local[2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"commpatch report: spark_master (--spark-master) 'local[2': not a Spark master URL ({spark.MASTERS})"
    for good in ("local", "local[*]", "local[4]", "spark://a:7077,b:7077", "yarn", "k8s://https://h:443"):
        spark.check_master(good)
    # a Java that exits at once (a real process, as a broken JVM does): its last words in the one line
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\necho 'Error: this JVM refuses to start' >&2\nexit 1\n")
    java.chmod(0o755)
    env = dict(os.environ, JAVA_HOME=str(tmp_path / "jdk"), COMMPATCH_OUTPUT="none")
    done = subprocess.run(
        [sys.executable, "-m", "commpatch", "report", str(tmp_path / "run"), "--engine", "spark"],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("commpatch report: the Spark engine failed ([JAVA_GATEWAY_EXITED]"), lines
    assert "Java: Error: this JVM refuses to start" in lines[0] and "Traceback" not in done.stderr


def _reports(path, **spark_options) -> tuple[dict, dict]:
    out = []
    for name, options in (("duckdb", {}), ("spark", spark_options)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with commpatch.open(path, engine=name, **options) as run:
                assert run.engine == name
                out.append(run.to_dict())
    return out[0], out[1]


def _assert_same_findings(path, **spark_options) -> dict:
    duck, sp = _reports(path, **spark_options)
    assert differences(duck, sp) == []
    first = sp["findings"][0]["text"]
    assert first.startswith("hang: ranks 0-8 10-63 wait in all_reduce #") and "rank 9 never issued it" in first, first
    assert sp["headline"]["straggler"]["rank"] == 5
    assert [(m["kind"], m["detail"]) for m in sp["sections"]["mismatches"]] == [
        ("bytes", "4096 on rank(s) 8,9,10,12,13,14,15; 8192 on rank(s) 11")
    ]
    assert {"hang", "mismatch", "straggler"} <= {f["kind"] for f in sp["findings"]}
    return sp


@pytest.fixture(scope="module")
def run64(tmp_path_factory):
    path = tmp_path_factory.mktemp("spark64")
    write_binary_run(str(path), 64, 200, straggler=5, straggler_delay_us=3000.0, mismatch=(11, 7), hang=9)
    return str(path)


@needs_spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spark_in_local_mode_gives_the_duckdb_report(run64, tmp_path, monkeypatch):
    staged = tmp_path / "staged"
    staged.mkdir()
    writers = set()
    close = spark.SparkEngine.close

    def close_and_see(self):  # the staged files' names say which process wrote them (engine.stage)
        rows = os.path.join(self.directory, "rows")
        writers.update(int(name.split("-")[1]) for name in os.listdir(rows))
        close(self)

    monkeypatch.setattr(spark.SparkEngine, "close", close_and_see)
    _assert_same_findings(run64, spark_master="local[2]", spark_dir=str(staged))
    assert writers and os.getpid() not in writers  # read and staged by Spark's Python workers
    assert os.listdir(staged) == []  # the staged ranks are removed with the run


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while chosen: no port given twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture
def standalone_cluster(tmp_path):
    """A Spark standalone master and two workers (1 core, 1 GB each) on 127.0.0.1, as separate
    processes; their URL; all stopped afterwards."""
    import pyspark

    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    port, ui, *worker_ui = _free_ports(4)
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(tmp_path), SPARK_NO_DAEMONIZE="1")
    procs = []

    def start(*args, log):
        with open(tmp_path / log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [spark_class, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    url = f"spark://127.0.0.1:{port}"
    start(
        "org.apache.spark.deploy.master.Master",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--webui-port",
        str(ui),
        log="master.log",
    )
    try:
        for i in (1, 2):
            start(
                "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                "--webui-port", str(worker_ui[i - 1]), "--work-dir", str(tmp_path / f"work{i}"), log=f"worker{i}.log",
            )  # fmt: skip
        deadline, alive = time.monotonic() + 120, 0
        while time.monotonic() < deadline and alive < 2:
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
                    alive = sum(w["state"] == "ALIVE" for w in json.load(r)["workers"])
            except OSError:
                pass
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log")}
        assert alive == 2, logs
        yield url, ui
    finally:
        try:
            spark.stop()  # the application first, while its master is there to hear of it
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


@needs_spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spark_on_a_standalone_cluster_gives_the_duckdb_report(run64, standalone_cluster):
    url, ui = standalone_cluster
    _assert_same_findings(run64, spark_master=url)
    with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
        apps = json.load(r)
    ran = apps["activeapps"] + apps["completedapps"]
    assert [a["name"] for a in ran] == ["commpatch report"], ran  # the queries ran on the cluster's executors


@needs_spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_unreachable_master_is_named_in_one_line(run64, capsys):
    """No master at that address: Spark's client gives up after its retries (~1 min), and the
    report says so in one line, with Spark's own reason."""
    (port,) = _free_ports(1)
    try:
        assert cli.main(["report", run64, "--engine", "spark", "--spark-master", f"spark://127.0.0.1:{port}"]) == 2
    finally:
        spark.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("commpatch report: the Spark engine failed ("), err
    assert "All masters are unresponsive! Giving up." in err[0], err
