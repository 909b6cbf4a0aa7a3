"""Where the torch APIs the tests use live on each supported torch (2.4 to 2.15): the tests
import them from here, so a scenario runs the same on every torch of the CI matrix."""

from __future__ import annotations


def fully_shard():
    """FSDP2's ``fully_shard``: public in torch.distributed.fsdp since torch 2.6."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard as fn
    return fn


def fsdp_param_group():
    """FSDP2's ``FSDPParamGroup`` (torch.distributed.fsdp._fully_shard since torch 2.6)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        from torch.distributed._composable.fsdp._fsdp_param_group import FSDPParamGroup
    return FSDPParamGroup


def dtensor():
    """The DTensor package (``Replicate``, ``Shard``, ``distribute_tensor``, ``debug``):
    torch.distributed.tensor since torch 2.5, torch.distributed._tensor before."""
    import importlib

    try:
        module = importlib.import_module("torch.distributed.tensor")
        module.distribute_tensor  # noqa: B018 - 2.4 has the package (parallel) without DTensor itself
    except (ImportError, AttributeError):
        module = importlib.import_module("torch.distributed._tensor")
    return module


def comm_debug_mode():
    """``CommDebugMode``: torch.distributed.tensor.debug since torch 2.5, _tensor.debug before."""
    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:
        from torch.distributed._tensor.debug import CommDebugMode
    return CommDebugMode


def fsdp2_cpu_unsupported() -> str | None:
    """Why FSDP2 cannot run on CPU tensors with this torch (None when it can): what ``commpatch env``
    says of it (``integrations.fsdp.cpu_gap``)."""
    from commpatch.integrations.fsdp import cpu_gap

    return cpu_gap()


def leaf(public: str) -> str:
    """The function a row of ``public`` is named after: a torch with ``*_single`` functions (2.13 and
    2.15 here) implements all_gather_into_tensor / reduce_scatter_tensor through
    them (the innermost call is recorded); one without (2.4, 2.8, 2.11 as seen) records ``public``."""
    import torch.distributed as dist

    single = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}[public]
    return single if hasattr(dist, single) else public


def pipeline_stage(stage_mod, rank: int, world_size: int, microbatch_shape: tuple):
    """A ``PipelineStage`` on CPU: torch 2.4 requires the input shapes (``input_args``: an example
    microbatch, zeros: no random numbers drawn), later torch infers them (given only where
    required, so the p2p traffic is torch's own)."""
    import inspect

    import torch
    from torch.distributed.pipelining import PipelineStage

    kwargs = {}
    needed = inspect.signature(PipelineStage).parameters.get("input_args")
    if needed is not None and needed.default is inspect.Parameter.empty:
        kwargs["input_args"] = (torch.zeros(microbatch_shape),)
    return PipelineStage(stage_mod, rank, world_size, torch.device("cpu"), **kwargs)


def selective_checkpoint_context(saved_ops):
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that saves the outputs of
    ``saved_ops`` and recomputes the rest: torch >= 2.5's ``create_selective_checkpoint_contexts``
    with a ``CheckpointPolicy``, torch 2.4's ``_pt2_selective_checkpoint_context_fn_gen`` (the
    same two dispatch modes; its policy answers True for "do not recompute")."""
    import functools

    import torch.utils.checkpoint as ckpt

    if hasattr(ckpt, "CheckpointPolicy"):

        def policy(ctx, op, *args, **kwargs):
            return ckpt.CheckpointPolicy.MUST_SAVE if op in saved_ops else ckpt.CheckpointPolicy.PREFER_RECOMPUTE

        return functools.partial(ckpt.create_selective_checkpoint_contexts, policy)

    def old_policy(mode, op, *args, **kwargs):
        return op in saved_ops

    return functools.partial(ckpt._pt2_selective_checkpoint_context_fn_gen, old_policy)


def file_store_exchange_unsupported() -> str | None:
    """Why the clock exchange cannot run over a FileStore on this torch (None when it can): it talks
    to rank 0 through its own connection to the process group's store: a client of its own for a
    TCPStore (torchrun's, ``tcp://``, ``env://``) on every torch, ``Store.clone()`` for a FileStore,
    which torch < 2.5 does not have (offsets not measured, the report says so)."""
    from commpatch.record.clocksync import unmeasured_stores

    return unmeasured_stores()


def destroy_process_group(group=None) -> None:
    """``dist.destroy_process_group``, past a deadlock of torch < 2.5's gloo: the group's destructor
    joins its worker threads holding the GIL, while a worker may still be releasing the last work,
    whose tensor's Python object was kept by C++ (``all_reduce(torch.ones(2))``: a temporary) and
    needs the GIL to be freed. Reproduced without commpatch on torch 2.4.1: 7 of 12 two-rank jobs
    hung in ``~ProcessGroupGloo``; 0 of 12 with the GIL released for 0.2 s first (or the tensors kept).
    Fixed in torch's later releases: nothing to wait for there."""
    import time

    import torch
    import torch.distributed as dist

    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 5):
        time.sleep(0.2)  # the workers release their last work meanwhile (they need the GIL for it)
    if group is None:
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(group)
