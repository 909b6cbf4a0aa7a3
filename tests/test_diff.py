"""``commpatch diff`` and ``commpatch check`` on real gloo DDP jobs (issue 36): two runs with
different ``bucket_cap_mb``, a run against itself, a run with one slow collective."""

import json
import os
import subprocess
import sys

import pytest

from commpatch.analysis.diff import change

from .diff_workers import ddp_jobs
from .multiproc import run_ranks

pytestmark = pytest.mark.slow


def _cli(*args):
    res = subprocess.run([sys.executable, "-m", "commpatch", *args], capture_output=True, text=True, timeout=180)
    return res.returncode, res.stdout, res.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    jobs = dict(
        plain=dict(bucket_cap_mb=25.0),
        small=dict(bucket_cap_mb=0.3),  # 6 buckets of one layer each instead of 2
        slow=dict(bucket_cap_mb=25.0, slow_ms=15.0),  # rank 1 late by 15 ms at the loss all_reduce
    )
    for name, job in jobs.items():
        job["out"] = str(root / name)
    run_ranks(ddp_jobs, 2, timeout=240, jobs=list(jobs.values()))
    return {name: job["out"] for name, job in jobs.items()}


def test_a_run_against_itself_changes_nothing(runs):
    code, out, err = _cli("diff", runs["plain"], runs["plain"], "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    assert d["steps_a"] == d["steps_b"] >= 20
    figures = d["steps"] + [c[k] for c in d["collectives"] for k in ("calls", "bytes", "time_us")]
    assert figures and all(f["significant"] is False and f["change"] == 0 for f in figures), figures
    assert d["only_a"] == d["only_b"] == []
    code, out, _ = _cli("check", runs["plain"], "--baseline", runs["plain"], "--max-regression", "5%")
    assert code == 0 and "FAILED" not in out, out


def test_another_bucket_size_shows_in_the_calls_and_sizes(runs):
    code, out, err = _cli("diff", runs["plain"], runs["small"], "--format", "json")
    assert code == 0, err
    d = json.loads(out)

    def gradients(side):  # the gradient buckets' all_reduce calls and bytes per step (not the 4-byte loss)
        both = [(c["calls"][side], c["bytes"][side]) for c in d["collectives"] if c["collective"] == "all_reduce"]
        only = [(c["calls"], c["bytes"]) for c in d[f"only_{side}"] if c["collective"] == "all_reduce"]
        grads = [(n, b) for n, b in both + only if b > 4 * n]
        return sum(n for n, _ in grads), sum(b for _, b in grads)

    (calls_a, bytes_a), (calls_b, bytes_b) = gradients("a"), gradients("b")
    assert calls_b >= 3 * calls_a >= 3, (calls_a, calls_b)  # 2 buckets of 25 MB cap (the first 1 MiB), 6 of 0.3
    assert bytes_b == pytest.approx(bytes_a, rel=0.01)  # the same gradients, in other buckets
    assert any(c["collective"] == "all_reduce" for c in d["only_b"]), d["only_b"]  # sizes only the small cap makes
    code, text, _ = _cli("diff", runs["plain"], runs["small"])
    assert "- only in B: all_reduce <= " in text and " calls, " in text, text


def test_one_slow_collective_is_found_and_fails_the_gate(runs):
    code, out, err = _cli("diff", runs["plain"], runs["slow"], "--format", "json")
    assert code == 0, err
    d = json.loads(out)
    (loss,) = [c for c in d["collectives"] if c["collective"] == "all_reduce" and c["size_bucket"] == 4]
    t = loss["time_us"]
    # rank 0 waits ~15 ms for rank 1 at that call: ~7.5 ms per rank and step, significant
    assert t["significant"] is True and 5_000 < t["change"] < 20_000 and t["lo"] > 0, t
    assert d["collectives"][0] is not None and d["collectives"][0]["collective"] == "all_reduce"
    assert d["collectives"][0]["size_bucket"] == 4  # the largest change first
    assert loss["calls"]["change"] == 0 and loss["calls"]["significant"] is False
    (step,) = [s for s in d["steps"] if s["key"] == "step_us"]
    assert step["significant"] is True and step["change"] > 10_000, step
    code, text, _ = _cli("diff", runs["plain"], runs["slow"])
    assert "all_reduce <= 4 B: time" in text and "significant" in text
    code, out, _ = _cli("check", runs["slow"], "--baseline", runs["plain"], "--max-regression", "5%")
    assert code == 1 and "FAILED: step time against the baseline: +" in out, out
    code, out, _ = _cli("check", runs["slow"], "--max-step-ms", "10000", "--max-exposed", "100%")
    assert code == 0 and out.count("ok:") == 2, out


def test_check_says_each_bad_limit_in_one_line(runs):
    for args, said in (
        ((), "no limit given"),
        (("--max-exposed", "ten"), "--max-exposed 'ten': a percentage"),
        (("--max-regression", "5%"), "give both --baseline and --max-regression"),
        (("--max-step-ms", "-1"), "--max-step-ms -1.0: a number of milliseconds above 0"),
    ):
        code, out, err = _cli("check", runs["plain"], *args)
        assert code == 2 and err.strip().count("\n") == 0 and said in err and "Traceback" not in err, (args, err)
    code, _, err = _cli("diff", runs["plain"], os.path.join(runs["plain"], "nothing"))
    assert code == 2 and "no such file or directory" in err


def test_the_interval_covers_what_the_steps_show():
    """The change and its interval: identical samples give 0 and no significance; a shift far
    beyond the spread is significant with the interval around it; too few steps, no interval;
    unknown (NaN) stays unknown."""
    import math

    import numpy as np

    rng = np.random.default_rng(1)
    a = 100 + rng.normal(0, 1, 30)
    same = change(a, a)
    assert same["change"] == 0 and same["significant"] is False
    shifted = change(a, a + 10)
    assert shifted["significant"] and shifted["lo"] < 10 < shifted["hi"] and shifted["relative"] > 0.09
    noisy = change(a, 100 + rng.normal(0, 1, 30))
    assert noisy["lo"] < 0 < noisy["hi"] and noisy["significant"] is False
    assert change([1.0, 2.0], [3.0, 4.0])["significant"] is None
    unknown = change([math.nan] * 5, [1.0] * 5)
    assert math.isnan(unknown["a"]) and unknown["significant"] is None
