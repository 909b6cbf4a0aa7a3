"""Renderers, the `commpatch report` command and its outputs: text / Markdown / JSON / CSV,
the Chrome trace (loaded back), the CommDebugMode module tree, plots and the scaling view."""

import gzip
import json

import pandas as pd
import pytest

import commpatch
from commpatch import cli
from commpatch.render import text as report
from commpatch.render import trace
from commpatch.testing import make_log, write_rank_files


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs")
    write_rank_files(str(out), 4, 5, p2p=True, straggler=1, mismatch=(3, 12))
    return str(out)


def run_cli(capsys, *argv):
    code = cli.main(["report", *map(str, argv), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def report_title(out: str) -> str:
    """The text report's title, its wrapped lines joined (the lines above its '===' underline)."""
    lines = out.splitlines()
    return " ".join(lines[: next(i for i, line in enumerate(lines) if line.startswith("==="))])


def block(out: str, heading: str) -> list:
    """The items ('- ...', wrapped lines joined) of a block of the text report ('Findings:', 'Notes:')."""
    lines = out.splitlines()
    items: list = []
    for line in lines[lines.index(heading) + 1 :]:
        if not line.strip():
            break
        if line.startswith("- "):
            items.append(line[2:])
        else:
            items[-1] += " " + line.strip()
    return items


def test_text_report_has_every_section_and_the_error(logs, capsys):
    code, out, _ = run_cli(capsys, logs)
    assert code == 0
    lines = out.splitlines()
    assert lines[2] == "Headline:"  # the key figures first, then the error and the findings, each naming its table
    assert lines.index("Findings:") < 12
    found = block(out, "Findings:")
    assert found[0].startswith("ERROR: bytes mismatch in group 0 at collective #13 (step 2, broadcast)")
    assert any(
        f.startswith("rank 1 arrived last in 25 of 25 collectives")
        and "straggler" in f
        and f.endswith("[table: ranks]")
        for f in found
    )
    assert any("steady-state step: median" in f and "exposed" in f for f in found)
    for title in (
        "Per collective and message size",
        "Per step",
        "stragglers first",
        "largest arrival skew",
        "Point-to-point channels",
        "Notes:",
    ):
        assert title in out
    assert "<= 4.19 MB" in out and "MiB" not in out  # size buckets in the bytes column's units
    assert max(map(len, lines)) <= 120  # for people: fits 120 columns
    wide = run_cli(capsys, logs, "--wide")[1]  # every column of every table
    assert " busbw_with_wait_gbps " in wide and " busbw_with_wait_gbps " not in out  # a column of --wide only
    assert "0.00104" in wide and " 0.000 " not in wide  # small bandwidths keep their digits
    assert run_cli(capsys, logs, "--fail-on-mismatch")[0] == 1


@pytest.mark.parametrize("fmt", ["markdown", "json"])
def test_markdown_and_json(logs, capsys, fmt):
    code, out, _ = run_cli(capsys, logs, "--format", fmt)
    assert code == 0
    if fmt == "json":
        rep = json.loads(out)
        assert set(rep["sections"]) == {"summary", "steps", "mismatches", "ranks", "rank_steps", "skew", "p2p"}
        assert rep["sections"]["ranks"][0]["rank"] == 1
        assert len(rep["errors"]) == 1 and rep["sections"]["mismatches"][0]["coll_seq"] == 12
        assert list(rep)[:2] == ["title", "findings"]
        assert {f["kind"] for f in rep["findings"]} >= {"steps", "overhead", "setup", "mismatch", "straggler"}
        assert all(f["section"] in rep["sections"] for f in rep["findings"])
    else:
        assert out.startswith("# commpatch report: 140 calls, 4 rank(s) 0-3\n\n## Headline\n\n- **step time**: ")
        assert "\n\n## Findings\n\n- ERROR: bytes mismatch" in out
        assert "| collective | size_bucket |" in out


def test_csv_sections(logs, capsys):
    code, out, _ = run_cli(capsys, logs, "--format", "csv")
    assert code == 0 and out.splitlines()[0].startswith("collective,size_bucket,count,per_rank,total_us")
    code, out, _ = run_cli(capsys, logs, "--format", "csv", "--section", "ranks", "--by", "op")
    assert out.splitlines()[1].split(",")[0] == "1"
    code, _, err = run_cli(capsys, logs, "--format", "csv", "--section", "nope")
    assert code == 2 and "available" in err


def test_single_rank_report_says_no_cross_rank(logs, capsys):
    code, out, _ = run_cli(capsys, f"{logs}/rank0.csv", "--by", "op")
    assert code == 0 and "one rank only" in out and "stragglers first" not in out


def test_steps_file(logs, capsys, tmp_path):
    steps = tmp_path / "steps.csv"
    pd.DataFrame({"step": range(5), "duration_us": [50_000.0] * 5}).to_csv(steps, index=False)
    code, out, _ = run_cli(capsys, logs, "--format", "json", "--steps", str(steps))
    per_step = json.loads(out)["sections"]["steps"]
    assert code == 0 and {s["step_time_from"] for s in per_step} == {"user"}
    assert all(s["step_us"] == 50_000.0 for s in per_step)


def test_trace_loads_back_with_one_event_per_row(logs, capsys, tmp_path):
    from commpatch import io as cpio

    df = cpio.read(logs)
    for name in ("trace.json", "trace.json.gz"):
        path = tmp_path / name
        assert run_cli(capsys, logs, "--trace", str(path))[0] == 0
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        events = data["traceEvents"]
        slices = [e for e in events if e["ph"] == "X"]
        assert len(slices) == len(df)
        assert {e["pid"] for e in slices} == {0, 1, 2, 3}
        names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
        assert names == {(r, f"rank {r}") for r in range(4)}
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
        assert sorted(e["args"]["seq"] for e in slices if e["pid"] == 2) == sorted(df.loc[df["rank"] == 2, "seq"])
    # every track nests: no two slices of one (pid, tid) overlap (sends and receives share a moment)
    for _, part in pd.DataFrame(slices).groupby(["pid", "tid"]):
        part = part.sort_values("ts")
        assert (part["ts"].iloc[1:].to_numpy() >= (part["ts"] + part["dur"]).iloc[:-1].to_numpy() - 1e-6).all()


def test_module_tree_in_commdebugmode_form(tmp_path):
    df = make_log(2, 2)
    with pytest.raises(ValueError, match="module"):
        trace.module_tree(df.drop(columns="module"))
    n = len(df)
    df["module"] = pd.Categorical(["net.layer1" if i % 2 else "net.layer2.attn" for i in range(n)])
    df["phase"] = pd.Categorical(["backward" if i % 4 == 0 else "forward" for i in range(n)])
    tree = trace.module_tree(df)
    keys = {
        "fqn",
        "module_type",
        "parameters",
        "children",
        "collectives_forward",
        "collectives_backward",
        "operations_forward",
        "operations_backward",
        "operations_checkpointing",
    }
    assert keys <= set(tree) and tree["fqn"] == "Global"
    net = tree["children"][0]
    assert net["fqn"] == "net" and [c["fqn"] for c in net["children"]] == ["net.layer1", "net.layer2"]
    assert net["children"][1]["children"][0]["fqn"] == "net.layer2.attn"
    counts = lambda node, k: sum(c for _, c in node[f"collectives_{k}"])  # noqa: E731
    assert counts(tree, "forward") + counts(tree, "backward") == n  # inclusive at the root
    assert counts(tree, "backward") == len(range(0, n, 4))
    assert tree["commpatch"]["bytes"] == df["bytes"].sum()
    assert tree["commpatch"]["total_us"] == pytest.approx(df["duration_us"].sum())
    path = trace.write_module_tree(df, str(tmp_path / "tree.json"))
    assert json.load(open(path))["fqn"] == "Global"


def test_plots_are_written(logs, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(capsys, logs, "--plots", str(tmp_path / "plots"))
    assert code == 0
    for name in ("bandwidth_vs_size.png", "comm_per_step.png", "skew_heatmap.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert name in err


def test_comm_per_step_keeps_its_legend_off_the_data_and_both_share_lines_visible():
    """Issue 36: the legend sat on the data (upper left, over the bars and the share lines), and the
    exposed-share line hid the communication-share line where they coincide (every wait exposed).
    Here they coincide at 90-95% of each step: the legend is outside the axes, and the drawing has
    both the red of the exposed line and the grey of the wide communication line under it."""
    pytest.importorskip("matplotlib")
    import numpy as np

    from commpatch.render import plots

    n = 12
    share = np.linspace(0.9, 0.95, n)
    steps = pd.DataFrame(
        dict(
            step=np.arange(n),
            stage=["setup"] + ["steady"] * (n - 1),
            exposed_us=np.full(n, 9000.0),
            overlapped_us=np.full(n, 500.0),
            comm_share=share,
            exposed_share=share,
        )
    )
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plots.comm_per_step(steps)
    FigureCanvasAgg(fig).draw()
    (ax, _) = fig.axes
    (legend,) = fig.legends
    box, frame = legend.get_window_extent(), ax.get_window_extent()
    assert box.y1 <= frame.y0 or box.y0 >= frame.y1, (box, frame)  # above or below the axes, not on them
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    inside = pixels[int(fig.bbox.height - frame.y1) : int(fig.bbox.height - frame.y0), int(frame.x0) : int(frame.x1)]
    red = (inside[..., 0] > 90) & (inside[..., 0] < 170) & (inside[..., 1] < 50) & (inside[..., 2] < 50)  # maroon
    grey = (abs(inside[..., 0] - inside[..., 1]) < 8) & (abs(inside[..., 1] - inside[..., 2]) < 8)
    grey &= (inside[..., 0] > 100) & (inside[..., 0] < 170)
    top_rows = slice(0, inside.shape[0] // 4)  # the share lines at 90-95%: the top of the axes, above the bars
    assert red[top_rows].sum() > 50 and grey[top_rows].sum() > 200, (red[top_rows].sum(), grey[top_rows].sum())


def test_compare_runs(capsys, tmp_path):
    runs = []
    for n in (2, 4, 8):
        runs.append(str(tmp_path / f"w{n}"))
        write_rank_files(runs[-1], n, 5)
    code, out, _ = run_cli(capsys, "--compare", *runs, "--format", "json", "--global-batch", "32")
    data = json.loads(out)
    assert code == 0 and [r["world_size"] for r in data["scaling"]] == [2, 4, 8]
    assert [r["steps"] for r in data["scaling"]] == [3, 3, 3]  # set-up and the untimed last step left out
    assert {"efficiency", "speedup", "steps_per_s", "samples_per_s", "exposed_share"} <= set(data["scaling"][0])
    assert data["scaling"][0]["efficiency"] == 1.0
    assert {r["collective"] for r in data["by_op"]} >= {"all_reduce", "broadcast"}
    code, out, _ = run_cli(capsys, "--compare", *runs, "--scaling", "strong")
    assert "commpatch scaling" in out and "strong scaling" in out
    assert run_cli(capsys, "--compare", *runs, "--global-batch", "0")[0] == 2
    flat = tmp_path / "flat"  # a run whose log has no step boundary, too short for a pattern of 3 iterations
    flat.mkdir()
    for rank, part in make_log(2, 2).assign(step=0).groupby("rank"):
        commpatch.export_csv(str(flat / f"rank{rank}.csv"), df=part.reset_index(drop=True))
    flat = str(flat)
    code, out, err = run_cli(capsys, "--compare", runs[0], flat)
    assert code == 0 and f"--compare {flat}: no steady-state step" in err
    assert "warning: no step boundary" in err and "no clear repeating pattern of collectives" in err
    if pytest.importorskip("matplotlib"):
        assert run_cli(capsys, "--compare", *runs, "--plots", str(tmp_path / "p"))[0] == 0
        assert (tmp_path / "p" / "scaling.png").stat().st_size > 5000
        from commpatch import analysis
        from commpatch.render import plots

        logs = {r: commpatch.read_csv(r) for r in runs}
        fig = plots.scaling(analysis.scaling(logs), analysis.scaling_by_op(logs))
        assert all(list(ax.get_xticks()) == [2, 4, 8] for ax in fig.axes)  # integer world sizes only


def test_render_text_truncates_long_tables():
    rep = report.build_report(make_log(2, 30))
    text = report.render_report_text(rep, max_rows=5)
    assert "... 25 more row(s)" in text


def test_latest_run_is_the_one_that_started_last(tmp_path, capsys):
    """Issue 23.10: 'latest run' is the run's own start time (its logs' headers), not the directory's
    time of change: converting an old run does not make it the latest; the first line names it."""
    import os

    from commpatch.testing import write_binary_run

    old, new = tmp_path / "zz-old", tmp_path / "aa-new"  # names in the other order
    for run, created in ((old, b"1763800000000000000"), (new, b"1763800009000000000")):
        write_binary_run(str(run), 2, 200, straggler=None, mismatch=None)
        for log in run.glob("*.cplog"):
            data = log.read_bytes()
            assert data.count(b'"created_ns":1763800000000000000') == 1
            log.write_bytes(data.replace(b'"created_ns":1763800000000000000', b'"created_ns":' + created))
    assert cli.main(["convert", str(old), "--no-progress"]) == 0  # writes CSVs into the old run
    os.utime(old)
    capsys.readouterr()
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 0 and report_title(out).startswith(
        f"commpatch report: run aa-new (the latest of 2 in {tmp_path}; 1 other(s)): 400 calls"
    ), report_title(out)
    assert "reading the latest, aa-new; the other run(s): zz-old" in err
    one = tmp_path / "one"
    write_binary_run(str(one / "r1"), 2, 100, straggler=None, mismatch=None)
    assert report_title(run_cli(capsys, str(one))[1]).startswith(f"commpatch report: run r1 (the only one in {one}): ")
    # the run directory itself, or its files: no run named
    assert run_cli(capsys, str(one / "r1"))[1].splitlines()[0].startswith("commpatch report: 200 calls")


def test_trace_marks_each_rank_s_step_starts(logs, capsys, tmp_path):
    """Step markers: one instant event 'step N' per rank and step, at the rank's first call of the
    step, on a 'steps' track of its own."""
    from commpatch import io as cpio

    df = cpio.read(logs)
    path = tmp_path / "trace.json"
    assert run_cli(capsys, logs, "--trace", str(path))[0] == 0
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    marks = [e for e in events if e["ph"] == "i" and e.get("cat") == "step"]
    assert len(marks) == df.groupby(["rank", "step"]).ngroups == 4 * 5
    origin = data["otherData"]["origin_unix_ns"]
    first = df.groupby(["rank", "step"])["start_ns"].min()
    for e in marks:
        assert e["name"] == f"step {e['args']['step']}" and e["s"] == "t"
        assert abs(e["ts"] - (first[(e["pid"], e["args"]["step"])] - origin) / 1e3) < 1e-3
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {tracks[(e["pid"], e["tid"])] for e in marks} == {"steps"}
    slices = [e for e in events if e["ph"] == "X"]
    assert not {(e["pid"], e["tid"]) for e in slices} & {(e["pid"], e["tid"]) for e in marks}


@pytest.mark.parametrize("engine", ["pandas", "duckdb"])
def test_a_forgotten_host_is_named_first(tmp_path, capsys, engine):
    """Issue 33: a real 2-rank job whose rank-1 log is moved away (the other host's directory not
    given): the report says first which rank of the world has no log, and the straggler line says
    why it is unknown, with either engine (before: '1 rank(s)', 'straggler: unknown (one rank)')."""
    from tests.clock_workers import exchange_job
    from tests.multiproc import run_ranks

    run_ranks(exchange_job, 2, timeout=120, out=str(tmp_path), seconds=0.5)
    host_b = tmp_path / "hostB"
    host_b.mkdir()
    moved = [p for p in tmp_path.iterdir() if p.is_file() and p.name.startswith("rank1.")]
    assert moved, sorted(p.name for p in tmp_path.iterdir())
    for p in moved:
        p.rename(host_b / p.name)
    code, out, err = run_cli(capsys, tmp_path, "--engine", engine, "--format", "json")
    assert code == 0, err
    rep = json.loads(out)
    first = rep["findings"][0]
    assert first["kind"] == "missing_logs" and first["text"].startswith("no log for rank(s) 1 of this job"), first
    assert rep["headline"]["missing_logs"] == [1]
    code, out, err = run_cli(capsys, tmp_path, "--engine", engine)
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.strip().startswith("straggler:")]
    assert "no log for rank(s) 1" in line, line
    findings = block(out, "Findings:")
    assert findings[0].startswith("no log for rank(s) 1 of this job"), findings[:2]
