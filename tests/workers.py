"""Worker functions run in each rank by tests.multiproc.run_ranks (importable by name)."""

from __future__ import annotations

import threading

K = 5  # elements per rank in the scenarios
FLOAT = 4  # bytes of float32


def scenarios(rank: int, n: int):
    """(name, op recorded, call, expected bytes, expected dtype, expected peer) per scenario."""
    import torch
    import torch.distributed as dist

    def t(numel=K, value=1.0):
        return torch.full((numel,), float(value))

    peer = 1 - rank if n == 2 else (rank + 1) % n
    prev = (rank - 1) % n
    obj = {"rank": rank, "payload": list(range(10))}

    def sendrecv():
        if rank == 0:
            dist.send(t(), dst=1)
        elif rank == 1:
            dist.recv(t(), src=0)

    def isendirecv():
        if rank == 0:
            dist.isend(t(), dst=1).wait()
        elif rank == 1:
            dist.irecv(t(), src=0).wait()

    def batch():
        recv = t(value=-1)
        ops = [dist.P2POp(dist.isend, t(value=rank), peer), dist.P2POp(dist.irecv, recv, prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert recv[0].item() == prev, "batch_isend_irecv delivered the wrong data"

    def objs_p2p():
        if rank == 0:
            dist.send_object_list([obj], dst=1)
        elif rank == 1:
            out = [None]
            dist.recv_object_list(out, src=0)
            assert out[0]["rank"] == 0

    only01 = rank in (0, 1)
    nk = n * K * FLOAT
    return [
        ("all_reduce", "all_reduce", lambda: dist.all_reduce(t()), K * FLOAT, "float32", -1, True),
        (
            "all_reduce_async",
            "all_reduce",
            lambda: dist.all_reduce(t(), async_op=True).wait(),
            K * FLOAT,
            "float32",
            -1,
            True,
        ),
        (
            "all_reduce_coalesced",
            "all_reduce_coalesced",
            lambda: dist.all_reduce_coalesced([t(), t(2 * K)]),
            3 * K * FLOAT,
            "float32",
            -1,
            True,
        ),
        ("all_gather", "all_gather", lambda: dist.all_gather([t() for _ in range(n)], t()), nk, "float32", -1, True),
        (
            "all_gather_into_tensor",
            "all_gather_into_tensor",
            lambda: dist.all_gather_into_tensor(t(n * K), t()),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "all_gather_single",
            "all_gather_single",
            lambda: dist.all_gather_single(t(n * K), t()),
            nk,
            "float32",
            -1,
            True,
        ),
        ("_all_gather_base", "_all_gather_base", lambda: dist._all_gather_base(t(n * K), t()), nk, "float32", -1, True),
        (
            "all_gather_coalesced",
            "all_gather_coalesced",
            lambda: dist.all_gather_coalesced([[t()] for _ in range(n)], [t()]),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "all_gather_object",
            "all_gather_object",
            lambda: dist.all_gather_object([None] * n, obj),
            None,
            "object",
            -1,
            True,
        ),
        (
            "reduce_scatter",
            "reduce_scatter",
            lambda: dist.reduce_scatter(t(), [t() for _ in range(n)]),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "reduce_scatter_tensor",
            "reduce_scatter_tensor",
            lambda: dist.reduce_scatter_tensor(t(), t(n * K)),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "reduce_scatter_single",
            "reduce_scatter_single",
            lambda: dist.reduce_scatter_single(t(), t(n * K)),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "_reduce_scatter_base",
            "_reduce_scatter_base",
            lambda: dist._reduce_scatter_base(t(), t(n * K)),
            nk,
            "float32",
            -1,
            True,
        ),
        ("broadcast", "broadcast", lambda: dist.broadcast(t(), src=0), K * FLOAT, "float32", 0, True),
        (
            "broadcast_object_list",
            "broadcast_object_list",
            lambda: dist.broadcast_object_list([obj], src=0),
            None,
            "object",
            0,
            True,
        ),
        ("reduce", "reduce", lambda: dist.reduce(t(), dst=0), K * FLOAT, "float32", 0, True),
        (
            "all_to_all",
            "all_to_all",
            lambda: dist.all_to_all([t() for _ in range(n)], [t() for _ in range(n)]),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "all_to_all_single",
            "all_to_all_single",
            lambda: dist.all_to_all_single(t(n * K), t(n * K)),
            nk,
            "float32",
            -1,
            True,
        ),
        (
            "gather",
            "gather",
            lambda: dist.gather(t(), [t() for _ in range(n)] if rank == 0 else None, dst=0),
            nk,
            "float32",
            0,
            True,
        ),
        (  # torch 2.15; gloo: "does not support" (NCCL >= 2.28.3 runs it): one error row, as called
            "gather_single",
            "gather_single",
            lambda: dist.gather_single(t(), t(n * K) if rank == 0 else None, dst=0),
            nk,
            "float32",
            0,
            True,
        ),
        (  # its alias, which calls it: one row, the outer call's
            "gather_into_tensor",
            "gather_into_tensor",
            lambda: dist.gather_into_tensor(t(), t(n * K) if rank == 0 else None, dst=0),
            nk,
            "float32",
            0,
            True,
        ),
        (
            "gather_object",
            "gather_object",
            lambda: dist.gather_object(obj, [None] * n if rank == 0 else None, dst=0),
            None,
            "object",
            0,
            True,
        ),
        (
            "scatter",
            "scatter",
            lambda: dist.scatter(t(), [t() for _ in range(n)] if rank == 0 else None, src=0),
            nk,
            "float32",
            0,
            True,
        ),
        (
            "scatter_object_list",
            "scatter_object_list",
            lambda: dist.scatter_object_list([None], [obj] * n if rank == 0 else None, src=0),
            None,
            "object",
            0,
            True,
        ),
        ("barrier", "barrier", lambda: dist.barrier(), 0, "none", -1, True),
        ("monitored_barrier", "monitored_barrier", lambda: dist.monitored_barrier(), 0, "none", -1, True),
        ("send_recv", "send" if rank == 0 else "recv", sendrecv, K * FLOAT, "float32", 1 - rank, only01),
        ("isend_irecv", "isend" if rank == 0 else "irecv", isendirecv, K * FLOAT, "float32", 1 - rank, only01),
        # the peer every op names (2 ranks: next == prev), -1 when several (a ring of 4)
        ("batch_isend_irecv", "batch_isend_irecv", batch, 2 * K * FLOAT, "float32", peer if peer == prev else -1, True),
        (
            "object_p2p",
            "send_object_list" if rank == 0 else "recv_object_list",
            objs_p2p,
            None,
            "object",
            1 - rank,
            only01,
        ),
    ]


def all_ops(rank: int, world_size: int):
    """Each scenario inside its own capture(); returns {scenario: (rows, expectation, error)}."""
    import torch.distributed as dist

    import commpatch

    out = {}
    commpatch.enable(output="none")
    for name, op, call, nbytes, dtype, peer, participates in scenarios(rank, world_size):
        error = None
        exp = dict(
            op=op, bytes=nbytes, dtype=dtype, peer=peer, participates=participates, present=hasattr(dist, op)
        )  # an older torch lacks some (all_gather_single < 2.5)
        if not exp["present"]:
            out[name] = (None, exp, None)
            continue
        with commpatch.capture() as cap:
            try:
                call()
            except Exception as exc:  # unsupported by gloo: must surface unchanged
                error = f"{type(exc).__name__}: {exc}"
        out[name] = (cap.df, exp, error)
    commpatch.disable()
    return out


def two_threads(rank: int, world_size: int, calls: int = 200):
    """Two threads issue collectives on two separate groups at once."""
    import torch
    import torch.distributed as dist

    import commpatch

    groups = [dist.new_group(list(range(world_size))) for _ in range(2)]
    commpatch.enable(output="none")

    def issue(group, value):
        t = torch.ones(3)
        for _ in range(calls):
            dist.all_reduce(t * value, group=group)

    threads = [threading.Thread(target=issue, args=(g, i + 1)) for i, g in enumerate(groups)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    df = commpatch.log()
    commpatch.disable()
    return df


def coalescing(rank: int, world_size: int):
    """Collectives inside _coalescing_manager, each scenario with the profiler as witness:
    {scenario: (rows, gloo ops the profiler saw, results correct)}, and the internal errors."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager as bound_before_enable
    from torch.profiler import profile

    import commpatch
    from tests.integration_workers import witness_counts

    commpatch.enable(output="none")
    manager = dist.distributed_c10d._coalescing_manager  # looked up at call time, as torch does
    n, k = world_size, 4
    total = sum(range(1, n + 1))

    def all_reduce_sync():
        xs = [torch.ones(k) * (rank + 1) for _ in range(3)]
        with manager():
            for x in xs:
                dist.all_reduce(x)
        return all(x[0].item() == total for x in xs)

    def all_reduce_async():
        xs = [torch.ones(k) * (rank + 1) for _ in range(3)]
        with manager(async_ops=True) as cm:
            for x in xs:
                dist.all_reduce(x, async_op=True)  # returns torch's _IllegalWork placeholder
        cm.wait()
        return all(x[0].item() == total for x in xs)

    def all_gather():
        outs = [torch.zeros(n * k) for _ in range(2)]
        with manager():
            for out in outs:
                dist.all_gather_into_tensor(out, torch.full((k,), float(rank)))
        return all(out.tolist() == [float(r) for r in range(n) for _ in range(k)] for out in outs)

    def reduce_scatter_async():
        outs = [torch.zeros(k) for _ in range(2)]
        with manager(async_ops=True) as cm:
            for out in outs:
                dist.reduce_scatter_tensor(out, torch.ones(n * k))
        cm.wait()
        return all(out[0].item() == n for out in outs)

    def with_a_broadcast():  # broadcast does not queue: it runs (and is recorded) at once
        x, b = torch.ones(k), torch.ones(2)
        with manager():
            dist.all_reduce(x)
            dist.broadcast(b, src=0)
        return x[0].item() == n

    def bound_early():  # bound before enable(): not wrapped, one row per queued call
        xs = [torch.ones(k) for _ in range(3)]
        with bound_before_enable():
            for x in xs:
                dist.all_reduce(x)
        return all(x[0].item() == n for x in xs)

    out = {}
    for fn in (all_reduce_sync, all_reduce_async, all_gather, reduce_scatter_async, with_a_broadcast, bound_early):
        with commpatch.capture() as cap, profile() as prof:
            ok = fn()
        out[fn.__name__] = (cap.df, witness_counts(prof), ok)
    commpatch.disable()
    return out, commpatch.internal_errors()


def errors_propagate(rank: int, world_size: int):
    """A collective torch rejects raises the same exception, and leaves a status=error row."""
    import torch
    import torch.distributed as dist

    import commpatch

    raw = dist.all_gather_into_tensor
    results = {}
    for patched in (False, True):
        if patched:
            commpatch.enable(output="none")
        try:
            (dist.all_gather_into_tensor)(torch.zeros(3), torch.ones(2))  # wrong output size
        except Exception as exc:  # noqa: BLE001
            results[patched] = (type(exc), str(exc))
    df = commpatch.log()
    commpatch.disable()
    assert raw is dist.all_gather_into_tensor
    return results, df


def non_member(rank: int, world_size: int):
    """A rank outside a subgroup records nothing for that subgroup's calls."""
    import torch
    import torch.distributed as dist

    import commpatch

    sub = dist.new_group([0, 1])
    commpatch.enable(output="none")
    dist.all_reduce(torch.ones(2), group=sub)
    dist.all_reduce(torch.ones(2))
    df = commpatch.log()
    commpatch.disable()
    return df
