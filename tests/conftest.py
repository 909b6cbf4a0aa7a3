import os

import pytest

os.environ.setdefault("COMMPATCH_OUTPUT", "none")  # tests write files only where they ask to
# Subprocesses (workers, scripts run from a temporary directory) import this checkout's commpatch,
# not whichever one is installed in site-packages (an editable install may point at another tree).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


# Tests that read files or synthetic logs and check the project itself: nothing in them depends on the
# torch version. The version-matrix cells (ci/matrix.sh) leave them out (`-m "not offline"`); `make test`
# runs them. A test elsewhere can be marked @pytest.mark.offline itself.
OFFLINE_MODULES = {
    "test_analysis",
    "test_docs",
    "test_engine",
    "test_fuzz",
    "test_fuzz_follow",
    "test_harness",
    "test_hostile",
    "test_hostile_report",
    "test_html_report",
    "test_layers",
    "test_lint",
    "test_mismatch_kinds",
    "test_notebook",
    "test_project",
    "test_step_pattern",
    "test_testing",
    "test_trackers",
}
# disks and processes failing under the writer (full, slow, read-only disks, SIGKILL, removed
# directories): the OS's behaviour, the same on every torch; left out of the venv matrix cells
SYSTEM_MODULES = {"test_faults", "test_durable"}
# Tests whose verdicts are about time measured in real jobs (stragglers, delays, clocks, a device kept
# busy): they hold beside a CPU hog, not beside two more test processes with their ranks. `make test`
# runs them after the others, one at a time (the others run in parallel: pytest-xdist).
SERIAL_MODULES = {
    "test_advice",
    "test_clock",
    "test_diff",
    "test_emulated_device",
    "test_multihost",
    # its committed outputs compared unequal once among 3 workers, not since (the test prints the
    # line that differs when it does): alone until that line is seen
    "test_notebook",
    "test_steps",
    "test_stragglers",
    "test_verdicts",
}
# What touches torch's own API (what is patched, how frameworks call it, its stores and process
# groups): the version-matrix cells run these on each torch (ci/matrix.sh); the rest reads logs or
# analyses rows, the same on every torch, and runs on the main cell.
TORCH_MODULES = {
    "test_activation",
    "test_clock",
    "test_compat",
    "test_core",
    "test_ddp_transparency",
    "test_emulated_device",
    "test_hangs",
    "test_integrations_backends",
    "test_integrations_checkpoint",
    "test_integrations_compiled",
    "test_integrations_ddp",
    "test_integrations_fsdp",
    "test_integrations_functional",
    "test_integrations_modules",
    "test_integrations_pipeline",
    "test_integrations_reenable",
    "test_multiproc_core",
    "test_ops",
    "test_p2p_rows",
    "test_readme",
    "test_transparency",
    "test_watchdog",
}


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in OFFLINE_MODULES:
            item.add_marker(pytest.mark.offline)
        if module in SYSTEM_MODULES:
            item.add_marker(pytest.mark.system)
        if module in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        if module in TORCH_MODULES:
            item.add_marker(pytest.mark.torch)

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


# A hang that pytest-timeout cannot end: its default method raises from SIGALRM's handler, which runs
# only when the main thread runs Python, so a test blocked in C (a process group's wait, a JVM's call)
# or a teardown that hangs after the alarm has fired (it fires once an item) would stall the run until
# CI's own limit kills it with no word of where. This backstop, BACKSTOP_S after the item's own
# timeout, dumps every thread's stack from faulthandler's C thread and ends the process: pytest-xdist
# then reports the test as its worker's crash and goes on with a fresh worker.
BACKSTOP_S = float(os.environ.get("COMMPATCH_TEST_BACKSTOP_S", "120"))


def pytest_configure(config):
    config._backstop_stderr = os.dup(2)  # the terminal's stderr (a test's fd 2 is captured)


def _arm_backstop(config, deadline) -> None:
    import faulthandler
    import time

    faulthandler.dump_traceback_later(max(1.0, deadline - time.monotonic()), exit=True, file=config._backstop_stderr)


def _timeout_of(item) -> float:
    """The item's pytest-timeout: its marker's, else the ini's (0: none, or no pytest-timeout)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not installed: no "timeout" ini
        return 0.0


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler
    import time

    timeout = _timeout_of(item)
    item._backstop_deadline = time.monotonic() + timeout + BACKSTOP_S if timeout > 0 else None
    if item._backstop_deadline is not None:
        _arm_backstop(item.config, item._backstop_deadline)
    try:
        yield
    finally:
        if item._backstop_deadline is not None:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node, call, report):
    """pytest's faulthandler plugin cancels the timer when a phase fails (before a debugger could
    start): armed again, to the same deadline, for the phases that follow (a teardown that hangs)."""
    deadline = getattr(node, "_backstop_deadline", None)
    if deadline is not None:
        _arm_backstop(node.config, deadline)


@pytest.fixture(autouse=True)
def fresh_session(request):
    """Every test starts with a fresh default Session (log, timing, patcher), and ends with the
    original torch functions in place (by identity), and with no internal error of commpatch
    unless it injected faults on purpose (marker ``faults``)."""
    from commpatch import session

    session.new_default()
    yield
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from commpatch.data.ops import TARGET_NAMES
    from commpatch.record import state
    from commpatch.record.wrapper import MARK

    session.new_default()  # closes the test's session: disabled, exit handler dropped
    errors = dict(state.ERRORS)
    state.reset_errors()
    if request.node.get_closest_marker("faults") is None:
        assert not errors, f"commpatch recorded internal errors: {errors}"
    for name in TARGET_NAMES + ("destroy_process_group",):
        for mod in (dist, c10d):
            fn = getattr(mod, name, None)
            assert not hasattr(fn, MARK), f"{mod.__name__}.{name} is still patched"
