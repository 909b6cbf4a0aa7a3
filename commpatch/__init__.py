"""commpatch: what a PyTorch distributed job communicates, and how long it takes.

    import commpatch
    commpatch.enable()          # wrap every torch.distributed collective
    ...                         # train as usual
    df = commpatch.log()        # one row per collective call (pandas DataFrame)
    commpatch.export_csv("commpatch_logs/rank{rank}.csv")

    run = commpatch.open("commpatch_logs/")   # offline: every rank's log, as a Run
    print(run.text())                         # the report `commpatch report` prints

Or with no code change: ``COMMPATCH=1 torchrun ...`` (after ``commpatch install-hook`` or a
regular ``pip install``) or ``commpatch run -- torchrun ...``.

Importing commpatch imports neither torch nor pandas (nor anything of its own until used).
"""

from ._version import __version__ as __version__

_SESSION_API = (
    "capture",
    "disable",
    "enable",
    "export_csv",
    "internal_errors",
    "is_enabled",
    "log",
    "reset",
    "step",
    "summary",
    "summary_text",
    "tag",
)

# the offline entry point: ``commpatch.open(path)`` -> ``commpatch.offline.Run``. ``open`` is not in
# ``__all__``: ``from commpatch import *`` must not hide the builtin ``open``
_OFFLINE_API = ("open", "Run", "compare")


def __getattr__(name):
    """The public functions, imported on first use: ``commpatch.pth`` imports this package in
    every Python process started with COMMPATCH set, and must cost (almost) nothing there."""
    if name in _SESSION_API:
        from . import session  # lazy: importing commpatch must cost (almost) nothing

        value = getattr(session, name)
    elif name in _OFFLINE_API:
        from . import offline  # lazy: importing commpatch must cost (almost) nothing

        value = getattr(offline, name)
    elif name == "ConfigError":
        from .config import ConfigError as value  # lazy: importing commpatch must cost (almost) nothing
    elif name in ("LogFileError", "LogFileWarning"):
        from .io import reader  # lazy: importing commpatch must cost (almost) nothing

        value = getattr(reader, name)
    else:
        raise AttributeError(f"module 'commpatch' has no attribute {name!r}")
    globals()[name] = value
    return value


def read_csv(paths):
    """Read per-rank log files (a file, a directory, a glob or a list) into one DataFrame."""
    from .io.reader import read  # lazy: importing commpatch must cost (almost) nothing

    return read(paths)


def schema():
    """The log's columns: (name, dtype, unit, doc) for each."""
    from .data.schema import SCHEMA  # lazy: importing commpatch must cost (almost) nothing

    return [(c.name, c.dtype, c.unit, c.doc) for c in SCHEMA]


__all__ = [
    "ConfigError",
    "LogFileError",
    "LogFileWarning",
    "Run",
    "capture",
    "compare",
    "disable",
    "enable",
    "export_csv",
    "internal_errors",
    "is_enabled",
    "log",
    "read_csv",
    "reset",
    "schema",
    "step",
    "summary",
    "summary_text",
    "tag",
]
