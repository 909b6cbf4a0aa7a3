"""benchmarks/gpu/validate.py (the GPU validation kit) on this CPU machine: it must not crash, must say
that nothing was validated, and its code must run end to end (--dry-run-cpu, gloo); its verdict
logic must be able to fail."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "benchmarks", "gpu", "validate.py")


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_validate", KIT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, *args):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, KIT, "--quick", "--json", str(out), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_without_cuda_every_gpu_check_is_a_skip_and_nothing_is_validated(tmp_path):
    kit = _kit()
    stdout, result = _run(tmp_path)
    table = [line for line in stdout.splitlines() if line.startswith(("SKIP", "PASS", "FAIL"))]
    assert [line.split()[0] for line in table] == ["SKIP"] * len(kit.CHECKS)
    assert all("CUDA is not available" in line for line in table)
    assert stdout.strip().splitlines()[-1].startswith("NOTHING VALIDATED")
    assert "commpatch recorded 8 of 8 collectives" in stdout  # the gloo plumbing ran
    assert result["validated"] is False and result["exit_status"] == 0
    assert [c["check"] for c in result["checks"]] == list(kit.CHECKS)

    # --dry-run-cpu: every check's code runs on CPU tensors and gloo; nothing raised, nothing validated
    stdout, result = _run(tmp_path, "--dry-run-cpu")
    assert stdout.strip().splitlines()[-1] == "DRY RUN on CPU with gloo: every check's code ran; NOTHING VALIDATED."
    assert {c["check"] for c in result["checks"]} == set(kit.CHECKS)
    assert all(c["status"] == "skip" and not c["data"].get("raised") for c in result["checks"]), result["checks"]


def test_the_verdicts_pass_and_fail():
    kit = _kit()
    kernels = [100.0] * 9 + [1000.0]
    ok = kit.compare([k + 5 for k in kernels], kernels, kit.TOL["queued"])
    assert ok["ok"] and ok["n"] == 10 and ok["excess_med_us"] == pytest.approx(5)
    assert not kit.compare([k + 50 for k in kernels], kernels, kit.TOL["queued"])["ok"]  # too long
    assert not kit.compare([k - 10 for k in kernels], kernels, kit.TOL["queued"])["ok"]  # shorter than the kernel
    assert kit.compare([k + 50 for k in kernels], kernels, kit.TOL["idle"])["ok"]  # launch latency allowed
    assert not kit.compare([float("nan")] * 10, kernels, kit.TOL["idle"])["ok"]
    with pytest.raises(ValueError, match="3 commpatch rows against 10 kernels"):
        kit.compare([1.0] * 3, kernels, kit.TOL["idle"])
    assert kit.parse_sizes("8K,1m,2G") == [8192, 1 << 20, 2 << 30]

    def r(status, **data):
        return kit.row("step_time", "step", status, "m", "t", **data)

    merged = kit.merge_ranks([[r("pass")], [r("fail")]])
    assert merged[0]["status"] == "fail" and merged[0]["measured"].startswith("rank 1:")
    assert kit.verdict(merged)[0] == 1
    assert kit.verdict(kit.merge_ranks([[r("pass")], [r("skip")]])) == (0, "PASSED: all 1 checks (0 skipped).")
    assert kit.dry_run_verdict(kit.merge_ranks([[r("fail", raised=True)]]))[0] == 1
