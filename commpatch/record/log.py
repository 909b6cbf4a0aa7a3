"""The in-memory log of one process: packed rows, registries, flushing to the rank's sink.

The hot path packs one fixed-size binary row per call into a ``bytearray``
(``buf.extend(ROW.pack(...))``: one C call, atomic under the GIL, so threads never
interleave half rows). There is no per-row Python object and no compaction pass: 59
bytes a row, and reading is a zero-copy ``np.frombuffer`` of a snapshot. (Measured here:
tuple rows cost ~28 ns less to append but ~600-950 ns a row to compact into columns.)
Names (op, group, dtype, tag, module) are small integer codes into registries.
Nothing here imports pandas until ``to_dataframe()`` is called, and every derived column
(bytes, Unix times, bandwidth) is computed there, vectorised.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from dataclasses import dataclass

from ..data import logfile
from ..data.frame import concat_frames, dataframe, parse_log
from ..data.ops import OBJECT, OP_NAMES
from ..data.schema import ROW, SCHEMA_VERSION, TIMINGS, compact_ranks, row_dtype
from . import inflight, sinks, state
from .rows import take_rows

CHUNK_BITS = 14
CHUNK = 1 << CHUNK_BITS  # rows between maintenance passes (late timings, clock offset)
CHUNK_MASK = CHUNK - 1


@dataclass(frozen=True)
class GroupInfo:
    name: str
    size: int
    ranks: str
    backend: str  # as configured: 'gloo', or 'cpu:gloo,cuda:nccl' for several
    backends: tuple = ()  # the one that runs, per device code (cpu, the accelerator, none)


class _Rows:
    """``log.rows.append(tuple)``: the slow-path way to add a row (dtype given as an object)."""

    __slots__ = ("append",)

    def __init__(self, log: Log) -> None:
        pack, extend, dtype_id = ROW.pack, log.buf.extend, log.dtype_id

        def append(row) -> None:
            row = list(row)
            row[3] = dtype_id(row[3])  # the dtype field
            extend(pack(*row))

        self.append = append


class Log:
    """Rows of one process. ``buf`` holds the rows not yet flushed, ``ROW.size`` bytes each; every
    ``FLUSH_S`` seconds (and every ``CHUNK`` rows) ``flush()`` moves them, with the late durations
    and the registries seen since, to the rank's binary log (``record.sinks``, in the ``data.logfile`` format): a file from the first
    row when an output is configured, else frames in memory. Readers parse what was flushed."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.buf = bytearray()
        self.done: dict[int, int] = {}  # seq -> duration_ns, written by completion callbacks
        self.own: dict[int, int] = {}  # seq -> own time (ns) of device-timed rows, when resolved
        self.device = ""  # the accelerator's type, once a row ran on it
        # seq -> (op code, gid, numel, thread id, start perf ns, issue stack or None): calls in
        # flight (async ones until their timing resolves; sync ones too when the watchdog is on)
        self.pending: dict[int, tuple] = {}
        self.offsets = ([0], [time.time_ns() - time.perf_counter_ns()])  # (from seq, perf->Unix ns)
        # (at, lo, hi ns, same machine): rank 0's wall clock minus ours (record.clocksync)
        self.rank0_offsets: list[tuple] = []
        self.groups: list[GroupInfo] = []
        self.group_ids: dict = {}  # group object (None: default group) -> gid
        self.dtype_names: list[str] = ["none", OBJECT]
        self.dtype_sizes: list[int] = [0, 1]
        self.dtype_ids: dict = {None: 0, OBJECT: 1}
        self.rows = _Rows(self)
        self.rank = -1
        self.world_size = -1
        self.pid = os.getpid()
        self.buckets: list[tuple] = []  # (first_seq, end_seq, bucket, params): DDP hook spans
        self.syncs: list[tuple] = []  # (seq, ns after its start): end of DDP's finalize (integrations.ddp)
        self.packs: list[tuple] = []  # (seq, pack ns, alone ns): DDP's gradient packing before a bucket (rows.Packing)
        self.waits: list[
            tuple
        ] = []  # (seq, ns): the thread's wait_tensor on a functional collective (integrations.base.Waits)
        # (step, at, Unix ns, thread CPU ns): the training thread where a step starts (at 0) and at the
        # step's first root forward (at 1) (integrations.steps)
        self.step_marks: list[tuple] = []
        self.settings: list[tuple] = []  # (wrapper, module, {setting: value}): a DDP / FSDP module's settings
        self.output = ""  # path template ('' : frames kept in memory)
        self.max_rows = 0  # with no output: rows kept in memory (0: no limit)
        self.on_open = None  # called with (log) before a file is opened: e.g. start the flusher
        self.on_warn = None  # called with a message the user should see once
        self.wake = None  # asks the flusher to write soon, without waiting for it
        self.sink = None  # the current record.sinks sink
        # The disk is written by one thread at a time, under io_lock (taken before self.lock, never
        # inside it): frames wait in the backlog meanwhile, bounded (max_rows or BACKLOG_ROWS).
        self.io_lock = threading.RLock()
        self.backlog = sinks.MemorySink()  # frames for this rank's file not written yet
        self.chain_written = False  # an earlier file of this rank holds the header: a new one needs it again
        self.stem_cache = None  # (stem, export suffix) of this rank's files, once known
        self.failing = ""  # why this rank's file cannot be written now ('' : it can)
        self.retry_at = 0.0  # time.monotonic() of the next attempt after a failure
        self.closing = False  # the process exits: no file is re-created
        self.exiting = False  # the interpreter's shutdown began (before any atexit handler: Session)
        self.closed: list = []  # earlier sinks that log() still shows (re-initialised ranks)
        self.files: list = []  # every file sink this process opened (exported at exit)
        self.written: dict[str, int] = {}  # registry -> entries already collected for the current sink
        self.flushed_rows = 0  # rows collected (in the sinks or the backlog)
        self.dropped = 0  # rows dropped by a cap (max_rows; the backlog's bound), counted
        self.reset_seq = 0  # log() shows rows from this seq on (commpatch.reset())
        self.recent = b""  # the last flushed rows (the watchdog's view)
        self.observed = None  # frames collected, for the live metrics (a list when on)
        self.unobserved = 0  # frames the live metrics never took (bounded list)
        self.inflight = inflight.InFlight(sinks.FLUSH_S)  # the flusher's notes on calls in flight

    # ---- registries (slow path, first sight only) -------------------------------------
    def group_id(self, group) -> int:
        """Code for a group; -1 for a rank that is not a member (nothing is recorded)."""
        gid = self.group_ids.get(group)
        if gid is not None:
            return gid
        import torch.distributed as dist

        with self.lock:
            if group is None and not dist.is_initialized():
                return -1  # not cached: torch raises its own error for this call
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            if pg is dist.GroupMember.NON_GROUP_MEMBER:
                self.group_ids[group] = -1
                return -1
            if self.rank < 0:
                self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            info = GroupInfo(
                name=_group_name(pg),
                size=pg.size(),
                ranks=compact_ranks(dist.get_process_group_ranks(pg)),
                backend=str(dist.get_backend(pg)),
                backends=_device_backends(str(dist.get_backend(pg)), pg),
            )
            try:
                gid = self.groups.index(info)
            except ValueError:
                gid = len(self.groups)
                self.groups.append(info)
            self.group_ids[group] = gid
            if not state.STATE.devices:
                state.STATE.devices = accelerator_present()
            opening = self.sink is None and self.output and self.on_open is not None
        if opening:
            self.on_open(self)  # outside self.lock: it may touch the disk
        return gid

    def note_rank0_offset(self, at_ns: int, lo_ns: int, hi_ns: int, same_machine: bool = False) -> None:
        """A measured interval of rank 0's wall clock minus this rank's (``record.clocksync``'s
        thread; ``same_machine``: rank 0 runs on this one): written with the next flush."""
        self.rank0_offsets.append((at_ns, lo_ns, hi_ns, int(same_machine)))  # one append: atomic under the GIL

    def forget_groups(self) -> None:
        """Called when process groups are destroyed: group objects may be reused or re-created."""
        with self.lock:
            self.group_ids.clear()  # the same dict object: wrappers hold a reference

    def end_file(self) -> None:
        """The default group is destroyed: flush and close this rank's file; a re-initialised
        process group (maybe with another rank) starts a new one."""
        with self.io_lock, self.lock:
            self._retire_sink()
            self.rank = self.world_size = -1
            self.forget_groups()

    def dtype_id(self, dt) -> int:
        code = self.dtype_ids.get(dt)
        if code is None:
            code = self.dtype_ids[dt] = len(self.dtype_names)
            self.dtype_names.append(str(dt).replace("torch.", ""))
            self.dtype_sizes.append(dt.itemsize)
        return code

    # ---- maintenance (every CHUNK rows, and on read) ---------------------------------
    def maintain(self, seq: int) -> None:
        """Re-read the clock offset so long runs do not drift; move what is new out of ``buf``
        (the recording thread: never waits for the disk)."""
        with self.lock:
            self.offsets[0].append(seq)
            self.offsets[1].append(time.time_ns() - time.perf_counter_ns())
            self.collect()

    def flush(self) -> int:
        """Collect what is new and write it to the disk now, waiting for it (log(), exit,
        destroy_process_group); never raises. Returns the rows collected."""
        with self.io_lock:
            rows = self.collect(self._in_flight_notes())
            self.drain(force=True)
            return rows

    def tick(self) -> None:
        """The flusher's pass: note the calls in flight too long (``record.inflight``), collect,
        then write unless a failed file waits for its retry time."""
        with self.io_lock:
            self.collect(self._in_flight_notes())
            self.drain()

    def _in_flight_notes(self) -> bytes:
        """Records of the calls in flight too long and of those since completed (``record.inflight``),
        for a rank's file (the caller holds io_lock)."""
        return self.inflight.scan(self) if self.wants_file() else b""

    def flush_soon(self) -> None:
        """Collect what is new and have the flusher write it, without waiting (disable())."""
        self.collect()
        wake = self.wake
        if wake is not None:
            wake()

    def wants_file(self) -> bool:
        return bool(self.output) and self.rank >= 0

    def collect(self, notes: bytes = b"") -> int:
        """Move new rows, late durations and registry entries out of ``buf`` into frames in memory:
        the backlog of this rank's file (bounded), or the in-memory sink; ``notes``: more records
        (frames) after the registries. No I/O; never raises. Returns the rows moved."""
        with self.lock:
            taken = 0
            try:
                if self.sink is None and not self.wants_file():
                    if not self.buf and not self.done:
                        return 0
                    self.sink = sinks.MemorySink()
                    self.written = {}
                target = self.sink if self.sink is not None and self.sink.path is None else self.backlog
                other = bytearray(self._new_meta())
                other += notes
                done = self.done
                for kind, pairs in ((logfile.LATE, done), (logfile.OWN, self.own)):
                    if pairs:
                        other += logfile.frame(kind, _drain_pairs(pairs))
                n = len(self.buf) // ROW.size * ROW.size
                chunk = take_rows(self.buf, n)  # whole rows; appends meanwhile stay in buf
                rows = taken = n // ROW.size
                if chunk:
                    # the last rows across flushes (a flush may take one row): only the tail is copied
                    self.recent = (self.recent + chunk[-_RECENT * ROW.size :])[-_RECENT * ROW.size :]
                    chunk = logfile.frame(logfile.ROWS, chunk)
                if other or chunk:
                    meta = bytes(other)
                    target.append(meta, chunk, rows)
                    if self.observed is not None:  # the live metrics' copy (no bytes copied)
                        self._observe(meta, chunk)
                self.flushed_rows += rows
                if target is self.backlog:
                    self._cap_backlog()
                elif self.max_rows:
                    self.dropped += target.cap_rows(self.max_rows, ROW.size)[0]
                return rows
            except Exception as exc:  # noqa: BLE001 - the user's job goes on without us
                state.fail("export.flush", exc, rows=taken)
                return 0

    def _observe(self, meta: bytes, chunk: bytes) -> None:
        observed = self.observed
        if len(observed) >= OBSERVED_FRAMES:  # nobody takes them: bounded, counted
            self.unobserved += len(observed)
            del observed[:]
        if meta:
            observed.append(meta)
        if chunk:
            observed.append(chunk)

    def take_observed(self) -> list:
        """The frames collected since the last call, in order (the live metrics, on the flusher)."""
        with self.lock:
            taken, self.observed = self.observed or [], []
        return taken

    def _cap_backlog(self) -> None:
        """Past the bound, the oldest rows waiting for the disk are dropped: counted, warned once
        and noted in the log (a "lost" record), never waited for."""
        bound = self.backlog_bound()
        if self.backlog.rows <= bound:
            return
        n, first, last = self.backlog.cap_rows(bound, ROW.size)
        if n:
            self.dropped += n
            why = self.failing or "the disk is slower than the calls"
            self.backlog.other += logfile.meta("lost", rows=n, first_seq=first, last_seq=last, why=why)
            state.fail(
                "export.dropped",
                OSError(
                    f"more than {bound} rows waited for this rank's log ({why}): the oldest are dropped, counted "
                    "(commpatch.internal_errors()) and noted in the log; the job is never made to wait"
                ),
                rows=n,
            )

    def drain(self, force: bool = False) -> None:
        """Write the backlog to this rank's file, opening (or re-creating, or replacing) it first
        when needed. The caller holds ``io_lock``; never raises. ``force``: even before the retry
        time of a failed file."""
        sink = None
        try:
            with self.lock:
                if not self.wants_file() or not force and time.monotonic() < self.retry_at:
                    return
                sink = self.sink
            if sink is not None and sink.removed():
                if self.exiting and not self.closing:
                    return  # the user's own exit handlers may be removing it: the exit's flush says it, once
                self._forget_removed(sink)
                if self.closing:
                    return  # at exit: no new file where the user removed one
                sink = None
            if sink is None or sink.torn:
                if not self.backlog.rows:
                    return  # nothing worth a (new) file yet
                sink = self._open_file()
            with self.lock:
                taken, self.backlog = self.backlog, sinks.MemorySink()
            if not taken:
                return
            try:
                sink.append(taken.payload(), taken.rows)
            except OSError:
                with self.lock:  # kept, before what came meanwhile; bounded again
                    taken.extend(self.backlog)
                    self.backlog = taken
                    self._cap_backlog()
                raise
            self.chain_written = True
            if self.failing:
                self.failing = ""
                self.retry_at = 0.0
                if self.on_warn is not None:
                    self.on_warn(f"commpatch: {sink.path} is written again (rows dropped meanwhile: {self.dropped})")
        except OSError as exc:
            self._failed(exc, sink)
        except Exception as exc:  # noqa: BLE001 - the user's job goes on without us
            state.fail("export.flush", exc, rows=0)

    def open(self) -> None:
        """Open this rank's file now (it exists from the first row's call on), never raising and
        never waiting: when the flusher is at the disk, it opens the file itself."""
        if not self.io_lock.acquire(blocking=False):
            return
        try:
            with self.lock:
                if self.sink is not None or not self.wants_file():
                    return
            self._open_file()
            self.failing = ""
        except OSError as exc:
            self._failed(exc, None)
        except Exception as exc:  # noqa: BLE001
            state.fail("export.open", exc, rows=0)
        finally:
            self.io_lock.release()

    def _open_file(self):
        """A new file for this rank (the caller holds io_lock); after an earlier file of this rank
        (removed, or ending in a record that could not be cut back) it starts with the registries."""
        if self.stem_cache is None:
            self.stem_cache = self.stem()
        stem, export_suffix = self.stem_cache
        sink, _ = sinks.create_exclusive(stem, (logfile.SUFFIX, export_suffix))
        with self.lock:
            old = self.sink
            if old is not None and old.path is not None:  # torn: its whole frames stay readable
                old.close()
                self.closed.append(old)
            self.sink = sink
            self.files.append(sink)
            if self.chain_written:
                self.backlog.other[:0] = self._new_meta(written={}, notes=False)
        return sink

    def _failed(self, exc: OSError, sink) -> None:
        """This rank's file could not be opened or written: keep the rows (bounded), retry later,
        say so once per episode."""
        with self.lock:
            self.retry_at = time.monotonic() + sinks.RETRY_S
            first = not self.failing
            where = sink.path if sink is not None else (self.stem_cache or ("this rank's log",))[0]
            self.failing = f"{where}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
            message = (
                f"commpatch: cannot write {self.failing}; the rows are kept in memory (at most "
                f"{self.backlog_bound()}; beyond it the oldest are dropped and counted) and the file is tried "
                f"again every {sinks.RETRY_S:g} s"
            )
        if first and self.on_warn is not None:
            self.on_warn(message)

    def _forget_removed(self, sink) -> None:
        """The file was deleted under us (with its directory, say): its rows are gone; say so once,
        counting them. Later rows go to a new file of the same name (directories re-created),
        except at exit: then the rows still waiting are counted with them (log() still shows them)."""
        with self.lock:
            sink.close()
            if sink in self.files:
                self.files.remove(sink)
            if self.sink is sink:
                self.sink = None
            lost, later = sink.rows, "later rows go to a new file of that name"
            if self.closing:
                lost += self._keep_backlog_in_memory()
                later = "at exit, no new file is made there"
        state.fail(
            "export.removed",
            FileNotFoundError(
                f"{sink.path} was deleted while the job ran (its directory too?): the rows it held are lost; {later}"
            ),
            rows=lost,
        )

    def _keep_backlog_in_memory(self) -> int:
        """Rows the file will not take: kept readable by log() (an in-memory sink), returned."""
        n = self.backlog.rows
        if self.backlog:
            self.closed.append(self._backlog_sink())
        self.backlog = sinks.MemorySink()
        return n

    def backlog_bound(self) -> int:
        """Rows that may wait for the disk: never fewer than BACKLOG_ROWS (a healthy disk never
        drops a row), more if COMMPATCH_MAX_ROWS says so."""
        return max(self.max_rows, sinks.BACKLOG_ROWS)

    def unwritten(self) -> int:
        """Rows still waiting for this rank's file."""
        return self.backlog.rows

    def stem(self) -> tuple[str, str]:
        """(path without suffix, export suffix) of this rank's files, from the output template."""
        template = self.output
        root, suffix = os.path.splitext(template)
        run = ""
        if "{run}" in template:
            store = None
            try:
                import torch.distributed as dist

                store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - no default group: a per-process name
                pass
            run = sinks.run_name(store)
        stem = root.format(rank=self.rank, pid=self.pid, run=run)
        if "{rank}" not in template and "{pid}" not in template and self.world_size > 1:
            stem += f".rank{self.rank}"
            if self.on_warn is not None:
                self.on_warn(
                    f"commpatch: the output {template!r} has no {{rank}} in a {self.world_size}-rank job: "
                    f"this rank writes {stem}{suffix}"
                )
        return stem, suffix

    def _new_meta(self, written: dict | None = None, notes: bool = True) -> bytes:
        """Frames for what the current sink has not been told yet (registries only grow); with
        ``written={}`` every registry entry (the start of a new file), ``notes``: with the notes
        taken since the last flush (each is written once)."""
        MODULES, TAGS = state.MODULES, state.TAGS
        w, out = self.written if written is None else written, []
        if not w:
            out.append(
                logfile.meta(
                    "header",
                    version=logfile.FORMAT_VERSION,
                    schema=SCHEMA_VERSION,
                    rank=self.rank,
                    world_size=self.world_size,
                    pid=self.pid,
                    ops=list(OP_NAMES),
                    timings=list(TIMINGS),
                    created_ns=time.time_ns(),
                )
            )
        for key, items, make in (
            (
                "groups",
                self.groups,
                lambda i, g: logfile.meta(
                    "group",
                    gid=i,
                    name=g.name,
                    size=g.size,
                    ranks=g.ranks,
                    backend=g.backend,
                    backends=list(g.backends),
                ),
            ),
            (
                "dtypes",
                self.dtype_names,
                lambda i, name: logfile.meta("dtype", code=i, name=name, size=self.dtype_sizes[i]),
            ),
            ("tags", TAGS, lambda i, name: logfile.meta("tag", code=i, name=name)),
            ("modules", MODULES, lambda i, name: logfile.meta("module", code=i, name=name)),
            ("clock", self.offsets[0], lambda i, seq: logfile.meta("clock", seq=seq, offset=self.offsets[1][i])),
            (
                "rank0_offsets",
                self.rank0_offsets,
                lambda i, o: logfile.meta("rank0_offset", at=o[0], lo=o[1], hi=o[2], same=o[3]),
            ),
            ("device", [self.device] if self.device else [], lambda i, name: logfile.meta("device", name=name)),
            (
                "step_sources",
                state.STEP_SOURCE_MARKS,
                lambda i, mark: logfile.meta(
                    "step_source", seq=mark[0], source=mark[1], **dict(zip(("micro", "switched"), mark[2:]))
                ),
            ),
        ):
            start, stop = w.get(key, 0), len(items)
            out.extend(make(i, items[i]) for i in range(start, stop))
            w[key] = stop
        # notes taken since the last flush, each once (appended to by other threads meanwhile: the
        # first k are taken, the rest wait for the next flush)
        for kind, taken, fields in (
            ("bucket", self.buckets, ("lo", "hi", "index", "params")),
            ("sync", self.syncs, ("seq", "end")),
            ("pack", self.packs, ("seq", "ns", "alone")),
            ("wait", self.waits, ("seq", "ns")),
            ("step", self.step_marks, ("step", "at", "ns", "cpu")),
            ("settings", self.settings, ("wrapper", "module", "values")),
        ):
            if taken and notes:
                k = len(taken)
                out.extend(logfile.meta(kind, **dict(zip(fields, note))) for note in taken[:k])
                del taken[:k]
        return b"".join(out)

    def sinks(self) -> list:
        return self.closed + ([self.sink] if self.sink is not None else [])

    def recent_rows(self):
        """The last rows recorded (flushed or not), as a numpy structured array: the watchdog's view."""
        import numpy as np

        data = self.recent + bytes(self.buf)
        return np.frombuffer(data[len(data) % ROW.size :], dtype=row_dtype(np))

    def clear(self, next_seq: int) -> None:
        """Forget the rows recorded so far (``commpatch.reset()``): files keep them, log() does not."""
        with self.io_lock, self.lock:
            self.flush()
            self.reset_seq = next_seq
            self.closed = []
            if self.sink is not None and self.sink.path is None:
                self.sink = None
            self.dropped = 0

    def set_output(self, output: str) -> None:
        """A new output template (enable() after disable()): later rows go to a new file."""
        with self.io_lock, self.lock:
            if output != self.output:
                self._retire_sink()
                self.output = output

    def _retire_sink(self) -> None:
        """Flush and close the current sink; log() still reads it, later rows go to a new one (an
        in-memory sink too: its header names the rank it was opened for). The caller holds
        io_lock, then self.lock. Rows the file could not take stay readable by log(), counted."""
        self.flush()
        if self.sink is not None:
            self.sink.close()
            self.closed.append(self.sink)
            self.sink = None
        where = self.failing or "this rank's log"
        unwritten = self._keep_backlog_in_memory()
        if unwritten:
            state.fail("export.unwritten", OSError(f"cannot write {where}; log() still shows its rows"), rows=unwritten)
        self.written = {}
        self.chain_written = False
        self.stem_cache = None
        self.failing = ""
        self.retry_at = 0.0

    def _backlog_sink(self):
        """The backlog as a readable in-memory log (the registries first)."""
        kept = sinks.MemorySink()
        kept.append(self._new_meta(written={}, notes=False) + bytes(self.backlog.other), b"", 0)
        for frame in self.backlog.row_frames:
            kept.append(b"", frame, (len(frame) - 5) // ROW.size)
        return kept

    def after_fork(self) -> None:
        """In a forked child: the parent's rows and file are not ours; locks may be held by dead threads.
        A child that initialises its own process group is a rank of its own and opens its own file."""
        self.lock = threading.RLock()
        self.io_lock = threading.RLock()
        self.backlog = sinks.MemorySink()
        self.chain_written, self.stem_cache, self.failing, self.retry_at, self.wake = False, None, "", 0.0, None
        self.exiting = False
        del self.buf[:]
        self.done.clear()
        self.own.clear()
        self.pending.clear()
        self.inflight.after_fork()
        self.buckets.clear()
        self.syncs.clear()
        self.packs.clear()
        self.waits.clear()
        self.step_marks.clear()
        self.settings.clear()
        self.sink, self.closed, self.files, self.written = None, [], [], {}
        self.flushed_rows = self.dropped = 0
        self.recent = b""
        self.observed = None  # the parent's live metrics do not follow a forked child
        self.rank = self.world_size = -1
        self.group_ids.clear()
        self.pid = os.getpid()

    def __len__(self) -> int:
        return self.flushed_rows + len(self.buf) // ROW.size

    def nbytes(self) -> int:
        """Bytes of rows held in memory: the unflushed rows plus an in-memory sink."""
        return len(self.buf) + self.backlog.nbytes() + sum(s.nbytes() for s in self.sinks() if s.path is None)

    # ---- derivation ---------------------------------------------------------------
    def to_dataframe(self):
        """Every row this process recorded since the last reset, from its sinks, as a DataFrame
        with the SCHEMA's columns and dtypes."""
        import pandas as pd

        datas = self._read_back()
        parsed = list(_fold_empty(parse_log(d) for d in datas))
        frames = [dataframe(p) for p in parsed]
        if not frames:
            frames = [dataframe(parse_log(logfile.MAGIC))]
        df = frames[0] if len(frames) == 1 else concat_frames(pd, frames)
        if self.reset_seq:
            df = df[df["seq"] >= self.reset_seq].reset_index(drop=True)
        df.attrs["dropped_rows"] = self.dropped
        notes = [logfile.job_notes(p) for p in parsed]
        df.attrs[logfile.JOB_ATTR] = [
            {
                "rank": self.rank,
                "step_marks": [m for n in notes for m in n["step_marks"]],
                "settings": [s for n in notes for s in n["settings"]],
            }
        ]
        return df

    def _read_back(self) -> list:
        """The bytes of every sink of this process (the backlog last), flushed first."""
        with self.io_lock:
            self.flush()
            with self.lock:
                current = self.sinks()
                waiting = self._backlog_sink() if self.backlog else None
            datas = []
            for sink in current:
                try:
                    datas.append(sink.read())
                except OSError as exc:  # removed under us: its rows are gone
                    state.fail("export.read_back", exc, rows=0)
            if waiting is not None:  # rows the file could not take yet
                datas.append(waiting.read())
        return datas

    def all_rows(self):
        """Every row of this process since the last reset, as one numpy structured array in no
        particular order (the watchdog's count of the calls before a stuck one)."""
        import numpy as np

        parts = [parse_log(d).rows for d in self._read_back()]
        rows = np.concatenate(parts) if parts else np.zeros(0, row_dtype(np))
        return rows[rows["seq"] >= self.reset_seq] if self.reset_seq else rows


_RECENT = 64
OBSERVED_FRAMES = 1 << 12


def accelerator_present() -> bool:
    """Whether this process can have tensors on an accelerator (asked once a process group exists:
    by then asking cannot break a later fork)."""
    try:
        import torch

        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "is_available"):
            return bool(acc.is_available())
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - unknown: test every tensor
        return True


def _drain_pairs(pairs: dict) -> bytes:
    """(seq, value) int64 pairs of a dict that completion callbacks add to, emptied as read."""
    out = array("q")
    for key in list(pairs):
        value = pairs.pop(key, None)
        if value is not None:
            out.append(key)
            out.append(value)
    return out.tobytes()


def _fold_empty(parsed):
    """Parsed sinks, those without rows folded into the one before: a sink opened after the rank's
    file was retired (destroy_process_group) may hold only durations that completed late, of rows
    in the earlier sink."""
    import numpy as np

    out = []
    for p in parsed:
        if out and len(p.rows) == 0:
            prev = out[-1]
            prev.late_seq = np.concatenate((prev.late_seq, p.late_seq))
            prev.late_dur = np.concatenate((prev.late_dur, p.late_dur))
            prev.own_seq = np.concatenate((prev.own_seq, p.own_seq))
            prev.own_dur = np.concatenate((prev.own_dur, p.own_dur))
            prev.step_marks += p.step_marks
            prev.settings += p.settings
            continue
        out.append(p)
    return out


def _group_name(pg) -> str:
    """``pg.group_name``; a Python ProcessGroup from a registered backend has none set (it
    raises): then the name torch keeps for the group in its registry."""
    try:
        return str(pg.group_name)
    except (AttributeError, RuntimeError):
        import torch.distributed as dist

        return str(dist.distributed_c10d._world.pg_names.get(pg, ""))


def _device_backends(backend: str, pg) -> tuple:
    """(cpu, accelerator, no tensor) -> name of the backend that runs the call, from a configured
    string.

    A group set up with one backend per device (``"cpu:gloo,cuda:nccl"``, ``"cpu:gloo,xpu:xccl"``,
    ``"cpu:gloo,emu:emustream"``) runs a call on the
    backend of its tensors' device; calls without a tensor (barrier, object collectives) run on
    the device torch picks for them (``_get_object_coll_device``: cpu when the group has one).
    """
    if ":" not in backend:
        return (backend,) * 3
    by_device = dict(pair.split(":", 1) for pair in backend.split(",") if ":" in pair)
    try:
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        pick = getattr(c10d, "_get_object_coll_device", None)
        if pick is None:  # torch < 2.5: the same rule, returning a torch.device
            pick = lambda group: c10d._get_pg_default_device(group).type  # noqa: E731
        none = by_device.get(pick(pg), backend)
    except Exception:  # noqa: BLE001 - an unusual group: keep the configured string
        none = backend
    accelerator = next((b for device, b in by_device.items() if device != "cpu"), backend)
    return by_device.get("cpu", backend), accelerator, none
