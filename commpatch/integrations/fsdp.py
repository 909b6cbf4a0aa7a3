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
  passed to ``fully_shard``. On an accelerator, FSDP2's copy-out makes the current stream wait for
  the all-gather's event (the host returns at once): ``FSDPParamGroup.wait_for_unshard`` is
  wrapped to time that stall on the device (``Stalls``), the all-gather row's wait.
- FSDP1: ``_runtime_utils._unshard`` and ``_runtime_utils._reduce_grad``; the unit is the
  ``FullyShardedDataParallel`` instance that owns the handle (named like its forward rows).
"""

from __future__ import annotations

import weakref

from ..data.ops import OP_NAMES
from ..data.schema import P_BACKWARD
from ..record import state as _runtime
from ..record.rows import peek_seq
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

    stalls = Stalls(log, ctx.timing)
    ctx.patches.wrap(cls, "unshard", lambda orig: stalls.issuing(_attributed(orig, unit)))
    ctx.patches.wrap(cls, "post_backward", lambda orig: _attributed(orig, lambda group, args: group.modules[0]))
    if hasattr(cls, "wait_for_unshard"):
        ctx.patches.wrap(cls, "wait_for_unshard", stalls.waiting)


class Stalls:
    """The stall of the training thread's stream at FSDP2's wait for an all-gather, on an accelerator.

    FSDP2 issues a unit's all-gather (one ``all_gather_single`` / ``all_gather_into_tensor``, sync, on its all-gather
    stream) in ``unshard`` and records an event after it; ``wait_for_unshard`` makes the current
    stream wait for that event before the copy-out. The host returns from both at once, so the
    stream's wait is what the step is held up by there, and the row's own device duration (on the
    all-gather stream) says nothing of it. Noted at ``unshard`` (the one row it issued, found in
    ``Log.pending``: a device row in flight), timed at ``wait_for_unshard``: an event on the
    current stream, the same wait on the all-gather's event that FSDP2 makes next (made twice: the
    second passes at once, nothing runs on that stream between them), an event after it; the
    stall between the two is the row's wait (``Timing.stall_mark`` / ``stall_end``). Left to the
    ``Work.wait()`` timing (``Timing.wait_begin``): an ``unshard(async_op=True)``, whose ``Work``
    FSDP2 waits on. Not timed: CPU tensors (gloo: the thread waits in the call), a stream that is
    capturing."""

    def __init__(self, log, timing) -> None:
        self.log, self.timing = log, timing
        self.issued: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> (id(result), seq, device key)
        self.codes = {
            OP_NAMES.index(name) for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
        }

    def issuing(self, orig):
        state = _runtime.STATE

        def unshard(group, *args, **kwargs):
            if not state.recording or self.timing is None:
                return orig(group, *args, **kwargs)
            first = peek_seq()
            out = orig(group, *args, **kwargs)
            try:
                self.note(group, first)
            except Exception as exc:  # noqa: BLE001 - a stall not timed never breaks FSDP
                _runtime.fail("fsdp.stall", exc)
            return out

        return unshard

    def note(self, group, first: int) -> None:
        result = getattr(group, "_all_gather_result", None)
        if result is None or peek_seq() != first + 1:  # no collective, or calls of other threads too
            return
        pending = self.log.pending.get(first)
        output = result.all_gather_output
        if pending is None or pending.op not in self.codes or output.is_cpu or result.all_gather_event is None:
            return
        self.issued[group] = (id(result), first, (output.device.type, output.device.index))

    def waiting(self, orig):
        state = _runtime.STATE

        def wait_for_unshard(group, *args, **kwargs):
            entry = self.issued.pop(group, None) if self.issued else None
            if entry is not None and state.recording:
                try:
                    self.stall(group, *entry)
                except Exception as exc:  # noqa: BLE001
                    _runtime.fail("fsdp.stall", exc)
            return orig(group, *args, **kwargs)

        return wait_for_unshard

    def stall(self, group, rid: int, seq: int, key) -> None:
        import torch

        result = getattr(group, "_all_gather_result", None)
        if result is None or id(result) != rid or result.all_gather_work is not None:
            return
        event = result.all_gather_event
        # the stream FSDP2 makes wait, through its own device module (torch.cuda's streams take
        # torch.cuda's events; torch.Stream's do not)
        handle = getattr(group, "device_handle", None) or getattr(torch, key[0], None)
        mark = self.timing.stall_mark(key) if event is not None and handle is not None else None
        if mark is None:
            return
        try:
            handle.current_stream().wait_event(event)  # as foreach_all_gather_copy_out does next
        except Exception:
            self.timing.cancel((key, mark))
            raise
        self.timing.stall_end(seq, key, mark)


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
    patches="FSDP2 FSDPParamGroup.unshard / post_backward / wait_for_unshard; FSDP1 _runtime_utils._unshard / _reduce_grad",
    relies_on=tuple(
        Needs("|".join(f"{m}.FSDPParamGroup.{a}" for m in FSDP2), "FSDP2's module attribution")
        for a in ("unshard", "post_backward")
    )
    + (
        Needs(
            "|".join(f"{m}.FSDPParamGroup.wait_for_unshard" for m in FSDP2),
            "the stall of FSDP2's stream at its all-gathers on an accelerator",
        ),
    )
    + tuple(Needs(f"{FSDP1}.{f}", "FSDP1's module attribution") for f in ("_unshard", "_reduce_grad"))
    + (Needs("torch._C._current_graph_task_id"),),
    records="FSDP's collectives attributed to their unit (module); each unit's settings (resharding after forward)",
    wanted=wanted,
    apply=apply,
)
