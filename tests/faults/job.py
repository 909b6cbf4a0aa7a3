"""One rank of a fault-test job (tests/test_faults.py): ``python -m tests.faults.job``.

A 2-rank gloo job whose all_reduce results it checks itself (exit 3 if one is wrong), with a
storage fault made at a known point by ``--mode`` (rank 0 makes it, both ranks wait for it at a
barrier). ``--plain`` runs the same job without commpatch: the reference exit status. Prints one
JSON line: the main thread's id, commpatch's internal errors, the rows it counted as dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time


def fill(directory: str, leave: int) -> str:
    """Fill the file system of ``directory`` (a small tmpfs), then free ``leave`` bytes of it."""
    st = os.statvfs(directory)
    if st.f_blocks * st.f_frsize > 64 << 20:  # never the machine's disk
        raise SystemExit(
            f"fill: {directory} is on a file system of {st.f_blocks * st.f_frsize} bytes, not a small tmpfs"
        )
    path = os.path.join(directory, "filler")
    block = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError:
                break
        while True:  # the last partial block
            try:
                f.write(b"\0" * 512)
            except OSError:
                break
    os.truncate(path, max(0, os.path.getsize(path) - leave))
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--backlog", type=int, default=0, help="record.sinks.BACKLOG_ROWS for this job")
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()

    import torch
    import torch.distributed as dist

    cp = None
    output = os.path.join(a.out, "{run}", "rank{rank}.csv")
    if not a.plain:
        import commpatch as cp
        from commpatch.record import sinks

        if a.backlog:
            sinks.BACKLOG_ROWS = a.backlog
        cp.enable(output=output)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world)
    expected = a.world * (a.world + 1) / 2

    def calls(n: int) -> None:
        for _ in range(n):
            t = torch.full((64,), float(a.rank + 1))
            dist.all_reduce(t)
            if not bool((t == expected).all()):
                sys.exit(3)

    def run_dir() -> str:
        dirs = [d for d in os.listdir(a.out) if os.path.isdir(os.path.join(a.out, d))]
        return os.path.join(a.out, dirs[0]) if dirs else a.out

    calls(a.calls)
    if a.mode == "diskfull":  # full (one page left: a write is cut short), then freed
        time.sleep(0.5)
        dist.barrier()
        filler = fill(a.out, 4096) if a.rank == 0 else None
        dist.barrier()
        calls(a.calls)
        time.sleep(1.0)  # the flusher meets the full disk
        dist.barrier()
        if filler:
            os.unlink(filler)
        dist.barrier()
        calls(a.calls)
        time.sleep(1.5)  # past the retry interval
    elif a.mode == "rmdir":  # the run directory removed while the job runs
        time.sleep(0.5)
        dist.barrier()
        if a.rank == 0 and cp is not None:
            shutil.rmtree(run_dir())
        dist.barrier()
        calls(a.calls)
        time.sleep(0.5)
    elif a.mode in ("reenable", "capture"):  # then SIGKILL: what the flusher wrote is all there is
        if cp is not None:
            cp.disable()
            if a.mode == "reenable":
                cp.enable(output=output)
                calls(a.calls)
            else:
                with cp.capture(output=output):
                    calls(a.calls)
                with cp.capture(output=output):  # killed inside the block: no exit flush
                    calls(a.calls)
                    time.sleep(1.0)
                    os.kill(os.getpid(), signal.SIGKILL)
        else:
            calls(a.calls * (1 if a.mode == "reenable" else 2))
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    elif a.mode == "slow":
        pass
    if os.environ.get("SHIM_LOG"):  # what the shim notes from here on: log() and the exit
        with open(os.environ["SHIM_LOG"], "a") as f:
            f.write(f"END {threading.get_native_id()}\n")
    dropped = cp.log().attrs["dropped_rows"] if cp else 0  # log() writes what waited (or drops it)
    result = {"errors": cp.internal_errors() if cp else {}, "dropped": dropped}
    print(json.dumps(result), flush=True)
    from tests.torch_compat import destroy_process_group

    destroy_process_group()  # else gloo may abort one rank at exit (torch, with or without commpatch)


if __name__ == "__main__":
    main()
