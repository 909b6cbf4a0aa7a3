"""Shared by the benchmarks: memory readings, the fake process group, alternating rounds."""

import os
import statistics


def rss_mb() -> float:
    """Resident memory of this process now, in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def fake_world(world_size: int = 8) -> None:
    """A process group on torch's `fake` backend: collectives cost only their Python/C++ call."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def alternating(ways: dict, rounds: int) -> dict:
    """Run each of ``ways`` (name -> function returning a time) once to warm up, then ``rounds``
    times in alternation; the median time per way."""
    for fn in ways.values():
        fn()
    results = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            results[name].append(fn())
    return {name: statistics.median(values) for name, values in results.items()}
