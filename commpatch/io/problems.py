"""The problems of reading logs, shared by the reader and the converter: ``LogFileError`` (one
line naming the file), ``LogFileWarning`` (read best-effort), and the damage of a binary log said
as warnings."""

from __future__ import annotations

import warnings


class LogFileError(ValueError):
    """A file given to ``read`` (or the set of files) cannot be read as commpatch logs.

    ``str(exc)`` is one line, ``<path>: <what is wrong>``; ``exc.path`` and ``exc.problem`` hold
    the two parts (``path`` is None when no single file is to blame).
    """

    def __init__(self, path, problem: str):
        self.path = None if path is None else str(path)
        self.problem = problem
        super().__init__(problem if path is None else f"{path}: {problem}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)


class LogFileNotFoundError(LogFileError, FileNotFoundError):
    """A path given to ``read`` does not exist, or a directory / glob holds no log file."""


class LogFileWarning(UserWarning):
    """A log was read best-effort: something was skipped, filled in or treated as unmeasured."""


class _NotALog(LogFileError):
    """The file is another tool's (not commpatch's columns): skipped when a directory scan found it."""


def warn_damage(path, parsed) -> None:
    """A LogFileWarning per kind of damage a parsed binary log had (``data.logfile.Parsed.damage``)."""
    for problem in parsed.damage():
        warnings.warn(f"{path}: {problem}", LogFileWarning, stacklevel=3)


class Notes:
    """Warnings collected while reading, one per problem: the same problem in many files (64
    ranks written by an older commpatch) is one warning naming the first file and a count."""

    def __init__(self) -> None:
        self.problems: dict[str, list[str]] = {}
        self.run = None  # (the run directory read, how many runs its parent holds): latest_run
        self.flight: list[dict] = []  # per binary log read: data.logfile.in_flight (its calls in flight at the end)
        self.job: list[dict] = []  # per binary log read: data.logfile.job_notes (step marks, settings)

    def add(self, path, problem: str) -> None:
        self.problems.setdefault(problem, []).append(str(path))

    def emit(self) -> None:
        import warnings

        problems, self.problems = self.problems, {}
        for problem, where in problems.items():
            more = f" (and {len(where) - 1} other file(s))" if len(where) > 1 else ""
            warnings.warn(f"{where[0]}{more}: {problem}", LogFileWarning, stacklevel=4)
