"""Workers for tests/test_integrations_*.py (run in each rank by tests.multiproc.run_ranks).

Each scenario runs once with an independent witness on the same run: torch.profiler's
``gloo:<op>`` events (what gloo actually executed) and/or CommDebugMode's counts.
"""

from __future__ import annotations

import contextlib
from collections import Counter


def witness_counts(prof) -> Counter:
    """gloo ops the profiler saw: {'all_reduce': 4, ...}."""
    return Counter(e.name[len("gloo:") :] for e in prof.events() if e.name.startswith("gloo:"))


def settle_gloo(seconds: float = 0.2) -> None:
    """A pause before the profiler stops: it records a gloo work's event from gloo's thread when
    the work ends, which can be after the work's future woke the caller (DDP's last bucket): on
    torch 2.4 the witness was one all_reduce short twice in full suite runs (not reproduced in 16
    runs of the scenario alone)."""
    import time

    time.sleep(seconds)


def claimed_counts(df) -> Counter:
    """gloo ops commpatch's rows say ran (integration ops declare what they issue underneath)."""
    from commpatch.data.ops import BY_NAME

    out = Counter()
    for op in df["op"].astype(str):
        runs = BY_NAME[op].runs or GLOO_RUNS.get(op, (op,))
        out.update(runs)
    return out


# torch.distributed functions whose gloo kernels have other names, or that issue several
# (gloo runs reduce_scatter_single, and what is built on it, as an all_reduce of the full input)
GLOO_RUNS = {
    "all_gather_into_tensor": ("all_gather",),
    "all_gather_single": ("all_gather",),
    "reduce_scatter_tensor": ("all_reduce",),
    "reduce_scatter_single": ("all_reduce",),
    "isend": ("send",),
    "irecv": ("recv",),
    "send_object_list": ("send", "send"),
    "recv_object_list": ("recv", "recv"),
    "all_gather_object": ("all_gather", "all_gather"),
}


# bytes per element of the scalar types the profiler names (kineto events' dtypes())
_ITEMSIZE = {
    "float": 4,
    "double": 8,
    "int": 4,
    "long": 8,
    "long int": 8,
    "long long": 8,
    "short": 2,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


def witness_bytes(prof, world_size) -> Counter:
    """Bytes per gloo op the profiler saw (record_shapes=True), as nccl-tests counts S: the
    tensors given, all_gather times the group size (gloo's event shows the local input)."""
    import math

    out = Counter()
    for e in prof.profiler.kineto_results.events():
        if e.name().startswith("gloo:"):
            op = e.name()[len("gloo:") :]
            n = sum(math.prod(shape) * _ITEMSIZE[dtype] for shape, dtype in zip(e.shapes(), e.dtypes()))
            out[op] += n * (world_size if op == "all_gather" else 1)
    return out


def claimed_bytes(df) -> Counter:
    """Bytes per gloo op commpatch's rows say ran (rows of ops that issue one collective)."""
    from commpatch.data.ops import BY_NAME

    out = Counter()
    for op, n in zip(df["op"].astype(str), df["bytes"]):
        runs = BY_NAME[op].runs or GLOO_RUNS.get(op, (op,))
        assert len(runs) == 1, op
        out[{"reduce_scatter": "all_reduce"}.get(runs[0], runs[0])] += int(n)
    return out


def python_kernel(op: str) -> bool:
    """A Python kernel (commpatch's, patch/dispatch.py) is registered for ``op``: at its key torch
    otherwise has a fallthrough registered in C++."""
    import torch

    line = next(ln for ln in torch._C._dispatch_dump_table(op).splitlines() if ln.startswith("ADInplaceOrView:"))
    # a kernel of its own ("registered at <file>:<line> [kernel]": the Python file on torch >= 2.5,
    # /dev/null on 2.4), not torch's "fallthrough registered at ... [backend fallback]"
    return "fallthrough" not in line and line.rstrip().endswith("[kernel]")


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _same_steps(a, b) -> bool:
    """Two runs' per-step lists of tensors (None where a gradient is undefined) equal bit for bit."""
    import torch

    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for xs, ys in zip(a, b)
        for x, y in zip(xs, ys)
    )


def _train(ddp, rank, steps=4, accumulate=True):
    """Steps of SGD; the first step accumulates one micro-batch under no_sync(). Returns grads."""
    import torch

    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        if accumulate and step == 0:
            with ddp.no_sync():
                ddp(torch.randn(4, 8, generator=gen)).sum().backward()
        ddp(torch.randn(4, 8, generator=gen)).sum().backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def ddp_default(rank, world_size):
    """Bucket rows, witness counts and bit-identical gradients against an uninstrumented run."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile

    import commpatch

    reference = _train(DDP(_model(), bucket_cap_mb=0.0002), rank)
    commpatch.enable(output="none")
    with _counting_installs() as installs, profile(record_shapes=True) as prof:
        ddp = DDP(_model(), bucket_cap_mb=0.0002)  # several buckets
        grads = _train(ddp, rank)
        settle_gloo()
    df = commpatch.log()
    commpatch.disable()
    identical = _same_steps(reference, grads)
    after = _train(ddp, rank, steps=2)  # the hook stays registered: a pass-through now
    return dict(
        df=df,
        witness=witness_counts(prof),
        witness_bytes=witness_bytes(prof, world_size),
        identical=identical,
        rows_after_disable=len(commpatch.log()) - len(df),
        finite=all(g.isfinite().all() for g in after[-1]),
        params=[p.numel() * p.element_size() for p in ddp.parameters()],
        installs=dict(installs),
    )


def ddp_batched_copy(rank, world_size):
    """DDP(batched_grad_copy=True) (newer torch): without a hook the reducer copies a bucket's
    gradients unscaled and divides the flat bucket once (``x / d``), not ``x * (1/d)`` as it scales
    them one by one: gradients under commpatch, through its C hook and through its Python hook,
    against the same training without commpatch, with and without gradient_as_bucket_view. None
    where this torch's DDP has no such argument."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch
    from commpatch.integrations import ddp as cp_ddp

    if "batched_grad_copy" not in inspect.signature(DDP.__init__).parameters:
        return None
    out = {}
    for view in (False, True):

        def make(view=view):
            return DDP(_model(), bucket_cap_mb=0.0002, batched_grad_copy=True, gradient_as_bucket_view=view)

        reference = _train(make(), rank)
        commpatch.enable(output="none")
        try:
            grads = {"C hook": _train(make(), rank)}
            bucket_hook, cp_ddp.bucket_hook = cp_ddp.bucket_hook, lambda *args, **kwargs: None
            try:
                grads["Python hook"] = _train(make(), rank)
            finally:
                cp_ddp.bucket_hook = bucket_hook
            buckets = int((commpatch.log()["op"] == "ddp_bucket_allreduce").sum())
        finally:
            commpatch.disable()
            commpatch.reset()
        for path, got in grads.items():
            out[(view, path)] = _same_steps(reference, got)
        out[(view, "buckets")] = buckets
    return out


def ddp_lazy_buckets(rank, world_size):
    """DDP(lazy_bucket_allocation=True, gradient_as_bucket_view=True) (newer torch): a bucket gets
    its storage when its first gradient is marked ready, and the gradients defined then become its
    views (divided in place, ``x / d``), the others are copied in (``x * (1/d)``). Gradients under
    commpatch against the same training without it, per case: {case: (identical, bucket rows)}.
    None where this torch's DDP has no such argument."""
    import inspect

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    if "lazy_bucket_allocation" not in inspect.signature(DDP.__init__).parameters:
        return None

    class Net(torch.nn.Module):
        def __init__(self, unused):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
            self.u = torch.nn.Linear(4, 4) if unused else None  # never used: find_unused / static graph
            self.reentrant = False  # block b under a reentrant checkpoint: a backward inside the backward

        def forward(self, x):
            h = torch.relu(self.a(x))
            if self.reentrant:
                from torch.utils.checkpoint import checkpoint

                h = checkpoint(self.b, h, use_reentrant=True)
            else:
                h = self.b(h)
            return self.c(torch.relu(h))

    def train(case):
        opts = dict(case)
        unused, to_none, accumulate = opts.pop("unused", False), opts.pop("to_none", True), opts.pop("no_sync", False)
        net = Net(unused)
        net.reentrant = opts.pop("reentrant", False)
        ddp = DDP(net, bucket_cap_mb=0.0004, gradient_as_bucket_view=True, lazy_bucket_allocation=True, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        grads = []
        for step in range(5):
            if accumulate and step % 2 == 0:
                with ddp.no_sync():
                    ddp(torch.randn(4, 8, generator=gen)).sum().backward()
            ddp(torch.randn(4, 8, generator=gen)).sum().backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in ddp.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=to_none)
        return grads

    cases = {
        "default": {},
        "zero_grad(set_to_none=False)": {"to_none": False},
        "find_unused_parameters": {"find_unused_parameters": True, "unused": True},
        "static_graph": {"static_graph": True, "unused": True},
        "static_graph, reentrant checkpoint": {"static_graph": True, "reentrant": True},
        "no_sync accumulation": {"no_sync": True},
    }
    out = {}
    for name, case in cases.items():
        reference = train(case)
        commpatch.enable(output="none")
        try:
            got = train(case)
            buckets = int((commpatch.log()["op"] == "ddp_bucket_allreduce").sum())
        finally:
            commpatch.disable()
            commpatch.reset()
        out[name] = (_same_steps(reference, got), buckets)
    return out


def ddp_c_and_python_paths(rank, world_size):
    """The same DDP training twice under commpatch: buckets through the C comm hook (when built),
        then through the Python one (``bucket_hook`` made to decline, ``rows.Packing`` for the packing); the seq ranges of each, how often
        the Python default hook ran in each, and whether the gradients agree (also with commpatch's own
        error injected after each last bucket: its internal error counts; that model's first forward
    runs under inference_mode())."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch
    from commpatch.integrations import ddp as cp_ddp
    from commpatch.record import rows

    calls, phase = Counter(), ["c"]
    default_hook, bucket_hook, packing = cp_ddp._default_hook, cp_ddp.bucket_hook, cp_ddp.packing

    def counting(*args, **kwargs):
        calls[phase[0]] += 1
        return default_hook(*args, **kwargs)

    commpatch.enable(output="none")
    cp_ddp._default_hook = counting
    try:
        lo = rows.peek_seq()
        grads_c = _train(DDP(_model(), bucket_cap_mb=0.0002), rank)
        mid = rows.peek_seq()
        phase[0] = "python"
        cp_ddp.bucket_hook = lambda *args, **kwargs: None
        cp_ddp.packing = lambda log: rows.Packing(log.packs, rows.STATE)
        grads_py = _train(DDP(_model(), bucket_cap_mb=0.0002), rank)
        hi = rows.peek_seq()
    finally:
        cp_ddp._default_hook, cp_ddp.bucket_hook, cp_ddp.packing = default_hook, bucket_hook, packing
    # commpatch's own error inside the hook (after the last bucket): counted, never the user's
    time_finalize = cp_ddp._time_finalize

    def broken(*args):
        raise RuntimeError("injected")

    cp_ddp._time_finalize = broken
    try:
        model = DDP(_model(), bucket_cap_mb=0.0002)
        with torch.inference_mode():  # commpatch installs at this first forward: packing timed anyway
            model(torch.randn(4, 8))
        grads_fault = _train(model, rank)
    finally:
        cp_ddp._time_finalize = time_finalize
    unpacked = rows.peek_seq()
    commpatch.disable()
    commpatch.enable(output="none", ddp_packing=False)  # COMMPATCH_DDP_PACKING=0: no packing timed
    _train(DDP(_model(), bucket_cap_mb=0.0002), rank)
    df = commpatch.log()
    commpatch.disable()
    identical = all(_same_steps(grads_c, runs) for runs in (grads_py, grads_fault))
    return dict(
        df=df,
        lo=lo,
        mid=mid,
        hi=hi,
        unpacked=unpacked,
        calls=dict(calls),
        c_rows=rows.C_ROWS,
        identical=identical,
        errors=commpatch.internal_errors(),
    )


@contextlib.contextmanager
def _counting_installs():
    """How many times DDP's dispatcher kernels were put in place, per kind (each costs ~150 us)."""
    from commpatch.integrations import ddp as cp_ddp

    counts, install = Counter(), cp_ddp._inner_kernels

    def counting(log, ops, kind, *args, **kwargs):
        counts[kind] += 1
        return install(log, ops, kind, *args, **kwargs)

    cp_ddp._inner_kernels = counting
    try:
        yield counts
    finally:
        cp_ddp._inner_kernels = install


def ddp_unused(rank, world_size):
    """find_unused_parameters=True with a branch that is never used: the constructor and 5 steps
    under the profiler; the dispatcher kernels present only while the reducer's bitmap
    all-reduce is due (in backward), never after a step or after disable()."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile

    import commpatch

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.unused = _model(), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.body(x)

    commpatch.enable(output="none")
    kernels_between_steps = []
    with _counting_installs() as installs, profile(record_shapes=True) as prof:
        ddp = DDP(Branchy(), find_unused_parameters=True, bucket_cap_mb=0.0002)
        for _ in range(5):
            ddp(torch.randn(4, 8)).sum().backward()
            kernels_between_steps.append(python_kernel("c10d::allreduce_") or python_kernel("c10d::broadcast_"))
        settle_gloo()
    df = commpatch.log()
    commpatch.disable()
    return dict(
        df=df,
        witness=witness_counts(prof),
        witness_bytes=witness_bytes(prof, world_size),
        kernels_between_steps=kernels_between_steps,
        errors=commpatch.internal_errors(),
        params=[p.numel() * p.element_size() for p in ddp.parameters()],
        installs=dict(installs),
    )


def compiled_coalesced(rank, world_size):
    """A coalesced functional all-reduce in a graph compiled with fullgraph=True (aot_eager), 3 calls,
    then one in eager code waited for with ``funcol.wait_tensors`` where torch has it (2.15: compiled
    code waits a coalesced result with ``_c10d_functional.wait_tensors``), else by using both
    results. Returns the rows (op, duration) and whether the outputs equal the eager function's."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import commpatch

    def step(a, b):
        x, y = funcol.all_reduce_coalesced([a * 2, b * 3], "sum", dist.group.WORLD)
        return x + 1, y + 1

    eager = [step(torch.ones(8), torch.ones(16)) for _ in range(3)]
    commpatch.enable(output="none")
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = [compiled(torch.ones(8), torch.ones(16)) for _ in range(3)]
    outs = funcol.all_reduce_coalesced([torch.ones(4), torch.ones(4)], "sum", dist.group.WORLD)
    if hasattr(funcol, "wait_tensors"):
        outs = funcol.wait_tensors(outs)
    total = float((outs[0] + outs[1]).sum())
    commpatch.disable()
    df = commpatch.log()
    equal = _same_steps(eager, got)
    return dict(rows=list(zip(df["op"].astype(str), df["duration_us"])), equal=equal, total=total)


def compiled_tp(rank, world_size):
    """A tensor-parallel MLP compiled with inductor (fullgraph=True), and a functional collective
    whose autograd formula issues one in backward; the profiler as witness."""
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.profiler import profile

    import commpatch
    from commpatch.integrations import compiled

    mesh = init_device_mesh("cpu", (world_size,))

    def tp_mlp():
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        return parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def step(model):
        inp = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        out = model(inp)
        out.sum().backward()
        return [out.detach()] + [inp.grad] + [p.grad.to_local() for p in model.parameters()]

    eager = step(tp_mlp())
    commpatch.enable(output="none")
    out = {"installed_before_compile": compiled._KERNELS.installed}
    model = tp_mlp()
    cmodel = torch.compile(model, fullgraph=True)
    with commpatch.capture() as cap, profile(record_shapes=True) as prof:
        first = step(cmodel)  # compiles forward and backward, then runs them
        for p in model.parameters():
            p.grad = None
        second = step(cmodel)
    out["tp"] = (cap.df, witness_counts(prof), witness_bytes(prof, world_size))
    out["equal_eager"] = all(torch.equal(a, b) for a, b in zip(eager, first)) and all(
        torch.equal(a, b) for a, b in zip(eager, second)
    )

    x = torch.ones(4, 3, requires_grad=True)
    with commpatch.capture() as cap, profile(record_shapes=True) as prof:
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd  # < 2.5
        y = gather(x * (rank + 1), 0, mesh)
        (funcol.wait_tensor(y) * 2).sum().backward()
    out["formula"] = (cap.df, witness_counts(prof), witness_bytes(prof, world_size), x.grad.flatten().tolist())
    commpatch.disable()
    out["kernel_after_disable"] = python_kernel("_c10d_functional::all_reduce_")
    out["errors"] = commpatch.internal_errors()
    return out


def ddp_hooks(rank, world_size):
    """User hooks, builtin hooks and enabling after the model is built."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpatch

    out = {}
    built_before = DDP(_model())
    commpatch.enable(output="none")
    for name in ("built_before", "user_fp16", "builtin_allreduce", "no_sync_only"):
        with commpatch.capture() as cap:
            if name == "built_before":
                _train(built_before, rank, steps=2, accumulate=False)
            elif name == "user_fp16":
                ddp = DDP(_model())
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                _train(ddp, rank, steps=2, accumulate=False)
            elif name == "builtin_allreduce":
                ddp = DDP(_model())
                ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
                _train(ddp, rank, steps=2, accumulate=False)
            else:
                ddp = DDP(_model())
                with ddp.no_sync():
                    for _ in range(3):
                        import torch

                        ddp(torch.randn(2, 8)).sum().backward()
        out[name] = cap.df
    commpatch.disable()
    return out


def functional(rank, world_size):
    """Functional collectives and a tensor-parallel MLP, with the profiler and CommDebugMode."""
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    from tests.torch_compat import comm_debug_mode, dtensor

    Replicate, Shard, distribute_tensor = dtensor().Replicate, dtensor().Shard, dtensor().distribute_tensor
    CommDebugMode = comm_debug_mode()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.profiler import profile

    import commpatch

    mesh = init_device_mesh("cpu", (world_size,))  # torch.distributed.tensor imported before enable()
    commpatch.enable(output="none")
    out = {}
    x = torch.ones(4, 6) * (rank + 1)
    with commpatch.capture() as cap, profile() as prof:
        a = funcol.all_reduce(x, "sum", mesh)
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.5
        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        b = gather(x, 0, mesh)
        c = scatter(x, "sum", 0, mesh)
        d = funcol.all_to_all_single(x, None, None, mesh)
        values = [float(r.wait().sum()) for r in (a, b, c, d)]  # every lazy wait completes
    out["funcol"] = (cap.df, witness_counts(prof), values)

    with commpatch.capture() as cap, profile() as prof:
        full = torch.arange(24.0).reshape(4, 6)
        dt_shard = distribute_tensor(full, mesh, [Shard(0)])
        dt_rep = distribute_tensor(full, mesh, [Replicate()])
        gathered = dt_shard.redistribute(mesh, [Replicate()]).to_local()
    out["distribute"] = (
        cap.df,
        witness_counts(prof),
        torch.equal(gathered, full) and dt_rep.to_local().shape == full.shape,
    )

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    inp = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    comm_mode = CommDebugMode()
    with commpatch.capture() as cap, profile() as prof, comm_mode:
        mlp(inp).sum().backward()
    counts = {str(k): v for k, v in comm_mode.get_comm_counts().items()}
    out["tp_mlp"] = (cap.df, witness_counts(prof), counts)

    import torch.distributed as dist

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(t):
        dist.all_reduce(t)
        return t * 2

    with commpatch.capture() as cap, profile() as prof:
        compiled(torch.ones(4))
    out["compiled"] = (cap.df, witness_counts(prof))
    commpatch.disable()
    return out


def pipeline(rank, world_size):
    """A two-stage GPipe schedule runs unchanged while patched; send/recv rows carry the peer."""
    import torch
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.profiler import profile

    import commpatch
    from tests.torch_compat import pipeline_stage

    torch.manual_seed(0)
    stage_mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    commpatch.enable(output="none")
    stage = pipeline_stage(stage_mod, rank, world_size, (2, 8))  # torch 2.4 needs a microbatch's shape
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.sum())
    x = torch.randn(4, 8)
    with commpatch.capture() as cap, profile(record_shapes=True) as prof:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=torch.zeros(4, 8))
    commpatch.disable()
    return cap.df, witness_counts(prof), witness_bytes(prof, world_size)


def _fsdp_train(model, steps=2):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).sum().backward()
        opt.step()
        opt.zero_grad()


def fsdp(rank, world_size):
    """FSDP2 (fully_shard per Linear and the root) and FSDP1 (one unit per Linear), 2 steps each,
    with the profiler as witness; the unit sizes as FSDP sharded them."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.profiler import profile

    import commpatch
    from tests.torch_compat import fsdp2_cpu_unsupported
    from tests.torch_compat import fully_shard as _fully_shard

    commpatch.enable(output="none")
    out = {}
    if fsdp2_cpu_unsupported() is None:
        fully_shard = _fully_shard()
        model = _model()
        for unit in (model[0], model[2], model):
            fully_shard(unit)
        # S of a unit's all-gather / reduce-scatter: every rank's shard (DTensor local shards)
        sharded = {
            name: world_size * 4 * sum(p.to_local().numel() for p in model[int(name)].parameters())
            for name in ("0", "2")
        }
        with commpatch.capture() as cap, profile() as prof:
            _fsdp_train(model)
        out["fsdp2"] = (cap.df, witness_counts(prof), sharded)

    model = FullyShardedDataParallel(
        _model(), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu")
    )
    units = {name: m for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel) and name}
    sharded = {
        name: world_size * 4 * sum(h.flat_param._sharded_size.numel() for h in [m._handle]) for name, m in units.items()
    }
    with commpatch.capture() as cap, profile() as prof:
        _fsdp_train(model)
    out["fsdp1"] = (cap.df, witness_counts(prof), sharded)
    commpatch.disable()
    return out, commpatch.internal_errors()


def _forwarding_backend(store, rank, size, timeout):
    """A backend registered with ``dist.Backend.register_backend``: a Python ProcessGroup that
    forwards what it is asked to a gloo backend of its own (the profiler sees gloo run)."""
    import torch.distributed as dist

    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    class Forwarding(dist.ProcessGroup):
        def getBackendName(self):
            return "forwarding"

        def allreduce(self, tensors, opts):
            return gloo.allreduce(tensors, opts)

        def allgather(self, outputs, inputs, opts=None):  # torch 2.4's all_gather passes no options
            return gloo.allgather(outputs, inputs) if opts is None else gloo.allgather(outputs, inputs, opts)

        def all_gather_single(self, output, input, opts):  # torch >= 2.15's all_gather_object calls it
            return gloo.all_gather_single(output, input, opts)

        def broadcast(self, tensors, opts):
            return gloo.broadcast(tensors, opts)

        def barrier(self, opts):
            return gloo.barrier(opts)

    return Forwarding(rank, size)


def backends(rank, world_size):
    """The same calls on groups of several backend kinds: {backend spec: (rows, gloo ops seen)}."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the 'fake' backend
    from torch.profiler import profile

    import commpatch

    dist.Backend.register_backend("forwarding", _forwarding_backend, devices=["cpu"])
    specs = ("cpu:gloo,cuda:fake", "cpu:fake,cuda:gloo", "forwarding")
    groups = {spec: dist.new_group(backend=spec) for spec in specs}
    commpatch.enable(output="none")
    out = {}
    for spec, group in groups.items():
        with commpatch.capture() as cap, profile() as prof:
            dist.all_reduce(torch.ones(4), group=group)
            dist.barrier(group=group)
            if not spec.startswith("cpu:fake"):  # fake moves no data: no object to unpickle
                dist.all_gather_object([None] * world_size, {"rank": rank}, group=group)
        out[spec] = (cap.df, witness_counts(prof), str(dist.get_backend(group)))
    commpatch.disable()
    return out, commpatch.internal_errors()


class _Synced:
    """Builds a layer that all-reduces a statistic in its forward (as SyncBatchNorm does)."""

    @staticmethod
    def make():
        import torch
        import torch.distributed as dist

        class Synced(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                y = self.lin(x)
                stat = y.detach().mean(0)
                dist.all_reduce(stat)
                return y - stat / dist.get_world_size()

        return Synced()


def module_attribution(rank, world_size):
    """DDP over a model whose submodule issues a collective in forward, an optimizer whose step
    issues one, and a barrier outside both; 2 steps, the profiler as witness."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile

    import commpatch

    class ClipSGD(torch.optim.SGD):
        def step(self, closure=None):
            norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]]).norm()
            dist.all_reduce(norm.reshape(1))  # a global gradient norm, as clipping needs
            return super().step(closure)

    torch.manual_seed(0)
    commpatch.enable(output="none")
    with commpatch.capture() as cap, profile() as prof:
        model = DDP(torch.nn.Sequential(_Synced.make(), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
        opt = ClipSGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        dist.barrier()
    summary = commpatch.summary(cap.df, by=("module", "phase"))
    commpatch.disable()
    return cap.df, witness_counts(prof), summary, commpatch.internal_errors()


WAIT_EVENT = "_c10d_functional::wait_tensor"


def tp_waits(rank, world_size, late_rank=-1, delay_s=0.0, steps=8):
    """A tensor-parallel MLP trained for ``steps`` optimizer steps under torch.profiler; rank
    ``late_rank`` sleeps ``delay_s`` before each forward, so the others wait for it in the
    ``wait_tensor`` of the forward's all-reduce. Returns the rows, and per rank the profiler's
    time in ``_c10d_functional::wait_tensor`` (the union of its events, us) and the number of
    those events."""
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.profiler import profile

    import commpatch

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    commpatch.enable(output="none")
    with commpatch.capture() as cap, profile() as prof:
        for _ in range(steps):
            if rank == late_rank:
                time.sleep(delay_s)
            opt.zero_grad()
            mlp(x).sum().backward()
            opt.step()
    commpatch.disable()
    # only the training thread calls wait_tensor (gloo's threads run the collectives)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.name == WAIT_EVENT)
    union, reach = 0.0, float("-inf")
    for lo, hi in spans:  # nested events of one wait (a redispatch) counted once
        union += max(0.0, hi - max(lo, reach))
        reach = max(reach, hi)
    return cap.df, union, len(spans)
