"""The report's figures on a real DDP job (2 gloo ranks): the same whatever output asks for them
(text, JSON, with or without --trace, --compare, the DuckDB engine, the Python API): issue 23."""

import json
import math

import pytest

import commpatch
from commpatch import analysis, cli
from commpatch.analysis.findings import _pct
from commpatch.render import text as report

from .analysis_workers import ddp_job
from .multiproc import run_ranks


@pytest.fixture(scope="module")
def ddp_logs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp"))
    run_ranks(ddp_job, 2, timeout=180, out=out, steps=12)
    return out


def run_cli(capsys, *argv):
    code = cli.main(["report", *argv, "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _steady(ddp_logs):
    df = analysis.with_pattern_steps(commpatch.read_csv(ddp_logs))
    return analysis.per_step(df, by_rank=False)


def test_report_columns_are_what_the_analyses_read(ddp_logs):
    """A report of the columns ``commpatch report`` loads (no --trace) equals one of every column."""
    full = commpatch.read_csv(ddp_logs)
    assert full["pack_us"].notna().any() and full["sync_end_us"].notna().any()  # DDP's packing, finalize measured
    a = report.build_report(full)
    b = report.build_report(full[list(analysis.REPORT_COLUMNS)])
    assert [f.text for f in a.findings] == [f.text for f in b.findings]
    assert [x.as_dict() for x in a.advice] == [x.as_dict() for x in b.advice]
    for key, frame in a.sections.items():
        assert frame.to_json() == b.sections[key].to_json(), key


def test_shares_identical_across_outputs(ddp_logs, capsys, tmp_path):
    table = _steady(ddp_logs)
    st = analysis.steady_state(table)
    assert st["steps"] >= 8 and st["ddp_pack_us"] > 0 and st["ddp_finalize_us"] > 0
    sentence = (
        f"communication is in flight {_pct(st['comm_share'])} of it and the training thread waits for it "
        f"{_pct(st['exposed_share'])} of it"
    )
    texts = [run_cli(capsys, ddp_logs), run_cli(capsys, ddp_logs, "--trace", str(tmp_path / "t.json"))]
    for text in texts:
        text = " ".join(text.split())  # sentences wrapped to 120 columns
        assert sentence in text and "DDP's packing of gradients into its buckets" in text
    assert texts[0] == texts[1]
    from commpatch.analysis import engine as duckdb_engine

    engines = ["pandas"] + (["duckdb"] if duckdb_engine.available() else [])
    for engine in engines:
        for extra in ((), ("--trace", str(tmp_path / f"{engine}.json.gz"))):
            data = json.loads(run_cli(capsys, ddp_logs, "--format", "json", "--engine", engine, *extra))
            steps = data["sections"]["steps"]
            assert [s["step"] for s in steps] == table["step"].tolist()
            for col in ("busy_us", "exposed_us", "ddp_pack_us", "ddp_finalize_us", "comm_share", "exposed_share"):
                got = [s[col] for s in steps]
                want = table[col].tolist()
                assert all(
                    (g is None and math.isnan(w)) or math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-9)
                    for g, w in zip(got, want)
                ), (engine, extra, col)
            assert any(sentence in f["text"] for f in data["findings"]), (engine, extra)
    scaling = json.loads(run_cli(capsys, "--compare", ddp_logs, "--format", "json"))["scaling"][0]
    assert math.isclose(scaling["comm_share"], st["comm_share"], rel_tol=1e-9)
    assert math.isclose(scaling["exposed_share"], st["exposed_share"], rel_tol=1e-9)
