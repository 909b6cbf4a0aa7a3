"""Real logs written by commpatch's writer, for the reader tests (tests/test_bad_input.py,
tests/test_fuzz.py): ``python -m tests.writer_logs OUT_DIR`` runs a one-rank gloo job under
commpatch that flushes between its steps, so its ``rank0.cplog`` holds many frames (registries
as they appear, rows in several chunks, tags, a subgroup), and its ``rank0.csv`` export."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

STEPS = 6


def main(out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import commpatch

    commpatch.enable(output=os.path.join(out, "rank{rank}.csv"))
    store = tempfile.mktemp(prefix="commpatch_store_")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    t = torch.ones(16)
    sub = dist.new_group([0])
    for step in range(STEPS):
        with commpatch.tag(f"phase{step % 3}"):
            dist.all_reduce(t)
            dist.broadcast(t, 0, group=sub)
            dist.all_gather([torch.zeros(16)], t)
            dist.all_reduce(t.double(), async_op=True).wait()
        commpatch.step()
        time.sleep(0.3)  # past the flusher's period: each step's rows are a frame of their own
    dist.destroy_process_group()


def write(out: str) -> tuple[str, str]:
    """(the .cplog, its CSV export) of the job, written under ``out``."""
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, COMMPATCH_OUTPUT="none")
    done = subprocess.run(
        [sys.executable, "-m", "tests.writer_logs", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 0, done.stderr
    return os.path.join(out, "rank0.cplog"), os.path.join(out, "rank0.csv")


if __name__ == "__main__":
    main(sys.argv[1])
