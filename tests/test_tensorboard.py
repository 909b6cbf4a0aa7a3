"""`commpatch report --tensorboard OUTDIR`: per rank and step, the report's own figures, read back
with TensorBoard's event reader."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_watch import ROOT, finish, start_job, wait_done

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")


@pytest.fixture(scope="module")
def run_logs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("tbjob"))
    procs, logs, release = start_job(tmp, steps=12, sleep=0.02)
    wait_done(tmp, procs)
    finish(procs, release)
    return logs


def _report(*args):
    return subprocess.run(
        [sys.executable, "-m", "commpatch", "report", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_scalars_are_the_reports_figures_per_rank_and_step(run_logs, tmp_path):
    import commpatch
    from commpatch import analysis

    out = tmp_path / "tb"
    done = _report(run_logs, "--tensorboard", str(out))
    assert done.returncode == 0, done.stderr
    assert f"TensorBoard scalars written to {out} (2 rank(s)" in done.stderr
    df = analysis.with_transfer(analysis.with_pattern_steps(commpatch.read_csv(run_logs)))
    table = analysis.per_step(df)
    bw = analysis.summary(df, by=["rank", "step", "collective"])
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]
    for rank in (0, 1):
        got = _scalars(str(out / f"rank{rank}"))
        mine = table[table["rank"] == rank].set_index("step")
        timed = mine[mine["step_us"].notna()]
        assert len(timed) == 11  # 12 steps: the last has no next one to time it
        assert sorted(got["step/time_ms"]) == timed.index.tolist()
        for step, row in timed.iterrows():
            assert got["step/time_ms"][step] == pytest.approx(row["step_us"] / 1e3, rel=1e-6)
            assert got["step/comm_share"][step] == pytest.approx(row["comm_share"], rel=1e-6)
            assert got["step/exposed_share"][step] == pytest.approx(row["exposed_share"], rel=1e-6)
        assert 0 < max(got["step/comm_share"].values()) <= 1
        for coll in ("all_reduce", "broadcast", "all_gather"):
            expected = (
                bw[(bw["rank"] == rank) & (bw["collective"] == coll)]
                .set_index("step")["busbw_gbps"]
                .dropna()
                .sort_index()
            )
            assert len(expected) == 12
            series = got[f"busbw_gbps/{coll}"]
            assert sorted(series) == expected.index.tolist()
            assert np.allclose([series[s] for s in expected.index], expected.to_numpy(), rtol=1e-6)
        assert "busbw_gbps/barrier" not in got  # no bytes: no bandwidth, not 0


def test_tensorboard_refuses_a_directory_of_earlier_events(run_logs, tmp_path):
    out = tmp_path / "tb"
    assert _report(run_logs, "--tensorboard", str(out)).returncode == 0
    again = _report(run_logs, "--tensorboard", str(out))
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds TensorBoard events" in lines[0] and again.stdout == ""


def test_tensorboard_without_the_extra_names_it(run_logs, tmp_path):
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from commpatch.cli import main\n"
        f"sys.exit(main(['report', {run_logs!r}, '--tensorboard', {str(tmp_path / 'tb')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "commpatch report: --tensorboard needs the tensorboard package: pip install 'commpatch[tensorboard]'"
    )
    assert not (tmp_path / "tb").exists()


def test_tensorboard_with_compare_is_refused_in_one_line(run_logs, tmp_path):
    done = _report("--compare", run_logs, run_logs, "--tensorboard", str(tmp_path / "tb"))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "commpatch report: --tensorboard writes one run's steps: give the run without --compare"
    )


def test_tensorboard_points_are_written_in_step_order_per_tag(tmp_path):
    """The bus-bandwidth points were written in the summary's order (by time, not step): TensorBoard's
    server read a lower step as a restart and kept 6 of 1,115 points (issue 32)."""
    import glob

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from commpatch.render.tensorboard import write_tensorboard
    from commpatch.testing import make_log

    df = make_log(2, 30, jitter_us=400.0)
    write_tensorboard(df, str(tmp_path))
    for rank in (0, 1):
        (path,) = glob.glob(str(tmp_path / f"rank{rank}" / "events.out.tfevents.*"))
        steps: dict = {}
        for event in EventFileLoader(path).Load():  # in the file's order
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
        busbw = [tag for tag in steps if tag.startswith("busbw_gbps/")]
        assert len(busbw) == 4 and all(len(steps[tag]) == 30 for tag in busbw)
        for tag, seen in steps.items():
            assert seen == sorted(seen) and len(set(seen)) == len(seen), (tag, seen)
