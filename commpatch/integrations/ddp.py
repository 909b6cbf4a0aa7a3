"""DistributedDataParallel: one row per gradient bucket per step, and the constructor's collectives.

DDP's reducer issues its all-reduce from C++, so no ``dist.*`` wrapper sees it. It calls a
comm hook per bucket, though, and that is where commpatch measures:

- no user hook: at the model's first forward while enabled, a hook is registered that does
  exactly what the reducer does without one (scale by 1/world size, then the reducer's own
  C++ all-reduce via ``reducer._run_allreduce_hook``): gradients stay bit-identical. It records
  ``ddp_bucket_allreduce`` (bytes of the bucket, timed to the future's completion).
- a user hook (``register_comm_hook``, DDP(mixed_precision=...), builtin hooks mapped to their
  Python equivalents) is wrapped: collectives it issues through ``dist.*`` are recorded by the
  core wrappers as what actually ran (an fp16 all_reduce, PowerSGD's two all-reduces); when it
  issues none visible from Python (the reducer's C++ all-reduce), a ``ddp_bucket_allreduce``
  row is recorded for it.
Every row issued inside a hook carries the bucket index and its parameter count (spans kept in
``Log.buckets``, mapped to rows when the DataFrame is built: no per-call cost).

The constructor's parameter check and broadcast are reached by name (``dist._verify_params_
across_processes``, ``dist._broadcast_coalesced``); the bucket rebuild before the second
forward through ``Reducer._rebuild_buckets``. A hook can be registered once per model and never
removed: after disable() it is a pass-through with the same numerics.
"""

from __future__ import annotations

import time
import weakref

from .. import _runtime
from .._log import T_FUTURE, T_HOST
from .._runtime import P_BACKWARD
from .._session import _peek_seq
from .._wrapper import SEQ
from . import modules, record, when_imported

DDP_MODULE = "torch.nn.parallel.distributed"
HOOKED = "_commpatch_hooked"     # DDP instance attribute: a (measured) hook is in place
_pc = time.perf_counter_ns


def wanted(settings: dict) -> bool:
    return True


def apply(ctx) -> None:
    import torch.distributed as dist

    p, log = ctx.patches, ctx.log
    p.wrap(dist, "_broadcast_coalesced", lambda orig: _recorded(log, orig, "ddp_broadcast_coalesced", _coalesced_size))
    p.wrap(dist, "_verify_params_across_processes",
           lambda orig: _recorded(log, orig, "ddp_verify_params", lambda args, kwargs: (None, 0)))
    when_imported(DDP_MODULE, _patch_ddp_class)


def _patch_ddp_class(ctx, module) -> None:
    from torch._C._distributed_c10d import Reducer

    cls = module.DistributedDataParallel
    p, log = ctx.patches, ctx.log
    p.wrap(Reducer, "_rebuild_buckets", lambda orig: _rebuild_buckets(log, orig))
    p.wrap(cls, "_pre_forward", lambda orig: _pre_forward(log, orig))
    p.wrap(cls, "register_comm_hook", lambda orig: _register_comm_hook(log, orig))
    p.wrap(cls, "_register_builtin_comm_hook", lambda orig: _register_builtin_comm_hook)


# ---- the bucket hook ---------------------------------------------------------------------
def measured(log, ddp, hook):
    """Wrap a comm hook: bucket spans for the rows inside it, a row when none is visible."""
    ddp_ref = weakref.ref(ddp)
    state = _runtime.STATE
    buckets = log.buckets
    done = log.done

    def hook_wrapper(hook_state, bucket):
        if not state.recording:
            return hook(hook_state, bucket)
        where = state.where
        ddp = ddp_ref()
        state.where = modules.where(ddp, P_BACKWARD) if ddp is not None else where
        try:
            lo = _peek_seq(SEQ)
            start = _pc()
            fut = hook(hook_state, bucket)
            end = _pc()
            try:
                if _peek_seq(SEQ) == lo:         # nothing visible from Python: the C++ all-reduce ran
                    buf = bucket.buffer()
                    seq = record(log, "ddp_bucket_allreduce", ddp.process_group if ddp else None, buf,
                                 buf.numel(), start, end, True, T_FUTURE)
                    fut.then(lambda _f, seq=seq, start=start: done.__setitem__(seq, _pc() - start))
                buckets.append((lo, _peek_seq(SEQ), bucket.index(), len(bucket.parameters())))
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("ddp.hook", exc)
            return fut
        finally:
            state.where = where

    hook_wrapper.__wrapped__ = hook      # DDP checks the hook's signature (a 'bucket' parameter)
    hook_wrapper.__qualname__ = getattr(hook, "__qualname__", "hook")
    return hook_wrapper


def _default_hook(ddp_ref, bucket):
    """What the reducer does without a hook: scale into the bucket by 1/size, C++ all-reduce(SUM)."""
    ddp = ddp_ref()
    bucket.buffer().mul_(1.0 / ddp.process_group.size())
    # the hook must return a future whose value is a Python object: then(), not the C++ future
    return ddp.reducer._run_allreduce_hook(bucket).then(_bucket_tensor)


def _bucket_tensor(fut):
    value = fut.value()
    return value[0] if isinstance(value, list) else value


def _pre_forward(log, orig):
    def _pre_forward(self, *args, **kwargs):
        if not self.__dict__.get(HOOKED) and _runtime.STATE.recording:
            _install_default(log, self)
        return orig(self, *args, **kwargs)

    return _pre_forward


def _install_default(log, ddp) -> None:
    import torch.distributed as dist

    ddp.__dict__[HOOKED] = True
    try:
        existing = ddp._get_ddp_logging_data().get("comm_hook", "")
        if existing:     # a hook registered before enable(): it cannot be wrapped or replaced
            _runtime.fail("ddp.hook_registered_before_enable",
                          RuntimeError(f"comm hook {existing!r} was registered before commpatch.enable(): "
                                       "its buckets are not recorded"))
            return
        if getattr(ddp, "_use_python_reducer", False):
            return
        dist._register_comm_hook(ddp.reducer, weakref.ref(ddp), measured(log, ddp, _default_hook))
    except Exception as exc:  # noqa: BLE001
        _runtime.fail("ddp.install", exc)


def _register_comm_hook(log, orig):
    def register_comm_hook(self, state, hook):
        if not _runtime.STATE.enabled:
            return orig(self, state, hook)
        self.__dict__[HOOKED] = True
        return orig(self, state, measured(log, self, hook))

    return register_comm_hook


def _register_builtin_comm_hook(self, comm_hook_type):
    """Builtin C++ hooks run no Python: register their Python equivalents (same numerics)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    python_hook = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    self.register_comm_hook(self.process_group, python_hook[comm_hook_type])


# ---- constructor and rebuild collectives -----------------------------------------------------
def _coalesced_size(args, kwargs):
    tensors = args[1] if len(args) > 1 else kwargs.get("tensors", [])
    return (tensors[0] if tensors else None), sum(t.numel() for t in tensors)


def _recorded(log, orig, op, size):
    """A C++ function reachable by name: one host-timed row per call."""
    state = _runtime.STATE

    def wrapper(*args, **kwargs):
        if not state.recording or _runtime.LOCAL.depth:
            return orig(*args, **kwargs)
        group = args[0] if args else kwargs.get("process_group")
        start = _pc()
        err = True
        try:
            result = orig(*args, **kwargs)
            err = False
            return result
        finally:
            end = _pc()
            try:
                tensor, numel = size(args, kwargs)
                record(log, op, group, tensor, numel, start, end, False, T_HOST, err)
            except Exception as exc:  # noqa: BLE001
                _runtime.fail(f"ddp.{op}", exc)

    return wrapper


def _rebuild_buckets(log, orig):
    """The reducer's bucket rebuild (before the 2nd forward) broadcasts the new layout from C++."""
    state = _runtime.STATE

    def _rebuild_buckets(self):
        if not state.recording:
            return orig(self)
        start = _pc()
        rebuilt = orig(self)
        end = _pc()
        if rebuilt:
            try:
                record(log, "ddp_rebuild_buckets", None, None, 0, start, end, False, T_HOST)
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("ddp.rebuild_buckets", exc)
        return rebuilt

    return _rebuild_buckets
