"""Shared by the benchmarks: memory readings and the fake process group."""

import os


def rss_mb() -> float:
    """Resident memory of this process now, in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def fake_world(world_size: int = 8) -> None:
    """A process group on torch's `fake` backend: collectives cost only their Python/C++ call."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
