"""Live Prometheus metrics: the settings, the missing extra, a real Prometheus server scraping a
real running 2-rank gloo job (its totals equal the log's), the node-exporter text files, and the
Grafana dashboard naming only metrics that exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from commpatch import config
from commpatch.metrics import METRICS, PREFIX
from tests.test_watch import ROOT, finish, start_job, wait_done

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="the metrics extra (prometheus-client) is not installed"
)

PORTS = range(33200, 33990, 10)  # this test file's share of the task's ports


@pytest.mark.parametrize("value", ["abc", "70000", "0x10", ":8000", "host:"])
def test_a_bad_port_is_one_line_naming_the_setting(value):
    with pytest.raises(config.ConfigError) as err:
        config.resolve(environ={"COMMPATCH_METRICS_PORT": value})
    message = str(err.value)
    assert "\n" not in message and "COMMPATCH_METRICS_PORT" in message and "HOST:PORT" in message


def test_port_and_file_values():
    got = config.resolve(
        environ={"COMMPATCH_METRICS_PORT": "127.0.0.1:9400", "COMMPATCH_METRICS_FILE": "/m/r{rank}.prom"}
    )
    assert got["metrics_port"] == ("127.0.0.1", 9400) and got["metrics_file"] == "/m/r{rank}.prom"
    assert config.resolve(environ={"COMMPATCH_METRICS_PORT": "9400"})["metrics_port"] == ("0.0.0.0", 9400)
    assert config.resolve(environ={})["metrics_port"] is None and config.resolve(environ={})["metrics_file"] == ""
    for bad in ("/m/r{rank}.txt", "/m/r{host}.prom"):
        with pytest.raises(config.ConfigError, match="COMMPATCH_METRICS_FILE"):
            config.resolve(environ={"COMMPATCH_METRICS_FILE": bad})


@pytest.mark.parametrize("env", ["COMMPATCH_METRICS_PORT", "COMMPATCH_METRICS_FILE"])
def test_without_the_extra_the_setting_names_it(env):
    """prometheus-client not importable (as without `pip install 'commpatch[metrics]'`): one warning
    naming the setting and the extra, through the COMMPATCH=1 activation path, and the job runs
    (a monitoring setting never stops a job: issue 33)."""
    value = "33100" if env.endswith("PORT") else "/tmp/x{rank}.prom"
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import torch.distributed as dist\n"
        "import commpatch._bootstrap\n"
        "import torch.distributed.distributed_c10d\n"
        "print('the job ran')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, COMMPATCH="1", **{env: value}),
    )
    said = [ln for ln in out.stderr.splitlines() if env in ln]
    assert out.returncode == 0 and out.stdout == "the job ran\n", out
    assert len(said) == 1 and said[0].endswith(
        f"RuntimeWarning: commpatch: {env}={value!r} needs the prometheus-client package: pip install "
        "'commpatch[metrics]'; the job runs without it"
    ), out.stderr


def test_grafana_dashboard_names_only_metrics_that_exist():
    """Every commpatch_* name in the dashboard's queries is one the exporter serves (a counter's
    _total, a histogram's _bucket / _sum / _count, a gauge's name)."""
    served = set()
    for name, (kind, _) in METRICS.items():
        full = PREFIX + name
        served |= (
            {full + "_total"}
            if kind == "counter"
            else {full + s for s in ("_bucket", "_sum", "_count")}
            if kind == "histogram"
            else {full}
        )
    with open(os.path.join(ROOT, "contrib", "grafana", "commpatch.json")) as f:
        dashboard = json.load(f)
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    used = {m for q in queries for m in re.findall(r"\bcommpatch_[a-z_]+", q)}
    assert used and used <= served, sorted(used - served)
    panel_names = {
        m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"commpatch_[a-z_]+", t["expr"])
    }
    # every metric shows up somewhere on the dashboard
    assert {PREFIX + n for n in METRICS} <= {re.sub(r"_(total|bucket|sum|count)$", "", m) for m in panel_names}


def _free_ports(n):
    """``n`` consecutive free ports of this file's range on 127.0.0.1 (the base)."""
    for base in PORTS:
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip("no free ports in 33200-33990")


def _query(api, expr):
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _by(results, *labels):
    return {tuple(r["metric"].get(lab, "") for lab in labels): float(r["value"][1]) for r in results}


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the Prometheus server is not installed (Debian package prometheus, ci/apt-packages.txt)",
)
def test_a_real_prometheus_scrapes_a_running_2_rank_job_and_its_totals_equal_the_log(tmp_path, monkeypatch):
    import commpatch

    tmp = str(tmp_path)
    base = _free_ports(3)  # rank 0, rank 1 (port + local rank), Prometheus itself
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\nscrape_configs:\n"
        "  - job_name: train\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{base}', '127.0.0.1:{base + 1}']\n"
    )
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp}/tsdb",
            f"--web.listen-address=127.0.0.1:{base + 2}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(tmp, "prometheus.log"), "w"),
    )
    api = f"http://127.0.0.1:{base + 2}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # as torchrun sets it; the log directory is another name
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    procs = []
    try:
        procs, logs, release = start_job(
            tmp,
            steps=20,
            sleep=0.05,
            hold=120,
            metrics_port=f"127.0.0.1:{base}",
            metrics_file=os.path.join(tmp, "metrics", "rank{rank}.prom"),
        )
        wait_done(tmp, procs)
        time.sleep(1.0)  # the flusher's last passes: every row and duration on disk
        df = commpatch.read_csv(logs)
        expected = {
            (str(r), str(c)): (int(len(g)), int(g["bytes"].sum()))
            for (r, c), g in df.groupby(["rank", "collective"], observed=True)
        }
        assert {c for _, c in expected} >= {"all_reduce", "broadcast", "all_gather", "barrier"}
        assert df["duration_us"].notna().all()
        # the job waits; Prometheus scrapes it until its totals are those of the log (or 60 s)
        deadline, calls, nbytes = time.monotonic() + 60, {}, {}
        while time.monotonic() < deadline:
            try:
                calls = _by(_query(api, "sum by (rank, collective) (commpatch_calls_total)"), "rank", "collective")
                nbytes = _by(_query(api, "sum by (rank, collective) (commpatch_bytes_total)"), "rank", "collective")
            except OSError:
                pass  # the server is still starting
            try:
                steps = _by(_query(api, "commpatch_step"), "rank")
            except OSError:
                steps = {}
            # the step figures are computed every 2 s: they may lag the counters by a pass
            if calls == {k: v[0] for k, v in expected.items()} and steps == {("0",): 19.0, ("1",): 19.0}:
                break
            time.sleep(0.5)
        assert calls == {k: float(v[0]) for k, v in expected.items()}, (calls, expected)
        assert nbytes == {k: float(v[1]) for k, v in expected.items()}
        measured = _by(
            _query(api, "sum by (rank, collective) (commpatch_duration_seconds_count)"), "rank", "collective"
        )
        assert measured == calls  # every call of this job has a duration
        seconds = _by(_query(api, "sum by (rank, collective) (commpatch_duration_seconds_sum)"), "rank", "collective")
        for (rank, coll), total in seconds.items():
            mine = df[(df["rank"] == int(rank)) & (df["collective"] == coll)]
            assert total == pytest.approx(mine["duration_us"].sum() / 1e6, rel=1e-6)
        # the labels: who and where, 'job' left to Prometheus (its scrape job)
        series = _query(api, "commpatch_calls_total")
        assert {s["metric"]["job"] for s in series} == {"train"}
        assert {s["metric"]["host"] for s in series} == {socket.gethostname().split(".")[0]}
        # the launcher's run id and the log's run directory, both: a series leads to its files
        assert {(s["metric"]["run"], s["metric"]["run_dir"]) for s in series} == {("job-7", "logs")}
        assert {s["metric"]["phase"] for s in series} == {"other"} and {s["metric"]["group"] for s in series} == {"0"}
        steps = _by(_query(api, "commpatch_step"), "rank")
        assert steps == {("0",): 19.0, ("1",): 19.0}
        shares = _query(api, "commpatch_comm_share")
        assert len(shares) == 2 and all(0 < float(s["value"][1]) <= 1 for s in shares)
        assert _by(_query(api, "commpatch_inflight_calls"), "rank") == {("0",): 0.0, ("1",): 0.0}
        names = set(json.load(urllib.request.urlopen(f"{api}/api/v1/label/__name__/values", timeout=5))["data"])
        for name, (kind, _) in METRICS.items():
            assert PREFIX + name + {"counter": "_total", "histogram": "_count", "gauge": ""}[kind] in names, name
        finish(procs, release)
        # node-exporter's text files, written at exit: the same totals
        from prometheus_client.parser import text_string_to_metric_families

        for rank in (0, 1):
            with open(os.path.join(tmp, "metrics", f"rank{rank}.prom")) as f:
                families = {fam.name: fam for fam in text_string_to_metric_families(f.read())}
            got = {}
            for sample in families["commpatch_calls"].samples:
                key = (sample.labels["rank"], sample.labels["collective"])
                got[key] = got.get(key, 0) + sample.value
            assert got == {k: v[0] for k, v in expected.items() if k[0] == str(rank)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.terminate()
        server.wait(timeout=20)


def _scrape(port):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("commpatch_inflight")
    }


def _inflight_worker(rank, world_size, base, out_dir):
    """Rank 0 issues an async all_reduce that rank 1 joins only 3 s later: rank 0's own endpoint,
    scraped meanwhile, shows one call in flight for over a second; afterwards none."""
    import torch
    import torch.distributed as dist

    import commpatch

    os.environ["LOCAL_RANK"] = str(rank)
    commpatch.enable(output=os.path.join(out_dir, "rank{rank}.csv"), metrics_port=f"127.0.0.1:{base}")
    t = torch.ones(8)
    dist.all_reduce(t)  # the rank's first row: its labels are known from here on
    if rank == 1:
        time.sleep(3.0)
        dist.all_reduce(t, async_op=True).wait()
        return None
    work = dist.all_reduce(t, async_op=True)
    time.sleep(1.5)
    during = _scrape(base + rank)
    work.wait()
    deadline = time.monotonic() + 10
    after = _scrape(base + rank)
    while after.get("commpatch_inflight_calls") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _scrape(base + rank)
    return during, after


@pytest.mark.slow
def test_the_hang_alarm_shows_the_age_of_a_call_in_flight(tmp_path):
    from tests.multiproc import run_ranks

    base = _free_ports(2)
    during, after = run_ranks(_inflight_worker, 2, timeout=120, base=base, out_dir=str(tmp_path))[0]
    assert during["commpatch_inflight_calls"] == 1
    assert 1.0 <= during["commpatch_inflight_oldest_seconds"] < 60
    assert after["commpatch_inflight_calls"] == 0 and after["commpatch_inflight_oldest_seconds"] == 0


def test_label_values_are_bounded():
    """40 process groups and 12 dtypes: 16 group names and 8 dtypes keep their name, the rest
    are counted as 'other' (the counts are all kept)."""
    import types

    import numpy as np

    from commpatch.data.frame import Cat
    from commpatch.metrics import MAX_DTYPES, MAX_GROUPS, Exporter

    log = types.SimpleNamespace(pending={}, sink=None, take_observed=lambda: [])
    exporter = Exporter(log)
    exporter.who = ("0", "host", "run", "run_dir")
    n = 480
    rng = np.arange(n)
    cols = {
        "seq": rng,
        "collective": Cat(np.zeros(n, np.int8), ["all_reduce"]),
        "group": Cat(rng % 40, [f"g{i}" for i in range(40)]),
        "phase": Cat(np.zeros(n, np.int8), ["other"]),
        "dtype": Cat(rng % 12, [f"d{i}" for i in range(12)]),
        "bytes": np.full(n, 4),
        "duration_us": np.full(n, 10.0),
        "own_us": np.full(n, 10.0),
        "busbw_gbps": np.full(n, 1.0),
    }
    exporter._count(cols)
    groups = {key[1] for key in exporter.counts}
    dtypes = {key[3] for key in exporter.counts}
    assert len(groups) == MAX_GROUPS + 1 and "other" in groups
    assert len(dtypes) == MAX_DTYPES + 1 and "other" in dtypes
    assert sum(v[0] for v in exporter.counts.values()) == n
    assert sum(v[1] for v in exporter.counts.values()) == 4 * n


def test_a_taken_port_is_a_warning_and_the_job_runs_on(monkeypatch):
    import types

    from commpatch.metrics import Exporter

    base = _free_ports(1)
    taken = socket.socket()
    taken.bind(("127.0.0.1", base))
    taken.listen(1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    said = []
    try:
        exporter = Exporter(
            types.SimpleNamespace(pending={}, sink=None, take_observed=lambda: []),
            ("127.0.0.1", base),
            warn=said.append,
        )
    finally:
        taken.close()
    assert exporter.server is None and exporter.address is None
    assert len(said) == 1 and f"metrics not served on 127.0.0.1:{base}" in said[0] and "the job runs on" in said[0]


# ---- the endpoint: /metrics only, bounded connections, bad settings never stop a job (issue 33) ----
def _exporter(monkeypatch):
    """An exporter of an empty log serving on a port the OS picks (127.0.0.1)."""
    import types

    from commpatch.metrics import Exporter

    monkeypatch.setenv("LOCAL_RANK", "0")
    exporter = Exporter(types.SimpleNamespace(pending={}, sink=None, take_observed=lambda: []), ("127.0.0.1", 0))
    assert exporter.server is not None and exporter.address[1] > 0
    return exporter


def _get(port, path):
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_only_the_metrics_path_is_served(monkeypatch):
    exporter = _exporter(monkeypatch)
    port = exporter.address[1]
    try:
        code, text = _get(port, "/metrics")
        assert code == 200 and "# TYPE commpatch_calls_total counter" in text
        assert _get(port, "/metrics?name[]=commpatch_calls")[0] == 200
        for path in ("/", "/foo", "/metrics/", "/metrics/x", "/index.html", "/metricsx"):
            code, text = _get(port, path)
            assert (code, text) == (404, "commpatch serves /metrics only\n"), path
    finally:
        exporter.close()


def test_idle_connections_do_not_grow_the_threads(monkeypatch):
    """500 connections that send nothing: at most MAX_CONNECTIONS threads serve them (the rest are
    closed at once; before, one thread each: 500 threads); once they go, a scrape is answered."""
    import threading

    exporter = _exporter(monkeypatch)
    port = exporter.address[1]
    before = threading.active_count()
    idle = []
    try:
        for _ in range(500):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(1.0)  # the server has accepted them all
        during = threading.active_count()
        assert during - before <= 8, (before, during)
    finally:
        for s in idle:
            s.close()
    deadline, code = time.monotonic() + 30, None
    while code != 200 and time.monotonic() < deadline:
        try:
            code = _get(port, "/metrics")[0]
        except OSError:
            time.sleep(0.2)
    exporter.close()
    assert code == 200


BAD_SETTING_JOB = """
import os, sys
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
t = torch.ones(4)
for _ in range(5):
    dist.all_reduce(t)
dist.destroy_process_group()
print("the job ran")
"""


@pytest.mark.parametrize(
    "env, value, allowed",
    [
        ("COMMPATCH_METRICS_PORT", "abc", "must be a port 1-65535 or HOST:PORT"),
        ("COMMPATCH_METRICS_PORT", "host:", "must be a port 1-65535 or HOST:PORT"),
        ("COMMPATCH_METRICS_FILE", "TMP/m{host}.prom", "only the fields {run}, {rank} and {pid}"),
        ("COMMPATCH_METRICS_FILE", "TMP/metrics.prom", "has no {rank} in a 2-rank job"),
    ],
)
def test_a_bad_monitoring_setting_warns_once_and_the_job_runs(tmp_path, env, value, allowed):
    """A real 2-rank gloo job activated by COMMPATCH=1 with a malformed metrics setting: each rank
    says it once, in one line naming the variable and what is allowed, runs to the end (exit 0)
    and records its rows; no metrics (before: exit status 2 before the job started)."""
    script = tmp_path / "job.py"
    script.write_text(BAD_SETTING_JOB)
    value = value.replace("TMP", str(tmp_path))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "store")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(
                os.environ,
                COMMPATCH="1",
                COMMPATCH_OUTPUT=str(tmp_path / "logs" / "rank{rank}.csv"),
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                **{env: value},
            ),
        )
        for rank in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out == "the job ran\n", err[-2000:]
        said = [ln for ln in err.splitlines() if env in ln]
        assert len(said) == 1 and allowed in said[0] and said[0].endswith("; the job runs without it"), err
        assert "Traceback" not in err
    import commpatch

    df = commpatch.read_csv(str(tmp_path / "logs"))
    assert sorted(df["rank"].unique().tolist()) == [0, 1] and (df["op"] == "all_reduce").sum() == 10
    assert not list(tmp_path.glob("*.prom"))  # no metrics: the setting is off
