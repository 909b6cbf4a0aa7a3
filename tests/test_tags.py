"""``commpatch.tag()`` blocks in several threads (issue 23): process-wide, and no tag outlives its
block. Tags are process-wide on purpose: the collectives a block causes may be issued from other
threads (autograd's device threads run DDP's bucket hooks for a ``backward()`` inside the block)."""

import threading

import torch
import torch.distributed as dist

import commpatch
from tests.fakepg import fake_world


def _in_thread(name: str, entered: threading.Event, leave: threading.Event, left: threading.Event):
    def run():
        with commpatch.tag(name):
            entered.set()
            leave.wait(10)
        left.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_overlapping_blocks_of_two_threads_leave_no_tag_behind():
    """Thread 1 enters "a", thread 2 enters "b", thread 1 leaves, then thread 2: each call is
    labelled by the innermost block still open, and none after both left (it used to keep "a":
    thread 2's block restored the tag it had found when it entered)."""
    events = [threading.Event() for _ in range(6)]
    a_in, a_leave, a_out, b_in, b_leave, b_out = events
    with fake_world(2):
        commpatch.enable(output="none")
        dist.all_reduce(torch.ones(1))
        first = _in_thread("a", a_in, a_leave, a_out)
        a_in.wait(10)
        dist.all_reduce(torch.ones(1))
        second = _in_thread("b", b_in, b_leave, b_out)
        b_in.wait(10)
        dist.all_reduce(torch.ones(1))
        a_leave.set()
        a_out.wait(10)
        dist.all_reduce(torch.ones(1))  # "b" is still open
        b_leave.set()
        b_out.wait(10)
        dist.all_reduce(torch.ones(1))
        with commpatch.tag("c"):
            with commpatch.tag("d"):
                dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1))
        first.join(10)
        second.join(10)
        df = commpatch.log()
    assert df["tag"].astype(str).tolist() == ["", "a", "b", "b", "", "d", "c", ""]


def test_a_block_left_by_an_exception_leaves_no_tag():
    with fake_world(2):
        commpatch.enable(output="none")
        try:
            with commpatch.tag("boom"):
                raise ValueError
        except ValueError:
            pass
        dist.all_reduce(torch.ones(1))
        df = commpatch.log()
    assert df["tag"].astype(str).tolist() == [""]
