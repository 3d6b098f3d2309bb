"""Reading a file that a user or another program put there, without hanging on it."""
from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


class NotARegularFile(ValueError):
    """The path is a FIFO, a device, a folder or larger than allowed; the message says which."""


@contextmanager
def open_regular_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """`path` opened for reading in binary, without blocking, and checked before anything is read:
    a FIFO would wait for a writer forever, a device might never end. Raises OSError when it
    cannot be opened, NotARegularFile when it is not a regular file."""
    fd = os.open(Path(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:  # owns fd from here on
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        yield handle


def read_regular_file(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, opened as open_regular_file does. Raises OSError when it cannot be
    opened, NotARegularFile when it is not a regular file or holds more than `max_bytes`."""
    with open_regular_file(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise NotARegularFile(f"{path} is {size:,} bytes, more than {max_bytes:,}")
        return handle.read() if max_bytes is None else handle.read(max_bytes + 1)
