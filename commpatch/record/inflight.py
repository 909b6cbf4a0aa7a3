"""Calls in flight, noted in the rank's log by the flusher: what a hung rank was waiting in.

A row is written when a call completes, so the call a rank hangs in is in no row. Each pass of
the flusher (every ``record.sinks.FLUSH_S``) looks, at no cost to the hot path, at the calls in
flight longer than one period, and writes for each, once, an ``inflight`` record (``data.logfile``):
its op, group, peer, elements, bytes, issue time (when known), the time it was first seen in flight,
its process sequence number (``seq``, when known) or a bound (``below``: every row recorded before
it was first seen has a lower seq), the issuing thread and a short stack. When it completes, a
``landed`` record; and an ``alive`` record at most every ``ALIVE_S`` seconds (whatever is in
flight), so a killed job's log says until when the process was alive.

Two sources, neither of which costs the recording thread anything:
- ``Log.pending`` (async calls until their completion callback fires, DDP's gradient buckets
  among them: the training thread waits for those in the reducer's finalize, in no wrapper; every
  call while the watchdog runs): exact seq and issue time, and the issue stack of async calls (a
  bucket's: its thread's stack when first seen in flight);
- the stacks of the process's threads (``sys._current_frames()``): a thread inside a commpatch
  wrapper is in that call. The wrapper's locals give the group, the tensor and the peer (and the
  seq and issue time on the Python path; the C recorder numbers a call when it returns). A thread
  seen in the same wrapper frame at two passes with no call issued in between (the process's
  sequence counter unchanged) is in one call for at least a period.
A call waited for outside any wrapper (``isend(...).wait()`` on gloo, whose p2p works have no
completion callback) is not seen: its row, written at issue, is all the log has.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

from ..data import logfile
from ..data.ops import OP_CODE
from .rows import SEQ, peek_seq
from .state import fail

ALIVE_S = 1.0  # an 'alive' record at most this often
STACK_FRAMES = 5  # frames of the caller's stack kept in a record, innermost last
WRAPPER_FILE = "<commpatch wrapper "  # the generated wrappers' code file name (record.wrapper)


class InFlight:
    """The flusher's notes on calls in flight (one per ``Log``); ``scan(log)`` returns the records to write."""

    def __init__(self, period_s: float) -> None:
        self.period_ns = int(period_s * 1e9)
        self.noted: dict = {}  # key -> record id, of the calls noted and not landed yet
        self.sightings: dict = {}  # thread ident -> (wrapper frame id, seq counter, first seen perf ns)
        self.next_id = 0
        self.last_alive = 0.0

    def after_fork(self) -> None:
        self.noted.clear()
        self.sightings.clear()

    def scan(self, log) -> bytes:
        """Records for what changed since the last pass; never raises (b'' on an internal error)."""
        try:
            return self._scan(log)
        except Exception as exc:  # noqa: BLE001 - the job must never notice us
            fail("inflight", exc)
            return b""

    def _scan(self, log) -> bytes:
        now = time.perf_counter_ns()
        wall = now + log.offsets[1][-1]  # perf -> Unix ns, as the rows' start_ns
        out, live = [], {}
        pending = log.pending.copy()  # one C call: safe against concurrent updates
        frames = None
        for seq, e in pending.items():  # (op, gid, numel, thread, start, stack): rows.Pending
            if now - e[4] > self.period_ns:
                if not e[5] and frames is None:  # no issue stack (a DDP bucket): where its thread is now
                    frames = sys._current_frames()
                live[("seq", seq)] = lambda seq=seq, e=e, frames=frames: dict(
                    seq=seq,
                    below=seq + 1,
                    op=e[0],
                    gid=e[1],
                    peer=-1,
                    numel=e[2],
                    bytes=-1,
                    start=e[4] + log.offsets[1][-1],
                    thread=_thread_name(e[3]),
                    stack=_stack_lines(e[5]) if e[5] else _thread_stack(frames, e[3]),
                )
        counter = peek_seq(SEQ)
        me = threading.get_ident()
        seen = {}
        for ident, top in sys._current_frames().items():
            if ident == me:
                continue
            frame = _outer_wrapper(top)
            if frame is None:
                continue
            try:
                local = frame.f_locals
            except Exception:  # noqa: BLE001 - a frame that cannot be read: not noted
                continue
            seq = local.get("seq")
            if type(seq) is int and seq in pending:
                continue  # the pending entry says it (exact)
            first = self.sightings.get(ident)
            if first is None or first[0] != id(frame) or first[1] != counter:
                seen[ident] = (id(frame), counter, now)  # a new call (or maybe one): wait a period
                continue
            seen[ident] = first
            if now - first[2] < self.period_ns:
                continue
            key = ("seq", seq) if type(seq) is int else ("frame", ident, id(frame), first[1])
            live[key] = lambda frame=frame, local=local, ident=ident, first=first: _from_frame(
                log, frame, local, ident, first, wall - now
            )
        self.sightings = seen
        for key, make in live.items():
            if key not in self.noted:
                record = make()
                if record is None:
                    continue
                record["id"] = self.next_id
                record.setdefault("seen", wall)
                self.noted[key] = self.next_id
                self.next_id += 1
                out.append(logfile.meta("inflight", **record))
        for key in [k for k in self.noted if k not in live]:
            out.append(logfile.meta("landed", id=self.noted.pop(key), ns=wall))
        if time.monotonic() - self.last_alive >= ALIVE_S:
            self.last_alive = time.monotonic()
            out.append(logfile.meta("alive", ns=wall))
        return b"".join(out)


def _outer_wrapper(frame):
    """The outermost commpatch wrapper frame of a thread's stack (the row's call), or None."""
    found = None
    while frame is not None:
        if frame.f_code.co_filename.startswith(WRAPPER_FILE):
            found = frame
        frame = frame.f_back
    return found


def _from_frame(log, frame, local, ident, first, offset) -> dict | None:
    op = OP_CODE.get(frame.f_code.co_name)
    if op is None:
        return None
    gid = local.get("gid")
    if type(gid) is not int:
        gid = log.group_ids.get(local.get("group"), -1)
    if gid < 0:
        return None
    t, numel, nbytes = local.get("t"), local.get("numel"), -1
    try:
        if type(numel) is not int and t is not None:
            numel = t.numel()
        if t is not None:
            nbytes = int(numel) * t.element_size()
    except Exception:  # noqa: BLE001 - not a tensor after all: its size is unknown
        pass
    seq, start = local.get("seq"), local.get("start")
    exact = type(seq) is int
    peer = local.get("peer")
    return dict(
        seq=seq if exact else -1,
        below=seq + 1 if exact else first[1],
        op=op,
        gid=gid,
        peer=peer if type(peer) is int else -1,
        numel=numel if type(numel) is int else -1,
        bytes=nbytes,
        start=start + offset if exact and type(start) is int else -1,
        seen=first[2] + offset,
        thread=_thread_name(ident),
        stack=_stack_lines(traceback.extract_stack(frame.f_back, limit=STACK_FRAMES)),
    )


def _thread_stack(frames, ident) -> list:
    """The stack of thread ``ident`` now (``frames``: ``sys._current_frames()``), or [] when it is gone.
    A DDP bucket's thread waits for it in the reducer's finalize, under the user's backward()."""
    frame = frames.get(ident) if frames else None
    return _stack_lines(traceback.extract_stack(frame, limit=STACK_FRAMES)) if frame is not None else []


def _stack_lines(frames) -> list:
    """'file:line in function' of the innermost STACK_FRAMES frames, innermost last."""
    return [f"{f[0]}:{f[1]} in {f[2]}" for f in list(frames)[-STACK_FRAMES:]]


def _thread_name(ident) -> str:
    thread = threading._active.get(ident)  # noqa: SLF001 - no lock: a name is all it reads
    return thread.name if thread is not None else str(ident)
