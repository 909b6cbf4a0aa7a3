"""The binary rank logs of a running job, read as they grow (``commpatch watch``): each file is
read from where the last look ended (never re-read), its new bytes decoded by ``data.follow``;
files that appear later (a rank that starts late, a rank's new file) are picked up. A file
replaced at its path (a new inode: a restarted job, a copy moved over it) or rewritten in place
(shorter than what was read, or its first bytes changed: truncated) is read again from its start."""

from __future__ import annotations

import os

from ..data.follow import Follower
from ..data.logfile import SUFFIX
from .discovery import file_rank, latest_run, runs

READ_MOST = 64 << 20  # bytes read from one file per look (the rest at the next look)
CHUNK = 4 << 20
HEAD = 256  # first bytes of a file compared at each look: a file rewritten in place no longer has them


class FileFollower:
    """One ``.cplog`` file, read incrementally (opened without following a link)."""

    def __init__(self, path: str, **window) -> None:
        self.path = path
        self.window = window
        self.follower = Follower(**window)
        self.offset = 0
        self.fd = -1
        self.error = ""  # why the file cannot be read ('' : it can)
        self.ident: tuple = ()  # (device, inode) of the file read, or of the one that failed
        self.head = b""  # its first bytes, as read
        self.restarts = 0  # times the file was replaced or rewritten and read again from its start
        self.restarted = ""  # why, the last time

    def poll(self) -> int:
        """Read and decode what was appended since the last call (at most READ_MOST bytes);
        returns the bytes read. A file replaced or rewritten since is read from its start."""
        self._check_same_file()
        if self.error:
            return 0
        done = 0
        while done < READ_MOST:
            try:
                if self.fd < 0:
                    self.fd = os.open(
                        self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                    )
                    st = os.fstat(self.fd)
                    self.ident = (st.st_dev, st.st_ino)
                data = os.pread(self.fd, CHUNK, self.offset)
            except OSError as exc:
                self.error = f"{self.path}: {exc.strerror or exc}"
                self.ident = self._at_path() or self.ident
                break
            if not data:
                break
            if self.offset < HEAD:
                self.head += data[: HEAD - self.offset]
            self.offset += len(data)
            done += len(data)
            try:
                self.follower.feed(data)  # decoded chunk by chunk: the window stays bounded
            except ValueError as exc:  # not a rank log
                self.error = f"{self.path}: {exc}"
                break
        return done

    def _at_path(self) -> tuple:
        """(device, inode) of what is at the path now (a link itself, not followed); () if nothing."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return ()
        return (st.st_dev, st.st_ino)

    def _check_same_file(self) -> None:
        """Start over when the path holds another file than the one read (or than the one that
        failed), or the file read is shorter than what was read, or its first bytes changed."""
        now = self._at_path()
        if not now:
            return  # gone (moved away, being replaced): what was read stays until a file is there
        why = ""
        if now != self.ident and (self.ident or self.error):
            why = "replaced by a new file"
        elif self.fd >= 0 and self.offset:
            try:
                if os.fstat(self.fd).st_size < self.offset:
                    why = "truncated"
                elif os.pread(self.fd, len(self.head), 0) != self.head:
                    why = "rewritten"
            except OSError:
                return
        if why:
            self.close()
            self.follower = Follower(**self.window)
            self.offset, self.error, self.ident, self.head = 0, "", (), b""
            self.restarts += 1
            self.restarted = why

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

    def restarts(self) -> list[str]:
        """A line per file read again from its start (replaced or rewritten while followed)."""
        return [
            f"{f.path}: {f.restarted}: read again from its start" + (f" ({f.restarts} times)" if f.restarts > 1 else "")
            for f in self.files.values()
            if f.restarts
        ]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
