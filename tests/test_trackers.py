"""The report's figures in experiment trackers: a real MLflow tracking server (``mlflow server``, its
own process, read back through MLflow's client) and Weights & Biases in offline mode (read back from
the run's ``.wandb`` file); what each holds is the report's own steps table and headline, an unknown
figure left out (never 0); a tracker missing or refusing is one line."""

import glob
import json
import math
import os
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import commpatch
from commpatch import cli
from commpatch.render import trackers
from commpatch.testing import make_log

from .multiproc import free_port


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-rank run whose step 5 has no duration at all: its communication figures are unknown."""
    df = make_log(2, 12)
    df.loc[df["step"] == 5, ["duration_us", "own_us"]] = np.nan
    df["timing"] = df["timing"].astype(str).where(df["step"] != 5, "none")
    out = tmp_path_factory.mktemp("logs") / "job-7"
    out.mkdir()
    for rank, frame in df.groupby("rank", observed=True):
        commpatch.export_csv(str(out / f"rank{rank}.csv"), df=frame.reset_index(drop=True))
    return str(out)


def _report(run_dir, capsys, *extra):
    code = cli.main(["report", run_dir, "--format", "json", "--no-progress", *extra])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else None), out.err


def _expected(rep):
    """{metric: {step: value}} the report's steps table says, unknown values left out."""
    want: dict = {}
    for row in rep["sections"]["steps"]:
        for name, (column, scale) in trackers.STEP_METRICS.items():
            if row.get(column) is not None:
                want.setdefault(trackers.STEP + name, {})[row["step"]] = row[column] * scale
    return want


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow")
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port(35400, 35500)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{home}/db.sqlite",
            "--default-artifact-root",
            str(home / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(home / "server.log", "wb"),
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, (home / "server.log").read_text()[-2000:]
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow  # a real MLflow server started: `make test-slow`
def test_mlflow_holds_the_reports_steps_and_headline(run_dir, capsys, mlflow_server):
    """``report --mlflow URI``: a new, finished run named after the log's run directory, whose metric
    histories are the report's steps table (the step: the job's) and whose run metrics and tags are
    its headline; step 5, with no duration, has no communication point (unknown, not 0)."""
    from mlflow import MlflowClient

    code, rep, err = _report(run_dir, capsys, "--mlflow", mlflow_server, "--mlflow-experiment", "tests")
    assert code == 0, err
    assert f"logged to MLflow at {mlflow_server}: experiment tests, run " in err, err
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "job-7" and runs[0].info.status == "FINISHED", runs
    run = runs[0]
    want = _expected(rep)
    assert 5 not in want[trackers.STEP + "comm_share"] and 5 in want[trackers.STEP + "time_ms"], want
    for name, points in want.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert got.keys() == points.keys(), (name, got, points)
        assert all(math.isclose(got[s], v, rel_tol=1e-9) for s, v in points.items()), (name, got, points)
    h = rep["headline"]
    assert math.isclose(run.data.metrics[trackers.RUN + "step_p50_ms"], h["step_us"] * 1e-3, rel_tol=1e-9)
    assert math.isclose(run.data.metrics[trackers.RUN + "exposed_share"], h["exposed_share"], rel_tol=1e-9)
    assert run.data.tags[trackers.PREFIX + "straggler"] == h["straggler"]["verdict"]
    assert run.data.tags[trackers.PREFIX + "hang"] == h["hang"]["verdict"]


def test_an_unreachable_tracking_server_is_one_line(run_dir, capsys, monkeypatch):
    """A tracking server that does not answer: the report is printed, then one line naming the
    option and the URI, exit 2, no traceback."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://127.0.0.1:{free_port(35500, 35600)}"
    code, rep, err = _report(run_dir, capsys, "--mlflow", uri)
    lines = [line for line in err.splitlines() if line.startswith("commpatch report: --mlflow")]
    assert code == 2 and rep is not None and "Traceback" not in err, err
    assert len(lines) == 1 and f"--mlflow {uri}: could not log (" in lines[0], err


def test_a_missing_tracker_names_its_extra(run_dir, capsys, monkeypatch):
    """Without the tracker's package: one line naming the extra to install, before anything is read."""
    from commpatch import offline

    monkeypatch.setitem(offline.TRACKERS, "wandb", "wandb_is_not_installed_here")
    code, rep, err = _report(run_dir, capsys, "--wandb", "proj")
    assert code == 2 and rep is None, err
    assert "--wandb needs the wandb_is_not_installed_here package: pip install 'commpatch[wandb]'" in err, err


def _wandb_records(path):
    """The records of a ``.wandb`` file, parsed with W&B's own protobuf (``wandb_internal_pb2.Record``).
    W&B 0.31 has no Python reader of its files any more (its Go core reads them), so the framing is
    read here: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB-log blocks of 32 KiB,
    each record a 7-byte header (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    records, pos, parts = [], 7, b""
    block = 32 * 1024
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def _wandb_run(path):
    """((project, name), {step: {key: value}}, summary) of the ``.wandb`` file at ``path``: the run record
    as None where the file has none (each test asserts on it)."""
    history, summary, run = {}, {}, None
    records = _wandb_records(path)
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = (record.run.project, record.run.display_name)
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            history[int(items.pop("_step"))] = items
        elif kind == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.summary.update})
    assert records and records[-1].WhichOneof("record_type") == "exit", (
        path,
        [r.WhichOneof("record_type") for r in records],
    )
    return run, history, summary


@pytest.mark.slow  # wandb's offline run and its reader: `make test-slow`
def test_wandb_offline_run_holds_the_reports_steps_and_headline(run_dir, capsys, monkeypatch, tmp_path):
    """``report --wandb PROJECT`` with ``WANDB_MODE=offline``: the run's history is the report's steps
    table (W&B's step: the job's), its summary the headline; step 5 has no communication value."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, rep, err = _report(run_dir, capsys, "--wandb", "commpatch-tests")
    assert code == 0, err
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert f"logged to Weights & Biases: {os.path.dirname(path)}" in err, err
    run, history, summary = _wandb_run(path)
    assert run == ("commpatch-tests", "job-7"), run
    history = {s: {k: v for k, v in items.items() if k.startswith(trackers.PREFIX)} for s, items in history.items()}
    want = _expected(rep)
    got = {name: {s: v[name] for s, v in history.items() if name in v} for name in want}
    assert got.keys() == want.keys() and all(got[n].keys() == want[n].keys() for n in want), (got, want)
    assert all(math.isclose(got[n][s], want[n][s], rel_tol=1e-9) for n in want for s in want[n])
    assert 5 in history and trackers.STEP + "comm_share" not in history[5], history[5]
    h = rep["headline"]
    assert math.isclose(summary[trackers.RUN + "step_p50_ms"], h["step_us"] * 1e-3, rel_tol=1e-9)
    assert summary[trackers.PREFIX + "straggler"] == h["straggler"]["verdict"], summary


@pytest.mark.slow  # wandb's offline runs and their reader: `make test-slow`
def test_wandb_logging_beside_the_callers_own_run_leaves_that_run_alone(run_dir, monkeypatch, tmp_path):
    """``Run.log_wandb`` in a process whose own W&B run is active (``wandb.init()``: W&B's global run): the
    report is a run of its own, written out whole; the caller's run stays the global one, unfinished,
    logs on after it and holds none of commpatch's figures."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    mine = wandb.init(project="mine", name="training")
    try:
        mine.log({"loss": 1.0}, step=0)
        where = commpatch.open(run_dir).log_wandb("commpatch-tests")
        assert wandb.run is mine
        mine.log({"loss": 0.5}, step=1)  # W&B refuses to log to a finished run
    finally:
        mine.finish()
    wandb.teardown()  # the caller's run written out (W&B's atexit hook does this at the process's exit)
    runs = {}
    for path in glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")):
        run, history, _ = _wandb_run(path)
        runs[run] = (os.path.dirname(path), history)
    assert runs.keys() == {("mine", "training"), ("commpatch-tests", "job-7")}, runs.keys()
    assert runs[("commpatch-tests", "job-7")][0] == where
    ours = runs[("commpatch-tests", "job-7")][1]
    assert any(k.startswith(trackers.PREFIX) for items in ours.values() for k in items), ours
    theirs = runs[("mine", "training")][1]
    assert {s: items["loss"] for s, items in theirs.items()} == {0: 1.0, 1: 0.5}, theirs
    assert not any(k.startswith(trackers.PREFIX) for items in theirs.values() for k in items), theirs
