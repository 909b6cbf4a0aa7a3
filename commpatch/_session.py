"""The process's one log, timing state and patcher, and the operations on them.

``commpatch/__init__.py`` re-exports the public functions defined here. Importing this
module imports neither torch nor pandas.
"""

from __future__ import annotations

import contextlib
import os
import threading

from . import _config, _runtime
from ._log import Log
from ._patching import Patcher
from ._timing import Timing

LOG = Log()
TIMING = Timing(LOG)
PATCHER = Patcher(LOG, TIMING)
_lock = threading.RLock()


def enable(**settings) -> None:
    """Patch every torch.distributed collective and start recording.

    Keyword arguments override the environment (see ``commpatch env``): ``output``,
    ``ops``, ``timing``, ``summary``. Calling it again while enabled only resumes recording
    (and applies nothing new); ``disable()`` first to change settings.
    """
    with _lock:
        state = _runtime.STATE
        if state.enabled:
            state.recording = True
            return
        resolved = _config.resolve(settings)
        output = resolved["output"]
        if output:
            from .export import check_writable

            setting = "output" if "output" in settings else "COMMPATCH_OUTPUT"
            check_writable(output, setting)
            world = os.environ.get("WORLD_SIZE", "")
            if world.isdigit() and int(world) > 1 and "{rank}" not in output and "{pid}" not in output:
                raise _config.ConfigError(
                    f"{setting}={output!r} has no {{rank}} in a {world}-rank job (WORLD_SIZE={world}): every rank "
                    "writes its own file, e.g. 'commpatch_logs/{run}/rank{rank}.csv'")
        state.settings = resolved
        LOG.set_output(output)
        LOG.forget_groups()         # groups may have been destroyed and re-created while disabled
        if LOG.rank >= 0:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() != LOG.rank:
                LOG.end_file()      # re-initialised while disabled: a new file for the new rank
        LOG.max_rows = resolved["max_rows"]
        LOG.on_open = _start_flusher
        LOG.on_warn = _warn_once
        _register_fork_handler()
        PATCHER.apply(resolved["ops"], host_only=resolved["timing"] == "host")
        state.enabled = True
        state.recording = True
        from . import watchdog
        watchdog.start(LOG, resolved)
        from .export import install_exit_handlers

        install_exit_handlers()


_fork_handler_registered = False
_flusher = None


def _start_flusher(log) -> None:
    """The first row of a rank with an output file: flush it now, then every FLUSH_S seconds."""
    global _flusher
    from . import _logfile

    log.open()
    if _flusher is None:
        _flusher = _logfile.Flusher(log.flush)


def _stop_flusher() -> None:
    global _flusher
    flusher, _flusher = _flusher, None
    if flusher is not None:
        flusher.stop()


_warned_messages: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned_messages:
        _warned_messages.add(message)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler_registered = True


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, say) starts with an empty log and never writes the
    parent's file: its exit (or SIGTERM from the parent) must not overwrite the parent's rows."""
    global _lock, _flusher
    _lock = threading.RLock()
    _flusher = None                 # threads do not survive fork
    LOG.after_fork()
    TIMING.after_fork()
    _runtime.STATE.settings = dict(_runtime.STATE.settings, output="")
    from . import _wrapper, export

    _wrapper._nesting_lock = threading.Lock()
    export.after_fork()


def disable() -> None:
    """Stop recording and restore every original function object. The log is kept."""
    with _lock:
        state = _runtime.STATE
        state.recording = False
        if state.enabled:
            from . import watchdog
            watchdog.stop()
            TIMING.resolve(block=False)
            PATCHER.remove()
            _stop_flusher()
            LOG.flush()
            state.enabled = False


def is_enabled() -> bool:
    return _runtime.STATE.enabled


def log():
    """The recorded calls as a pandas DataFrame (one row per user-level call), read back from this
    rank's log (a file on disk when an output is configured)."""
    TIMING.resolve(block=True)
    return LOG.to_dataframe()


def reset() -> None:
    """Drop every recorded row from what ``log()`` returns (sequence numbers keep counting; rows
    already in this rank's file stay there)."""
    from ._wrapper import SEQ

    TIMING.resolve(block=True)
    LOG.clear(_peek_seq(SEQ))


def export_csv(path: str | None = None, df=None) -> str:
    """Write the log (or ``df``, a log already built) to ``path``; ``.parquet`` writes Parquet.

    ``{rank}``/``{pid}``/``{run}`` expand; the default path is this rank's export beside its binary log
    (or the output template).
    """
    from . import _logfile, export

    if path is None and LOG.sink is not None and LOG.sink.path is not None:
        suffix = os.path.splitext(_runtime.STATE.settings.get("output") or ".csv")[1]
        path = LOG.sink.path[: -len(_logfile.SUFFIX)] + suffix
    template = path or _runtime.STATE.settings.get("output") or _config.BY_NAME["output"].default
    return export.write(log() if df is None else df, os.path.normpath(export.rank_path(str(template))))


def step(value: int | None = None) -> int:
    """Advance the step counter (or set it); rows carry the value current at their call."""
    state = _runtime.STATE
    state.step = state.step + 1 if value is None else int(value)
    return state.step


@contextlib.contextmanager
def tag(name: str):
    """Label the calls issued inside the block (process-wide; the innermost tag wins)."""
    state = _runtime.STATE
    previous = state.tag
    state.tag = _runtime.tag_id(str(name))
    try:
        yield
    finally:
        state.tag = previous


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
    from ._wrapper import SEQ

    with _lock:
        was_enabled, was_recording = _runtime.STATE.enabled, _runtime.STATE.recording
        enable(**settings)
    cap = Capture()
    cap.first_seq = _peek_seq(SEQ)
    try:
        yield cap
    finally:
        cap.last_seq = _peek_seq(SEQ)
        with _lock:
            if not was_enabled:
                disable()
            else:
                _runtime.STATE.recording = was_recording


def _peek_seq(counter) -> int:
    """Next value of an itertools.count without consuming it."""
    text = repr(counter)          # 'count(42)'
    return int(text[text.index("(") + 1:text.index(")")])


def internal_errors() -> dict[str, int]:
    """Internal failures of commpatch so far, per kind (each warned once)."""
    return dict(_runtime.ERRORS)


def summary(df=None, by=("op",)):
    """Per-op (or per ``by``) summary DataFrame of a log (default: this process's log)."""
    from .analysis import summary as _summary

    return _summary(log() if df is None else df, by=by)


def summary_text(df=None, by=("op",)) -> str:
    from .report import render_text

    return render_text(summary(df, by=by))
