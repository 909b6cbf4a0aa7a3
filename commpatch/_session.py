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
        if resolved["output"]:
            from .export import check_writable

            check_writable(resolved["output"], "output" if "output" in settings else "COMMPATCH_OUTPUT")
        if resolved["max_rows"] and resolved["output"].endswith(".parquet"):
            raise _config.ConfigError(
                f"COMMPATCH_MAX_ROWS={resolved['max_rows']} streams rows to the output file in chunks, which "
                f"needs a .csv output, not {resolved['output']!r} (Parquet is written whole at exit)")
        state.settings = resolved
        from . import export

        LOG.max_rows = resolved["max_rows"]
        LOG.on_full = export.stream_flush if resolved["max_rows"] else None
        _register_fork_handler()
        PATCHER.apply(resolved["ops"], host_only=resolved["timing"] == "host")
        state.enabled = True
        state.recording = True
        from . import watchdog
        watchdog.start(LOG, resolved)
        from .export import install_exit_handlers

        install_exit_handlers()


_fork_handler_registered = False


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler_registered = True


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, say) starts with an empty log and never writes the
    parent's file: its exit (or SIGTERM from the parent) must not overwrite the parent's rows."""
    global _lock
    _lock = threading.RLock()
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
            state.enabled = False


def is_enabled() -> bool:
    return _runtime.STATE.enabled


def log():
    """The recorded calls as a pandas DataFrame (one row per user-level call).

    With ``max_rows`` and an output file, rows already streamed to the file are read back.
    """
    TIMING.resolve(block=True)
    df = LOG.to_dataframe()
    if LOG.flushed:
        import pandas as pd

        from . import export
        from ._log import apply_schema

        flushed = export.read(LOG.stream_path)
        df = apply_schema(pd.concat([flushed, df], ignore_index=True))
        df.attrs["dropped_rows"] = LOG.dropped
    return df


def reset() -> None:
    """Drop every recorded row (sequence numbers keep counting)."""
    TIMING.resolve(block=True)
    LOG.clear()


def export_csv(path: str | None = None, df=None) -> str:
    """Write the log (or ``df``, a log already built) to ``path``; ``.parquet`` writes Parquet.

    ``{rank}``/``{pid}`` expand; the default path is the output template.
    """
    from . import export

    template = path or _runtime.STATE.settings.get("output") or _config.BY_NAME["output"].default
    return export.write(log() if df is None else df, export.rank_path(str(template)))


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
