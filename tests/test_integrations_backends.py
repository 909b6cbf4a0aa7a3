"""The ``backend`` column names the backend that ran the call: per device for groups set up with
one backend per device ("cpu:gloo,cuda:..."), and the registered name of a third-party backend
(``dist.Backend.register_backend``); the profiler's gloo events witness what ran."""

import pytest
import torch.distributed as dist

from commpatch.record.log import _device_backends
from tests import integration_workers as w
from tests.multiproc import run_ranks


@pytest.fixture(scope="module")
def run():
    return run_ranks(w.backends, 2, timeout=90)


def test_mixed_backends_record_the_device_backend_not_the_configured_string(run):
    for out, errors in run:
        assert not errors
        df, witness, configured = out["cpu:gloo,cuda:fake"]
        assert configured == "cpu:gloo,cuda:fake"
        assert list(df["op"]) == ["all_reduce", "barrier", "all_gather_object"]
        assert set(df["backend"]) == {"gloo"}  # cpu tensors; barrier/objects: torch picks cpu
        assert w.claimed_counts(df) == witness
        df, witness, _ = out["cpu:fake,cuda:gloo"]
        assert list(df["op"]) == ["all_reduce", "barrier"] and set(df["backend"]) == {"fake"}
        assert witness == {}  # nothing ran on gloo


def test_registered_backend_recorded_under_its_name(run):
    for out, _ in run:
        df, witness, configured = out["forwarding"]
        assert configured == "forwarding"
        assert list(df["op"]) == ["all_reduce", "barrier", "all_gather_object"]
        assert set(df["backend"]) == {"forwarding"}
        assert w.claimed_counts(df) == witness  # it forwards to gloo, which the profiler sees
        # a Python ProcessGroup has no group_name: the name torch registered for it is used
        groups = {spec: set(d["group"]) for spec, (d, _, _) in out.items()}
        assert all(len(g) == 1 and "" not in g for g in groups.values())
        assert len(set.union(*groups.values())) == len(groups)


def test_device_backends_from_a_configured_string():
    assert _device_backends("gloo", None) == ("gloo", "gloo", "gloo")
    # no process group to ask for the no-tensor device: the configured string is kept for those
    assert _device_backends("cpu:gloo,cuda:nccl", None) == ("gloo", "nccl", "cpu:gloo,cuda:nccl")


@pytest.mark.skipif(dist.is_nccl_available(), reason="pins the CPU-only build's error")
def test_limit_cpu_gloo_cuda_nccl_cannot_initialise_without_nccl():
    """Documented limit: on a CPU-only torch the mixed "cpu:gloo,cuda:nccl" group cannot be
    created at all; "cpu:gloo,cuda:fake" stands in for it in the test above."""
    with pytest.raises(RuntimeError, match="Distributed package doesn't have NCCL built in"):
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
