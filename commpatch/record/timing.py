"""Timing sources beyond host wall time, and lazy resolution of pending measurements.

- ``future``: async CPU calls; the ``Work`` future's completion callback stamps the end.
- ``wait``: async CPU calls whose ``Work`` has no future (gloo's send / recv): timed to the return
  of the training thread's ``Work.wait()`` on it (``waited``; ``Patcher`` wraps ``Work.wait``), and
  the time the thread spent in that wait noted (``Log.waits``: the exposed time). A work never
  waited for keeps its row without a duration.
- ``device_event``: tensors on any accelerator (CUDA, XPU, HPU, MTIA, NPU, PrivateUse1 devices),
  through torch's device-generic API (``torch.accelerator.current_stream``, ``torch.Event``):
  pooled events (one pool per device) recorded on the current stream before the call and after
  it (sync) or inside ``get_future().then()`` (async: the callback runs on a stream that waits
  for the collective). Never a device synchronize on the hot path: events are queried lazily
  (when the pool is empty, by the thread that records them: ``benchmarks/gpu/percall.py``
  measured a resolver thread of its own on an H100 host, starved of the GIL, costing more),
  synchronized only when the log is read or written, and not touched at all while the
  stream is capturing (CUDA graphs: those rows say ``timing=none``). A device whose backend
  has no events makes the row ``timing=none`` (counted in ``internal_errors()``, warned once).
  Functional collectives on a device (``integrations.base.Waits``): the end event after the
  ``wait_tensor`` on their result, on the stream that waits, and an event just before that wait:
  the stream's stall between the two is the row's wait (``device_mark``, ``device_waited``).
  A stream's wait for a collective timed on its own (FSDP2's copy-out waiting for its all-gather's
  event, ``integrations.fsdp``): events just before and after that wait, the stall between them
  the row's wait (``stall_mark``, ``stall_end``); so is the stream's wait in a ``Work.wait()`` on an
  async call's work (``wait_begin``, ``wait_end``: ``Patcher`` wraps ``Work.wait``).
- ``nccl``: ``work._get_duration()`` once an async NCCL work completed, when collective
  timing is enabled (``TORCH_NCCL_ENABLE_TIMING=1``).
Durations land in ``Log.done`` (seq -> ns) and are flushed to the rank log by ``Log.flush``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque

from ..data.schema import T_DEVICE, T_FUTURE, T_NCCL, T_NONE, T_WAIT
from . import state as _runtime

_pc = time.perf_counter_ns
# works without a future kept for their wait (each keeps its tensor alive): beyond this many not yet
# waited for (a job that drops its works unwaited), they are dropped and their rows stay untimed
AT_WAIT_MAX = 1024


class Timing:
    def __init__(self, log) -> None:
        self.log = log
        self.lock = threading.Lock()
        self.apis: dict = {}  # (device type, index) -> _DeviceApi
        self.pools: dict = {}  # (device type, index) -> free events
        self.created = 0  # events ever created (pools keep it flat)
        self.resolve_at = _EARLY  # measurements in flight before a new event is created rather than resolving first
        self.dev_pending: list = []  # (seq, device key, gid, start_event, end_event), new since the last resolve
        self.chains: dict = {}  # (device key, gid) -> deque of dev_pending's items, in seq order, unresolved
        self.in_chains = 0  # items in self.chains
        self.examined = 0  # items taken in or queried by resolves (the tests' probe of their cost)
        self.nccl_pending: list = []  # (seq, work, device key, start_event)
        self.stalls: deque = deque()  # (seq, device key, mark event, end event): streams' waits (stall_end)
        self.last_end: dict = {}  # (device key, gid) -> end event of the group's last resolved call
        self.no_future: set[int] = set()  # op codes whose CPU Work has no future (gloo p2p)
        self.at_wait: dict[int, tuple] = {}  # id(work) -> (work, seq, start): timed at its wait (``waited``)
        # id(work) -> (weak reference, seq, device key): an async call on an accelerator, whose
        # ``Work.wait()`` makes the current stream wait: the stall there is its row's wait
        self.dev_waits: dict[int, tuple] = {}
        self.nccl_timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") not in ("0", "")

    def after_fork(self) -> None:
        self.lock = threading.Lock()
        self.apis, self.pools, self.last_end, self.chains, self.in_chains = {}, {}, {}, {}, 0
        self.dev_pending[:], self.nccl_pending[:] = [], []
        self.stalls = deque()
        self.at_wait = {}
        self.dev_waits.clear()  # (the same dict: Patcher's Work.wait looks into it)

    # ---- CPU ------------------------------------------------------------------------
    def future(self, seq: int, start: int, work, op: int) -> int:
        """Attach a completion stamp to an async CPU work; returns the timing code used."""
        if not work:
            return T_NONE
        if op in self.no_future:
            return self._at_wait(work, seq, start)
        fut = self._future_of(work, op)
        if fut is None:
            return self._at_wait(work, seq, start) if op in self.no_future else T_NONE
        done, pending = self.log.done, self.log.pending

        def stamp(_fut, seq=seq, start=start):
            done[seq] = _pc() - start
            pending.pop(seq, None)

        fut.then(stamp)
        return T_FUTURE

    def _at_wait(self, work, seq: int, start: int) -> int:
        """Time ``work`` (one, without a future) at the training thread's wait on it."""
        if isinstance(work, list):
            return T_NONE
        if len(self.at_wait) >= AT_WAIT_MAX:  # works never waited for: dropped (their rows stay untimed)
            self.at_wait.clear()
        self.at_wait[id(work)] = (work, seq, start)  # the entry keeps the work alive: its id is not reused
        return T_WAIT

    def waited(self, work, began: int) -> None:
        """The thread's ``work.wait()``, entered at ``began`` (perf ns), has returned: the row's
        duration (issue to now) and the time the thread waited in it."""
        entry = self.at_wait.pop(id(work), None)
        if entry is not None and entry[0] is work:
            now = _pc()
            self.log.done[entry[1]] = now - entry[2]
            self.log.waits.append((entry[1], now - began))

    def _future_of(self, work, op: int):
        """The work's future (one for all works of a batch), or None where none exists."""
        works = work if isinstance(work, list) else [work]
        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:  # e.g. gloo send/recv works: no future exists
            self.no_future.add(op)
            return None
        except (TypeError, ValueError):  # _IllegalWork inside _coalescing_manager
            return None
        if any(f is None for f in futures):
            return None
        if len(futures) == 1:
            return futures[0]
        import torch

        return torch.futures.collect_all(futures)

    # ---- accelerators -------------------------------------------------------------
    def device_start(self, tensor):
        """A measurement started on ``tensor``'s device: (device key, start event) recorded on the
        current stream; None while the stream is capturing (no event may be recorded then)."""
        dev = tensor.device
        key = (dev.type, dev.index)
        api = self.apis.get(key) or self._api(key, dev)
        if api.here is not None and api.here():  # CUDA's current device: two C calls
            if api.here_capturing():
                return None
            ev = self._event(key, api)
            ev.record()
            return key, ev
        stream = api.current_stream()
        if api.capturing(stream):
            return None
        ev = self._event(key, api)
        ev.record(stream)
        return key, ev

    def device_end(self, seq: int, gid: int, started, work, async_op: bool) -> int:
        """End the measurement: an end event after the call (sync), or recorded from the work's
        future callback, whose current stream waits for the collective (async). Returns the timing
        code of the row."""
        if started is None:
            return T_NONE
        key, start_ev = started
        api = self.apis[key]
        if not async_op:
            end_ev = self._event(key, api)
            api.record(end_ev)
            self.dev_pending.append((seq, key, gid, start_ev, end_ev))
            return T_DEVICE
        if work is None:
            self.cancel(started)
            return T_NONE
        if not isinstance(work, list):
            self._stall_at_wait(work, seq, key)
        if self.nccl_timing and hasattr(work, "_get_duration") and self._nccl_group(gid):
            self.nccl_pending.append((seq, work, key, start_ev))
            return T_NCCL
        return self.device_after(seq, gid, started, self._future_of(work, -1))

    def _stall_at_wait(self, work, seq: int, key) -> None:
        """Note an async call's work on an accelerator for its ``Work.wait()`` (``wait_begin``),
        weakly: a work dropped unwaited takes its entry with it (a work keeps its tensors alive)."""
        waits, i = self.dev_waits, id(work)
        if len(waits) >= AT_WAIT_MAX:  # (works kept alive elsewhere, never waited for)
            waits.clear()
        waits[i] = (weakref.ref(work, lambda _ref, i=i: waits.pop(i, None)), seq, key)

    def wait_begin(self, work):
        """Before ``work.wait()`` on an async call noted by ``_stall_at_wait``: (seq, device key, an
        event on the current stream where its stall begins), or None (not noted, waited before, the
        stream capturing)."""
        entry = self.dev_waits.pop(id(work), None)
        if entry is None or entry[0]() is not work:
            return None
        mark = self.stall_mark(entry[2])
        return None if mark is None else (entry[1], entry[2], mark)

    def wait_end(self, begun) -> None:
        """``work.wait()`` has returned (``begun``: ``wait_begin``'s): the current stream waits for
        the collective from here; the stall is the row's wait (``stall_end``)."""
        self.stall_end(*begun)

    def device_after(self, seq: int, gid: int, started, fut) -> int:
        """End the measurement when ``fut`` (a device-aware future: a Work's, or a DDP comm hook's)
        completes: its ``then()`` callback runs on a stream that waits for the collective, and
        records the end event there. Returns the timing code of the row."""
        if started is None:
            return T_NONE
        key, start_ev = started
        if fut is None:
            self.cancel(started)
            return T_NONE
        fut.then(self.end_recorder(seq, gid, started))
        return T_DEVICE

    def end_recorder(self, seq: int, gid: int, started):
        """A function(future=None) that ends the measurement ``started`` (not None): run inside a
        ``then()`` callback, whose current stream waits for the collective, it records the end
        event there. Callers with a callback of their own call it from theirs (one ``then()``:
        each costs a stream from the pool and a GIL hand-off)."""
        key, start_ev = started
        api = self.apis[key]
        end_ev = self._event(key, api)
        pending = self.dev_pending

        def record_end(_fut=None, seq=seq, start_ev=start_ev, end_ev=end_ev):
            api.record(end_ev)  # this callback's current stream waits for the collective
            pending.append((seq, key, gid, start_ev, end_ev))

        return record_end

    def device_mark(self, started):
        """Before the training thread makes its stream wait for a functional collective's result
        (``started``: its measurement, ``device_start``'s): an event recorded on the current stream,
        where the stream's stall for the collective begins; None while the stream is capturing."""
        return self.stall_mark(started[0])

    def stall_mark(self, key):
        """An event recorded on device ``key``'s current stream (where a stall begins), or None:
        the stream is capturing, or no measurement was ever made on that device."""
        api = self.apis.get(key)
        if api is None or api.capturing_now():
            return None
        ev = self._event(key, api)
        api.record(ev)
        return ev

    def stall_end(self, seq: int, key, mark) -> None:
        """The current stream has been made to wait for the collective of row ``seq``, whose own
        duration is measured apart (``mark``: ``stall_mark``'s event, just before that wait): an
        end event recorded now; the stream's stall, ``mark`` to it, becomes the row's wait
        (``Log.waits``). Nothing while the stream is capturing."""
        api = self.apis[key]
        if api.capturing_now():
            self._free(key, mark)
            return
        end_ev = self._event(key, api)
        api.record(end_ev)
        self.stalls.append((seq, key, mark, end_ev))

    def device_waited(self, seq: int, gid: int, started, mark) -> None:
        """The current stream has been made to wait for the result of the functional collective
        ``seq`` (started at its issue: ``started``): its end event recorded there. The row's
        duration runs from the issue to the stream passing the wait (an upper bound on the
        collective, as a CPU ``wait`` row's), and the stream's stall, ``mark`` (``device_mark``)
        to that end, is the row's wait (``Log.waits``): the exposed time on the device (while the
        stream is capturing, nothing: the row stays untimed)."""
        key, start_ev = started
        api = self.apis[key]
        if api.capturing_now():
            self.cancel(started)
            if mark is not None:
                self._free(key, mark)
            return
        end_ev = self._event(key, api)
        api.record(end_ev)
        self.dev_pending.append((seq, key, gid, start_ev, end_ev, mark))

    def _host_wait(self, work, key) -> None:
        """Wait on the host for a work (read / exit only): NCCL's ``wait()`` makes the current
        stream wait, not the host (without TORCH_NCCL_BLOCKING_WAIT), so an event recorded after it
        is synchronized."""
        work.wait()
        api = self.apis.get(key)
        if api is not None and not work.is_completed():
            ev = self._event(key, api)
            ev.record(api.current_stream())
            ev.synchronize()
            self._free(key, ev)

    def cancel(self, started) -> None:
        """A started measurement that will not be ended: its event goes back to the pool."""
        if started is not None:
            self._free(*started)

    def _nccl_group(self, gid: int) -> bool:
        """The group runs device tensors on NCCL (other backends' works have ``_get_duration`` too,
        and raise)."""
        groups = self.log.groups
        return 0 <= gid < len(groups) and len(groups[gid].backends) > 1 and groups[gid].backends[1] == "nccl"

    def _event(self, key, api):
        pool = self.pools.get(key)
        if pool:
            return pool.pop()
        if self.in_flight() >= self.resolve_at and not self.lock.locked():
            self.resolve()  # completed measurements give their events back (O(new + resolved))
            # doubled past what the resolve left in flight (a device far behind the host): a
            # resolve per new event would query a chain's head each time, for nothing
            self.resolve_at = max(_EARLY, 2 * self.in_flight())
            pool = self.pools.get(key)
            if pool:
                return pool.pop()
        self.created += 1
        return api.event()

    def _free(self, key, *events) -> None:
        self.pools.setdefault(key, []).extend(events)

    def _api(self, key, dev):
        api = self.apis[key] = _DeviceApi(dev)
        return api

    # ---- resolution ---------------------------------------------------------------
    def resolve(self, block: bool = False) -> None:
        """Fold finished measurements into the log; ``block`` waits for device ones (read/exit).
        Nothing is queried or synchronized on a device whose current stream is capturing."""
        if not (self.dev_pending or self.in_chains or self.nccl_pending or self.stalls):
            return
        with self.lock:
            try:
                capturing = {key for key, api in self.apis.items() if api.capturing_now()}
                self._resolve_device(block, capturing)
                self._resolve_nccl(block, capturing)
                self._resolve_stalls(block, capturing)
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("timing.resolve", exc)

    def _resolve_device(self, block: bool, capturing) -> None:
        """Durations, and own times: a call's completion minus the later of its start and the
        completion of the previous call on its group, both on the device (the previous end event is
        kept until the next call of the group is resolved). New measurements join their group's
        chain in seq order; a chain resolves from its head and stops at the first one not yet
        complete, so a resolve costs what is new and what it resolves, never what stays in flight
        (a device far behind the host: walking every measurement in flight at each resolve cost as
        much as what was in flight)."""
        chains = self.chains
        new = _take(self.dev_pending)
        if new:
            new.sort(key=_first)
            for item in new:
                chain = chains.get((item[1], item[2]))
                if chain is None:
                    chains[(item[1], item[2])] = deque((item,))
                elif chain and chain[-1][0] > item[0]:  # a late completion callback: in seq order
                    ordered = sorted([*chain, item], key=_first)
                    chain.clear()
                    chain.extend(ordered)
                else:
                    chain.append(item)
            self.in_chains += len(new)
        examined, resolved = len(new), 0
        done, own, last, pending, pools = self.log.done, self.log.own, self.last_end, self.log.pending, self.pools
        waits = self.log.waits
        for (key, gid), chain in chains.items():
            if key in capturing:
                continue
            pool = pools.setdefault(key, [])
            while chain:
                examined += 1
                item = chain[0]
                seq, ev0, ev1 = item[0], item[3], item[4]
                if block:
                    ev1.synchronize()
                if not ev1.query():
                    break
                chain.popleft()
                duration = ev0.elapsed_time(ev1)  # ms
                prev = last.get((key, gid))
                mine = duration
                if prev is not None:
                    gap = prev.elapsed_time(ev1)  # this call's completion after the previous one's
                    if 0 < gap < duration:
                        mine = gap
                    pool.append(prev)
                last[(key, gid)] = ev1
                pool.append(ev0)
                if len(item) > 5 and item[5] is not None:  # a stream's wait for the result (device_waited)
                    waits.append((seq, int(item[5].elapsed_time(ev1) * 1e6)))
                    pool.append(item[5])
                done[seq] = int(duration * 1e6)
                own[seq] = int(mine * 1e6)
                pending.pop(seq, None)
                resolved += 1
        self.in_chains -= resolved
        self.examined += examined

    def in_flight(self) -> int:
        """Device measurements not yet resolved."""
        return len(self.dev_pending) + self.in_chains + len(self.stalls)

    def _resolve_stalls(self, block: bool, capturing) -> None:
        """Streams' waits, in the order they were recorded, up to the first not yet complete (they
        sit on the training thread's streams, which pass them in about that order)."""
        stalls, waits = self.stalls, self.log.waits
        while stalls:
            seq, key, mark, end_ev = stalls[0]
            if key in capturing:
                return
            if block:
                end_ev.synchronize()
            if not end_ev.query():
                return
            stalls.popleft()
            waits.append((seq, int(mark.elapsed_time(end_ev) * 1e6)))
            self._free(key, mark, end_ev)

    def _resolve_nccl(self, block: bool, capturing) -> None:
        keep, done = [], self.log.done
        pending = _take(self.nccl_pending)
        for item in pending:
            seq, work, key, ev0 = item
            if key in capturing:
                keep.append(item)
                continue
            if block:
                self._host_wait(work, key)
            if work.is_completed():
                try:
                    done[seq] = int(work._get_duration() * 1e6)
                except RuntimeError:
                    pass
                self.log.pending.pop(seq, None)
                self._free(key, ev0)
            else:
                keep.append(item)
        self.nccl_pending.extend(keep)


def _first(item):
    return item[0]


def _take(items: list) -> list:
    """Remove and return what ``items`` holds now; completion callbacks may append meanwhile
    (their items stay)."""
    n = len(items)
    out = items[:n]
    del items[:n]
    return out


_EARLY = 64  # measurements in flight at least, before an empty pool makes a resolve


class _DeviceApi:
    """torch's device-generic stream / event API for one device (torch >= 2.6:
    ``torch.accelerator``, ``torch.Event``); CUDA's own on older torch."""

    def __init__(self, dev) -> None:
        import torch

        self.device = dev
        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "current_stream") and hasattr(torch, "Event"):
            self.current_stream = lambda: acc.current_stream(dev)
            self.event = lambda: torch.Event(device=dev, enable_timing=True)
        elif dev.type == "cuda":
            self.current_stream = lambda: torch.cuda.current_stream(dev)
            self.event = lambda: torch.cuda.Event(enable_timing=True)
        else:
            raise RuntimeError(f"no stream / event API for {dev.type!r} devices in torch {torch.__version__}")
        # CUDA, the current device: an event recorded with no stream goes to its current stream, and
        # capture is one C call (torch.accelerator.current_stream(dev) costs ~3 us in Python per call)
        self.here = None
        get, capturing = (
            getattr(torch._C, "_cuda_getDevice", None),
            getattr(torch._C, "_cuda_isCurrentStreamCapturing", None),
        )
        if dev.type == "cuda" and get is not None and capturing is not None and dev.index is not None:
            index = dev.index
            self.here = lambda: get() == index
            self.here_capturing = capturing

    def record(self, ev) -> None:
        """Record ``ev`` on this device's current stream."""
        if self.here is not None and self.here():
            ev.record()
        else:
            ev.record(self.current_stream())

    def capturing_now(self) -> bool:
        """Whether this device's current stream is capturing (a CUDA graph)."""
        if self.here is not None and self.here():
            return bool(self.here_capturing())
        return self.capturing(self.current_stream())

    @staticmethod
    def capturing(stream) -> bool:
        test = getattr(stream, "is_capturing", None)
        if test is not None:
            return bool(test())
        import torch

        return bool(torch.cuda.is_current_stream_capturing())
