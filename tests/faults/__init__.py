"""Real faults for the tests: C sources of LD_PRELOAD shims, and their build."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def build_shim(name: str, out_dir) -> str:
    """``tests/faults/<name>.c`` built with gcc as an LD_PRELOAD library in ``out_dir``: its path;
    the test is skipped (saying why) without gcc or when it does not build here."""
    if shutil.which("gcc") is None:
        pytest.skip(f"needs gcc to build the LD_PRELOAD shim {name}.c")
    out = os.path.join(str(out_dir), f"{name}.so")
    res = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-o", out, os.path.join(HERE, f"{name}.c"), "-ldl"],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        pytest.skip(f"the shim {name}.c does not build here: {res.stderr[-500:]}")
    return out
