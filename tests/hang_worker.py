"""One rank of a job that hangs (tests/test_hangs.py): ``python -m tests.hang_worker``.

``--mode skip``: STEPS all_reduce calls on the world group, except on rank ``world - 1``, which
skips the last one: the other ranks wait in it for ever. ``--mode recv``: two ranks exchange
STEPS send / recv pairs, then rank 0 sends once more (``send``, or ``isend`` then ``wait`` with
``--async-send``) and rank 1 never receives it. ``--mode clean``: the STEPS all_reduce calls on
every rank (the last rank SLOW_S late for one of them) and a normal exit. Every rank writes ``ready<rank>`` once it reached the point where
it waits (rank ``world - 1`` of ``skip`` and rank 1 of ``recv`` then sleep, as a rank busy
elsewhere would), and the test kills the job with SIGKILL. ``--mode ddp``: a DDP model trained
STEPS steps, except that rank ``world - 1`` stops before the last one (a data loader that hangs):
the others wait in the backward for its gradient buckets (issued by DDP's reducer, waited for in
its finalize).
"""

from __future__ import annotations

import argparse
import os
import time

STEPS = 20
SLOW_S = 3.0  # --mode clean: the last rank is this late for one all_reduce (the others wait in it)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", required=True, choices=("skip", "recv", "clean", "ddp"))
    p.add_argument("--async-send", action="store_true")
    a = p.parse_args()

    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(a.out, "rank{rank}.csv"))
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world)
    t = torch.ones(256)

    def ready():
        with open(os.path.join(a.out, f"ready{a.rank}"), "w") as f:
            f.write(str(time.time()))

    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 64)
        for step in range(STEPS):
            if step == STEPS - 1:
                ready()
                if a.rank == a.world - 1:
                    break  # its data loader hangs: it sleeps below, alive
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    elif a.mode in ("skip", "clean"):
        last = a.world - 1
        for step in range(STEPS):
            if a.mode == "clean" and step == STEPS // 2 and a.rank == a.world - 1:
                time.sleep(SLOW_S)
            if a.mode == "skip" and step == STEPS - 1:
                ready()  # the others write it before they block: the test waits a little more
                if a.rank == last:
                    break
            dist.all_reduce(t)
            commpatch.step()
        if a.mode == "clean":
            ready()
            from tests.torch_compat import destroy_process_group

            destroy_process_group()
            return
    else:
        peer = 1 - a.rank
        for _ in range(STEPS):
            if a.rank == 0:
                dist.send(t, dst=peer)
                dist.recv(t, src=peer)
            else:
                dist.recv(t, src=peer)
                dist.send(t, dst=peer)
        ready()
        if a.rank == 0:
            if a.async_send:
                dist.isend(t, dst=peer).wait()
            else:
                dist.send(t, dst=peer)
    time.sleep(600)  # the test's SIGKILL ends this


if __name__ == "__main__":
    main()
