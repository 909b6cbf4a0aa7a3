"""``_coalescing_manager``: one row for the coalesced collective that actually ran.

Inside ``torch.distributed.distributed_c10d._coalescing_manager`` the ``all_reduce`` /
``all_gather_single`` / ``reduce_scatter_single`` calls (and the functions built on them) only
queue a ``_CollOp`` in torch's per-group op list; at exit the manager issues one coalesced
collective for the whole list (``allreduce_coalesced``, ``all_gather_single_coalesced``,
``reduce_scatter_single_coalesced``) and waits for it, or hands its Work to the manager
(``async_ops=True``). The manager is wrapped (in ``distributed_c10d``, where
``batch_isend_irecv`` looks it up, and ``torch.distributed``): while it is open, the core
wrappers record no row for a queued call and only hand over the start of the first one
(``record.state.COALESCING``); at exit one row is recorded:

- op ``coalesced.<queued op>`` (``coalesced.all_reduce``, ...) with a seq taken at exit, where
  the collective runs (``group_seq`` follows the order of execution); bytes of the whole list as
  the queued calls count them (all_gather the full outputs, reduce_scatter the full inputs);
  ``tensors`` is the number of calls coalesced;
- timed from the first queued call: to the manager's exit (``host``: the exit waits for the
  collective), or with ``async_ops=True`` to the completion of the returned Work's future
  (``future``; ``none`` where the backend gives none, e.g. gloo's coalesced reduce_scatter).
Calls that do not queue (other ops inside the manager, a backend with its own coalescing) keep
their own rows; the ``_IllegalWork`` placeholders are never touched. Inside another recorded call
(``batch_isend_irecv`` on a coalescing backend) the manager is not recorded: the outer row is.
A manager bound by name before ``enable()`` is not wrapped: each queued call then keeps a row
of its own with ``timing=none``.
"""

from __future__ import annotations

import contextlib
import time

from ..data.ops import OP_CODE
from ..data.schema import T_HOST, T_NONE
from ..record import state as _runtime
from ..record.rows import SEQ
from .base import Integration, Needs, record, when_imported

C10D = "torch.distributed.distributed_c10d"
_pc = time.perf_counter_ns


def wanted(settings: dict) -> bool:
    return True


def apply(ctx) -> None:
    when_imported(C10D, _patch)


def _patch(ctx, c10d) -> None:
    import torch.distributed as dist

    made = {}

    def make(orig):  # one wrapper object for both namespaces
        return made.setdefault(id(orig), _manager(ctx, c10d, orig))

    for owner in (c10d, dist):
        ctx.patches.wrap(owner, "_coalescing_manager", make)


def _manager(ctx, c10d, orig):
    state, local, spans = _runtime.STATE, _runtime.LOCAL, _runtime.COALESCING

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False):
        pg = None
        if state.recording and not local.depth:
            try:
                pg = group or c10d._get_default_group()
            except Exception:  # noqa: BLE001 - torch raises its own error below
                pg = None
        if pg is None or pg in spans:
            with orig(group, device, async_ops) as cm:
                yield cm
            return
        span = spans[pg] = []  # [start] of the first queued call, set by the wrapper
        queue, cm, err = [], None, True
        try:
            with orig(group, device, async_ops) as cm:
                queue = c10d._world.pg_coalesce_state.get(pg, [])  # torch pops it at exit, the list stays
                yield cm
            err = False
        finally:
            end = _pc()
            spans.pop(pg, None)
            if span:
                try:
                    _record(ctx, pg, queue, span, end, cm if async_ops else None, err)
                except Exception as exc:  # noqa: BLE001 - never break the user's collective
                    _runtime.fail("coalescing.record", exc)

    return _coalescing_manager


def _record(ctx, pg, queue, span, end, cm, err) -> None:
    start, seq = span[0], next(SEQ)
    name = queue[0].op.__name__  # the wrapper's name: torch's own function name
    # S as the queued calls count it: all_gather the full output (the dst tensors), else the input
    gather = name in ("all_gather_single", "all_gather_into_tensor")  # the latter queued on torch < 2.5
    numel = sum((op.dst_tensor if gather else op.tensor).numel() for op in queue)
    op = OP_CODE["coalesced." + name]
    tcode = T_HOST
    if cm is not None and not err:
        tcode = ctx.timing.future(seq, start, list(cm.works), op) if cm.works else T_NONE
    record(ctx.log, "coalesced." + name, pg, queue[0].tensor, numel, start, end, cm is not None, tcode, err, seq=seq)
    ctx.log.buckets.append((seq, seq + 1, -1, len(queue)))


INTEGRATION = Integration(
    name="coalescing",
    patches="distributed_c10d._coalescing_manager (in distributed_c10d and torch.distributed)",
    relies_on=(
        Needs(f"{C10D}._coalescing_manager"),
        Needs(f"{C10D}._world.pg_coalesce_state"),
        Needs(f"{C10D}._IllegalWork"),
        Needs(f"{C10D}._get_default_group"),
    ),
    records="_coalescing_manager's coalesced collectives",
    wanted=wanted,
    apply=apply,
)
