"""The binary rank logs of a running job, read as they grow (``commpatch watch``): each file is
read from where the last look ended (never re-read), its new bytes decoded by ``data.follow``;
files that appear later (a rank that starts late, a rank's new file) are picked up."""

from __future__ import annotations

import os

from ..data.follow import Follower
from ..data.logfile import SUFFIX
from .discovery import file_rank, latest_run, runs

READ_MOST = 64 << 20  # bytes read from one file per look (the rest at the next look)
CHUNK = 4 << 20


class FileFollower:
    """One ``.cplog`` file, read incrementally (opened without following a link)."""

    def __init__(self, path: str, **window) -> None:
        self.path = path
        self.follower = Follower(**window)
        self.offset = 0
        self.fd = -1
        self.error = ""  # why the file cannot be read ('' : it can)

    def poll(self) -> int:
        """Read and decode what was appended since the last call (at most READ_MOST bytes);
        returns the bytes read."""
        if self.error:
            return 0
        done = 0
        while done < READ_MOST:
            try:
                if self.fd < 0:
                    self.fd = os.open(
                        self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                    )
                data = os.pread(self.fd, CHUNK, self.offset)
            except OSError as exc:
                self.error = f"{self.path}: {exc.strerror or exc}"
                break
            if not data:
                break
            self.offset += len(data)
            done += len(data)
            try:
                self.follower.feed(data)  # decoded chunk by chunk: the window stays bounded
            except ValueError as exc:  # not a rank log
                self.error = f"{self.path}: {exc}"
                break
        return done

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _created(f: FileFollower) -> int:
    created = f.follower.parsed.header.get("created_ns")
    return created if isinstance(created, int) else 0


class RunFollower:
    """Every rank log of a run directory (or of the latest run in a directory of runs)."""

    def __init__(self, directory: str, **window) -> None:
        self.root = directory
        self.window = window
        self.files: dict[str, FileFollower] = {}

    def directory(self) -> str:
        """The run directory read: ``root`` when it holds rank logs, else its latest run."""
        try:
            if any(name.endswith(SUFFIX) for name in os.listdir(self.root)) or not runs(self.root):
                return self.root
        except OSError:  # not there yet: the job creates it
            return self.root
        return latest_run(self.root) or self.root

    def poll(self) -> int:
        """Look for new files, then read what every file gained; returns the bytes read."""
        directory = self.directory()
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            names = []
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(SUFFIX) and path not in self.files and os.path.isfile(path):
                self.files[path] = FileFollower(path, **self.window)
        return sum(f.poll() for f in list(self.files.values()))

    def by_rank(self) -> dict:
        """rank -> the FileFollower of its latest file (created last, as its header says; the rank from
        the header, else from the file's name)."""
        out: dict = {}
        for path, f in self.files.items():
            rank = f.follower.parsed.header.get("rank")
            if not isinstance(rank, int) or rank < 0:
                rank = file_rank(path)
            if rank is not None and (rank not in out or _created(f) > _created(out[rank])):
                out[rank] = f
        return out

    def errors(self) -> list[str]:
        return [f.error for f in self.files.values() if f.error]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
