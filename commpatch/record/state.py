"""Process-wide runtime state shared by the wrapper and the public API.

Kept tiny and free of torch/pandas imports: the hot path reads ``STATE.recording``,
``STATE.step``, ``STATE.tag`` and the thread-local ``LOCAL.depth``.
"""

from __future__ import annotations

import sys
import threading
import warnings


class State:
    """Mutable process-wide switches. Slots: one read each on the hot path, in Python, and the C
    recorder (record/_hot.c) reads them at their offsets without a dict lookup."""

    __slots__ = ("enabled", "recording", "step", "step_source", "tag", "nesting", "where", "devices", "settings")

    def __init__(self) -> None:
        self.enabled = False  # patches installed
        self.recording = False  # wrappers record (False: pure pass-through)
        self.step = 0  # step counter: commpatch.step(), else integrations.steps
        self.step_source = 0  # index into data.schema.STEP_SOURCES of what advances it (set_step_source)
        self.tag = 0  # index into TAGS; 0 is no tag
        self.nesting = 0  # nesting ops (object collectives, send, ...) running in any thread
        self.where = 0  # (index into MODULES) << 2 | index into data.schema.PHASES (data.schema.pack_where)
        self.devices = False  # an accelerator is present: the wrappers test each tensor's device
        self.settings: dict = {}


class _Local(threading.local):
    depth = 0  # >0 while inside a recorded call that may issue wrapped calls itself
    nested = None  # bytes accumulated by inner calls of an object collective, else None
    python_call = False  # a Python wrapper that records its call runs torch's function: dispatcher kernels skip it
    waited = None  # the collective result torch waited for inside that function (integrations.functional)


STATE = State()
LOCAL = _Local()
# process group -> [start] of the first call queued in an open, wrapped _coalescing_manager
# (integrations.coalescing records the coalesced op at exit; the wrapper records no row per queued call)
COALESCING: dict = {}
TAGS: list[str] = [""]
_TAG_INDEX = {"": 0}
MODULES: list[str] = [""]  # module FQNs seen by commpatch.integrations.modules
# (first seq, code into data.schema.STEP_SOURCES): each change of what advances the step counter,
# written to the rank's log once each (a "step_source" meta record), turned into a column when read
STEP_SOURCE_MARKS: list[tuple] = []  # (seq, code[, micro-batches, step of the switch]: integrations.steps)

# Internal failures: counted per kind, warned once per kind. The user's call proceeds.
ERRORS: dict[str, int] = {}
_warned: set[str] = set()
_errors_lock = threading.Lock()


def fail(kind: str, exc: BaseException | None = None, rows: int = 1) -> None:
    """Record an internal error of commpatch without ever raising."""
    try:
        with _errors_lock:
            ERRORS[kind] = ERRORS.get(kind, 0) + rows
            first = kind not in _warned
            _warned.add(kind)
        if first:
            warnings.warn(
                f"commpatch: internal error ({kind}): {type(exc).__name__ if exc else ''}: {exc}; "
                f"{_consequence(kind, rows)}, further errors of this kind are only counted "
                "(commpatch.internal_errors())",
                RuntimeWarning,
                stacklevel=3,
            )
    except Exception:  # noqa: BLE001 - the last line of defence must not raise
        try:
            sys.stderr.write(f"commpatch: internal error ({kind})\n")
        except Exception:  # noqa: BLE001
            pass


def _consequence(kind: str, rows: int) -> str:
    """What the user lost, in the one warning of a kind."""
    if kind == "export.convert":
        return (
            "this rank's CSV / Parquet was not written; its rows are in the binary log (.cplog) beside it: "
            "`commpatch report` reads it, `commpatch convert` converts it"
        )
    if kind.startswith("export"):
        return f"{rows} row(s) of this rank's log were NOT written"
    if kind.startswith("watchdog"):
        return "the hang dump went to stderr only" if kind == "watchdog.file" else "the watchdog may miss a hang"
    return "the collective proceeds"


def reset_errors() -> None:
    """Forget the internal errors counted so far (and that their kinds were warned)."""
    with _errors_lock:
        ERRORS.clear()
        _warned.clear()


def after_fork() -> None:
    """Fresh locks in a forked child (the parent's may have been held by another thread)."""
    global _errors_lock, _tags_lock
    _errors_lock = threading.Lock()
    _tags_lock = threading.Lock()
    STATE.nesting = 0


def module_id(name: str) -> int:
    """Code of a module FQN in MODULES (registered once per module, not per call)."""
    with _errors_lock:
        MODULES.append(name)
        return len(MODULES) - 1


def set_step_source(code: int, seq: int) -> None:
    """From the call numbered ``seq`` on, steps are counted by ``code`` (data.schema.STEP_SOURCES)."""
    STATE.step_source = code
    STEP_SOURCE_MARKS.append((seq, code))


# The tag() blocks open in any thread, in the order they were entered: one [tag index] list each,
# removed by identity when its block ends. STATE.tag is the last one's (the innermost open block).
# Restoring the tag a block found when it entered would be wrong across threads: with overlapping
# blocks in two threads, the one leaving last restored the other's tag, set long after both ended.
_OPEN_TAGS: list[list[int]] = []
_tags_lock = threading.Lock()


def open_tag(name: str) -> list[int]:
    """A tag() block begins: the calls issued from now on (in any thread) carry ``name``."""
    block = [tag_id(name)]
    with _tags_lock:
        _OPEN_TAGS.append(block)
        STATE.tag = block[0]
    return block


def close_tag(block: list[int]) -> None:
    """That block ends: the tag is the innermost block's still open, else none."""
    with _tags_lock:
        for i in range(len(_OPEN_TAGS) - 1, -1, -1):
            if _OPEN_TAGS[i] is block:
                del _OPEN_TAGS[i]
                break
        STATE.tag = _OPEN_TAGS[-1][0] if _OPEN_TAGS else 0


def tag_id(name: str) -> int:
    with _errors_lock:
        i = _TAG_INDEX.get(name)
        if i is None:
            i = _TAG_INDEX[name] = len(TAGS)
            TAGS.append(name)
        return i
