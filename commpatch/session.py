"""``Session``: the log, timing state, patcher, integrations, watchdog and flusher of a process,
and its lifecycle (enable / disable, the export at exit and at ``destroy_process_group``, fork).

The module-level functions (re-exported by ``commpatch/__init__.py``) act on a default session,
created on first use; ``new_default()`` replaces it with a fresh one (tests). Only one session
records at a time: torch's functions are process-global, and so are the hot path's switches
(``record.state.STATE``) and sequence counter (``record.rows.SEQ``). Importing this module imports
neither torch nor pandas.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import reprlib
import sys
import threading
import time
import weakref

from . import config, integrations, metrics, watchdog
from .analysis.summaries import summary as _summary
from .io.paths import check_writable, export_path, rank_path
from .io.writer import convert, write
from .patch.patcher import Patcher
from .record import clocksync
from .record import state as _runtime
from .record import wrapper as _wrapper
from .record.log import Log
from .record.rows import SEQ, peek_seq
from .record.sinks import Flusher
from .record.timing import Timing
from .render.text import render_text


class Session:
    """Everything commpatch holds for one process's recording, and its lifecycle."""

    def __init__(self) -> None:
        self.log = Log()
        self.timing = Timing(self.log)
        self.patcher = Patcher(self.log, self.timing, on_destroy=self._on_destroy)
        self.integrations = None  # integrations.Context while enabled
        self.flusher: Flusher | None = None
        self.metrics: metrics.Exporter | None = None  # live Prometheus metrics, when asked for
        self.clock = None  # record.clocksync.ClockSync: this rank's offset to rank 0
        self.stopped_clocks: list = []  # stopped (destroy_process_group) and maybe still in the store: joined at exit
        self.lock = threading.RLock()
        self.warned: set[str] = set()
        self.exit_lock = threading.Lock()
        self.exported: set[str] = set()  # binary logs already converted by this process
        self.exit_handler = False
        self.exited = False  # the exit's export ran (atexit, or a multiprocessing child's finalizer)
        self.mp_finalizer = None
        _register_fork_handler()  # a child forked before enable() must not take this log's pid for its own

    # ---- enable / disable ------------------------------------------------------------------
    def enable(self, **settings) -> None:
        with self.lock:
            state = _runtime.STATE
            if state.enabled:
                state.recording = True
                return
            resolved = config.resolve(settings, warn=self._warn_once)
            output = resolved["output"]
            problem = ""
            if output:
                setting = "output" if "output" in settings else "COMMPATCH_OUTPUT"
                problem = check_writable(output, setting, strict=resolved["strict"])
                world = os.environ.get("WORLD_SIZE", "")
                if world.isdigit() and int(world) > 1 and "{rank}" not in output and "{pid}" not in output:
                    raise config.ConfigError(
                        f"{setting}={output!r} has no {{rank}} in a {world}-rank job (WORLD_SIZE={world}): every rank "
                        "writes its own file, e.g. 'commpatch_logs/{run}/rank{rank}.csv'"
                    )
            for key, env in (("metrics_file", "COMMPATCH_METRICS_FILE"),):
                template = resolved[key]
                world = os.environ.get("WORLD_SIZE", "")
                if (
                    template
                    and world.isdigit()
                    and int(world) > 1
                    and "{rank}" not in template
                    and "{pid}" not in template
                ):
                    resolved[key] = ""  # monitoring never stops the job (config.Setting.monitoring)
                    self._warn_once(
                        f"commpatch: {env}={template!r} has no {{rank}} in a {world}-rank job: every rank "
                        "writes its own file, e.g. 'commpatch_rank{rank}.prom'; the job runs without it"
                    )
            state.settings = resolved
            log = self.log
            log.set_output(output)
            log.forget_groups()  # groups may have been destroyed and re-created while disabled
            if log.rank >= 0:
                import torch.distributed as dist

                if not dist.is_initialized() or dist.get_rank() != log.rank:
                    log.end_file()  # re-initialised while disabled: a new file for the new rank
            log.max_rows = resolved["max_rows"]
            log.on_open = self._start_flusher
            log.on_warn = self._warn_once
            if problem:
                log.failing = problem  # said here once; the log retries quietly until it can write
                self._warn_once(
                    f"commpatch: {problem}: the job runs; the rows are kept in memory (bounded, "
                    "COMMPATCH_MAX_ROWS) and the file is tried again every second (COMMPATCH_STRICT=1 "
                    "refuses instead)"
                )
            if log.sink is not None and log.sink.path is not None or log.backlog:
                self._start_flusher(log)  # rows recorded after a disable() reach the disk as before
            _register_fork_handler()
            self._start_metrics(resolved)
            self.patcher.apply(resolved["ops"], host_only=resolved["timing"] == "host")
            self.integrations = integrations.apply(log, self.timing, resolved)
            state.enabled = True
            state.recording = True
            watchdog.start(log, resolved)
            if not self.exit_handler:
                self.exit_handler = True
                atexit.register(self._at_exit)  # atexit only: the binary log needs no signal handler
                self.mp_finalizer = _multiprocessing_exit(self._at_exit)
                _at_shutdown(self)

    def disable(self) -> None:
        with self.lock:
            state = _runtime.STATE
            state.recording = False
            if state.enabled:
                watchdog.stop()
                self.timing.resolve(block=False)
                integrations.remove(self.integrations)
                self.integrations = None
                self.patcher.remove()
                self.log.flush_soon()  # the flusher writes it: disable() never waits for the disk
                state.enabled = False

    def close(self) -> None:
        """Disable, stop the flusher and the metrics, and drop the exit handler: a session replaced by another."""
        self.disable()
        self._stop_flusher()
        exporter, self.metrics = self.metrics, None
        if exporter is not None:
            exporter.close()
            self.log.observed = None
        self._stop_clock()
        if self.exit_handler:
            atexit.unregister(self._at_exit)
            finalizer, self.mp_finalizer = self.mp_finalizer, None
            if finalizer is not None:
                finalizer.cancel()
            self.exit_handler = False

    # ---- the log -----------------------------------------------------------------------------
    def dataframe(self):
        self.timing.resolve(block=True)
        return self.log.to_dataframe()

    def reset(self) -> None:
        self.timing.resolve(block=True)
        self.log.clear(peek_seq(SEQ))

    def export_csv(self, path: str | None = None, df=None) -> str:
        if path is not None and (not isinstance(path, (str, os.PathLike)) or not os.fspath(path)):
            raise config.ConfigError(f"export_csv path {path!r}: give a file name ending in .csv or .parquet, or None")
        _check_log(df, "export_csv")
        log = self.log
        if path is None and log.sink is not None and log.sink.path is not None:
            suffix = os.path.splitext(_runtime.STATE.settings.get("output") or ".csv")[1]
            path = export_path(log.sink.path, suffix)
        template = path or _runtime.STATE.settings.get("output") or config.BY_NAME["output"].default
        rank = log.rank if log.rank >= 0 else None
        target = os.path.normpath(rank_path(os.fspath(template), rank=rank))
        if os.path.isdir(target):
            raise config.ConfigError(
                f"export_csv path {target}: is a directory (give a file name ending in .csv or .parquet)"
            )
        return write(self.dataframe() if df is None else df, target)

    # ---- flusher, warnings ---------------------------------------------------------------------
    def _start_flusher(self, log) -> None:
        """The first row of a rank with an output file: open it now, then write every FLUSH_S
        seconds. The flusher lives as long as the session (disable() leaves it running: late
        durations and the last rows still reach the disk; enable() finds it running)."""
        log.open()
        if self.flusher is None or not self.flusher.alive():
            self.flusher = Flusher(self._tick)
            log.wake = self.flusher.wake
        self.flusher.wake()  # the file's first bytes (its header) right away
        if self.clock is None or not self.clock.alive():
            self.clock = clocksync.start(log)  # a thread: the training thread never waits for it

    def _stop_clock(self) -> None:
        """Stop the clock thread without waiting for it (the exit joins it: ``_join_clocks``)."""
        clock, self.clock = self.clock, None
        if clock is not None:
            clock.stop()  # it returns from the store at once: stop() sets the key it waits on
            self.stopped_clocks = [c for c in self.stopped_clocks if c.thread.is_alive()] + [clock]

    def _join_clocks(self, join_s: float) -> None:
        """At exit: wait up to ``join_s`` in all for the stopped clock threads to leave the store. A
        daemon thread that comes back from a C++ call (a cloned store's wait) once the interpreter
        is finalizing is ended by ``pthread_exit`` inside pybind11's GIL guard, a destructor: the
        process aborts ("terminate called without an active exception", exit status -6)."""
        deadline = time.monotonic() + join_s
        for clock in self.stopped_clocks:
            if clock.thread is not threading.current_thread():
                clock.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stopped_clocks = []

    def _tick(self) -> None:
        """The flusher's pass: the log to its file, then the live metrics from what was written."""
        self.log.tick()
        exporter = self.metrics
        if exporter is not None:
            try:
                exporter.update()
            except Exception as exc:  # noqa: BLE001 - the job goes on; the metrics say no more
                _runtime.fail("metrics", exc)

    def _start_metrics(self, resolved) -> None:
        """COMMPATCH_METRICS_PORT / _FILE: the exporter, fed by the flusher (started now, also
        with output 'none')."""
        if self.metrics is not None or not (resolved["metrics_port"] or resolved["metrics_file"]):
            return
        self.metrics = metrics.Exporter(
            self.log, resolved["metrics_port"], resolved["metrics_file"], warn=self._warn_once
        )
        self.log.observed = []
        self._start_flusher(self.log)

    def _stop_flusher(self) -> None:
        flusher, self.flusher = self.flusher, None
        if flusher is not None:
            flusher.stop()

    def _warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            import warnings

            warnings.warn(message, RuntimeWarning, stacklevel=2)

    # ---- exit, destroy_process_group, fork -------------------------------------------------------
    def _on_destroy(self) -> None:
        self._stop_clock()  # its store goes with the process group
        self.write_at_exit(reason="destroy_process_group")

    def _at_exit(self) -> None:
        """The process's end: once, whichever of atexit and multiprocessing's exit comes first."""
        if not self.exited:
            self.exited = True
            self.write_at_exit()

    def write_at_exit(self, reason: str = "exit") -> list[str]:
        """Flush this rank's binary log and write its CSV / Parquet beside it; never raises, never
        waits (a second caller, e.g. a signal handler of the user's during the first, returns at once)."""
        settings = _runtime.STATE.settings
        if not self.exit_lock.acquire(blocking=False):
            return []
        log = self.log
        written: list[str] = []
        try:
            self.timing.resolve(block=True)
            if reason == "exit":
                self._stop_clock()  # not inside the store when the interpreter ends:
                self._join_clocks(1.0)  # this one, or one destroy_process_group() stopped
            if reason == "destroy_process_group":
                log.end_file()
            else:
                log.closing = reason == "exit"
                log.flush()
                if self.metrics is not None and reason == "exit":
                    try:
                        self.metrics.update(final=True)  # the text file's last figures
                    except Exception as exc:  # noqa: BLE001 - the export below still runs
                        _runtime.fail("metrics", exc)
                if log.unwritten():  # the file never took them: say how many
                    _runtime.fail(
                        f"export.{reason}", OSError(f"cannot write {log.failing or 'this rank'}"), rows=log.unwritten()
                    )
            last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
            if reason == "exit" and isinstance(last, KeyboardInterrupt):
                # Ctrl-C: the rows are on disk already; importing the writers' extension modules now
                # would turn the process's exit status from -SIGINT into 1 (CPython), and slow it down
                if log.files:
                    sys.stderr.write(
                        f"commpatch: interrupted: this rank's rows are in {log.files[-1].path} "
                        "(`commpatch report` reads it, `commpatch convert` converts it)\n"
                    )
                return written
            _, suffix = os.path.splitext(settings.get("output") or ".csv")
            for sink in list(log.files):
                if sink.path in self.exported or sink is log.sink and reason != "exit":
                    continue
                self.exported.add(sink.path)
                out = export_path(sink.path, suffix)
                if not os.path.isfile(sink.path):  # the binary log was removed under us
                    _runtime.fail(f"export.{reason}", FileNotFoundError(f"{sink.path} was removed"), rows=len(log))
                    continue
                try:
                    written.append(convert(sink.path, out))
                except FileExistsError:
                    _runtime.fail(
                        "export.exists",
                        FileExistsError(f"{out} exists and was not written by commpatch; the rows are in {sink.path}"),
                        rows=0,
                    )
                except Exception as exc:  # noqa: BLE001 - the rows stay in the binary log
                    _runtime.fail("export.convert", exc, rows=0)
            if settings.get("summary") and reason == "exit" and len(log):
                df = log.to_dataframe()  # the rank from the rows: destroy_process_group() forgot it
                ranks = sorted(set(df["rank"].tolist()) - {-1})
                who = (
                    f"rank {','.join(map(str, ranks))} of {int(df['world_size'].max())}" if ranks else f"pid {log.pid}"
                )
                sys.stderr.write(render_text(summary(df), title=f"commpatch summary, {who}") + "\n")
            return written
        except Exception as exc:  # noqa: BLE001 - the user's exit must not fail because of us
            _runtime.fail(f"export.{reason}", exc, rows=0)
            return written
        finally:
            self.exit_lock.release()

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker, say) starts with an empty log and never writes the
        parent's file: its exit (or SIGTERM from the parent) must not overwrite the parent's rows."""
        self.lock = threading.RLock()
        self.flusher = None  # threads do not survive fork
        self.metrics = None  # the parent's metrics, not a child's
        self.clock = None
        self.stopped_clocks = []
        self.exit_lock = threading.Lock()
        self.exported.clear()
        self.log.after_fork()
        self.timing.after_fork()
        _runtime.STATE.settings = dict(_runtime.STATE.settings, output="")


# ---- the default session ------------------------------------------------------------------------
_default: Session | None = None
_default_lock = threading.Lock()
_fork_handler_registered = False


def default() -> Session:
    """The process's session, created on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Session()
    return _default


def new_default() -> Session:
    """Replace the default session with a fresh one (the old one is closed first): a clean log,
    timing state and patcher. Process-wide counters (seq, internal errors) are not reset."""
    global _default
    with _default_lock:
        old, _default = _default, Session()
    if old is not None:
        old.close()
    return _default


_EXITING: weakref.WeakSet = weakref.WeakSet()  # sessions whose log is told when the shutdown begins
_shutdown_hooked = False


def _at_shutdown(session) -> None:
    """Tell ``session``'s log when the interpreter's shutdown begins: threading's exit hooks run
    before any atexit handler (the user's, which may remove the output directory, included), and the
    flusher goes on until commpatch's own handler. One hook per process (it cannot be removed: it
    holds no session). Nothing where this Python has no such hook."""
    global _shutdown_hooked
    _EXITING.add(session)
    register = getattr(threading, "_register_atexit", None)
    if _shutdown_hooked or register is None:
        return
    try:
        register(_shutdown_begins)
        _shutdown_hooked = True
    except RuntimeError:  # the shutdown is under way already
        pass


def _shutdown_begins() -> None:
    for session in list(_EXITING):
        session.log.exiting = True


def _multiprocessing_exit(callback):
    """In a child of ``multiprocessing`` (``mp.Process``, ``torch.multiprocessing.start_processes``):
    ``callback`` at its end too. Its fork and forkserver children end in ``os._exit`` once the target
    returns, past atexit: only multiprocessing's own finalizers run there, and without one the last
    rows (all of a short job's) and the CSV at exit would be lost. None elsewhere."""
    mp = sys.modules.get("multiprocessing")
    try:
        if mp is None or mp.parent_process() is None:
            return None
        from multiprocessing import util

        return util.Finalize(None, callback, exitpriority=1)
    except Exception as exc:  # noqa: BLE001 - atexit still covers a normal exit
        _runtime.fail("export.exit", exc, rows=0)
        return None


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler_registered = True


def _after_fork_in_child() -> None:
    """Fork handling in one place: the record layer's locks, then the session's state."""
    global _default_lock
    _default_lock = threading.Lock()
    _runtime.after_fork()
    _wrapper.after_fork()
    if _default is not None:
        _default.after_fork_in_child()


# ---- the public functions (commpatch.enable() etc.) ------------------------------------------------
def enable(**settings) -> None:
    """Patch every torch.distributed collective and start recording.

    Keyword arguments override the environment (see ``commpatch env``): ``output``,
    ``ops``, ``timing``, ``summary``. Calling it again while enabled only resumes recording
    (and applies nothing new); ``disable()`` first to change settings.
    """
    default().enable(**settings)


def disable() -> None:
    """Stop recording and restore every original function object. The log is kept."""
    default().disable()


def is_enabled() -> bool:
    return _runtime.STATE.enabled


def log():
    """The recorded calls as a pandas DataFrame (one row per user-level call), read back from this
    rank's log (a file on disk when an output is configured)."""
    return default().dataframe()


def reset() -> None:
    """Drop every recorded row from what ``log()`` returns (sequence numbers keep counting; rows
    already in this rank's file stay there)."""
    default().reset()


def export_csv(path: str | None = None, df=None) -> str:
    """Write the log (or ``df``, a log already built) to ``path``; ``.parquet`` writes Parquet.

    ``{rank}``/``{pid}``/``{run}`` expand; the default path is this rank's export beside its binary log
    (or the output template).
    """
    return default().export_csv(path, df)


def write_at_exit(reason: str = "exit") -> list[str]:
    """The default session's export at exit (see ``Session.write_at_exit``)."""
    return default().write_at_exit(reason)


def step(value: int | None = None) -> int:
    """Advance the step counter (or set it); rows carry the value current at their call. Optional:
    steps are counted without it (``integrations.steps``); once called, only these calls count."""
    if value is not None:
        try:
            value = int(value)
        except (TypeError, ValueError):
            raise config.ConfigError(
                f"commpatch.step({reprlib.repr(value)}): give the step as an integer, or no value to count one"
            ) from None
    return integrations.steps.user_step(value)


@contextlib.contextmanager
def tag(name: str):
    """Label the calls issued while the block runs, in any thread (process-wide: the calls a
    block causes may be issued by other threads, as autograd's); the innermost block open wins,
    and no tag outlives its block (``record.state.open_tag``)."""
    block = _runtime.open_tag(str(name))
    try:
        yield
    finally:
        _runtime.close_tag(block)


class Capture:
    """Result of ``capture()``: the rows recorded inside the block."""

    def __init__(self) -> None:
        self.first_seq = None
        self.last_seq = None
        self._df = None

    @property
    def df(self):
        if self._df is None:
            df = log()
            mask = df["seq"] >= self.first_seq
            if self.last_seq is not None:
                mask &= df["seq"] < self.last_seq
            self._df = df[mask].reset_index(drop=True)
        return self._df

    def __len__(self) -> int:
        return len(self.df)


@contextlib.contextmanager
def capture(**settings):
    """Record only inside the block: ``with commpatch.capture() as cap: ...; cap.df``.

    Enables commpatch if needed (and disables it again on exit if it did).
    """
    session = default()
    with session.lock:
        was_enabled, was_recording = _runtime.STATE.enabled, _runtime.STATE.recording
        session.enable(**settings)
    cap = Capture()
    cap.first_seq = peek_seq(SEQ)
    try:
        yield cap
    finally:
        cap.last_seq = peek_seq(SEQ)
        with session.lock:
            if not was_enabled:
                session.disable()
            else:
                _runtime.STATE.recording = was_recording


def internal_errors() -> dict[str, int]:
    """Internal failures of commpatch so far, per kind (each warned once)."""
    return dict(_runtime.ERRORS)


def _check_log(df, caller: str) -> None:
    """``df`` given to ``caller``: None (this process's log) or a log (a DataFrame, or the same columns
    as a pyarrow Table); anything else is a one-line ConfigError."""
    if df is not None and not hasattr(df, "columns"):
        raise config.ConfigError(
            f"{caller} df {reprlib.repr(df)}: not a log: give commpatch.log()'s DataFrame, or None"
        )


def summary(df=None, by=("collective",)):
    """Per-op (or per ``by``) summary DataFrame of a log (default: this process's log). ``by``: columns
    of the log and ``size_bucket``; anything else, or a ``df`` that is no log, is a one-line ConfigError."""
    _check_log(df, "summary")
    df = log() if df is None else df
    try:
        keys = [by] if isinstance(by, str) else [str(k) for k in by]
    except TypeError:  # not iterable
        keys = []
    unknown = [k for k in keys if k not in df.columns and k != "size_bucket"]
    if not keys or unknown:
        raise config.ConfigError(
            f"summary by {reprlib.repr(by)}: give columns of the log or size_bucket"
            + (f" ({', '.join(map(repr, unknown))} is not one)" if unknown else "")
        )
    return _summary(df, by=keys)


def summary_text(df=None, by=("collective",)) -> str:
    return render_text(summary(df, by=by))
