"""Timing sources beyond host wall time, and lazy resolution of pending measurements.

- ``future``: async CPU calls; the ``Work`` future's completion callback stamps the end.
- ``cuda_event``: CUDA tensors; pooled events recorded on the current stream before the
  call and after it (sync) or inside ``get_future().then()`` (async, the callback runs on a
  stream that waits for the collective). Never a device synchronize on the hot path:
  events are queried lazily, and synchronized only when the log is read or written.
- ``nccl``: ``work._get_duration()`` once an async NCCL work completed, when collective
  timing is enabled (``TORCH_NCCL_ENABLE_TIMING=1``).
Durations land in ``Log.done`` (seq -> ns) and are flushed to the rank log by ``Log.flush``.
"""

from __future__ import annotations

import os
import threading
import time

from ..data.schema import T_CUDA, T_FUTURE, T_NCCL, T_NONE
from . import state as _runtime

_pc = time.perf_counter_ns


class Timing:
    def __init__(self, log) -> None:
        self.log = log
        self.lock = threading.Lock()
        self.pool: list = []             # free CUDA events
        self.cuda_pending: list = []     # (seq, start_event, end_event or None)
        self.nccl_pending: list = []     # (seq, work, start_event, end_event)
        self.no_future: set[int] = set()  # op codes whose CPU Work has no future (gloo p2p)
        self.nccl_timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") not in ("0", "")

    def after_fork(self) -> None:
        self.lock = threading.Lock()
        self.pool, self.cuda_pending[:], self.nccl_pending[:] = [], [], []

    # ---- CPU ------------------------------------------------------------------------
    def future(self, seq: int, start: int, work, op: int) -> int:
        """Attach a completion stamp to an async CPU work; returns the timing code used."""
        if not work or op in self.no_future:
            return T_NONE
        fut = self._future_of(work, op)
        if fut is None:
            return T_NONE
        done, pending = self.log.done, self.log.pending

        def stamp(_fut, seq=seq, start=start):
            done[seq] = _pc() - start
            pending.pop(seq, None)

        fut.then(stamp)
        return T_FUTURE

    def _future_of(self, work, op: int):
        """The work's future (one for all works of a batch), or None where none exists."""
        works = work if isinstance(work, list) else [work]
        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:          # e.g. gloo send/recv works: no future exists
            self.no_future.add(op)
            return None
        except (TypeError, ValueError):   # _IllegalWork inside _coalescing_manager
            return None
        if any(f is None for f in futures):
            return None
        if len(futures) == 1:
            return futures[0]
        import torch

        return torch.futures.collect_all(futures)

    # ---- CUDA -----------------------------------------------------------------------
    def cuda_start(self):
        """A recorded start event, or None where events are not allowed (graph capture)."""
        import torch

        if torch.cuda.is_current_stream_capturing():
            return None
        ev = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def cuda_end(self, seq: int, start_ev, work, async_op: bool) -> int:
        import torch

        if start_ev is None:
            return T_NONE
        end_ev = self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)
        if not async_op:
            end_ev.record()
            self.cuda_pending.append((seq, start_ev, end_ev))
            return T_CUDA
        if work is None:
            self.pool.append(end_ev)
            self.pool.append(start_ev)
            return T_NONE
        if self.nccl_timing and hasattr(work, "_get_duration"):
            self.nccl_pending.append((seq, work, start_ev, end_ev))
            return T_NCCL
        fut = self._future_of(work, -1)
        if fut is None:
            self.pool.append(end_ev)
            self.pool.append(start_ev)
            return T_NONE
        pending = self.cuda_pending

        def record_end(_fut, seq=seq, start_ev=start_ev, end_ev=end_ev):
            end_ev.record()   # current stream here waits for the collective
            pending.append((seq, start_ev, end_ev))

        fut.then(record_end)
        return T_CUDA

    # ---- resolution ---------------------------------------------------------------
    def resolve(self, block: bool = False) -> None:
        """Fold finished measurements into the log; ``block`` waits for CUDA ones (read/exit)."""
        if not (self.cuda_pending or self.nccl_pending):
            return
        with self.lock:
            try:
                self._resolve_cuda(block)
                self._resolve_nccl(block)
            except Exception as exc:  # noqa: BLE001
                _runtime.fail("timing.resolve", exc)

    def _resolve_cuda(self, block: bool) -> None:
        import torch

        if torch.cuda.is_current_stream_capturing():   # query/sync is illegal while capturing
            return
        keep, done = [], self.log.done
        pending, self.cuda_pending[:] = list(self.cuda_pending), []
        for seq, ev0, ev1 in pending:
            if block:
                ev1.synchronize()
            if ev1.query():
                done[seq] = int(ev0.elapsed_time(ev1) * 1e6)
                self.log.pending.pop(seq, None)
                self.pool.extend((ev0, ev1))
            else:
                keep.append((seq, ev0, ev1))
        self.cuda_pending.extend(keep)

    def _resolve_nccl(self, block: bool) -> None:
        keep, done = [], self.log.done
        pending, self.nccl_pending[:] = list(self.nccl_pending), []
        for seq, work, ev0, ev1 in pending:
            if block:
                work.wait()
            if work.is_completed():
                try:
                    done[seq] = int(work._get_duration() * 1e6)
                except RuntimeError:
                    pass
                self.log.pending.pop(seq, None)
                self.pool.extend((ev0, ev1))
            else:
                keep.append((seq, work, ev0, ev1))
        self.nccl_pending.extend(keep)
