"""The process's one log, timing state and patcher, and the operations on them.

``commpatch/__init__.py`` re-exports the public functions defined here. Importing this
module imports neither torch nor pandas.
"""

from __future__ import annotations

import contextlib
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
        state.settings = resolved
        PATCHER.apply(resolved["ops"], host_only=resolved["timing"] == "host")
        state.enabled = True
        state.recording = True
        from .export import install_exit_handlers

        install_exit_handlers()


def disable() -> None:
    """Stop recording and restore every original function object. The log is kept."""
    with _lock:
        state = _runtime.STATE
        state.recording = False
        if state.enabled:
            TIMING.resolve(block=False)
            PATCHER.remove()
            state.enabled = False


def is_enabled() -> bool:
    return _runtime.STATE.enabled


def log():
    """The recorded calls as a pandas DataFrame (one row per user-level call)."""
    TIMING.resolve(block=True)
    return LOG.to_dataframe()


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
