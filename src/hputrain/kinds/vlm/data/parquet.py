"""The rows of a Parquet file of images, each image a reference into the file (`FileSpan`), not
its bytes: the rows of a data set of many gigabytes of images are read without holding them.

datasets writes an Image column's bytes uncompressed and PLAIN-encoded (its Parquet writer's
column options: "none" compression for embedded storage, so that the Hub can deduplicate and
read single rows), so each image's bytes lie in the file as they are. While the rows are read,
each image's bytes are found in its column chunk, in order (a page header and a length prefix
apart), and checked byte for byte against the value Parquet gives; the image is then the file's
`length` bytes from `offset`, read in place (`os.pread`) when it is decoded, in the encoding
workers and in the data loader's: neither the process's heap nor its mapped pages grow with the
data set; the page cache holds what is read, as for a save_to_disk folder's memory-mapped Arrow
files (rows.SavedImage).

A column chunk that is compressed (pandas' and pyarrow's default, snappy) holds no image as it
is: its images stay bytes, as `hf_data.records` reads them. The file's size and modification
time are recorded with each reference: a file changed after its rows were read is one line
(its cache key changes with it, so the next run reads it anew).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ....errors import InputError, first_line

IMAGE_COLUMNS = ("image", "images")
"""The columns TRL's vision rows hold images in (rows.detect_image_format)."""
BATCH_ROWS = 8
"""Rows read from the file at a time: a batch's images are in memory while they are found."""
NEAR = 1 << 16
"""How far past the previous image the next one is looked for first (a page header, the
levels of a page, a length prefix)."""
SCAN = 1 << 22
"""Bytes read at a time when an image is looked for further."""


@dataclass(frozen=True)
class FileSpan:
    """An image as it lies in a file: `length` bytes from `offset`."""

    path: str
    """The file, absolute."""
    offset: int
    length: int
    size: int
    """The file's size and modification time (ns) when the span was found."""
    mtime_ns: int
    column: str
    row: int
    """The row, as errors number them (from 1)."""
    index: int | None = None
    """Its place in the row's list of images; None where the column holds one image."""

    def read(self) -> bytes:
        """The image's bytes, read in place."""
        handle = _opened(self.path, self.size, self.mtime_ns)
        data = os.pread(handle, self.length, self.offset)
        if len(data) != self.length:
            raise InputError(f"{self.path} was cut short after its rows were read: {self.describe()} "
                             "is past its end")
        return data

    def describe(self) -> str:
        at = "" if self.index is None else f"[{self.index}]"
        return f"{self.column}{at} of {self.path} row {self.row}"


@functools.lru_cache(maxsize=64)
def _opened(path: str, size: int, mtime_ns: int) -> int:
    """A read-only descriptor of `path`, once per process (a forked worker shares it: pread
    moves no file position), after checking the file is the one its rows were read from."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(f"{path}, whose images the examples refer to, cannot be opened: "
                         f"{exc.strerror}") from None
    now = os.fstat(handle)
    if (now.st_size, now.st_mtime_ns) != (size, mtime_ns):
        os.close(handle)
        raise InputError(f"{path} changed after its rows were read (its images are read in place): "
                         "run again to read it anew")
    return handle


def image_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of the Parquet file `path`, as hf_data.records gives them
    ("FILE row N", N from 1), each image of an `image` or `images` column of datasets Image
    values whose bytes lie in the file as they are a FileSpan instead of {"bytes", "path"}."""
    import pyarrow.parquet as pq

    handle = None
    try:
        # pages read as needed (a buffered stream, nothing read ahead), not a row group at once
        file = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
        columns = [c for c in IMAGE_COLUMNS if c in file.schema_arrow.names
                   and _image_kind(file.schema_arrow.field(c).type) is not None]
        handle = os.open(path, os.O_RDONLY)
        stat, number = os.fstat(handle), 0
        for group in range(file.num_row_groups):
            finders = {c: _Finder(handle, file.metadata.row_group(group), c) for c in columns}
            for batch in file.iter_batches(BATCH_ROWS, row_groups=[group]):
                rows = batch.drop_columns(columns).to_pylist()
                images = {c: _images(batch.column(c), finders[c]) for c in columns}
                for k, row in enumerate(rows):
                    number += 1
                    for column in columns:
                        row[column] = _spans(images[column][k], path, stat, column, number)
                    yield f"{path} row {number}", row
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        if isinstance(exc, InputError):
            raise
        raise InputError(f"--dataset {path} cannot be read as Parquet: {first_line(exc)}") from None
    finally:
        if handle is not None:
            os.close(handle)


def _image_kind(kind) -> str | None:
    """"one" for a datasets Image's storage (a struct of bytes and path), "list" for a list of
    them, else None."""
    import pyarrow as pa

    def image(t) -> bool:
        return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 \
            and pa.types.is_binary(t.field("bytes").type)

    if image(kind):
        return "one"
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and image(kind.value_type):
        return "list"
    return None


def _images(array, finder: _Finder) -> list:
    """Each row's value of an image column: None, one image, or a list of them; an image is
    (offset, length) where its bytes were found in the file, else its {"bytes", "path"}."""
    if _image_kind(array.type) == "one":
        return [_image(array[i], finder) for i in range(len(array))]
    values, lengths, at, found = array.flatten(), array.value_lengths().to_pylist(), 0, []
    for length in lengths:  # flatten() leaves out what a null list covers
        found.append(None if length is None else [_image(values[j], finder) for j in range(at, at + length)])
        at += length or 0
    return found


def _image(struct, finder: _Finder):
    if not struct.is_valid:
        return None
    value = struct.as_py()
    data = value.get("bytes")
    offset = finder.find(data) if data else None
    return value if offset is None else (offset, len(data))


def _spans(value, path: Path, stat, column: str, row: int):
    """`_images`' value of one row with its (offset, length) pairs as FileSpans."""
    def span(image, index):
        if not isinstance(image, tuple):
            return image
        return FileSpan(str(Path(path).resolve()), *image, stat.st_size, stat.st_mtime_ns, column,
                        row, index)

    return [span(image, k) for k, image in enumerate(value)] if isinstance(value, list) \
        else span(value, None)


class _Finder:
    """Finds each image's bytes in one row group's column chunk of images, in order."""

    def __init__(self, handle: int, group, column: str) -> None:
        self.handle, self.start, self.end = handle, 0, 0
        leaves = (f"{column}.bytes", f"{column}.list.element.bytes", f"{column}.list.item.bytes")
        for j in range(group.num_columns):
            chunk = group.column(j)
            if chunk.path_in_schema in leaves and chunk.compression == "UNCOMPRESSED":
                self.start = (chunk.dictionary_page_offset if chunk.has_dictionary_page
                              else chunk.data_page_offset)
                self.end = self.start + chunk.total_compressed_size
        self.cursor = self.start

    def find(self, data: bytes) -> int | None:
        """Where `data` lies in the chunk, checked byte for byte; None where it does not (a
        compressed chunk)."""
        if self.end <= self.start:
            return None
        head = data[:256]
        at = self._search(head, self.cursor, min(self.end, self.cursor + NEAR + len(head)))
        if at is None:  # further on, or before (a dictionary page's values come first)
            at = self._search(head, self.cursor, self.end)
            at = at if at is not None else self._search(head, self.start, self.cursor)
        while at is not None and os.pread(self.handle, len(data), at) != data:
            at = self._search(head, at + 1, self.end)
        if at is not None:
            self.cursor = at + len(data)
        return at

    def _search(self, head: bytes, start: int, end: int) -> int | None:
        """The first place in [start, end) of the file where `head` lies whole, or None."""
        while start < end:
            window = os.pread(self.handle, min(SCAN, end - start), start)
            found = window.find(head)
            if found >= 0:
                return start + found
            if len(window) < min(SCAN, end - start) or start + len(window) >= end:  # the end
                return None
            start += len(window) - len(head) + 1
        return None
