"""Training steps without code change: the step counter (``STATE.step``, the ``step`` column)
advances by itself, and each row says what counted its step (``step_source``).

- ``optimizer``: after each ``step()`` of the first optimizer seen stepping (a global optimizer
  step post-hook; other optimizers of the same loop, a GAN's second one, do not count again).
  A step is then one optimizer step: step 0 holds everything up to the end of the first one
  (process group creation, DDP's constructor collectives, the first iteration).
- ``forward``: before each forward of a root DDP / FSDP module after the first, as long as no
  optimizer step has been seen (a loop whose update is not a ``torch.optim`` optimizer). Nested
  FSDP units and DDP inside another counted forward do not count again. When an optimizer step
  comes after counted forwards and the next optimizer step takes k > 1 root forwards (gradient
  accumulation), the last k forward-counted steps were the first optimizer step's micro-batches:
  a mark says so, and the reader makes them one step and numbers the later ones as the job
  numbers its optimizer steps (``data.frame._job_steps``).
- ``user``: ``commpatch.step()`` was called: from then on only the user's calls move the counter.

With none of them the counter stays at 0; the offline analysis (``analysis.pattern``) then numbers
the iterations of the rank's repeating pattern of collectives (``pattern``): nothing at record time.

Each change of source is one ``step_source`` record in the rank's log (``record.state.
set_step_source``), not a field of every row. Where a step starts, and at the step's first root
forward, the training thread's wall clock and CPU time (``time.thread_time_ns``) are noted
(``Log.step_marks``, a ``step`` record each): the straggler advice tells more work (CPU time up)
from a rank kept off the CPU (wall time up, CPU time not) and from waiting on input (the time
from the step's start to its forward). Cost: one Python call per optimizer step and per root
forward; nothing per collective.
"""

from __future__ import annotations

import threading
import time

from ..data.schema import S_FORWARD, S_OPTIMIZER, S_USER
from ..record import state as _runtime
from ..record.rows import SEQ, peek_seq
from .base import Integration, Needs, when_imported

DDP_MODULE = "torch.nn.parallel.distributed"
FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"
FSDP2_MODULES = tuple(
    f"{package}._fsdp_state"
    for package in ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")
)

_handles: list = []
_driver: list = []  # id() of the optimizer whose steps count
_seen_forward: list = []  # a root forward ran (the first one opens step 0, it does not advance)
_micro: list = []  # [root forwards, step at the switch] during the first optimizer step after forward-counted ones
_local = threading.local()  # .depth: counted root forwards running in this thread
_marks: list = []  # [the Log's step_marks list] while applied
_forward_marked = [-1]  # the step whose first root forward is noted
_wall_ns, _cpu_ns = time.time_ns, time.thread_time_ns


def _mark(at: int) -> None:
    """Note the training thread's wall clock and CPU time: at 0 a step starts, at 1 its first root forward."""
    if _marks:
        _marks[0].append((_runtime.STATE.step, at, _wall_ns(), _cpu_ns()))


def wanted(settings: dict) -> bool:
    return True


def advance(source: int) -> None:
    """One step more, counted by ``source`` (switching to it first if another source counted)."""
    state = _runtime.STATE
    if state.step_source != source:
        if source == S_OPTIMIZER and state.step_source == S_FORWARD:
            # the last forwards counted may be this first optimizer step's micro-batches (gradient
            # accumulation): the root forwards of its next step say how many (_micro_batches)
            _micro[:] = [0, state.step]
        _runtime.set_step_source(source, peek_seq(SEQ))
    elif _micro and source == S_OPTIMIZER:
        _micro_batches(peek_seq(SEQ))
    state.step += 1
    _mark(0)


def _micro_batches(seq: int) -> None:
    """The second optimizer step after steps counted by forwards: a ``step_source`` mark notes how
    many root forwards it took (``micro``) and the step the first one ended (``switched``); the
    reader then puts that many forward-counted steps before the switch in one step and numbers the
    later ones as the job does (``data.frame._job_steps``)."""
    forwards, switched = _micro
    _micro.clear()
    if forwards > 1:
        _runtime.STEP_SOURCE_MARKS.append((seq, S_OPTIMIZER, forwards, switched))


def user_step(value=None) -> int:
    """``commpatch.step()``: the user's count overrides the automatic ones from now on."""
    state = _runtime.STATE
    value = None if value is None else int(value)  # before the source switches: a bad value changes nothing
    if state.step_source != S_USER:
        _runtime.set_step_source(S_USER, peek_seq(SEQ))
    state.step = state.step + 1 if value is None else value
    if state.recording:
        _mark(0)
    return state.step


def apply(ctx) -> None:
    _marks[:] = [ctx.log.step_marks]
    when_imported("torch.optim.optimizer", _install_optimizer_hook)
    when_imported(DDP_MODULE, lambda ctx, m: _wrap_forward(ctx, m.DistributedDataParallel, "forward"))
    when_imported(FSDP1_MODULE, lambda ctx, m: _wrap_forward(ctx, m.FullyShardedDataParallel, "forward"))
    for module in FSDP2_MODULES:
        when_imported(module, _wrap_fsdp2)


def _install_optimizer_hook(ctx, optim_module) -> None:
    if _handles:
        return
    state = _runtime.STATE

    def optim_post(optimizer, args, kwargs):
        if not state.recording or state.step_source == S_USER:
            return
        if not _driver:
            _driver.append(id(optimizer))
        elif _driver[0] != id(optimizer):
            return
        advance(S_OPTIMIZER)

    _handles.append(optim_module.register_optimizer_step_post_hook(optim_post))


def _root_forward_begins() -> None:
    state = _runtime.STATE
    if _micro and state.step_source == S_OPTIMIZER:
        _micro[0] += 1
    if not state.recording:
        return
    if state.step_source in (S_USER, S_OPTIMIZER):
        if _forward_marked[0] != state.step:  # the step's first forward: its input is in
            _forward_marked[0] = state.step
            _mark(1)
        return
    if _seen_forward:
        advance(S_FORWARD)
    else:
        _seen_forward.append(True)


def _wrap_forward(ctx, cls, name) -> None:
    def factory(orig):
        def forward(self, *args, **kwargs):
            depth = getattr(_local, "depth", 0)
            if depth == 0:
                try:
                    _root_forward_begins()
                except Exception as exc:  # noqa: BLE001 - step counting never breaks a forward
                    _runtime.fail("steps.forward", exc)
            _local.depth = depth + 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                _local.depth = depth

        return forward

    ctx.patches.wrap(cls, name, factory)


def _wrap_fsdp2(ctx, module) -> None:
    """FSDP2: ``FSDPState._root_pre_forward`` runs for every unit; the first of an iteration finds
    no ``iter_forward_root`` yet (the root's)."""
    cls = getattr(module, "FSDPState", None)
    if cls is None or not hasattr(cls, "_root_pre_forward"):
        return

    def factory(orig):
        def _root_pre_forward(self, *args, **kwargs):
            try:
                ctx_state = getattr(self, "_state_ctx", None)
                if (
                    ctx_state is not None
                    and getattr(ctx_state, "iter_forward_root", 0) is None
                    and getattr(_local, "depth", 0) == 0
                ):
                    _root_forward_begins()
            except Exception as exc:  # noqa: BLE001 - step counting never breaks a forward
                _runtime.fail("steps.forward", exc)
            return orig(self, *args, **kwargs)

        return _root_pre_forward

    ctx.patches.wrap(cls, "_root_pre_forward", factory)


def remove(ctx) -> None:
    while _handles:
        _handles.pop().remove()
    _driver.clear()
    _seen_forward.clear()
    _micro.clear()
    _marks.clear()
    _forward_marked[0] = -1


INTEGRATION = Integration(
    name="steps",
    patches="a global optimizer step post-hook; DistributedDataParallel.forward, FullyShardedDataParallel.forward, "
    "FSDP2 FSDPState._root_pre_forward (counting only)",
    relies_on=(
        Needs(
            "torch.optim.optimizer.register_optimizer_step_post_hook",
            "steps counted by optimizer.step() (DDP / FSDP root forwards still count)",
        ),
        Needs(f"{DDP_MODULE}.DistributedDataParallel.forward", "steps counted by DDP's forwards"),
        Needs(f"{FSDP1_MODULE}.FullyShardedDataParallel.forward", "steps counted by FSDP1's forwards"),
        Needs(
            "|".join(f"{m}.FSDPState._root_pre_forward" for m in FSDP2_MODULES),
            "steps counted by FSDP2's root forwards",
        ),
    ),
    records="automatic step numbers",
    wanted=wanted,
    apply=apply,
    remove=remove,
)
