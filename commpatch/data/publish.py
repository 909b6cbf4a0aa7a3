"""How commpatch writes a file (a log export, a page, a trace, a plot): under a temporary name
created exclusively, never through a link, which then takes its name; readers never see a file
half written, and on any error the temporary file is removed."""

from __future__ import annotations

import os


def publish(path: str, fill, exclusive: bool = False) -> str:
    """``fill(f)`` writes the file (``f``: binary) under the temporary name, which then takes the
    name ``path`` (a link there is replaced, its target left alone); ``exclusive`` refuses to
    replace an existing file (FileExistsError). Missing directories are created. Returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as f:
            fill(f)
        if exclusive:
            os.link(tmp, path)  # fails if the name is taken: nothing is replaced
        else:
            os.replace(tmp, path)  # readers never see a half-written file
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path


def write_bytes(data: bytes, path: str, exclusive: bool = False) -> str:
    """``data`` to ``path`` (``publish``)."""
    return publish(path, lambda f: f.write(data), exclusive)
