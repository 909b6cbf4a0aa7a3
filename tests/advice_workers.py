"""Real jobs for the advice tests (spawned by tests/multiproc.py run_ranks)."""


def many_small_calls(rank: int, n: int, steps: int = 14, small: int = 64, coalesced: bool = False):
    """Per step (commpatch.step()): ``small`` all_reduce calls of 16 floats, or one of them all flattened
    (``coalesced``), then 3 all_reduce calls of 1M floats; the log, as a DataFrame."""
    import torch
    import torch.distributed as dist

    import commpatch

    torch.set_num_threads(1)
    tiny = [torch.ones(16) for _ in range(small)]
    big = torch.ones(1 << 20)
    commpatch.enable(output="none")
    try:
        for _ in range(steps):
            commpatch.step()
            if coalesced:
                dist.all_reduce(torch.cat(tiny))
            else:
                for t in tiny:
                    dist.all_reduce(t)
            for _ in range(3):
                dist.all_reduce(big)
        return commpatch.log()
    finally:
        commpatch.disable()
