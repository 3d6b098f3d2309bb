"""Reading a file that a user or another program put there, without hanging on it."""
from __future__ import annotations

import os
import stat
from pathlib import Path


class NotARegularFile(ValueError):
    """The path is a FIFO, a device, a folder or larger than allowed; the message says which."""


def read_regular_file(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, opened without blocking and checked before it is read: a FIFO would
    wait for a writer forever, a device might never end. Raises OSError when it cannot be opened,
    NotARegularFile when it is not a regular file or holds more than `max_bytes`."""
    fd = os.open(Path(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:  # owns fd from here on
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise NotARegularFile(f"{path} is {info.st_size:,} bytes, more than {max_bytes:,}")
        return handle.read() if max_bytes is None else handle.read(max_bytes + 1)
