import os

import pytest

os.environ.setdefault("COMMPATCH_OUTPUT", "none")   # tests write files only where they ask to


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_patch_left_behind(request):
    """Every test ends with the original torch functions in place (by identity), and with no
    internal error of commpatch unless it injected faults on purpose (marker ``faults``)."""
    yield
    import commpatch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from commpatch._targets import TARGET_NAMES
    from commpatch._wrapper import MARK

    from commpatch import _runtime

    commpatch.disable()
    commpatch.reset()
    errors = dict(_runtime.ERRORS)
    _runtime.ERRORS.clear()
    _runtime._warned.clear()
    if request.node.get_closest_marker("faults") is None:
        assert not errors, f"commpatch recorded internal errors: {errors}"
    for name in TARGET_NAMES + ("destroy_process_group",):
        for mod in (dist, c10d):
            fn = getattr(mod, name, None)
            assert not hasattr(fn, MARK), f"{mod.__name__}.{name} is still patched"
