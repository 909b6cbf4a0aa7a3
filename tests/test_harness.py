"""The test harness itself: a test that hangs past its timeout ends, with its stacks, even where
pytest-timeout cannot end it (tests/conftest.py's backstop)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HANGS = """
import threading

import pytest


@pytest.fixture
def stuck():
    yield
    threading.Event().wait()  # a teardown that hangs after pytest-timeout's one alarm has fired


@pytest.mark.timeout(2)
def test_hangs(stuck):
    threading.Event().wait()
"""


def test_a_hang_past_its_timeout_is_ended_with_its_stacks(tmp_path):
    """pytest-timeout's alarm fails the test once; its teardown then hangs with no alarm left (and
    pytest's faulthandler plugin cancels a pending dump when a phase fails): without the backstop this
    run would never end (CI's last stop ran out of its 90 minutes in the slow tests' parallel part)."""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = dict(os.environ, COMMPATCH_TEST_BACKSTOP_S="3")
    began = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "test_hangs.py"],
        cwd=tmp_path, env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - began
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]  # faulthandler's exit status, not pytest's own summary
    assert p.stdout.startswith("F"), out[-3000:]  # pytest-timeout's alarm failed the call
    assert "Timeout (0:00:0" in out and ", line 10 in stuck" in out, out[-3000:]  # the backstop's stacks
    assert " passed" not in out and " failed" not in out, out[-3000:]  # no summary: the process was ended
    assert took < 60, took
