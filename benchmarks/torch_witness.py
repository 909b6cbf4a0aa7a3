"""PyTorch's own distributed tests as a witness: run each test file plain and under commpatch.

Every test that passes plain must pass with COMMPATCH=1 (COMMPATCH_OUTPUT=none, no files).
You supply a directory holding PyTorch's test tree (e.g. a checkout's `test/`); this script
downloads nothing and ships no PyTorch code. The files need `expecttest` and `pytest-timeout`
importable. test_distributed_spawn.py gets BACKEND=gloo WORLD_SIZE=2 and the TEMP_DIR/barrier
and INIT_METHOD it expects unless you set them.

Usage:
  python benchmarks/torch_witness.py TEST_DIR [FILE ...] [-k FILE=EXPR] [--timeout 300]
  e.g. python benchmarks/torch_witness.py ~/pytorch/test \
         -k "test_distributed_spawn.py=all_reduce or broadcast or barrier"
Exit status 1 when some test passes plain but not instrumented.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

DEFAULT_FILES = [
    "distributed/test_functional_api.py",
    "distributed/test_c10d_object_collectives.py",
    "distributed/tensor/test_dtensor.py",
    "distributed/test_distributed_spawn.py",
]
INSTRUMENTED = {"COMMPATCH": "1", "COMMPATCH_OUTPUT": "none"}


def file_env(path: str, scratch: str) -> dict[str, str]:
    """Environment a test file needs beyond the caller's."""
    if os.path.basename(path) != "test_distributed_spawn.py":
        return {}
    os.makedirs(os.path.join(scratch, "barrier"), exist_ok=True)
    # INIT_METHOD set up front: the test names its class after it and its child processes
    # (which see the file:// method the harness sets) must find the same class name.
    return {
        "BACKEND": "gloo",
        "WORLD_SIZE": "2",
        "TEMP_DIR": scratch,
        "INIT_METHOD": "file://" + os.path.join(scratch, "init"),
    }


def run(
    path: str, extra_env: dict[str, str], kexpr: str | None, timeout: float, per_test: float, xml_path: str
) -> dict[str, str]:
    """Run one test file under pytest; return {test id: passed|failed|skipped}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMPATCH")}
    env.update(extra_env)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        os.path.basename(path),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml_path}",
        f"--timeout={per_test:g}",
    ]
    if kexpr:
        cmd += ["-k", kexpr]
    if os.path.exists(xml_path):
        os.remove(xml_path)
    # own session: on timeout the whole tree goes, with the ranks the tests spawned
    proc = subprocess.Popen(
        cmd,
        cwd=os.path.dirname(path),
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"  {os.path.basename(path)}: whole run over {timeout:g}s, killed", file=sys.stderr)
    finally:  # also when this script is interrupted or terminated
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if not os.path.exists(xml_path):
        return {}
    outcomes = {}
    for case in ET.parse(xml_path).iter("testcase"):
        tags = {child.tag for child in case}
        state = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = state
    return outcomes


def counts(outcomes: dict[str, str]) -> str:
    return "/".join(str(sum(v == s for v in outcomes.values())) for s in ("passed", "failed", "skipped"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("test_dir", help="directory of PyTorch's tests (its `test/`)")
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES, help="test files relative to test_dir")
    ap.add_argument(
        "-k",
        action="append",
        default=[],
        metavar="FILE=EXPR",
        help="pytest -k expression for the file of that basename",
    )
    ap.add_argument("--timeout", type=float, default=120, help="per-test seconds")
    ap.add_argument("--run-timeout", type=float, default=3600, help="seconds for one whole file run")
    ap.add_argument("--xml-dir", help="keep the junit xml files (with tracebacks) here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups on `timeout`
    kexprs = dict(item.split("=", 1) for item in args.k)
    if args.xml_dir:
        os.makedirs(args.xml_dir, exist_ok=True)

    rows, regressions = [], []
    with tempfile.TemporaryDirectory(prefix="torch_witness_") as scratch:
        for rel in args.files:
            path = os.path.abspath(os.path.join(args.test_dir, rel))
            name = os.path.basename(path)
            env = file_env(path, scratch)
            result = {}
            for mode, extra in (("plain", {}), ("commpatch", INSTRUMENTED)):
                print(f"running {rel} ({mode})", file=sys.stderr)
                xml_path = os.path.join(args.xml_dir or scratch, f"{name}.{mode}.xml")
                result[mode] = run(path, {**env, **extra}, kexprs.get(name), args.run_timeout, args.timeout, xml_path)
            plain, inst = result["plain"], result["commpatch"]
            lost = sorted(t for t, s in plain.items() if s == "passed" and inst.get(t) != "passed")
            regressions += [(rel, t, inst.get(t, "missing")) for t in lost]
            rows.append((rel, counts(plain), counts(inst), len(lost)))

    header = ("file", "plain p/f/s", "commpatch p/f/s", "lost")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(4)]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    if regressions:
        print("\npassed plain, not under commpatch:")
        for rel, test, state in regressions:
            print(f"  {rel}  {test}  ({state})")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
