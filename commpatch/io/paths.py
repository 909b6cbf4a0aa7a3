"""Per-rank path templates (``{rank}``, ``{pid}``, ``{run}``) and the check that an output can be written."""

from __future__ import annotations

import os

from ..config import ConfigError, template_error
from ..data.logfile import SUFFIX


def rank_path(template: str, rank: int | None = None, pid: int | None = None, run: str = "") -> str:
    """``template`` with ``{rank}`` (default: $RANK, else 0), ``{pid}`` and ``{run}`` filled in; any
    other field is a ``ConfigError``."""
    problem = template_error(template)
    if problem:
        raise ConfigError(f"{template!r}: {problem}")
    rank = _env_rank() if rank is None else rank
    return template.format(rank=rank, pid=os.getpid() if pid is None else pid, run=run)


def export_path(binary_path: str, suffix: str = ".csv") -> str:
    """The CSV / Parquet (``suffix``) beside a binary rank log: the same stem."""
    return binary_path[: -len(SUFFIX)] + suffix


def _env_rank() -> int:
    env = os.environ.get("RANK")
    return int(env) if env and env.isdigit() else 0


def check_writable(template: str, setting: str = "COMMPATCH_OUTPUT", strict: bool = False) -> str:
    """Why the output cannot be written ('' when it can), known at enable() time rather than at exit;
    ``strict`` (COMMPATCH_STRICT): a ``ConfigError`` instead. Creates nothing (a process that never
    records must leave no directory behind). Symbolic links among the parent directories are
    followed, as ``mkdir -p`` does: the user chose the path (the file itself is never created
    through a link)."""
    existing = os.path.dirname(os.path.abspath(template.split("{", 1)[0] + "x"))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    problem = ""
    if not os.path.isdir(existing):
        problem = f"{setting}={template!r}: {existing!r} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{setting}={template!r}: cannot create files under {existing!r} (not writable)"
    if problem and strict:
        raise ConfigError(problem + " (COMMPATCH_STRICT=1; with 0 the job runs and the rows are kept in memory)")
    return problem
