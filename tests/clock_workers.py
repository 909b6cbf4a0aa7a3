"""Workers of tests/test_clock.py (spawned by tests/multiproc.py run_ranks)."""


def exchange_job(rank: int, n: int, out: str, seconds: float = 3.0):
    """all_reduce calls for about ``seconds`` with the binary log under ``out`` (the clock exchange
    runs beside them through the process group's store); results checked here."""
    import os
    import time

    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    calls = int(seconds / 0.005)  # the same number on every rank
    for _ in range(calls):
        x = torch.full((256,), float(rank))
        dist.all_reduce(x)
        assert float(x[0]) == sum(range(n))
        time.sleep(0.005)
    dist.barrier()
    commpatch.disable()
    return calls


def tcp_exchange(rank: int, n: int, port: int, seconds: float = 2.5):
    """The exchange alone over a TCPStore whose server is rank 0's (as ``init_method='tcp://'`` or
    torchrun's store): the intervals each rank noted."""
    import time

    import torch.distributed as dist

    from commpatch.record.clocksync import ClockSync

    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, wait_for_workers=True)
    noted = []
    sync = ClockSync(store, rank, n, lambda *interval: noted.append(interval), generation="test")
    time.sleep(seconds)
    sync.stop()
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(n)])  # rank 0's server lives until every rank is done
    return noted, sync.rounds, sync.error
