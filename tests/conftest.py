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
