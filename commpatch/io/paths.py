"""Per-rank path templates (``{rank}``, ``{pid}``, ``{run}``) and the check that an output can be written."""

from __future__ import annotations

import os

from ..config import ConfigError
from ..data.logfile import SUFFIX


def rank_path(template: str, rank: int | None = None, pid: int | None = None, run: str = "") -> str:
    """``template`` with ``{rank}`` (default: $RANK, else 0), ``{pid}`` and ``{run}`` filled in."""
    rank = _env_rank() if rank is None else rank
    return template.format(rank=rank, pid=os.getpid() if pid is None else pid, run=run)


def export_path(binary_path: str, suffix: str = ".csv") -> str:
    """The CSV / Parquet (``suffix``) beside a binary rank log: the same stem."""
    return binary_path[: -len(SUFFIX)] + suffix


def _env_rank() -> int:
    env = os.environ.get("RANK")
    return int(env) if env and env.isdigit() else 0


def check_writable(template: str, setting: str = "COMMPATCH_OUTPUT") -> None:
    """Fail at enable() time, not at exit, when the output cannot be written; creates nothing
    (a process that never records must leave no directory behind)."""
    existing = os.path.dirname(os.path.abspath(template.split("{", 1)[0] + "x"))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{setting}={template!r}: {existing!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting}={template!r}: cannot create files under {existing!r} (not writable)")
