"""Integrations installed from post-import hooks come back after disable() / enable() (one
process, fake backend): wrapt fires a hook at once only when it is registered."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commpatch


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class Synced(torch.nn.Module):
    def forward(self, x):
        dist.all_reduce(x)
        return x


def test_integrations_reapplied_on_every_enable():
    from tests.torch_compat import fsdp_param_group

    FSDPParamGroup = fsdp_param_group()
    from torch.nn.parallel import DistributedDataParallel as DDP

    originals = (c10d._coalescing_manager, DDP._pre_forward, FSDPParamGroup.unshard)
    for _ in range(2):
        commpatch.enable(output="none")
        current = (c10d._coalescing_manager, DDP._pre_forward, FSDPParamGroup.unshard)
        assert all(now is not orig for now, orig in zip(current, originals))
        with commpatch.capture() as cap:
            Synced()(torch.ones(2))
            with c10d._coalescing_manager():
                dist.all_reduce(torch.ones(2))
                dist.all_reduce(torch.ones(3))
        rows = list(zip(cap.df["op"], cap.df["module"], cap.df["phase"], cap.df["bytes"]))
        assert rows == [("all_reduce", "Synced", "forward", 8), ("coalesced.all_reduce", "", "other", 20)]
        commpatch.disable()
        assert (c10d._coalescing_manager, DDP._pre_forward, FSDPParamGroup.unshard) == originals
