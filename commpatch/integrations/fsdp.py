"""FSDP: module attribution of its all-gathers and gradient reductions.

FSDP (FSDP2 ``fully_shard`` and FSDP1 ``FullyShardedDataParallel``) issues its collectives
through ``torch.distributed`` (``all_gather_single`` / ``all_gather``, ``reduce_scatter_single``),
so the core wrappers record them. What the generic module hooks get wrong is attribution: FSDP
gathers a module's parameters in backward from tensor hooks that run before the root's backward
marker (phase ``other``), prefetches the next module's parameters from the current one's hook,
and reduces gradients from a post-backward hook or the root's final callback. The functions
that gather or reduce one unit's parameters are wrapped so that their rows name that unit (the
module whose parameters moved) and the phase (``backward`` inside the autograd engine, else the
current one). Cost: a few attribute reads per FSDP unit per step.

- FSDP2: ``FSDPParamGroup.unshard`` and ``FSDPParamGroup.post_backward``; the unit is the module
  passed to ``fully_shard``.
- FSDP1: ``_runtime_utils._unshard`` and ``_runtime_utils._reduce_grad``; the unit is the
  ``FullyShardedDataParallel`` instance that owns the handle (named like its forward rows).
"""

from __future__ import annotations

import weakref

from ..data.schema import P_BACKWARD
from ..record import state as _runtime
from . import modules
from .base import Integration, Needs, when_imported

# FSDP2's package: torch.distributed.fsdp._fully_shard since torch 2.6, _composable.fsdp before
FSDP2_PACKAGES = ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")
FSDP2 = tuple(f"{package}._fsdp_param_group" for package in FSDP2_PACKAGES)
FSDP1 = "torch.distributed.fsdp._runtime_utils"


def wanted(settings: dict) -> bool:
    return modules.wanted(settings)


def cpu_gap() -> str | None:
    """Why FSDP2 cannot run on CPU tensors with the installed torch (None when it can): torch 2.4's
    ``FSDPCommContext.init`` creates CUDA streams unconditionally; the device-aware ``lazy_init``
    that replaced it runs on CPU (gloo). A limit of torch's (the plain job fails too), which
    ``commpatch env`` says, as the tests that skip for it."""
    import importlib

    import torch

    for name in FSDP2:
        try:
            context = getattr(importlib.import_module(name), "FSDPCommContext", None)
        except ImportError:
            continue
        if context is not None and not hasattr(context, "lazy_init"):
            return (
                f"FSDP2 of torch {torch.__version__} runs on GPUs only (its comm context creates CUDA streams): "
                "a job on CPU tensors cannot use it, with or without commpatch"
            )
        return None
    return None


def apply(ctx) -> None:
    for module in FSDP2:
        when_imported(module, _patch_fsdp2)
    when_imported(FSDP1, _patch_fsdp1)


def _patch_fsdp2(ctx, module) -> None:
    cls = module.FSDPParamGroup
    noted: weakref.WeakSet = weakref.WeakSet()  # the groups whose settings are in the log
    log = ctx.log

    def unit(group, args):
        if group not in noted:
            noted.add(group)
            note_settings(log, group)
        return group.modules[0]

    ctx.patches.wrap(cls, "unshard", lambda orig: _attributed(orig, unit))
    ctx.patches.wrap(cls, "post_backward", lambda orig: _attributed(orig, lambda group, args: group.modules[0]))


def note_settings(log, group) -> None:
    """An FSDP2 unit's settings, at its first unshard (a ``settings`` record): reshard_after_forward
    (whether it gathers its parameters again in the backward) and its mesh."""
    try:
        mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
        values = dict(
            # None after lazy init where the unit does not reshard (False, or the root's)
            reshard_after_forward=getattr(group, "post_forward_mesh_info", None) is not None,
            mesh=list(mesh.shape) if mesh is not None else None,
            mesh_dims=list(mesh.mesh_dim_names or ()) if mesh is not None else None,
            params=len(getattr(group, "fsdp_params", ())),
        )
        name = getattr(group, "_module_fqn", None) or type(group.modules[0]).__name__
        log.settings.append(("fsdp2", name, values))
    except Exception as exc:  # noqa: BLE001 - a setting not read never breaks FSDP
        _runtime.fail("fsdp.settings", exc)


def _patch_fsdp1(ctx, module) -> None:
    noted: weakref.WeakSet = weakref.WeakSet()  # the handles whose unit's settings are in the log
    log = ctx.log

    def unit(state, args):
        found = _fsdp1_unit(state, args)
        handle = args[0]
        if handle not in noted:
            noted.add(handle)
            note_fsdp1_settings(log, handle, found)
        return found

    ctx.patches.wrap(module, "_unshard", lambda orig: _attributed(orig, unit))
    ctx.patches.wrap(module, "_reduce_grad", lambda orig: _attributed(orig, _fsdp1_unit))


def note_fsdp1_settings(log, handle, unit) -> None:
    """An FSDP1 unit's settings, at its first unshard: its sharding strategy, and whether it frees its
    parameters after its forward (FULL_SHARD and HYBRID_SHARD do, except the root's, whose backward
    starts at once); named as its rows name it (``modules``)."""
    try:
        strategy = getattr(getattr(handle, "_sharding_strategy", None), "name", None)
        root = bool(getattr(unit, "_is_root", False))
        values = dict(
            sharding_strategy=strategy,
            reshard_after_forward=strategy in ("FULL_SHARD", "HYBRID_SHARD") and not root,
        )
        log.settings.append(("fsdp1", _runtime.MODULES[modules.code_of(unit)], values))
    except Exception as exc:  # noqa: BLE001 - a setting not read never breaks FSDP
        _runtime.fail("fsdp.settings", exc)


_fsdp1_units: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FlatParamHandle -> unit


def _fsdp1_unit(state, args):
    """The FullyShardedDataParallel module owning the handle (``state`` is the caller, which may be
    prefetching another unit's handle); the handle's own module where no such wrapper is known."""
    handle = args[0]
    unit = _fsdp1_units.get(handle)
    if unit is None:
        unit = handle._fully_sharded_module
        if getattr(state, "_handle", None) is handle and hasattr(state, "named_modules"):
            unit = _fsdp1_units[handle] = state
    return unit


def _attributed(orig, unit_of):
    """``orig(first, *args)`` with ``STATE.where`` naming the FSDP unit and phase meanwhile."""
    import torch

    state = _runtime.STATE
    graph_task = torch._C._current_graph_task_id

    def wrapper(first, *args, **kwargs):
        if not state.recording:
            return orig(first, *args, **kwargs)
        where = state.where
        try:
            phase = P_BACKWARD if graph_task() >= 0 else where & 3
            state.where = modules.where(unit_of(first, args), phase)
        except Exception as exc:  # noqa: BLE001 - attribution never breaks FSDP
            _runtime.fail("fsdp.attribution", exc)
        try:
            return orig(first, *args, **kwargs)
        finally:
            state.where = where

    return wrapper


INTEGRATION = Integration(
    name="fsdp",
    gaps=cpu_gap,
    patches="FSDP2 FSDPParamGroup.unshard / post_backward; FSDP1 _runtime_utils._unshard / _reduce_grad",
    relies_on=tuple(
        Needs("|".join(f"{m}.FSDPParamGroup.{a}" for m in FSDP2), "FSDP2's module attribution")
        for a in ("unshard", "post_backward")
    )
    + tuple(Needs(f"{FSDP1}.{f}", "FSDP1's module attribution") for f in ("_unshard", "_reduce_grad"))
    + (Needs("torch._C._current_graph_task_id"),),
    records="FSDP's collectives attributed to their unit (module); each unit's settings (resharding after forward)",
    wanted=wanted,
    apply=apply,
)
