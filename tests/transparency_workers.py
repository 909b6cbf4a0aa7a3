"""Worker for tests/test_transparency.py (run in each rank by tests.multiproc.run_ranks).

``transparency`` runs every requested cell of one model kind in one process group: first a
baseline per compile mode with commpatch never enabled, then each cell — commpatch enabled
before the model is built, or after it was compiled and ran its first step, with module
attribution on or off — and compares losses, gradients and final parameters bit for bit
(``torch.equal``) with the baseline of its compile mode (same seeds, same process). Each cell's
outcome is returned, never raised, so that one broken cell does not hide the others.
"""

from __future__ import annotations

import time
import traceback

STEPS = 3  # commpatch records steps 0-2 ("before") or 1-2 ("after")
WIDTH = 16
BATCH = 4
PG_TIMEOUT = 60  # seconds a collective may wait for the other rank (a cell failing on one rank only)

KINDS = ("plain", "ddp", "fsdp2", "tp")
# compile mode -> torch.compile keyword arguments (None: eager)
COMPILES = {
    "eager": None,
    "compile": dict(backend="aot_eager"),
    "fullgraph": dict(backend="aot_eager", fullgraph=True),
    "inductor": dict(),  # the default backend
    # torchtitan's way: fully_shard each block, then block.compile(fullgraph=True) (fsdp2 only)
    "blocks": dict(backend="aot_eager", fullgraph=True),
}
PER_BLOCK = {"blocks"}  # compile modes applied per block (Block), not to the model
# cells run under torch.profiler (record_shapes) as the witness of what commpatch recorded:
# compile modes whose "before" cells (every step recorded) compare counts and bytes per collective
WITNESSED = {"blocks"}
WHENS = ("before", "after")  # enable() before building the model / after compiling it
MODULES = ("modules_on", "modules_off")  # enable(modules=True / False), i.e. COMMPATCH_MODULES=1 / 0


def cell_name(kind: str, compile_mode: str, when: str, modules: str) -> str:
    return f"{kind}-{compile_mode}-{when}-{modules}"


def instrumented_steps(when: str) -> int:
    return STEPS if when == "before" else STEPS - 1


def _block(n_in: int, n_out: int, relu: bool):
    """A block of the user's own class (torchtitan's TransformerBlock stands here): dynamo
    compiles its forward; a torch.nn class's forward it would skip as one of torch's files."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(n_in, n_out)

        def forward(self, x):
            y = self.linear(x)
            return torch.relu(y) if relu else y

    return Block()


def _build(kind: str, mesh, per_block: bool = False):
    """The tiny model of ``kind``, parallelized over the 2 ranks (same seed on every rank);
    ``per_block``: Linear-ReLU and Linear as two blocks of the user's own class (the same
    parameters, initialized alike)."""
    import torch

    torch.manual_seed(0)
    if per_block:
        model = torch.nn.Sequential(_block(8, WIDTH, True), torch.nn.Identity(), _block(WIDTH, 8, False))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # default buckets (one here): torch.compile's DDPOptimizer rejects a bucket cap under
        # its 1 MiB first bucket (several buckets are tested in eager in test_integrations_ddp.py)
        return DDP(model)
    if kind == "fsdp2":
        from tests.torch_compat import fully_shard as _fully_shard

        fully_shard = _fully_shard()
        for unit in (model[0], model[2], model):
            fully_shard(unit, mesh=mesh)
        return model
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model  # plain: no parallelism (and no collective)


def _local(t):
    """A DTensor's local shard (FSDP2, TP), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _run(kind: str, compile_mode: str, rank: int, mesh, enable_before, enable_after):
    """Build, compile and train ``STEPS`` steps of SGD. ``enable_before()`` runs before the model
    is built, ``enable_after()`` after the first (compiling) step. Returns (losses, grads of every
    step, final params) as this rank's local tensors."""
    import torch

    enable_before()
    per_block = compile_mode in PER_BLOCK
    model = _build(kind, mesh, per_block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = COMPILES[compile_mode]
    if per_block:
        for block in (model[0], model[2]):
            block.compile(**options)
    elif options is not None:
        model = torch.compile(model, **options)
    # data parallel kinds: different data per rank; tensor parallel: the same input on every rank
    gen = torch.Generator().manual_seed(1000 + (0 if kind == "tp" else rank))
    losses, grads = [], []
    for step in range(STEPS):
        if step == 1:
            enable_after()
        loss = model(torch.randn(BATCH, 8, generator=gen)).square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([_local(p.grad).detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    params = [_local(p).detach().clone() for p in model.parameters()]
    return losses, grads, params


def _differences(baseline, got) -> list[str]:
    """What differs between two runs (empty: bit-identical)."""
    import torch

    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    (lb, gb, pb), (lg, gg, pg) = baseline, got
    diffs = [f"loss of step {i}" for i, (a, b) in enumerate(zip(lb, lg)) if not same(a, b)]
    for i, (a, b) in enumerate(zip(gb, gg)):
        if len(a) != len(b):
            diffs.append(f"number of gradients at step {i}: {len(a)} != {len(b)}")
        diffs += [f"gradient of parameter {j} at step {i}" for j, (x, y) in enumerate(zip(a, b)) if not same(x, y)]
    if len(pb) != len(pg):
        diffs.append(f"number of parameters: {len(pb)} != {len(pg)}")
    diffs += [f"final parameter {j}" for j, (x, y) in enumerate(zip(pb, pg)) if not same(x, y)]
    return diffs


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:240]


def _nothing():
    pass


_MESSAGES: dict[str, str] = {}  # internal error kind -> commpatch's warning (said once per kind)
_PREFIX = "commpatch: internal error ("


def _keep_internal_error_messages(caught) -> None:
    for warning in caught:
        text = str(warning.message)
        if text.startswith(_PREFIX) and ")" in text:
            kind, _, message = text[len(_PREFIX) :].partition("): ")
            _MESSAGES.setdefault(kind, message.split("; the collective proceeds")[0][:200])


def transparency(rank, world_size, kind, cells):
    """``cells``: [(compile_mode, when, modules), ...] of ``kind``.

    Returns dict(cells={cell name: outcome}, baseline_errors={compile mode: text}, seconds={...});
    outcome = dict(ok, error, trace, differences, ops, internal_errors, seconds[, witness]): ``ok`` the cell
    ran, ``error`` one line when it did not, ``differences`` against the baseline, ``ops`` the
    rows commpatch recorded per op, ``internal_errors`` commpatch's internal errors in the cell
    ({kind: "<count>x <its warning>"}; commpatch warns once per kind and process); ``witness``
    (WITNESSED cells) {"counts" / "bytes": (commpatch's per gloo op, the profiler's)}.
    """
    import contextlib
    import datetime
    import warnings
    from collections import Counter

    import torch
    import torch._dynamo
    import torch._inductor.config
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import profile

    import commpatch
    from tests.integration_workers import claimed_bytes, claimed_counts, witness_bytes, witness_counts

    t0 = time.perf_counter()
    # inductor compiles in the rank's own process (same generated code): a pool of compile
    # subprocesses per rank only costs start-up and shutdown time on 2 cores
    torch._inductor.config.compile_threads = 1
    warnings.filterwarnings("ignore", message="commpatch: torch.compile")  # the once-per-process notice
    # a group of its own re-synchronizes the ranks after every cell, whatever happened in it
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2 * PG_TIMEOUT))
    mesh = init_device_mesh("cpu", (world_size,)) if kind in ("fsdp2", "tp") else None
    seconds = {"setup": time.perf_counter() - t0}

    baselines = {}
    for compile_mode in dict.fromkeys(c for c, _, _ in cells):
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            baselines[compile_mode] = _run(kind, compile_mode, rank, mesh, _nothing, _nothing)
        except Exception as exc:  # noqa: BLE001 - reported per cell
            baselines[compile_mode] = exc
        seconds[f"baseline {compile_mode}"] = time.perf_counter() - start
        dist.barrier(group=control)

    out = {}
    for compile_mode, when, modules in cells:
        name = cell_name(kind, compile_mode, when, modules)
        baseline = baselines[compile_mode]
        result = out[name] = dict(
            ok=False, error=None, trace=None, differences=None, ops={}, internal_errors={}, seconds=0.0
        )
        if isinstance(baseline, BaseException):
            result["error"] = f"the baseline (without commpatch) failed: {_one_line(baseline)}"
            continue

        def enable(modules=modules):
            commpatch.enable(output="none", modules=modules == "modules_on")

        errors_before = commpatch.internal_errors()
        torch._dynamo.reset()
        commpatch.reset()
        start = time.perf_counter()
        witnessed = compile_mode in WITNESSED and when == "before"
        with (
            warnings.catch_warnings(record=True) as caught,
            profile(record_shapes=True) if witnessed else contextlib.nullcontext() as prof,
        ):
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message="commpatch: torch.compile")
            try:
                got = _run(
                    kind,
                    compile_mode,
                    rank,
                    mesh,
                    enable if when == "before" else _nothing,
                    enable if when == "after" else _nothing,
                )
                result["differences"] = _differences(baseline, got)
                result["ok"] = True
            except Exception as exc:  # noqa: BLE001 - reported per cell
                result["error"] = _one_line(exc)
                result["trace"] = traceback.format_exc()[-4000:]
            finally:
                commpatch.disable()
                result["seconds"] = time.perf_counter() - start
        _keep_internal_error_messages(caught)
        try:
            result["ops"] = dict(Counter(commpatch.log()["op"].astype(str)))
        except Exception as exc:  # noqa: BLE001
            result["ops"] = {f"<commpatch.log() failed: {_one_line(exc)}>": 0}
        if witnessed and result["ok"]:
            df = commpatch.log()
            result["witness"] = dict(
                counts=(dict(claimed_counts(df)), dict(witness_counts(prof))),
                bytes=(dict(claimed_bytes(df)), dict(witness_bytes(prof, world_size))),
            )
        errors_after = commpatch.internal_errors()
        result["internal_errors"] = {
            kind_: f"{n - errors_before.get(kind_, 0)}x {_MESSAGES.get(kind_, '')}".rstrip()
            for kind_, n in errors_after.items()
            if n != errors_before.get(kind_, 0)
        }
        commpatch.reset()
        torch._dynamo.reset()
        dist.barrier(group=control)
    seconds["total"] = time.perf_counter() - t0
    return dict(
        cells=out,
        seconds=seconds,
        baseline_errors={m: _one_line(b) for m, b in baselines.items() if isinstance(b, BaseException)},
    )
