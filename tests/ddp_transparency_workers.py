"""Workers for tests/test_ddp_transparency.py (run in each rank by tests.multiproc.run_ranks).

Every case trains the same tiny model twice in the same ranks, with the same seeds: once
without commpatch, once with ``commpatch.enable(output="none")``, and reports whether every
gradient of every step is bit-identical, how DDP's own logging data differ (timings aside),
what each run raised, and the bucket rows commpatch recorded. Most cases run on a group of 3
ranks, where scaling by 1/3 and dividing by 3 differ in the last bit of about a third of the
values: a wrong divisor or a wrong operation shows. A few need 4 ranks (a power of two, so
that a divisor of 3 appears only once a rank joins). Outcomes are returned, never raised, so
one broken case hides no other.
"""

from __future__ import annotations

import contextlib
import time
import traceback

STEPS = 2
SMALL_BUCKETS = 0.0002  # MB: a few parameters per bucket, several buckets


def _model(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    class Model(torch.nn.Module):
        """``unused``: ``u`` never used; ``sometimes``: ``u`` used on odd calls only;
        ``sparse``: a sparse embedding (its own bucket, reduced as a sparse tensor)."""

        def __init__(self):
            super().__init__()
            self.calls = 0
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 4)
            if kind != "sparse":
                self.u = torch.nn.Linear(8, 4)
            else:
                self.emb = torch.nn.Embedding(10, 16, sparse=True)

        def forward(self, x):
            self.calls += 1
            h = torch.relu(self.a(x))
            if kind == "sparse":
                h = h + self.emb((x[:, 0].abs() * 3).long().clamp(0, 9))
            out = self.b(h)
            if kind == "sometimes" and self.calls % 2:
                out = out + self.u(x)
            return out

    return Model()


# name -> how to train: DDP keyword arguments, model kind, the step (0-based) before which
# something is registered, how gradients are zeroed, join, no_sync micro-batches
CASES = {
    "default": {},
    "join_initial": dict(join=True),
    "join_running": dict(join=False),  # divisor: ranks still running
    "static_graph": dict(ddp=dict(static_graph=True)),
    "bucket_view": dict(ddp=dict(gradient_as_bucket_view=True)),
    "bucket_view_kept": dict(ddp=dict(gradient_as_bucket_view=True), set_to_none=False, no_sync=True),
    "bucket_view_mixed": dict(
        ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=25), set_to_none=False, none_first=True
    ),  # one bucket: some grads views, some not
    "bucket_view_join": dict(ddp=dict(gradient_as_bucket_view=True), set_to_none=False, join=False),
    "no_sync": dict(no_sync=True),
    "find_unused": dict(ddp=dict(find_unused_parameters=True), kind="unused"),
    "find_unused_view_accum": dict(
        ddp=dict(find_unused_parameters=True, gradient_as_bucket_view=True), kind="sometimes", no_step=True
    ),
    "sparse": dict(kind="sparse"),
    "mixed_precision": dict(mixed_precision=True),
    "user_hook_early": dict(register=("user", 0)),
    "user_hook_late": dict(register=("user", 1)),
    "builtin_allreduce_late": dict(register=("allreduce", 1)),
    "builtin_fp16_late": dict(register=("fp16", 1)),
    "builtin_fp16_early": dict(register=("fp16", 0)),
    "fused_optimizer_late": dict(register=("fused", 1)),
    "optimizer_in_backward": dict(in_backward=True),
    "registered_twice": dict(register=("user", 1), twice=True),
    "late_after_disable": dict(register=("user", 1), disable_before=1),
}


def _register(ddp, what: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if what == "user":
        ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
    elif what == "allreduce":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif what == "fp16":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    elif what == "fused":  # its hook reduces over the default group: 4 ranks
        ddp._register_fused_optim(torch.optim.SGD, 0.1)


def _train(rank: int, group, cfg: dict, on_step=None) -> dict:
    """One run of a case: every step's gradients (None kept), what it raised, logging data."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {"grads": [], "raised": None, "raised_twice": None, "logging": {}}
    kwargs = dict(bucket_cap_mb=SMALL_BUCKETS, process_group=group)
    kwargs.update(cfg.get("ddp", {}))
    try:
        model = _model(cfg.get("kind", "mlp"))
        if cfg.get("in_backward"):
            from torch.distributed.optim import _apply_optimizer_in_backward

            _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        if cfg.get("mixed_precision"):
            from torch.nn.parallel.distributed import _MixedPrecision

            kwargs["mixed_precision"] = _MixedPrecision(
                param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16
            )
        ddp = DDP(model, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        steps = STEPS
        join = cfg.get("join")
        if join is not None:
            steps = 1 + rank  # uneven inputs: ranks join one after another
        ctx = ddp.join(divide_by_initial_world_size=join) if join is not None else contextlib.nullcontext()
        what, at = cfg.get("register", (None, -1))
        with ctx:
            for step in range(steps):
                if on_step is not None:
                    on_step(step)
                if step == at:
                    _register(ddp, what)
                    if cfg.get("twice"):
                        try:
                            _register(ddp, what)
                        except Exception as exc:  # noqa: BLE001
                            out["raised_twice"] = f"{type(exc).__name__}: {exc}"
                if cfg.get("no_sync") and step % 2 == 0:
                    with ddp.no_sync():
                        ddp(torch.randn(4, 8, generator=gen)).sum().backward()
                ddp(torch.randn(4, 8, generator=gen)).sum().backward()
                out["grads"].append([None if p.grad is None else p.grad.clone() for p in ddp.parameters()])
                if cfg.get("no_step"):  # gradients accumulate across steps
                    continue
                opt.step()
                opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
                if cfg.get("none_first"):
                    next(ddp.parameters()).grad = None
        out["logging"] = {k: v for k, v in ddp._get_ddp_logging_data().items() if "time" not in k and "avg" not in k}
    except Exception as exc:  # noqa: BLE001
        out["raised"] = f"{type(exc).__name__}: {exc}"
    return out


def _identical(a: list, b: list) -> bool:
    import torch

    def dense(t):
        return t.to_dense() if t.is_sparse else t

    if len(a) != len(b):
        return False
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb):
            if (x is None) != (y is None) or (x is not None and not torch.equal(dense(x), dense(y))):
                return False
    return True


def transparency(rank: int, world_size: int, cases: tuple = (), four_rank_cases: tuple = ()) -> dict:
    """4 ranks: ``cases`` on a group of ranks 0-2 (rank 3 waits), then ``four_rank_cases`` on all
    four. Each case without, then with commpatch; a summary per case."""
    import torch.distributed as dist

    import commpatch

    three = dist.new_group([0, 1, 2])
    results = {}
    if rank < 3:
        results.update(_run(rank, three, cases))
    dist.barrier()
    results.update({f"{name}@4": out for name, out in _run(rank, None, four_rank_cases).items()})
    results["_internal_errors"] = commpatch.internal_errors()
    return results


def _run(rank: int, group, cases: tuple) -> dict:
    import commpatch

    results = {}
    for name in cases:
        cfg = CASES[name]
        t0 = time.perf_counter()
        try:
            plain = _train(rank, group, cfg)
            disable_before = cfg.get("disable_before")

            def on_step(step, disable_before=disable_before):
                if step == disable_before:
                    commpatch.disable()

            commpatch.reset()
            commpatch.enable(output="none")
            try:
                patched = _train(rank, group, cfg, on_step if disable_before is not None else None)
                df = commpatch.log()
            finally:
                commpatch.disable()
            logging_diff = {
                k: (plain["logging"].get(k), patched["logging"].get(k))
                for k in set(plain["logging"]) | set(patched["logging"])
                if plain["logging"].get(k) != patched["logging"].get(k)
            }
            results[name] = dict(
                identical=_identical(plain["grads"], patched["grads"]),
                steps=len(plain["grads"]),
                raised=(plain["raised"], patched["raised"]),
                raised_twice=(plain["raised_twice"], patched["raised_twice"]),
                logging_diff=logging_diff,
                comm_hook=(plain["logging"].get("comm_hook"), patched["logging"].get("comm_hook")),
                bucket_rows=int((df["op"] == "ddp_bucket_allreduce").sum()) if len(df) else 0,
                hook_rows=int((df["bucket"] >= 0).sum()) if len(df) else 0,
                seconds=time.perf_counter() - t0,
            )
        except Exception:  # noqa: BLE001
            results[name] = dict(error=traceback.format_exc())
    return results
