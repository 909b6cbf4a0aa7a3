"""The one row writer outside the generated fast path: the wrapper's slow path (CUDA, async,
nested and coalesced calls, errors) and every integration write their rows through ``write_row``
(and ``record`` for a call an integration observed), into the same ``Log`` with the same packed
layout (``data.schema.ROW``) as the fast path's inline ``extend(pack(...))``.

Also: ``Pending``, the named entry of ``Log.pending`` (a call in flight, shown by the watchdog),
and the process's sequence counter ``SEQ``.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

from ..data.ops import OP_CODE
from ..data.schema import ROW, T_FUTURE, T_HOST, T_SHIFT, pack_flags
from .state import STATE, fail

try:
    from . import _hot  # the C row writer (record/_hot.c), built at install when a compiler is there

    _hot.bind_state(STATE)  # the slots of STATE it reads
except (ImportError, AttributeError, TypeError):  # not built (or built from other sources): the pure-Python path
    _hot = None
# It reads CLOCK_MONOTONIC itself: used only where that is what time.perf_counter_ns reads (Linux).
C_ROWS = _hot is not None and time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"

# per-process sequence shared by all wrappers; next() is atomic: the C recorder takes its numbers
# without an int object each (_hot.Counter: itertools.count's interface, and peek())
SEQ = _hot.Counter() if _hot is not None else itertools.count()


def take_rows_py(buf: bytearray, n: int) -> bytes:
    """The first ``n`` bytes of ``buf``, removed from it (atomic under the GIL: the hot path appends
    meanwhile); ValueError unless 0 <= n <= len(buf). In C (``_hot.take``, ``take_rows`` where
    built) the storage is kept for the next rows instead of freed."""
    if not 0 <= n <= len(buf):
        raise ValueError("take: n out of range")
    chunk = bytes(buf[:n])
    del buf[:n]
    return chunk


take_rows = _hot.take if C_ROWS else take_rows_py


def hot_call(
    log, mask: int, code: int, orig, maintain, coalescing: dict, tensor_type, dtype_code: int, check_devices: bool
):
    """The C recorder's ``call`` for op ``code`` wrapping ``orig``, bound to ``log`` (see
    record/_hot.c), or None when it is not available (not built, another clock).
    ``call(group, t, numel or None, peer, async_op, *args)`` returns ``SLOW`` for any call but the
    common case (the Python path takes it), else ``orig(*args)``, timed on the host, after
    appending its row (numel None: the tensor's own); ``maintain(seq)`` runs when a chunk of rows
    starts. ``dtype_code``: the op's dtype code when it has no tensor, else -1; ``check_devices``:
    leave every call to Python once ``STATE.devices`` is set (device timing)."""
    if not C_ROWS:
        return None
    return _hot.Recorder(
        log.buf,
        STATE,
        SEQ,
        log.dtype_ids,
        log.dtype_id,
        log.dtype_sizes,
        mask,
        code,
        T_HOST << T_SHIFT,
        orig,
        maintain,
        fail,
        log.group_ids,
        coalescing,
        tensor_type,
        dtype_code,
        check_devices,
    ).call


SLOW = _hot.SLOW if _hot is not None else object()


def bucket_hook(log, fallback, default_hook, where, on_last, tensor_type, packing=None):
    """The C comm hook for DDP's buckets (record/_hot.c: BucketHook) bound to ``log``, or None when
    the C module is not available: ``hook(slot, bucket)`` takes the reducer's own arithmetic on a
    dense CPU bucket (``slot.hook is default_hook``) and writes the bucket's row, span and timing;
    ``fallback(slot, bucket)`` takes anything else. ``where(ddp)``: the row's module/phase code;
    ``on_last(ddp, seq, start)``: after the last bucket of a backward. ``packing``: the model's
    ``packing(log)`` (its buckets' launches and completions), or None; a Python ``Packing`` leaves
    the buckets to the Python hook."""
    if not C_ROWS or not (packing is None or isinstance(packing, _hot.Packing)):
        return None
    return _hot.BucketHook(
        fallback,
        default_hook,
        STATE,
        SEQ,
        log.buf,
        log.dtype_ids,
        log.dtype_id,
        log.group_ids,
        log.group_id,
        log.done,
        log.pending,
        log.buckets,
        where,
        on_last,
        fail,
        tensor_type,
        OP_CODE["ddp_bucket_allreduce"],
        pack_flags(True, False, False, T_FUTURE),
        packing,
    )


class Packing:
    """DDP's packing of one model's gradients into its buckets (CPU), timed on the training thread.

    Per parameter, a window from the accumulation of its gradient (``acc``: a post-accumulate-grad
    hook, so the accumulation itself is not in it) to the end of the hooks on its gradient
    accumulator that run before commpatch's (``post``, registered after them: the reducer's, which
    copies the gradient into its bucket view), or to the launch of the bucket it completes, which
    runs inside the reducer's hook. ``launch(seq, start)`` (commpatch's bucket hook, at a bucket's
    issue) closes the windows since the previous launch into ``out`` as ``(seq, pack_ns, alone_ns)``:
    their total and the part of it with none of this model's buckets in flight (``done()``: one
    completed; a window that began with buckets in flight is alone from the last completion on,
    if they all completed before it ended). ``reset()`` at each forward drops windows no launch
    followed (a no_sync() backward). The C twin (record/_hot.c: ``Packing``) keeps the same books;
    here ``done()`` runs on the backend's thread and an update of ``inflight`` lost between
    bytecodes would skew the split until that reset (the C twin's updates hold the GIL throughout).
    """

    __slots__ = ("out", "state", "pre", "pre_busy", "inflight", "last_done", "total", "alone", "seen")

    def __init__(self, out: list, state) -> None:
        self.out, self.state = out, state
        self.reset()

    def reset(self) -> None:
        self.pre = self.pre_busy = self.inflight = self.last_done = self.total = self.alone = 0
        self.seen = False

    def acc(self, param) -> None:
        if self.state.recording:
            self.pre, self.pre_busy = time.perf_counter_ns(), self.inflight

    def post(self, grad_inputs, grad_outputs) -> None:
        if self.pre:
            self._close(time.perf_counter_ns())

    def _close(self, end: int) -> None:
        pre, self.pre = self.pre, 0
        self.total += end - pre
        self.seen = True
        if not self.pre_busy:
            self.alone += end - pre
        elif not self.inflight:
            self.alone += end - max(pre, self.last_done)

    def launch(self, seq: int, start: int) -> None:
        if self.pre:
            self._close(start)
        if self.seen:
            self.out.append((seq, self.total, self.alone))
            self.total = self.alone = 0
            self.seen = False
        self.inflight += 1

    def done(self) -> None:
        if self.inflight > 0:
            self.inflight -= 1
        self.last_done = time.perf_counter_ns()

    def completed(self, fut) -> None:
        """``done()`` as a future's callback."""
        self.done()


def packing(log):
    """The books of one DDP model's gradient packing, in C when built (see ``Packing``)."""
    if C_ROWS:
        return _hot.Packing(log.packs, STATE)
    return Packing(log.packs, STATE)


def peek_seq(counter=SEQ) -> int:
    """Next value of the counter (``_hot.Counter`` or an itertools.count) without consuming it."""
    peek = getattr(counter, "peek", None)
    if peek is not None:
        return peek()
    text = repr(counter)  # 'count(42)'
    return int(text[text.index("(") + 1 : text.index(")")])


class Pending(NamedTuple):
    """A call in flight: an async one until its timing resolves; a sync one too while the watchdog runs."""

    op: int  # op code (data.ops.OP_NAMES)
    gid: int  # group code (Log.groups)
    numel: int
    thread: int  # threading.get_ident() of the caller
    start: int  # perf_counter_ns at issue
    stack: tuple | None  # (file, line, function) frames where it was issued, or None


def write_row(
    log, seq: int, code: int, gid: int, dtype, numel: int, flags: int, start: int, end: int, peer: int
) -> None:
    """Append one packed row; ``dtype`` is a torch dtype, ``data.ops.OBJECT`` or None (no tensor).
    Step, tag and module/phase are those current now (``record.state.STATE``)."""
    state = STATE
    log.buf.extend(
        ROW.pack(
            seq, code, gid, log.dtype_id(dtype), numel, flags, start, end, peer, state.step, state.tag, state.where
        )
    )


def record(
    log,
    op: str,
    group,
    tensor,
    numel: int,
    start: int,
    end: int,
    async_op: bool,
    tcode: int,
    err: bool = False,
    peer: int = -1,
    seq: int | None = None,
) -> int:
    """One row for a call an integration observed (the op by name, the group object, the tensor
    that gives dtype and device); returns its seq."""
    gid = log.group_ids.get(group)
    if gid is None:
        gid = log.group_id(group)
    if seq is None:
        seq = next(SEQ)
    dev = tensor is not None and on_device(tensor, log)  # the device column (and its backend) come from it
    write_row(
        log,
        seq,
        OP_CODE[op],
        gid,
        tensor.dtype if tensor is not None else None,
        numel,
        pack_flags(async_op, dev, err, tcode),
        start,
        end,
        peer,
    )
    return seq


def on_device(t, log) -> bool:
    """Whether ``t`` lives on an accelerator (not cpu, not meta); names the device in the log."""
    if t.is_cpu or t.is_meta:
        return False
    if not log.device:
        log.device = t.device.type
    return True
