"""A stream-ordered process group for the emulated device, like NCCL on a GPU.

    from tests.emulated_device import pg
    pg.register()                                        # once per process, after emulated_device.load()
    dist.init_process_group("cpu:gloo,emu:emustream", ...)

gloo refuses emu tensors, so the "emustream" backend (a C++ c10d Backend forwarding to
``StreamCollectives`` below) queues each collective on the caller's *current stream*: the stream's
worker runs a private gloo group on CPU views of the device memory. The host call returns at
once with a Work whose future is device-aware and already completed; ``work.wait()`` makes the
current stream wait for the collective (not the host), and ``get_future().then(cb)`` runs ``cb``
on a stream that waits for it, as with NCCL. Only ``barrier()``'s wait blocks the host (as NCCL's does).

gloo matches calls by order, and a group's collectives may sit on several streams (FSDP2 issues
all-gathers and reduce-scatters on streams of their own): each stream worker therefore waits for
the group's earlier-issued collectives to have run before it runs its own, so every rank runs them
in issue order, as one NCCL communicator does. (No cycle: a collective only ever waits, through its
stream or through events, for work issued before it.)

Two options, read when a group is created (``COMM_STREAM_ENV`` / ``NCCL_LIKE_ENV`` set to 1):
- comm stream: the group runs its collectives on a stream of its own that first waits for the
  caller's current stream (as NCCL does), so a collective can queue behind the group's earlier
  ones while the caller's stream moves on;
- NCCL-like works: each work carries start / end events around the collective on the stream that
  runs it and answers ``_get_duration()`` (ms) once completed, as ProcessGroupNCCL's works do with
  ``TORCH_NCCL_ENABLE_TIMING=1``.
"""

from __future__ import annotations

import sys
import threading
import traceback

import torch
import torch.distributed as dist

from . import BACKEND, enqueue, ext

NAME = "emustream"
COMM_STREAM_ENV = "EMUSTREAM_COMM_STREAM"
NCCL_LIKE_ENV = "EMUSTREAM_NCCL_LIKE"


class EmuWork(dist.Work):
    def __init__(self, result, event, device, blocking: bool = False):
        super().__init__()
        self._event = event
        self._device = device
        self._blocking = blocking
        self.error: BaseException | None = None
        # Completed now, on the collective's stream: the future records its own events there, and
        # then() callbacks / wait() order device work after the collective.
        self._fut = torch.futures.Future(devices=[device])
        self._fut.set_result(result)

    def wait(self, timeout=None):
        if self._blocking:
            self._event.synchronize()
        else:
            torch.accelerator.current_stream(self._device).wait_event(self._event)
        return True

    def get_future(self):
        return self._fut

    def is_completed(self):
        return self._event.query()

    def is_success(self):
        return self.error is None

    def exception(self):
        return self.error


class NcclLikeWork(EmuWork):
    """A work that times itself on the device, like ProcessGroupNCCL's with timing enabled."""

    def __init__(self, result, event, device, blocking=False, start=None):
        super().__init__(result, event, device, blocking)
        self._start = start

    def _get_duration(self):
        if not self._event.query():
            raise RuntimeError("work not completed")
        return self._start.elapsed_time(self._event)


class StreamCollectives:
    """The Python side of the backend: one method per collective, each returning an EmuWork."""

    def __init__(self, gloo, rank: int, size: int, comm_stream: bool = False, nccl_like: bool = False):
        self.gloo = gloo
        self.rank = rank
        self.size = size
        self.comm_streams = {} if comm_stream else None  # device -> the group's own stream
        self.nccl_like = nccl_like
        self._issued = 0  # tickets handed out at issue time ...
        self._ran = 0  # ... and the next one allowed to run
        self._turn = threading.Condition()

    def _launch(self, device, job, result, blocking=False):
        device = torch.device(BACKEND, device.index if device.index is not None else ext().current_device())
        stream = torch.accelerator.current_stream(device)
        if self.comm_streams is not None:  # the group's stream waits for the caller's
            comm = self.comm_streams.get(device)
            if comm is None:
                comm = self.comm_streams[device] = torch.Stream(device=device)
            ready = torch.Event(device=device)
            ready.record(stream)
            comm.wait_event(ready)
            stream = comm
        start = None
        if self.nccl_like:
            start = torch.Event(device=device, enable_timing=True)
            start.record(stream)
        event = torch.Event(device=device, enable_timing=self.nccl_like)
        holder = {}
        with self._turn:
            ticket, self._issued = self._issued, self._issued + 1

        def run():
            with self._turn:
                self._turn.wait_for(lambda: self._ran == ticket)
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - a failed collective must not kill the worker
                if "work" in holder:
                    holder["work"].error = e
                print(f"emustream: collective failed on rank {self.rank}:\n{traceback.format_exc()}", file=sys.stderr)
                raise
            finally:
                with self._turn:
                    self._ran += 1
                    self._turn.notify_all()

        enqueue(run, stream)
        event.record(stream)
        with stream:  # the future's then() callbacks wait on this stream
            work = (
                NcclLikeWork(result, event, device, blocking, start)
                if self.nccl_like
                else EmuWork(result, event, device, blocking)
            )
        holder["work"] = work
        return work

    # -- collectives (called by the C++ backend with the GIL held; must not block) --
    def allreduce(self, tensors, op):
        views = [ext().cpu_view(t) for t in tensors]
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self._launch(tensors[0].device, lambda: self.gloo.allreduce(views, opts).wait(), tensors)

    def broadcast(self, tensors, root):
        views = [ext().cpu_view(t) for t in tensors]
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self._launch(tensors[0].device, lambda: self.gloo.broadcast(views, opts).wait(), tensors)

    def allgather(self, outputs, inputs):
        out_views = [[ext().cpu_view(t) for t in lst] for lst in outputs]
        in_views = [ext().cpu_view(t) for t in inputs]
        return self._launch(inputs[0].device, lambda: self.gloo.allgather(out_views, in_views).wait(), outputs)

    def allgather_into_tensor(self, output, input):
        out_view, in_view = ext().cpu_view(output), ext().cpu_view(input)

        def job():
            parts = [torch.empty_like(in_view) for _ in range(self.size)]
            self.gloo.allgather([parts], [in_view.contiguous()]).wait()
            out_view.copy_(torch.cat([p.reshape(-1) for p in parts]).view_as(out_view))

        return self._launch(input.device, job, [output])

    def _reduce_scatter_flat(self, flat_in, out_view, op):
        tmp = flat_in.clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.gloo.allreduce([tmp], opts).wait()
        out_view.copy_(tmp.chunk(self.size)[self.rank].reshape(out_view.shape))

    def reduce_scatter(self, outputs, inputs, op):
        out_view = ext().cpu_view(outputs[0])
        in_views = [ext().cpu_view(t) for t in inputs[0]]
        return self._launch(
            outputs[0].device,
            lambda: self._reduce_scatter_flat(torch.cat([v.reshape(-1) for v in in_views]), out_view, op),
            outputs,
        )

    def reduce_scatter_tensor(self, output, input, op):
        out_view, in_view = ext().cpu_view(output), ext().cpu_view(input)
        return self._launch(
            output.device, lambda: self._reduce_scatter_flat(in_view.reshape(-1), out_view, op), [output]
        )

    def barrier(self):
        return self._launch(
            torch.device(BACKEND, ext().current_device()), lambda: self.gloo.barrier().wait(), [], blocking=True
        )

    def send(self, tensors, dst, tag):
        views = [ext().cpu_view(t) for t in tensors]
        return self._launch(tensors[0].device, lambda: self.gloo.send(views, dst, tag).wait(), tensors)

    def recv(self, tensors, src, tag):
        views = [ext().cpu_view(t) for t in tensors]
        return self._launch(tensors[0].device, lambda: self.gloo.recv(views, src, tag).wait(), tensors)


def create(store, rank, size, timeout):
    import os

    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    options = {"comm_stream": os.environ.get(COMM_STREAM_ENV) == "1", "nccl_like": os.environ.get(NCCL_LIKE_ENV) == "1"}
    return ext().PyForwardBackend(rank, size, StreamCollectives(gloo, rank, size, **options))


def register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, devices=[BACKEND])
