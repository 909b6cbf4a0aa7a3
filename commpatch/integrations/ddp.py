"""DistributedDataParallel: one row per gradient bucket per step, and the constructor's collectives.

DDP's reducer issues its all-reduce from C++, so no ``dist.*`` wrapper sees it. It calls a
comm hook per bucket, though, and that is where commpatch measures. A reducer takes one hook,
once, and never gives it back; so commpatch registers one *dispatcher* per reducer (at the
model's first forward while enabled, or at a hook registration while enabled, whichever comes
first) and the dispatcher runs whatever sits in its slot:

- nothing registered: the reducer's own arithmetic, reproduced exactly (``_default_hook``):
  the divisor it would use (the group size, or under ``join(divide_by_initial_world_size=
  False)`` the count of ranks still running, read from the same forward all-reduce the reducer
  waits on) and the operation it would apply (``x * (1/d)`` on a gradient it copies into the
  bucket, ``x / d`` in place on one that already is its bucket view or on a sparse gradient;
  the two differ in the last bit unless d is a power of two; with gradient_as_bucket_view=True
  and a divisor that may not be one, a post-accumulate-grad hook per parameter tells them
  apart: ``_AliasTrack``, also under ``lazy_bucket_allocation=True``; ``x / d`` on the whole
  bucket under ``batched_grad_copy=True``, which defers the copies and divides the flat bucket
  once), then the reducer's own C++ all-reduce (``reducer._run_allreduce_
  hook``). Gradients stay bit-identical. A ``ddp_bucket_allreduce`` row (bytes of the bucket,
  timed to the future's completion). On a dense CPU bucket this runs in C when commpatch's
  extension is built (``record/_hot.c``: ``BucketHook``, the hook registered then; anything else
  goes to the Python hook): Python bytecode inside the backward cost the step more than its own
  time (docs/decisions/ddp-cost.md).
- a hook registered later, before or after the first step (``register_comm_hook``,
  ``_register_builtin_comm_hook`` with its Python equivalent, DDP(mixed_precision=...),
  optimizers in backward): torch's own method runs unchanged (its checks, its logging data,
  its ``_comm_hooks``) and its final ``dist._register_comm_hook`` fills the slot instead of
  failing with "can only be called once" (after disable() too); a second registration reaches
  the reducer and fails exactly as it does without commpatch. Collectives the hook issues
  through ``dist.*`` are recorded as what ran; when it issues none visible from Python (the
  reducer's C++ all-reduce), a ``ddp_bucket_allreduce`` row is recorded for it.
Every row issued inside a hook carries the bucket index and its parameter count (spans kept in
``Log.buckets``, mapped to rows when the DataFrame is built: no per-call cost).

The dispatcher outlives disable() (a pass-through then, same numerics), and so do three small
pass-throughs installed once per process with the first dispatcher, because its exactness and
replaceability depend on them: ``dist._register_comm_hook`` / ``dist._register_builtin_comm_
hook`` (fill the slot of a reducer that has a dispatcher; anything else goes straight to torch)
and ``Reducer._set_forward_pass_work_handle`` (called by DDP's forward only inside a join
context: keeps the all-reduce whose result is the reducer's divisor). Nothing is stored on the
DDP module: the dispatchers are keyed by reducer (``_SLOTS``), so a rebuilt reducer
(``_update_process_group``, unpickling) gets its own.

A hook registered before enable() (to a reducer commpatch has not seen) cannot be replaced:
that model's buckets are not recorded (``ddp.hook_registered_before_enable``). The wrappers that
install run as Python under torch.compile (``_eager``), as DDP's own forward code does.

The constructor's parameter check and broadcast are reached by name (``dist._verify_params_
across_processes``, ``dist._broadcast_coalesced``), the bucket rebuild before the second forward
through ``Reducer._rebuild_buckets``: around each call, dispatcher kernels for the ``c10d`` ops it
runs (``patch.dispatch``, calling thread only, removed after) give one row per collective with
its real bytes. With ``find_unused_parameters=True`` the reducer all-reduces its unused-parameter
bitmap right after launching the last bucket, from C++: the last bucket's hook installs a kernel
that records that one call, removed at the end of the backward.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from threading import get_ident

from ..data.ops import OP_CODE
from ..data.schema import P_BACKWARD, T_DEVICE, T_FUTURE
from ..patch.dispatch import Kernels
from ..record import state as _runtime
from ..record.rows import SEQ, Pending, bucket_hook, on_device, packing
from ..record.rows import peek_seq as _peek_seq
from . import base, modules
from .base import Integration, Needs, record, when_imported

DDP_MODULE = "torch.nn.parallel.distributed"
_pc = time.perf_counter_ns

# Reducer -> its _Dispatch, or None when the reducer is someone else's (a hook registered before
# enable(), the Python reducer): decided once per reducer, forgotten with it.
_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_REBUILD: weakref.WeakSet = weakref.WeakSet()  # reducers whose bucket rebuild is behind them or never comes
_TORCH: dict[str, object] = {}  # the torch functions behind the persistent pass-throughs


def wanted(settings: dict) -> bool:
    return True


def apply(ctx) -> None:
    import torch.distributed as dist

    p, log = ctx.patches, ctx.log
    p.wrap(dist, "_broadcast_coalesced", lambda orig: _scoped(log, orig, _CTOR, "broadcast_coalesced"))
    p.wrap(dist, "_verify_params_across_processes", lambda orig: _scoped(log, orig, _VERIFY, "verify_params"))
    when_imported(DDP_MODULE, _patch_ddp_class)


def _patch_ddp_class(ctx, module) -> None:
    from torch._C._distributed_c10d import Reducer

    cls = module.DistributedDataParallel
    p, log = ctx.patches, ctx.log
    p.wrap(Reducer, "_rebuild_buckets", lambda orig: _rebuild_buckets(log, orig))
    p.wrap(cls, "_pre_forward", lambda orig: _pre_forward(log, orig))
    p.wrap(cls, "register_comm_hook", lambda orig: _registering(log, orig))
    p.wrap(cls, "_register_builtin_comm_hook", lambda orig: _registering(log, orig))


# ---- the bucket hook ---------------------------------------------------------------------
def measured(log, ddp, hook, timing=None, pack=None):
    """Wrap a comm hook: bucket spans for the rows inside it, a row when none is visible (timed
    with device events on an accelerator, by the hook's future on CPU). ``pack``: the model's
    ``rows.Packing`` (CPU models), told of each bucket's launch and completion."""
    import torch

    ddp_ref = weakref.ref(ddp)
    state = _runtime.STATE
    engine, graph_task = torch.autograd.Variable._execution_engine, torch._C._current_graph_task_id
    buckets = log.buckets
    syncs = log.syncs
    done = log.done
    pending = log.pending  # a bucket is in flight until its future completes: what a hung rank waits in
    code = OP_CODE["ddp_bucket_allreduce"]

    def last_bucket(ddp, timed_seq, start):
        """After the last bucket of a backward: DDP's finalize timed (for the CPU row ``timed_seq``,
        if any) and find_unused_parameters' bitmap all-reduce recorded."""
        # a joined rank's hooks run outside any backward (DDP.join): no finalize follows
        if timed_seq is not None and graph_task() >= 0:
            _time_finalize(engine, syncs, timed_seq, start)
        if ddp is not None and ddp.find_unused_parameters and not ddp.static_graph:
            _unused_map_allreduce(log, ddp)

    def noted(ddp, bucket, lo, hi, timed_seq, start):
        """The bucket's span of rows, then ``last_bucket`` after the last one."""
        buckets.append((lo, hi, bucket.index(), len(bucket.parameters())))
        if bucket.is_last():
            last_bucket(ddp, timed_seq, start)

    def default_bucket(slot, bucket, buf, ddp):
        """The reducer's own arithmetic on a CPU bucket: its row, timed by the one callback that
        also hands the reducer its tensor (a second Python callback per bucket on gloo's thread
        costs a GIL hand-off)."""
        where = state.where
        state.where = modules.where(ddp, P_BACKWARD)
        try:
            seq = next(SEQ)
            start = _pc()
            if pack is not None:
                pack.launch(seq, start)
            pending[seq] = Pending(code, log.group_id(ddp.process_group), buf.numel(), get_ident(), start, None)
            try:
                fut = _default_hook(slot, bucket, buf, (done, pending, seq, start, pack))
            except BaseException:
                pending.pop(seq, None)
                raise
            bucket_row(ddp, bucket, buf, seq, start, _pc(), T_FUTURE, seq)
            return fut
        finally:
            state.where = where

    def bucket_row(ddp, bucket, buf, seq, start, end, tcode, timed_seq):
        """The bucket's row and span (never raises into the reducer)."""
        try:
            record(log, "ddp_bucket_allreduce", ddp.process_group, buf, buf.numel(), start, end, True, tcode, seq=seq)
            noted(ddp, bucket, seq, seq + 1, timed_seq, start)
        except Exception as exc:  # noqa: BLE001
            _runtime.fail("ddp.hook", exc)

    def device_bucket(slot, bucket, buf, ddp):
        """The reducer's own arithmetic on an accelerator bucket: its row, timed by device events
        whose end is recorded by the one callback that also hands the reducer its tensor (a second
        ``then()`` per bucket cost ~40% of the hook on the backward's critical path)."""
        where = state.where
        state.where = modules.where(ddp, P_BACKWARD)
        try:
            started = timing.device_start(buf)  # None while the stream is capturing
            seq, gid = next(SEQ), log.group_id(ddp.process_group)
            start = _pc()
            pending[seq] = Pending(code, gid, buf.numel(), get_ident(), start, None)
            try:
                if started is None:
                    fut, tcode = _default_hook(slot, bucket, buf, (done, pending, seq, start, None)), T_FUTURE
                else:
                    ended = timing.end_recorder(seq, gid, started)
                    fut, tcode = _default_hook(slot, bucket, buf, ended=ended), T_DEVICE
            except BaseException:
                pending.pop(seq, None)
                timing.cancel(started)
                raise
            bucket_row(ddp, bucket, buf, seq, start, _pc(), tcode, None)
            return fut
        finally:
            state.where = where

    def hook_wrapper(hook_state, bucket):
        if not state.recording:
            return hook(hook_state, bucket)
        if hook is _dispatch and hook_state.hook is _default_hook:
            buf = bucket.buffer()
            ddp = ddp_ref()
            if ddp is not None:
                if buf.is_cpu:
                    return default_bucket(hook_state, bucket, buf, ddp)
                if timing is not None and not buf.is_sparse and on_device(buf, log):
                    return device_bucket(hook_state, bucket, buf, ddp)
        where = state.where
        ddp = ddp_ref()
        state.where = modules.where(ddp, P_BACKWARD) if ddp is not None else where
        try:
            lo = _peek_seq(SEQ)
            started = None
            if timing is not None:  # the bucket's own device (the flag may not be set yet)
                try:
                    buf = bucket.buffer()
                    started = timing.device_start(buf) if on_device(buf, log) else None
                except Exception as exc:  # noqa: BLE001 - device events unusable: timed by the future
                    _runtime.fail("timing", exc)
            start = _pc()
            if pack is not None:
                pack.launch(lo, start)
            fut = hook(hook_state, bucket)
            end = _pc()
            try:
                if pack is not None:
                    fut.then(pack.completed)
                timed_seq = None
                if _peek_seq(SEQ) == lo:  # nothing visible from Python: the C++ all-reduce ran
                    buf, group = bucket.buffer(), ddp.process_group if ddp else None
                    seq, gid = next(SEQ), log.group_id(group)
                    # in flight until timed (before then(): on a completed future it runs inline)
                    pending[seq] = Pending(code, gid, buf.numel(), get_ident(), start, None)
                    if started is not None:
                        tcode = timing.device_after(seq, gid, started, fut)
                    else:
                        fut.then(functools.partial(_landed, done, pending, seq, start))
                        tcode = T_FUTURE
                    record(log, "ddp_bucket_allreduce", group, buf, buf.numel(), start, end, True, tcode, seq=seq)
                    if started is None and buf.is_cpu:
                        timed_seq = seq
                elif started is not None:  # the rows inside timed themselves
                    timing.cancel(started)
                noted(ddp, bucket, lo, _peek_seq(SEQ), timed_seq, start)
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("ddp.hook", exc)
            return fut
        finally:
            state.where = where

    hook_wrapper.__wrapped__ = hook
    hook_wrapper.__qualname__ = getattr(hook, "__qualname__", "hook")
    if hook is _dispatch:  # the common case in C when built (the same row, span and timing)
        fast = bucket_hook(
            log,
            hook_wrapper,
            _default_hook,
            functools.partial(modules.where, phase=P_BACKWARD),
            last_bucket,
            torch.Tensor,
            pack,
        )
        if fast is not None:
            return fast
    return hook_wrapper


def _time_finalize(engine, syncs, seq, start) -> None:
    """The end of the reducer's finalize after this backward (it waits for every bucket's future,
    then copies the averaged gradients into .grad), as ns after the last bucket's issue, noted for
    that bucket's row (``sync_end_us``). The reducer queues its finalize as an autograd-engine
    final callback right after this last hook returns (reducer.cpp, ``mark_variable_ready``); a
    callback queued here runs before it, and one queued by that callback after it (the engine runs
    the callbacks added while it runs them, in order). Two callbacks and one timestamp per step."""

    def finalize_begins():
        try:
            engine.queue_callback(lambda: syncs.append((seq, _pc() - start)))
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            _runtime.fail("ddp.finalize", exc)

    try:
        engine.queue_callback(finalize_begins)
    except Exception as exc:  # noqa: BLE001 - not inside a backward (no finalize follows)
        _runtime.fail("ddp.finalize", exc)


class _Dispatch:
    """The hook commpatch registered on one reducer: runs ``hook(state, bucket)``, which is the
    reducer's own arithmetic (``_default_hook``, state = self) until a hook is registered."""

    __slots__ = ("ddp", "size", "hook", "state", "user", "work", "static", "track", "pack", "divide", "__weakref__")

    def __init__(self, ddp) -> None:
        self.ddp = weakref.ref(ddp)  # the reducer holds this object: no cycle through it
        self.size = ddp.process_group.size()
        self.hook, self.state, self.user = _default_hook, self, False
        self.work, self.static = None, True  # the reducer's forward work handle (join), if any
        self.track = None  # _AliasTrack, when the reducer's operation must be known
        self.pack = None  # rows.Packing of a CPU model (_packing)
        # batched_grad_copy=True (newer torch): the reducer copies a bucket's gradients unscaled and
        # divides the flat bucket once (flush_deferred_copies: x / d), whether or not they alias it
        self.divide = bool(getattr(ddp, "batched_grad_copy", False))
        if ddp.gradient_as_bucket_view and not _pow2(self.size) and not self.divide:
            self.track = _AliasTrack(ddp)

    def fill(self, hook, state) -> None:
        self.hook, self.state, self.user = hook, state, True
        self.track = None  # the user's hook divides (or not) by itself

    def divisor(self) -> int:
        """What ``Reducer::set_divide_factor`` computes: the group size, or, when the forward
        passed a join work handle without useStaticWorldSize, that all-reduce's result."""
        work = self.work
        if work is None or self.static:
            return self.size
        work.wait()
        return int(_bucket_tensor(work.get_future()).item())


def _dispatch(slot, bucket):
    return slot.hook(slot.state, bucket)


def _pow2(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def _default_hook(slot, bucket, buf=None, timed=None, ended=None):
    """What the reducer does without a hook (reducer.cpp, mark_variable_ready_*): scale into the
    bucket with the divisor and the operation it would use, then its C++ all-reduce (SUM).
    ``timed`` = (done, pending, seq, start, pack): the completion callback also notes ``done[seq]``,
    takes ``seq`` out of ``pending`` and tells ``pack`` (a ``rows.Packing`` or None). ``ended``: a
    function the completion callback calls first (``Timing.end_recorder``: the end event)."""
    if buf is None:
        buf = bucket.buffer()
    d = slot.divisor()
    if d == 1:
        pass  # x * 1.0 and x / 1 are x: no pass over the bucket
    elif buf.is_sparse or slot.divide:
        buf.div_(d)  # mark_variable_ready_sparse, or batched_grad_copy's flat bucket: div_ in place
    elif slot.track is None or _pow2(d):
        buf.mul_(1.0 / d)  # mul_out(bucket_view, grad, 1/d); x/d is the same bits
    else:
        slot.track.scale(bucket, buf, d)
    if slot.track is not None and bucket.is_last():
        slot.track.clear()
    # the hook must return a future whose value is a Python object: then(), not the C++ future
    fut = slot.ddp().reducer._run_allreduce_hook(bucket)
    if ended is not None:
        return fut.then(functools.partial(_ended_bucket_tensor, ended))
    return fut.then(_bucket_tensor if timed is None else functools.partial(_timed_bucket_tensor, *timed))


def _bucket_tensor(fut):
    value = fut.value()
    return value[0] if isinstance(value, list) else value


def _ended_bucket_tensor(ended, fut):
    ended()
    return _bucket_tensor(fut)


def _landed(done, pending, seq, start, _fut=None) -> None:
    """A bucket's completion: its duration noted (as the rows' own callbacks note it), no longer in flight."""
    done[seq] = _pc() - start
    pending.pop(seq, None)


def _timed_bucket_tensor(done, pending, seq, start, pack, fut):
    _landed(done, pending, seq, start)
    if pack is not None:
        pack.done()
    return _bucket_tensor(fut)


class _AliasTrack:
    """gradient_as_bucket_view=True: the reducer scales a gradient it copies into the bucket
    (``x * (1/d)``) but divides in place one that already is its bucket view (``x / d``); with a
    divisor that is not a power of two the two differ in the last bit. It decides on the
    gradient right after accumulation, and by the time the hook runs every gradient is a bucket
    view; so a post-accumulate-grad hook on each parameter notes the storage of its gradient
    then. The first accumulation of a synchronized backward also notes the parameters not noted
    yet: those that accumulate nothing (unused ones, which the reducer marks first) keep that
    state. The notes are dropped once the last bucket of the backward is scaled.

    ``lazy_bucket_allocation=True`` (newer torch): the reducer gives a bucket its storage when the
    first of its parameters is marked ready in a backward (the unused ones, marked at the first
    accumulation, included) and then makes every gradient of the bucket that is defined at that
    moment a view of it (``initialize_bucket_views``): those are the ones it divides in place. So
    the notes are, per parameter, whether its gradient was defined when the backward's first
    accumulation ran (``pre``) and its place in the order of accumulation (``order``); under
    static_graph=True the first synchronized backward marks every gradient at its end, when
    every one accumulated is defined (``delayed``)."""

    def __init__(self, ddp) -> None:
        self.ddp = weakref.ref(ddp)
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.task = None  # the autograd graph task last seen
        self.ptr: dict[int, int] = {}  # id(param) -> data_ptr of its grad's storage (0: none)
        self.lazy = bool(getattr(ddp, "lazy_bucket_allocation", False))
        self.pre: dict[int, bool] = {}  # lazy: id(param) -> its grad defined at the first accumulation
        self.order: dict[int, int] = {}  # lazy: id(param) -> its place among this backward's accumulations
        # lazy, static_graph: DDP's first synchronized backward enqueues the reducer's delayed
        # all-reduce, which marks every gradient at the backward's end (all defined ones then views)
        self.enqueued = bool(getattr(ddp, "_static_graph_delay_allreduce_enqueued", False))
        self.delayed = False  # this backward is that one
        hook = functools.partial(_accumulated, weakref.ref(self))
        handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        weakref.finalize(self, _remove, handles)

    def note(self, param) -> None:
        grad = param.grad
        self.ptr[id(param)] = grad.untyped_storage().data_ptr() if grad is not None else 0

    def aliases(self, bucket, base: int) -> list[bool]:
        """Which of the bucket's gradients the reducer holds as views of it (divides in place)."""
        params = bucket.parameters()
        if not self.lazy:
            return [self.ptr.get(id(p)) == base for p in params]
        order = [self.order.get(id(p)) for p in params]
        if self.delayed:
            return [self.pre.get(id(p), False) or o is not None for p, o in zip(params, order)]
        # the storage came with the first mark: the backward's first accumulation where an unused
        # parameter is in the bucket, else the bucket's own first accumulation
        first = 0 if None in order else min(order)
        return [self.pre.get(id(p), False) or o == first for p, o in zip(params, order)]

    def clear(self) -> None:
        self.ptr.clear()
        self.pre.clear()
        self.order.clear()

    def scale(self, bucket, buf, d: int) -> None:
        base = buf.untyped_storage().data_ptr()
        alias = self.aliases(bucket, base)
        if all(alias):
            buf.div_(d)
        elif not any(alias):
            buf.mul_(1.0 / d)
        else:
            for view, is_alias in zip(bucket.gradients(), alias):
                view.div_(d) if is_alias else view.mul_(1.0 / d)


def _accumulated(track_ref, param) -> None:
    try:
        track = track_ref()
        ddp = track.ddp() if track is not None else None
        if ddp is None or not ddp.require_backward_grad_sync:  # no_sync(): no reduction follows
            return
        task = _graph_task_id()
        if task != track.task:  # a new backward (or a reentrant one inside it)
            track.task = task
            ptr, pre = track.ptr, track.pre
            if track.lazy and not pre:  # this backward's first accumulation (not a reentrant one's)
                # static_graph's first synchronized backward marks every gradient at its end
                enqueued = bool(getattr(ddp, "_static_graph_delay_allreduce_enqueued", False))
                track.delayed, track.enqueued = enqueued and not track.enqueued, enqueued
            for p in track.params:
                if id(p) not in ptr:
                    track.note(p)
                if track.lazy and id(p) not in pre:
                    pre[id(p)] = p is not param and p.grad is not None
        track.note(param)
        if track.lazy and id(param) not in track.order:
            track.order[id(param)] = len(track.order)
    except Exception as exc:  # noqa: BLE001 - never break the user's backward
        _runtime.fail("ddp.track", exc)


def _graph_task_id() -> int:
    import torch

    return torch._C._current_graph_task_id()


def _packing(log, slot, ddp):
    """A CPU model's ``rows.Packing``, its two hooks on each parameter's gradient accumulator in
    place while ``slot`` lives (after disable() they return at once), or None (a model on an
    accelerator: the reducer's copies are device kernels, which the host does not wait for)."""
    import torch

    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if not params or not all(p.is_cpu for p in params):
        return None
    pack = packing(log)
    handles = []
    try:
        # the first forward may run under no_grad() or inference_mode(): the accumulators exist anyway
        with torch.inference_mode(False), torch.enable_grad():
            for p in params:
                handles.append(p.register_post_accumulate_grad_hook(pack.acc))
                # the accumulator the reducer hooked (torch caches it per parameter; the reducer keeps it)
                handles.append(p.view_as(p).grad_fn.next_functions[0][0].register_hook(pack.post))
    except Exception as exc:  # noqa: BLE001 - the buckets are still recorded, without their packing
        _remove(handles)
        _runtime.fail("ddp.packing", exc)
        return None
    weakref.finalize(slot, _remove, handles)
    return pack


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


# ---- installing the dispatcher, filling its slot ---------------------------------------------
def _pre_forward(log, orig):
    """DDP's forward: the dispatcher goes in at the first forward while recording."""
    return _installing(log, orig, lambda: _runtime.STATE.recording)


def _installing(log, orig, active):
    """``orig`` (a DDP method), which first puts the dispatcher in place when ``active()``."""

    def installing(self, *args, **kwargs):
        if active():
            reducer = self.__dict__.get("reducer")
            if reducer is not None:
                slot = _SLOTS.get(reducer, _install)
                if slot is _install:
                    _install(log, self, reducer)
                    if getattr(self, "find_unused_parameters", False) and not getattr(self, "static_graph", False):
                        _NO_REBUILD.add(reducer)  # torch's should_rebuild_buckets() is false for good
                elif slot is not None and slot.pack is not None:
                    slot.pack.reset()  # a new forward: packing no launch followed is forgotten
        return orig(self, *args, **kwargs)

    return _eager(installing)


def _eager(fn):
    """Never traced by dynamo (it would fold the ``_SLOTS`` lookup into a compiled frame and
    install again at every call): under torch.compile of a DDP model, DDP's own forward code is
    torch's and runs as Python; so does this wrapper, and what it calls is compiled as before."""
    import torch

    disable = getattr(torch, "_disable_dynamo", None)
    return disable(fn, recursive=False) if disable is not None else fn


# parameters named in a DDP module's settings record: the first ones, whose gradients are ready last
# (DDP's buckets take the parameters in reverse order): they make the tail of the backward
SETTINGS_PARAMS = 64


def note_settings(log, ddp) -> None:
    """The DDP module's settings, once (a ``settings`` record: the advice never proposes what is
    already set), with its first parameters' names and bytes."""
    try:
        params = [[name, p.numel() * p.element_size()] for name, p in ddp.module.named_parameters() if p.requires_grad][
            :SETTINGS_PARAMS
        ]
        values = dict(
            bucket_cap_mb=ddp.bucket_bytes_cap / float(1 << 20),
            gradient_as_bucket_view=bool(ddp.gradient_as_bucket_view),
            static_graph=bool(ddp.static_graph),
            find_unused_parameters=bool(ddp.find_unused_parameters),
            first_params=params,
        )
        log.settings.append(("ddp", type(ddp.module).__name__, values))
    except Exception as exc:  # noqa: BLE001 - a setting not read never breaks the forward
        _runtime.fail("ddp.settings", exc)


def _install(log, ddp, reducer) -> None:
    _SLOTS[reducer] = None  # decided once per reducer, whatever happens below
    note_settings(log, ddp)
    try:
        existing = ddp._get_ddp_logging_data().get("comm_hook", "")
        if existing:  # a hook registered before enable(): it cannot be wrapped or replaced
            _runtime.fail(
                "ddp.hook_registered_before_enable",
                RuntimeError(
                    f"comm hook {existing!r} was registered before commpatch.enable(): its buckets are not recorded"
                ),
            )
            return
        if getattr(ddp, "_use_python_reducer", False):
            return
        _persist()
        slot = _Dispatch(ddp)
        ctx = base.CURRENT
        if ctx is None or ctx.settings.get("ddp_packing", True):
            slot.pack = _packing(log, slot, ddp)
        _TORCH["register"](
            reducer, slot, measured(log, ddp, _dispatch, ctx.timing if ctx is not None else None, slot.pack)
        )
        _SLOTS[reducer] = slot
    except Exception as exc:  # noqa: BLE001
        _runtime.fail("ddp.install", exc)


def _registering(log, orig):
    """register_comm_hook / _register_builtin_comm_hook while enabled: put the dispatcher in
    place first; torch's method then runs as is and its registration fills the slot."""
    return _installing(log, orig, lambda: _runtime.STATE.enabled)


def _persist() -> None:
    """Once per process: the pass-throughs a dispatcher relies on, kept after disable()."""
    if _TORCH:
        return
    import torch.distributed as dist
    from torch._C._distributed_c10d import Reducer

    register, builtin = dist._register_comm_hook, dist._register_builtin_comm_hook
    set_work = Reducer._set_forward_pass_work_handle
    _TORCH.update(register=register, builtin=builtin, set_work=set_work)

    @functools.wraps(register)
    def _register_comm_hook(reducer, state, comm_hook):
        slot = _slot_of(reducer)
        if slot is None or slot.user:  # no dispatcher, or taken: torch decides (and raises)
            return register(reducer, state, comm_hook)
        slot.fill(comm_hook, state)
        return None

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(reducer, comm_hook_type):
        slot = _slot_of(reducer)
        python_hook = _builtin_equivalent(comm_hook_type) if slot is not None and not slot.user else None
        ddp = slot.ddp() if slot is not None else None
        if python_hook is None or ddp is None:
            return builtin(reducer, comm_hook_type)
        slot.fill(python_hook, ddp.process_group)  # builtin hooks run no Python: same numerics
        return None

    def _set_forward_pass_work_handle(self, work, use_static_world_size):
        slot = _slot_of(self)
        if slot is not None:
            try:
                slot.work, slot.static = work, bool(use_static_world_size)
                ddp = slot.ddp()
                if (
                    not slot.static
                    and not slot.user
                    and slot.track is None
                    and slot.size > 2
                    and ddp is not None
                    and ddp.gradient_as_bucket_view
                ):
                    slot.track = _AliasTrack(ddp)  # the running count may be no power of two
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("ddp.join", exc)
        return set_work(self, work, use_static_world_size)

    dist._register_comm_hook = _register_comm_hook
    dist._register_builtin_comm_hook = _register_builtin_comm_hook
    Reducer._set_forward_pass_work_handle = _set_forward_pass_work_handle


def _slot_of(reducer):
    try:
        return _SLOTS.get(reducer)
    except TypeError:  # not weak-referenceable: not a reducer of ours
        return None


def _builtin_equivalent(comm_hook_type):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
        dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    }.get(comm_hook_type)


# ---- collectives the reducer and the constructor issue from C++ ----------------------------
# c10d op -> (row op, S: "in" the tensors given, "out" the gathered output)
_CTOR = {"broadcast_": ("ddp_broadcast_coalesced", "in")}
_VERIFY = {"allgather_": ("ddp_verify_params_allgather", "out"), "broadcast_": ("ddp_verify_params_broadcast", "in")}
_REBUILD = {"broadcast_": ("ddp_rebuild_buckets_broadcast", "in")}
_UNUSED = {"allreduce_": ("ddp_unused_allreduce", "in")}


def _scoped(log, orig, ops: dict, kind: str):
    """``orig`` (a C++ function reachable from Python: the constructor's parameter check and
    broadcast, the reducer's bucket rebuild) with the collectives it issues recorded one row each,
    with their real bytes: dispatcher kernels on ``ops`` installed for the duration of the call
    and only for the calling thread (``patch.dispatch``)."""
    state = _runtime.STATE

    def scoped(*args, **kwargs):
        if not state.recording or _runtime.LOCAL.depth:
            return orig(*args, **kwargs)
        kernels = _inner_kernels(log, ops, kind, threading.get_ident())
        try:
            return orig(*args, **kwargs)
        finally:
            kernels.remove()

    return scoped


def _inner_kernels(log, ops: dict, kind: str, thread: int, once: bool = False):
    """Kernels recording each call of ``ops`` made by ``thread`` (``once``: only the first)."""
    kernels = Kernels("c10d")
    try:
        where = _runtime.STATE.where
        for name, (op, count) in ops.items():
            kernels.wrap(
                name, lambda call, op=op, count=count: _inner_kernel(log, call, op, count, kind, thread, once, where)
            )
    except Exception as exc:  # noqa: BLE001
        kernels.remove()
        _runtime.fail(f"ddp.{kind}", exc)
    return kernels


def _inner_kernel(log, call, op: str, count: str, kind: str, thread: int, once: bool, where: int):
    from torch._C._distributed_c10d import ProcessGroup, Work

    done = log.done
    armed = [True]

    def inner(keyset, tensors, *rest, **kwargs):
        if not armed[0] or threading.get_ident() != thread:
            return call(keyset, tensors, *rest, **kwargs)
        flat, started = [t for ts in tensors for t in ts] if count == "out" else tensors, None
        timing = base.CURRENT.timing if base.CURRENT is not None else None
        try:
            if timing is not None and flat and on_device(flat[0], log):
                started = timing.device_start(flat[0])  # on an accelerator the work's future completes at enqueue
        except Exception as exc:  # noqa: BLE001 - device events unusable: timed by the future
            _runtime.fail("timing", exc)
        start = _pc()
        out = call(keyset, tensors, *rest, **kwargs)
        end = _pc()
        try:
            armed[0] = not once
            group = ProcessGroup.unbox(rest[0] if count == "in" else rest[1])
            fut, seq = Work.unbox(out[1]).get_future(), next(SEQ)
            if started is not None:
                tcode = timing.device_after(seq, log.group_id(group), started, fut)
            else:
                fut.then(lambda _f, seq=seq: done.__setitem__(seq, _pc() - start))
                tcode = T_FUTURE
            state = _runtime.STATE
            outer, state.where = state.where, where
            try:
                record(log, op, group, flat[0], sum(t.numel() for t in flat), start, end, True, tcode, seq=seq)
            finally:
                state.where = outer
        except Exception as exc:  # noqa: BLE001
            _runtime.fail(f"ddp.{kind}", exc)
        return out

    return inner


def _rebuild_buckets(log, orig):
    """The reducer's bucket rebuild (before the 2nd forward) broadcasts the new layout from C++.
    DDP asks at every forward, and the kernels cost ~150 us to put in place and take away, so they
    are installed only while a rebuild can still happen: not once it has happened (the reducer does
    it once), nor for a DDP that never rebuilds (find_unused_parameters without static_graph:
    noted by the forward wrapper)."""
    scoped = _scoped(log, orig, _REBUILD, "rebuild_buckets")

    def rebuild_buckets(reducer):
        try:
            done = reducer in _NO_REBUILD
        except TypeError:  # not weak-referenceable: not a reducer we know
            done = False
        if done:
            return orig(reducer)
        rebuilt = scoped(reducer)
        if rebuilt:
            _NO_REBUILD.add(reducer)
        return rebuilt

    return rebuild_buckets


def _unused_map_allreduce(log, ddp) -> None:
    """Called by the last bucket's hook of a DDP with find_unused_parameters: the reducer issues
    the all-reduce of its unused-parameter bitmap next, from C++ (``all_reduce_local_used_map``).
    A kernel records that one call; it is removed at the end of the backward."""
    import torch

    kernels = _inner_kernels(log, _UNUSED, "unused_parameters", threading.get_ident(), once=True)
    try:
        torch.autograd.Variable._execution_engine.queue_callback(kernels.remove)
    except Exception as exc:  # noqa: BLE001 - not inside a backward: nothing follows
        kernels.remove()
        _runtime.fail("ddp.unused_parameters", exc)


INTEGRATION = Integration(
    name="ddp",
    patches="DistributedDataParallel: __init__, forward pre-hook, register_comm_hook, _register_builtin_comm_hook, "
    "_rebuild_buckets, join; dist._register_comm_hook while a registration runs; dispatcher kernels for "
    "c10d::allgather_ / broadcast_ / allreduce_ around the constructor's and reducer's C++ collectives",
    relies_on=(
        Needs(f"{DDP_MODULE}.DistributedDataParallel._pre_forward"),
        Needs(f"{DDP_MODULE}.DistributedDataParallel.register_comm_hook"),
        Needs(f"{DDP_MODULE}.DistributedDataParallel._register_builtin_comm_hook"),
        Needs("torch.distributed._register_comm_hook"),
        Needs("torch.distributed._register_builtin_comm_hook"),
        Needs("torch.distributed.BuiltinCommHookType"),
        Needs("torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"),
        Needs("torch._C._distributed_c10d.Reducer._run_allreduce_hook"),
        Needs("torch._C._distributed_c10d.GradBucket.is_last"),
        Needs("torch._C._current_graph_task_id"),
        Needs("torch.autograd.Variable._execution_engine.queue_callback", "DDP's finalize time (sync_end_us)"),
        Needs("torch._C._distributed_c10d.Reducer._rebuild_buckets", "the bucket-rebuild broadcasts"),
        Needs(
            "torch._C._distributed_c10d.Reducer._set_forward_pass_work_handle",
            "the collectives of DDP.join()'s shadow steps",
        ),
        Needs("torch.distributed._broadcast_coalesced", "DDP's constructor broadcast"),
        Needs("torch.distributed._verify_params_across_processes", "DDP's constructor parameter check"),
        Needs("torch.Tensor.register_post_accumulate_grad_hook", "DDP's gradient packing (pack_us)"),
    ),
    records="DDP's gradient buckets",
    wanted=wanted,
    apply=apply,
)
