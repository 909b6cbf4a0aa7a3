"""One rank of a small running job for the live tests (tests/test_metrics.py, tests/test_watch.py):
started as a process per rank (``python tests/live_workers.py --rank R ...``), so that a test can
watch or scrape it while it runs. Each step: a synchronous all_reduce, a broadcast, an async
all_reduce and an all_gather; after the steps (and, with ``--lag``, an async all_reduce that rank 1
joins late) it writes ``--done``.rank{R} and waits (at most ``--hold`` seconds) for the file
``--release`` before it ends."""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--store", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--metrics-port", default="")
    p.add_argument("--metrics-file", default="")
    p.add_argument("--done", default="")
    p.add_argument("--release", default="")
    p.add_argument("--hold", type=float, default=60.0)
    p.add_argument(
        "--lag",
        type=float,
        default=0.0,
        help="after the steps, rank 0 issues an async all_reduce that rank 1 joins this many seconds later",
    )
    args = p.parse_args()
    os.environ["LOCAL_RANK"] = str(args.rank)
    import torch
    import torch.distributed as dist

    import commpatch

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    commpatch.enable(output=args.output, metrics_port=args.metrics_port or None, metrics_file=args.metrics_file or "")
    t = torch.ones(1024)
    u = torch.ones(4096, dtype=torch.float64)
    for step in range(args.steps):
        commpatch.step(step)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_reduce(u, async_op=True).wait()
        out = [torch.empty(256) for _ in range(args.world)]
        dist.all_gather(out, torch.ones(256))
        time.sleep(args.sleep * (1 + args.rank))  # rank 1 computes longer: rank 0 waits for it
    if args.lag:
        if args.rank == 1:
            time.sleep(args.lag)
        dist.all_reduce(t, async_op=True).wait()
    dist.barrier()
    if args.done:
        with open(f"{args.done}.rank{args.rank}", "w") as f:
            f.write("done\n")
    deadline = time.monotonic() + args.hold
    while args.release and not os.path.exists(args.release) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
