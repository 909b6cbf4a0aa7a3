"""An in-process default process group on torch's fake backend, for tests that need no real peer."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def fake_world(world_size: int = 8, rank: int = 0):
    """Collectives return at once without moving data; new_group works (no store traffic)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
