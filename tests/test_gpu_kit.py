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
    # an idle stream: the excess is allowed up to each call's own host time (the launch latency), no more
    late = [k + 50 for k in kernels]
    idle = kit.compare(late, kernels, kit.TOL["idle"], host_us=[45.0] * 10)
    assert idle["ok"] and idle["beyond_host_med_us"] == pytest.approx(5)
    assert not kit.compare(late, kernels, kit.TOL["idle"], host_us=[20.0] * 10)["ok"]  # 30 us beyond the call
    assert not kit.compare(late, kernels, kit.TOL["idle"])["ok"]  # without the host times: a bare +10 us
    assert not kit.compare([float("nan")] * 10, kernels, kit.TOL["idle"], host_us=[45.0] * 10)["ok"]
    with pytest.raises(ValueError, match="2 host times against 10 rows"):
        kit.compare(late, kernels, kit.TOL["idle"], host_us=[1.0, 2.0])
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


def test_the_committed_gpu_results_are_what_the_docs_say():
    """benchmarks/gpu/results/ holds a run's JSON per script; docs/gpu-validation.md's results table
    says pass / fail / not run per check: the failures it lists are the JSON's, no more, no fewer."""
    import glob

    results = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "gpu", "results", "*.json")))
    names = [os.path.basename(p) for p in results]
    for script in ("validate", "extras", "ddp_cost", "percall"):
        assert any(n.endswith(f"_{script}.json") for n in names), (script, names)
    failed, skipped = [], []
    for path in results:
        data = json.load(open(path))
        for check in data.get("checks", []):
            assert check["status"] in ("pass", "fail", "skip"), check
            (failed if check["status"] == "fail" else skipped if check["status"] == "skip" else []).append(
                check["name"]
            )
        if path.endswith("_validate.json"):
            assert data["validated"] and data["environment"]["gpu"].startswith("NVIDIA")
    with open(os.path.join(ROOT, "docs", "gpu-validation.md")) as f:
        text = f.read()
    table = text[text.index("## Results on one H100") :].split("\n\n")[2]
    rows = [line.split("|")[1:4] for line in table.splitlines()[2:]]
    assert sum("**fail**" in result for _, result, _ in rows) == len(failed), failed
    assert sum("not run" in result for _, result, _ in rows) == len(skipped), skipped
