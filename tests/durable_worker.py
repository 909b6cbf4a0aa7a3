"""One rank of the kill-matrix job (tests/test_durable.py): ``python -m tests.durable_worker``.

Records CALLS collectives, writes ``ready<rank>`` (the moment every recorded call has returned),
then ends the way ``--mode`` says, or waits (sleeping, or blocked in a collective) for the test's
signal. ``--plain`` runs the same job without commpatch, the reference for the exit status and
for how fast the process dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

CALLS = 300


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()

    import torch
    import torch.distributed as dist

    if not a.plain:
        import commpatch

        commpatch.enable(output=os.path.join(a.out, "{run}", "rank{rank}.csv"))
    if a.mode == "user_handler":  # a handler installed after enable(): cleans up, then exits 7
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world)
    t = torch.ones(64)
    for i in range(CALLS):
        if i % 5 == 0:
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.all_reduce(t)
    with open(os.path.join(a.out, f"ready{a.rank}"), "w") as f:
        f.write(str(time.time()))
    if a.mode == "exit":
        from tests.torch_compat import destroy_process_group

        destroy_process_group()
        return
    if a.mode == "exception":
        raise RuntimeError("the job failed")
    if a.mode == "os_exit":
        time.sleep(1.2)
        os._exit(3)
    if a.mode == "hang":  # the classic divergence: ranks wait in different collectives
        if a.rank == 0:
            dist.barrier()
        else:
            dist.broadcast(t, src=1)
    time.sleep(120)  # the test's signal ends this


if __name__ == "__main__":
    main()
