"""Functional collectives (``torch.distributed._functional_collectives``): DTensor, tensor parallel.

They call ``torch.ops._c10d_functional.*`` directly and never reach ``dist.*``. The module's
leaf functions are wrapped (the wrappers call each other through module globals, and DTensor
calls ``funcol.<name>`` at call time, so a late patch is seen). Their wait is lazy: the result
is an ``AsyncCollectiveTensor`` whose ``wait_tensor`` runs at first use, so the row is timed
``wait``: issue -> return of that ``wait_tensor`` (an upper bound on the collective: it also
contains whatever ran before the result was first used). The time the thread spent inside that
``wait_tensor`` is the row's ``wait_us``: the exposed part of the call (``AsyncCollectiveTensor``'s
``wait()`` and its wait at first use call the same function). On an accelerator that wait only
makes the current stream wait: the row is timed on the device instead (``base.Waits``), its wait
the stream's stall. A call torch waits for inside the
function itself (all_gather along a dim other than 0) is timed ``host``: exposed throughout (on an
accelerator: timed on the device to its return, its wait not seen). While a wrapper runs torch's function
it sets ``LOCAL.python_call``, so the dispatcher kernels of ``integrations.compiled`` (which see
the collectives of compiled graphs and of the autograd formulas, calling the ops directly) do
not count the call again.

- A result handed back from a cache instead of computed (selective activation checkpointing
  that saves collective outputs, torchtitan's SAC: its recomputation in backward returns the
  saved output) is no collective: no row (``Waits.served``; a result that torch waits for and
  turns into a new tensor inside the call, all_gather along a dim other than 0, is seen by the
  ``wait_tensor`` wrapper).
- A group given as a list of ranks (deprecated) is resolved to its name by the wrapper, where
  torch's FutureWarning (``stacklevel=3``) names the user's line; torch then gets the name.
- Cached groups are checked to be alive (a new default group after ``destroy_process_group()``
  has the old one's name).
"""

from __future__ import annotations

import inspect
import time

from ..data.schema import T_DEVICE, T_HOST, T_NONE, T_WAIT
from ..patch import compile_notice as _compile_notice
from ..record import state as _runtime
from . import compiled
from .base import (
    Integration,
    Needs,
    Waits,
    device_start,
    error_row,
    invisible_to_dynamo,
    marks,
    on_device,
    record,
    storage_key,
    when_imported,
)

FUNCOL = "torch.distributed._functional_collectives"
_pc = time.perf_counter_ns

# function -> (op recorded, is a list of tensors)
FUNCTIONS = {
    "all_reduce": ("funcol.all_reduce", False),
    "all_reduce_coalesced": ("funcol.all_reduce_coalesced", True),
    "all_gather_single": ("funcol.all_gather", False),
    "all_gather_single_autograd": ("funcol.all_gather", False),
    "all_gather_single_coalesced": ("funcol.all_gather_coalesced", True),
    "reduce_scatter_single": ("funcol.reduce_scatter", False),
    "reduce_scatter_single_autograd": ("funcol.reduce_scatter", False),
    "reduce_scatter_single_coalesced": ("funcol.reduce_scatter_coalesced", True),
    # the same collectives under their torch < 2.5 names (later torch keeps them, calling the above:
    # the outermost wrapped call is recorded, once)
    "all_gather_tensor": ("funcol.all_gather", False),
    "all_gather_tensor_autograd": ("funcol.all_gather", False),
    "all_gather_into_tensor_coalesced": ("funcol.all_gather_coalesced", True),
    "reduce_scatter_tensor": ("funcol.reduce_scatter", False),
    "reduce_scatter_tensor_autograd": ("funcol.reduce_scatter", False),
    "reduce_scatter_tensor_coalesced": ("funcol.reduce_scatter_coalesced", True),
    "all_to_all_single": ("funcol.all_to_all_single", False),
    "all_to_all_single_autograd": ("funcol.all_to_all_single", False),
    "broadcast": ("funcol.broadcast", False),
}


def wanted(settings: dict) -> bool:
    return True


def apply(ctx) -> None:
    when_imported(FUNCOL, _patch_funcol)


def _patch_funcol(ctx, funcol) -> None:
    waits = Waits(ctx.log, ctx.timing)
    # where dynamo inlines one (torch 2.4 traces dist.all_reduce into funcol.all_reduce_inplace, which
    # calls funcol.all_reduce), it traces torch's function: compiled calls are recorded by integrations.compiled
    for name, (op, many) in FUNCTIONS.items():
        ctx.patches.wrap(
            funcol,
            name,
            lambda orig, op=op, many=many: invisible_to_dynamo(_wrapper(ctx, funcol, orig, op, many, waits), orig),
        )
    ctx.patches.wrap(funcol, "wait_tensor", lambda orig: invisible_to_dynamo(_wait_wrapper(orig, waits), orig))
    if hasattr(funcol, "wait_tensors"):  # torch 2.15: waits a coalesced collective's results at once
        ctx.patches.wrap(
            funcol, "wait_tensors", lambda orig: invisible_to_dynamo(_wait_wrapper(orig, waits, many=True), orig)
        )


def _wrapper(ctx, funcol, orig, op: str, many: bool, waits: Waits):
    state, local = _runtime.STATE, _runtime.LOCAL
    log, timing = ctx.log, ctx.timing
    params = list(inspect.signature(orig).parameters)
    gpos, tpos = params.index("group"), params.index("tag") if "tag" in params else None
    peer_pos = params.index("src") if "src" in params else None
    act = funcol.AsyncCollectiveTensor
    groups: dict = {}
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from torch._subclasses.functional_tensor import FunctionalTensor
    except ImportError:  # a torch without it: no graph is functionalized so
        FunctionalTensor = None

    compiling, dynamo_compiling = torch.compiler.is_compiling, torch.compiler.is_dynamo_compiling
    resolve = getattr(funcol, "_resolve_group", None) or getattr(funcol, "_resolve_group_name", None)  # < 2.5
    grad_enabled = torch.is_grad_enabled

    def wrapper(*args, **kwargs):
        if not state.recording:
            return orig(*args, **kwargs)
        outer = local.python_call
        if outer:  # inside another wrapped function (``*_autograd`` calls the plain one)
            return orig(*args, **kwargs)
        if compiling():  # traced into a graph: seen when it runs (integrations.compiled)
            if not dynamo_compiling():  # AOT autograd runs this as Python (dynamo would only trace it)
                _compile_notice.collective_compiled(op)
            return orig(*args, **kwargs)
        try:
            first = args[0] if args else next(iter(kwargs.values()))
            tensor = first[0] if many else first
            traced = _traced(tensor, FakeTensor, FunctionalTensor)  # (make_fx, export, AOT autograd): nothing runs
            if not traced:
                group = args[gpos] if len(args) > gpos else kwargs["group"]
                tag = (args[tpos] if tpos is not None and len(args) > tpos else kwargs.get("tag", "")) or ""
        except Exception as exc:  # noqa: BLE001
            _runtime.fail("funcol.read", exc)
            return orig(*args, **kwargs)
        if traced:  # outside the try: torch's own error is the user's, raised once
            return orig(*args, **kwargs)
        if isinstance(group, list) and resolve is not None:
            # torch's FutureWarning for a rank list (stacklevel=3 in _resolve_group) names the caller
            # of the function that calls _resolve_group: called here, the user's line, as without
            # commpatch. torch then gets the group's name: the same group, and no second warning.
            group = resolve(group, tag)  # torch's own error for a bad list is the user's
            args, kwargs = _with_group(args, kwargs, gpos, group)
        try:
            pg = _process_group(funcol, groups, group, tag)
            numel = sum(t.numel() for t in first) if many else first.numel()
            peer = (args[peer_pos] if len(args) > peer_pos else kwargs.get("src", -1)) if peer_pos is not None else -1
        except Exception as exc:  # noqa: BLE001
            _runtime.fail("funcol.read", exc)
            return orig(*args, **kwargs)
        if tensor.requires_grad and grad_enabled():  # an autograd formula may issue collectives in
            compiled.ensure_installed(for_formulas=True)  # backward, from C++: seen at the dispatcher
        started = device_start(timing, tensor, "funcol")
        start = _pc()
        local.python_call = True  # recorded here: the dispatcher kernels skip it
        try:
            result = orig(*args, **kwargs)
        except BaseException:
            error_row(log, op, pg, tensor, numel, start, peer, "funcol")
            raise
        finally:
            local.python_call = outer
            waited, local.waited = local.waited, None  # (not kept alive past the call)
        end = _pc()
        try:
            last = result[-1] if many and result else result
            if isinstance(last, act):
                key = storage_key(last.elem)
                lazy = key is not None  # no real storage (a simulated LocalTensor): no wait to time
            else:  # torch waited for it and made a new tensor of it (all_gather on
                key, lazy = (storage_key(waited) if waited is not None else None), False  # a dim other than 0)
            if key and waits.served(key):  # a saved result handed back (SAC's recomputation): nothing ran
                if started is not None:
                    timing.cancel(started)
                return result
            if key and not lazy:
                waits.keep(key, waited)
            code = T_WAIT if lazy else T_HOST if not isinstance(last, act) else T_NONE
            if started is not None or on_device(tensor, log):  # the host's times say nothing of the device's
                code = T_DEVICE if started is not None and (lazy or code == T_HOST) else T_NONE
            seq = record(log, op, pg, tensor, numel, start, end, True, code, peer=peer)
            if lazy and code != T_NONE:  # the last result's wait marks completion of the batch
                waits.add(key, last.elem, seq, start, started, log.group_ids.get(pg, -1))
            elif lazy:  # on a device that gives no events now (a capturing stream): untimed
                waits.keep(key, last.elem)
            elif code == T_DEVICE:  # torch made the stream wait inside the call: to its return
                timing.device_end(seq, log.group_ids.get(pg, -1), started, None, False)
            elif started is not None:
                timing.cancel(started)
        except Exception as exc:  # noqa: BLE001
            _runtime.fail("funcol.record", exc)
        return result

    return wrapper


def _with_group(args: tuple, kwargs: dict, gpos: int, group):
    """The arguments with the group argument replaced."""
    if len(args) > gpos:
        return args[:gpos] + (group,) + args[gpos + 1 :], kwargs
    return args, {**kwargs, "group": group}


def _wait_wrapper(orig, waits: Waits, many: bool = False):
    """funcol's ``wait_tensor(tensor)``, or with ``many`` its ``wait_tensors(tensors)``."""
    local = _runtime.LOCAL

    def wait_tensor(tensor):
        stalls = marks(waits, tensor, many) if waits.devices else None
        began = _pc()  # the thread's wait (exposed time): one clock read
        out = orig(tensor)
        if local.python_call and not many:  # inside a recorded functional collective: its result
            local.waited = tensor
        if waits:
            for one in tensor if many else (tensor,):
                key = storage_key(one)
                if key is not None:  # a traced / fake tensor has no storage: not one of ours
                    waits.waited(key, began, stalls.get(key) if stalls else None)
        return out

    return wait_tensor


def _traced(tensor, fake_type, functional_type) -> bool:
    """A tensor being traced, not one a collective runs on: fake or meta, or a FunctionalTensor
    around one (AOT autograd's functionalization runs the graph so, torch.compiler.is_compiling()
    False there on torch 2.6 and 2.11: each forward's all-reduce was recorded once more)."""
    if functional_type is not None and isinstance(tensor, functional_type):
        import torch

        tensor = torch._from_functional_tensor(tensor.elem)
    return isinstance(tensor, fake_type) or tensor.is_meta


def _process_group(funcol, cache: dict, group, tag: str):
    """The ProcessGroup behind any RANK_TYPES form (a group, a mesh, (mesh, dim), a rank list)."""
    import torch.distributed.distributed_c10d as c10d

    key = (group, tag) if not isinstance(group, list) else None
    if key is not None:
        pg = cache.get(key)
        if pg is not None and pg in c10d._world.pg_names:  # not destroyed since (a new group may have its name)
            return pg
    import warnings

    with warnings.catch_warnings():  # torch warned the user already, from their own call
        warnings.simplefilter("ignore")
        pg = c10d._resolve_process_group(funcol._resolve_group_name(group, tag))
    if key is not None:
        cache[key] = pg
    return pg


INTEGRATION = Integration(
    name="functional",
    patches="the leaf functions of torch.distributed._functional_collectives (FUNCTIONS), and the wait of their "
    "AsyncCollectiveTensor results",
    relies_on=(
        Needs(f"{FUNCOL}.all_reduce"),
        Needs(f"{FUNCOL}._resolve_group_name"),
        Needs(f"{FUNCOL}.AsyncCollectiveTensor"),
        Needs("torch.distributed.distributed_c10d._resolve_process_group"),
        Needs(f"{FUNCOL}.wait_tensor", "functional collectives' durations (rows are timed to the call only)"),
        Needs("torch.compiler.is_compiling"),
        Needs("torch.compiler.is_dynamo_compiling"),
        Needs("torch._subclasses.fake_tensor.FakeTensor"),
    ),
    records="functional collectives (DTensor, tensor parallel)",
    wanted=wanted,
    apply=apply,
)
