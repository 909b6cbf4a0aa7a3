"""Workers for the runtime tests of issue 23 (run in each rank by tests.multiproc.run_ranks):
selective activation checkpointing over functional collectives, with torch.profiler as witness."""

from __future__ import annotations

import warnings
from collections import Counter

from tests.integration_workers import claimed_bytes, claimed_counts, witness_bytes, witness_counts
from tests.torch_compat import destroy_process_group

WIDTH = 8
STEPS = 3


def _sac_train(rank, world_size, layers, steps=STEPS):
    """A 2-layer sequence-parallel MLP written here (all-gather the sequence, MLP, reduce-scatter
    it back: the funcol ``*_autograd`` collectives tensor parallel uses; the first layer along
    dim 0, the second along dim 1, whose gather torch post-processes into a new tensor), both layers in one
    non-reentrant checkpoint whose policy saves the collectives' outputs, as torchtitan's SAC
    does; recomputation runs to the end (early stop off), so every forward collective is
    recomputed in backward. Returns (losses, gradients) of each step."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from tests.torch_compat import selective_checkpoint_context

    c10d = torch.ops._c10d_functional
    context_fn = selective_checkpoint_context({c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default})

    group = dist.group.WORLD

    def forward(x):
        for dim, (w1, w2) in enumerate(layers):  # the second layer gathers and scatters along dim 1
            h = funcol.all_gather_tensor_autograd(x, dim, group)
            y = torch.relu(h @ w1.T) @ w2.T
            x = x + funcol.reduce_scatter_tensor_autograd(y, "sum", dim, group)
        return x

    gen = torch.Generator().manual_seed(100 + rank)
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randn(4, WIDTH, generator=gen)
        with set_checkpoint_early_stop(False):
            out = checkpoint(forward, x, use_reentrant=False, context_fn=context_fn)
            loss = out.square().sum()
            loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for pair in layers for p in pair])
        for pair in layers:
            for p in pair:
                p.grad = None
    return losses, grads


def _as_gloo_runs(counts: Counter) -> dict:
    """gloo runs a reduce-scatter as an all-reduce of the full input (its profiler event)."""
    return {{"reduce_scatter": "all_reduce"}.get(op, op): n for op, n in counts.items()}


def _layers():
    import torch

    torch.manual_seed(0)
    return [
        (torch.nn.Parameter(torch.randn(2 * WIDTH, WIDTH)), torch.nn.Parameter(torch.randn(WIDTH, 2 * WIDTH))),
        (torch.nn.Parameter(torch.randn(2 * WIDTH, 2 * WIDTH)), torch.nn.Parameter(torch.randn(2 * WIDTH, 2 * WIDTH))),
    ]


def selective_checkpoint(rank, world_size):
    """The SAC MLP without commpatch, then under commpatch and the profiler: whether results are
    bit-identical, commpatch's rows per op, its counts and bytes per gloo op and the profiler's."""
    import torch
    from torch.profiler import profile

    import commpatch

    reference = _sac_train(rank, world_size, _layers())
    commpatch.enable(output="none")
    with warnings.catch_warnings(record=True) as said, profile(record_shapes=True) as prof:
        warnings.simplefilter("always")
        got = _sac_train(rank, world_size, _layers())
    df = commpatch.log()
    errors = commpatch.internal_errors()
    commpatch.disable()
    identical = all(torch.equal(a, b) for a, b in zip(reference[0], got[0])) and all(
        torch.equal(a, b) for ga, gb in zip(reference[1], got[1]) for a, b in zip(ga, gb)
    )
    return dict(
        identical=identical,
        ops=dict(Counter(df["op"].astype(str))),
        errors=errors,
        said=[str(w.message) for w in said if "commpatch" in str(w.message)],
        counts=(_as_gloo_runs(claimed_counts(df)), dict(witness_counts(prof))),
        bytes=(dict(claimed_bytes(df)), dict(witness_bytes(prof, world_size))),
    )


def funcol_after_reinit(rank, world_size):
    """A functional and a compiled all-reduce on the default group named by its name, then
    destroy_process_group() and a new default group (same name), and both again: commpatch's
    rows, internal errors, and the profiler's gloo ops over both groups."""
    import os
    import tempfile

    import torch
    import torch._dynamo
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.profiler import profile

    import commpatch

    store = os.path.join(tempfile.gettempdir(), f"commpatch-reinit-{os.getppid()}")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled(t, name):
        # wait_tensor, not AsyncCollectiveTensor.wait(): torch 2.4 cannot compile the latter
        return funcol.wait_tensor(funcol.all_reduce(t, "sum", name))

    commpatch.enable(output="none")
    with profile() as prof:
        for attempt in range(2):
            if attempt:
                destroy_process_group()
                dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
            name = dist.group.WORLD.group_name
            funcol.all_reduce(torch.ones(4), "sum", name).wait()
            compiled(torch.ones(4), name)
    df = commpatch.log()
    errors = commpatch.internal_errors()
    commpatch.disable()
    torch._dynamo.reset()
    dist.barrier()
    if rank == 0 and os.path.exists(store):
        os.remove(store)
    return dict(ops=df["op"].astype(str).tolist(), errors=errors, witness=dict(witness_counts(prof)))


def p2p(rank, world_size):
    """batch_isend_irecv over a ring (send to the next rank, receive from the previous one) and
    with one partner, then send_object_list / recv_object_list between ranks 0 and 1, under
    commpatch and the profiler: rows (op, bytes, peer) and the bytes gloo sent and received."""
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    import commpatch

    nxt, prev, partner = (rank + 1) % world_size, (rank - 1) % world_size, rank ^ 1
    commpatch.enable(output="none")
    with profile(record_shapes=True) as prof:
        for peers in ((nxt, prev), (partner, partner)):
            received = torch.zeros(4)
            ops = [
                dist.P2POp(dist.isend, torch.full((4,), float(rank)), peers[0]),
                dist.P2POp(dist.irecv, received, peers[1]),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            assert received[0].item() == peers[1]
        if rank == 0:
            dist.send_object_list([{"payload": list(range(20))}], dst=1)
        elif rank == 1:
            out = [None]
            dist.recv_object_list(out, src=0)
            assert out[0] == {"payload": list(range(20))}
    df = commpatch.log()
    commpatch.disable()
    moved = witness_bytes(prof, world_size)
    return dict(
        rows=list(zip(df["op"].astype(str), df["bytes"].astype(int), df["peer"].astype(int))),
        witness=moved["send"] + moved["recv"],
        expected_peers=[nxt if nxt == prev else -1, partner],
    )
