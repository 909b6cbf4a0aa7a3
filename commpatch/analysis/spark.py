"""The cross-rank report on Apache Spark: the DuckDB engine's SQL, run by Spark over the same staged
Parquet files, for logs past one machine's time budget.

``SparkEngine`` is ``engine.Engine`` with another connection: each rank is reduced and staged as for
DuckDB (``engine.stage``: integer columns, its per-step view, its point-to-point calls), into a
directory every Spark executor can read (a shared file system on a cluster); Spark's SQL then
computes the summary, the match of every collective, stragglers, mismatches, hangs and the rows the
advice reads, and the report is built from them as from DuckDB's (``tests/test_spark.py`` compares
the two reports key by key, in local mode and on a standalone cluster).

What differs is the dialect: ``to_spark`` rewrites the few DuckDB forms the engine's queries use
(double-quoted names, ``arg_max``, ``quantile_cont``, ``isfinite``, struct literals, ``//``,
``HUGEINT``), and the connection (``_Connection``) turns ``CREATE TABLE ... AS`` into a view of a
checkpointed result and pandas frames into views. Spark's ANSI mode is off, as DuckDB's arithmetic
(a division by zero is NULL)."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import warnings
from typing import Any

from .engine import Engine

INSTALL = "pip install 'commpatch[spark]' (PySpark 4, with Java 17 or newer)"


def available() -> bool:
    """PySpark is installed (``pip install 'commpatch[spark]'``)."""
    return importlib.util.find_spec("pyspark") is not None


def java() -> str | None:
    """The Java that PySpark starts (``$JAVA_HOME/bin/java``, else ``java`` on the PATH), or None."""
    home = os.environ.get("JAVA_HOME")
    if home:
        path = os.path.join(home, "bin", "java")
        return path if os.access(path, os.X_OK) else None
    return shutil.which("java")


# ---- the dialect ------------------------------------------------------------------------------
_NAME = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"')
_CALLS = {"arg_max_null(": "max_by(", "arg_max(": "max_by(", "arg_min(": "min_by(", "quantile_cont(": "percentile("}
_CALL = re.compile(r"\b(" + "|".join(re.escape(k) for k in _CALLS) + ")")
_CREATE = re.compile(r"^\s*CREATE\s+OR\s+REPLACE\s+(?:TEMP\s+)?TABLE\s+(\w+)\s+AS\s+(.*)$", re.S | re.I)
_DROP = re.compile(r"^\s*DROP\s+TABLE\s+IF\s+EXISTS\s+(\w+)\s*$", re.I)


def _closing(sql: str, start: int, open_: str = "(", close: str = ")") -> int:
    """The index of the bracket that closes the one at ``start`` (brackets in string literals skipped)."""
    depth, quoted = 0, False
    for i in range(start, len(sql)):
        c = sql[i]
        if c == "'":
            quoted = not quoted
        elif not quoted and c == open_:
            depth += 1
        elif not quoted and c == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_}{close} in: {sql[start : start + 80]}")


def _top_level_split(text: str, sep: str = ",") -> list[str]:
    parts, depth, quoted, last = [], 0, False, 0
    for i, c in enumerate(text):
        if c == "'":
            quoted = not quoted
        elif not quoted and c in "([{":
            depth += 1
        elif not quoted and c in ")]}":
            depth -= 1
        elif not quoted and depth == 0 and c == sep:
            parts.append(text[last:i])
            last = i + 1
    return parts + [text[last:]]


def _isfinite(sql: str) -> str:
    """``isfinite(x)`` -> ``(NOT isnan(x) AND abs(x) < double('inf'))`` (NULL stays NULL)."""
    while (at := sql.find("isfinite(")) >= 0:
        end = _closing(sql, at + len("isfinite"))
        x = _isfinite(sql[at + len("isfinite(") : end])
        sql = f"{sql[:at]}(NOT isnan({x}) AND abs({x}) < double('inf')){sql[end + 1 :]}"
    return sql


def _structs(sql: str) -> str:
    """``{'a': x, 'b': y}`` -> ``named_struct('a', x, 'b', y)``."""
    while (at := sql.find("{'")) >= 0:
        end = _closing(sql, at, "{", "}")
        fields = []
        for item in _top_level_split(_structs(sql[at + 1 : end])):
            key, _, value = item.strip().partition(":")
            fields += [key.strip(), value.strip()]
        sql = f"{sql[:at]}named_struct({', '.join(fields)}){sql[end + 1 :]}"
    return sql


def _lists(sql: str) -> str:
    """``percentile(x, [a, b])`` -> ``percentile(x, array(a, b))``."""
    return re.sub(r"\[([0-9.,\s]+)\]", r"array(\1)", sql)


def to_spark(sql: str) -> str:
    """The engine's DuckDB SQL in Spark SQL's dialect."""
    sql = _NAME.sub(r"`\1`", sql)
    sql = _CALL.sub(lambda m: _CALLS[m.group(1)], sql)
    sql = _lists(_structs(_isfinite(sql)))
    return sql.replace("HUGEINT", "DECIMAL(38, 0)").replace("//", " div ")


# ---- the session and its connection -----------------------------------------------------------
_LOG_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark_log4j2.properties")
_LOG: list = []  # [the file the JVM's console goes to, its size when the current session began]
_SESSIONS: dict = {}  # master URL -> SparkSession (one JVM per process: a session is reused)


def session(master: str | None = None):
    """A Spark session on ``master`` (default: ``local[*]``, every core of this machine). Spark's
    JVM writes its console (start-up notices, warnings) to a file of its own, removed at exit:
    its errors reach the report as the queries' exceptions."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    # PySpark 4 warns on each result that it does not "fully support" pandas 3: its Arrow path, which
    # the engine takes, gives the frames the parity tests compare (tests/test_spark.py)
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    master = master or "local[*]"
    got = _SESSIONS.get(master)
    if got is not None and not got.sparkContext._jsc.sc().isStopped():
        return got
    stop()  # one SparkContext per process
    conf = SparkConf().setMaster(master).setAppName("commpatch report")
    for key, value in (
        ("spark.ui.enabled", "false"),
        ("spark.ui.showConsoleProgress", "false"),
        ("spark.sql.ansi.enabled", "false"),  # DuckDB's arithmetic: x / 0 is NULL
        ("spark.sql.execution.arrow.pyspark.enabled", "true"),
        ("spark.sql.session.timeZone", "UTC"),
        ("spark.log.structuredLogging.enabled", "false"),
        ("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{_LOG_CONFIG}"),
        # the executors' Python, which reads and stages the ranks: this one, unless PYSPARK_PYTHON says
        ("spark.pyspark.python", os.environ.get("PYSPARK_PYTHON") or sys.executable),
    ):
        conf.set(key, value)
    if master.startswith("local"):
        conf.set("spark.sql.shuffle.partitions", str(max(2, 2 * (os.cpu_count() or 1))))
    gateway = None
    if SparkContext._gateway is None:  # the JVM, once per process
        log = tempfile.NamedTemporaryFile(prefix="commpatch-spark-", suffix=".log", delete=False)
        atexit.register(_remove, log.name)
        _LOG[:] = [log.name, 0]
        gateway = launch_gateway(conf, popen_kwargs={"stdout": log, "stderr": log})
        log.close()
    if _LOG:
        with contextlib.suppress(OSError):
            _LOG[1] = os.path.getsize(_LOG[0])
    context = SparkContext(conf=conf, gateway=gateway)
    context.setLogLevel("ERROR")
    spark = SparkSession(context)
    _SESSIONS[master] = spark
    return spark


MASTERS = "local, local[N], local[*], spark://HOST:PORT, yarn or k8s://https://HOST:PORT"
_MASTER = re.compile(
    r"^(local(\[(\*|[1-9][0-9]*)(, *[0-9]+)?\])?|spark://[^\s/]+(:[0-9]+)?(,[^\s/]+(:[0-9]+)?)*|yarn|k8s://\S+)$"
)


def check_master(master: str | None) -> None:
    """Raise ValueError naming what is allowed when ``master`` is no Spark master URL."""
    if master is not None and not _MASTER.match(master):
        raise ValueError(f"{master!r}: not a Spark master URL ({MASTERS})")


def _why(exc: BaseException) -> str:
    """One line of why Spark failed: its message, and the JVM's last error in its console's file
    (e.g. "All masters are unresponsive! Giving up."), which the exception may not carry."""
    text = " ".join(str(exc).split("\n\tat ")[0].split())[:200]
    said = []
    if _LOG:
        with contextlib.suppress(OSError), open(_LOG[0], errors="replace") as f:
            f.seek(_LOG[1])  # what the JVM said since this session began
            said = [
                line.strip()
                for line in f
                if line.strip() and not line.startswith(("WARNING", "\t", " ")) and "spark-class: line" not in line
            ]  # (spark-class's own complaint when the launcher it runs with Java failed: not the cause)
    errors = [line for line in said if line.startswith("spark: ERROR")]
    if errors:  # the first: what follows is the shutdown it caused (listeners failing, ...)
        text = f"{text}; Spark: {errors[0].split(': ', 2)[-1]}"
    elif said and "JAVA_GATEWAY_EXITED" in text:  # the JVM did not start: what it printed last
        text = f"{text}; Java: {said[-1]}"
    return text[:400]


def stop() -> None:
    """Stop the Spark session this process holds, if any (its JVM stays, for the next one)."""
    for spark in list(_SESSIONS.values()):
        spark.stop()
    _SESSIONS.clear()


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


class _Result:
    def __init__(self, frame) -> None:
        self.frame = frame

    def df(self):
        import pandas as pd

        out = self.frame.toPandas()
        for column in out.columns:  # strings as DuckDB gives them (object), not pandas' string dtype
            if isinstance(out[column].dtype, pd.StringDtype):
                out[column] = out[column].astype(object).where(out[column].notna(), None)
        return out

    def fetchone(self):
        rows = self.frame.take(1)
        return tuple(rows[0]) if rows else None


class _Connection:
    """What ``Engine`` calls on a DuckDB connection (``execute``, ``register``, ``unregister``,
    ``close``), on a Spark session: tables are temporary views of checkpointed results."""

    def __init__(self, spark) -> None:
        self.spark = spark
        self.views: dict[str, Any] = {}

    def execute(self, sql: str, params=None):
        made = _CREATE.match(sql)
        if made:
            name, select = made.groups()
            frame = self.spark.sql(to_spark(select), args=list(params or ())).localCheckpoint(eager=True)
            self._view(name, frame)
            return _Result(frame)
        dropped = _DROP.match(sql)
        if dropped:
            self.unregister(dropped.group(1))
            return None
        return _Result(self.spark.sql(to_spark(sql), args=list(params or ())))

    def register(self, name: str, frame) -> None:
        import pyarrow as pa

        table = pa.Table.from_pandas(frame, preserve_index=False)
        # a column of an empty frame's objects has no type: strings
        table = table.cast(
            pa.schema([pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in table.schema])
        )
        self._view(name, self.spark.createDataFrame(table))

    def read_parquet(self, name: str, directory: str) -> None:
        self._view(name, self.spark.read.parquet(directory))

    def _view(self, name: str, frame) -> None:
        self.unregister(name)
        frame.createOrReplaceTempView(name)
        self.views[name] = frame

    def unregister(self, name: str) -> None:
        frame = self.views.pop(name, None)
        if frame is not None:
            self.spark.catalog.dropTempView(name)
            frame.unpersist()

    def close(self) -> None:
        for name in list(self.views):
            self.unregister(name)


class SparkEngine(Engine):
    """``engine.Engine`` on Apache Spark (``master``: a Spark master URL, default ``local[*]``). The
    staged Parquet files go under ``temp_dir`` (default: the system's temporary directory): on a
    cluster, give a directory of a file system every executor reads at the same path."""

    # Spark has no ASOF join: the reach of the group's members that covers the collective, by its range
    _REACH_JOIN = "JOIN _reach e ON c.g = e.g AND c.cseq >= e.lo AND c.cseq < e.hi"

    def __init__(self, by=("collective", "size_bucket"), master: str | None = None, temp_dir: str | None = None):
        super().__init__(by=by, temp_dir=temp_dir)
        self.master = master

    @staticmethod
    def _errors() -> tuple:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException

        return (PySparkException, Py4JError)

    @staticmethod
    def _out_of_memory() -> tuple:
        return ()  # Spark spills its sorts and shuffles; an executor out of memory fails the query

    def run_tasks(self, tasks, run):
        """``io.read_ranks``' tasks (batches of ranks to read and stage) on Spark's executors, one
        Spark task each: the ranks are read and staged where Spark runs (each executor reads the
        logs and writes the staged files at the paths the driver sees: a shared file system on a
        cluster); what ``stage`` returns comes back to the driver, in order."""
        if not tasks:
            return iter(())
        return iter(
            self._guard(lambda: session(self.master).sparkContext.parallelize(tasks, len(tasks)).map(run).collect())
        )

    _message = staticmethod(_why)

    def _open(self):
        return _Connection(session(self.master))

    def _parquet_view(self, name: str, directory: str) -> None:
        self.con.read_parquet(name, directory)
