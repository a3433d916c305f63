"""TFRecord framing without TensorFlow: writing local files, and reading (for the PyTorch reader).

Each record is: length (uint64, little-endian), masked CRC-32C of the length,
the data, masked CRC-32C of the data — the format of
``tensorflow/core/lib/io/record_writer.cc``. Byte-identical to
``tf.io.TFRecordWriter`` (tested). Remote paths use TensorFlow's writer.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from typing import IO, Any, Protocol

import google_crc32c

from tfpipe.runtime import fs

MASK_DELTA = 0xA282EAD8


class RecordSink(Protocol):
    """What ``RecordWriter`` returns: ``LocalRecordWriter`` or ``tf.io.TFRecordWriter``."""

    def write(self, record: bytes) -> None: ...

    def close(self) -> None: ...


def masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def _header(length: int) -> bytes:
    size = struct.pack("<Q", length)
    return size + struct.pack("<I", masked_crc(size))


class LocalRecordWriter:
    """Writes serialized records to a local TFRecord file, framing each one as TensorFlow does."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "wb")

    def write(self, record: bytes) -> None:
        self._file.write(_header(len(record)))
        self._file.write(record)  # written as is: no copy of the (possibly large) record
        self._file.write(struct.pack("<I", masked_crc(record)))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LocalRecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def RecordWriter(path: str) -> RecordSink:
    """A TFRecord writer for ``path``: ``tf.io.TFRecordWriter`` for remote paths, else ``LocalRecordWriter``."""
    if fs.is_remote(path):
        from tfpipe.runtime.deps import require

        return require("tensorflow").io.TFRecordWriter(path)
    return LocalRecordWriter(path)


class CorruptRecord(Exception):
    """A TFRecord file whose framing or checksums are wrong: ``what`` is wrong at byte ``offset`` of ``path``
    (``note``: what the bytes there look like instead); the message names all three."""

    def __init__(self, path: str, what: str = "", offset: int = -1, note: str = "") -> None:
        # one argument: the whole message (as torch rebuilds an error raised in a DataLoader worker)
        super().__init__(f"{path}: {what} at byte {offset}{note}" if what else path)
        self.path, self.what, self.offset, self.note = path, what, offset, note

    def __reduce__(self) -> tuple[type, tuple[str, str, int, str]]:  # pickled across processes whole
        return CorruptRecord, (self.path, self.what, self.offset, self.note)


def _record_length(f: IO[Any], path: str, offset: int) -> int | None:
    """Reads a record's header and checks its CRC: the length of its data, or None at the end of the file."""
    header = f.read(12)
    if not header:
        return None
    if len(header) < 12:
        raise CorruptRecord(path, "truncated record header", offset)
    (length,), (length_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
    if masked_crc(header[:8]) != length_crc:
        raise CorruptRecord(path, "corrupt record length", offset, _compressed(header, offset))
    return int(length)


# the first bytes of a GZIP or ZLIB stream: TFRecords written with ``compression_type`` (or a gzipped shard)
COMPRESSED = {b"\x1f\x8b": "GZIP", b"\x78\x01": "ZLIB", b"\x78\x5e": "ZLIB", b"\x78\x9c": "ZLIB", b"\x78\xda": "ZLIB"}


def _compressed(header: bytes, offset: int) -> str:
    """What to add to a bad first header that starts as a compressed stream does; else ""."""
    said = _compressed_words(header) if offset == 0 else None
    return f" ({said})" if said else ""


def compressed(path: str) -> str | None:
    """What to say of a file that starts as a GZIP or ZLIB stream does (by its first two bytes); else None."""
    with fs.open(path, "rb") as f:
        return _compressed_words(f.read(2))


def _compressed_words(first: bytes) -> str | None:
    kind = COMPRESSED.get(first[:2])
    return (
        f"it reads as {kind}-compressed: tfpipe reads uncompressed TFRecords -- decompress it first" if kind else None
    )


def read_records(path: str, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """Yields the payload of records ``start`` to ``stop`` (default: to the end) of a TFRecord file, checking
    both CRCs of each (like TensorFlow's reader).

    Records before ``start`` are skipped by their framing, unread. Raises ``CorruptRecord`` naming ``path`` and
    the byte offset on a truncated file or a checksum mismatch.
    """
    with fs.open(path, "rb") as f:
        offset, size = 0, _size(f) if start else 0
        for _ in range(start):  # skipped by their framing: only the headers are read
            length = _record_length(f, path, offset)
            if length is None:
                return
            _skip(f, path, offset, length, size)
            offset += 16 + length
        # the header checks of _record_length written out again: a call per record made reading 17% slower
        for _ in itertools.repeat(None) if stop is None else range(start, stop):
            header = f.read(12)
            if not header:
                return
            if len(header) < 12:
                raise CorruptRecord(path, "truncated record header", offset)
            (length,), (length_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
            if masked_crc(header[:8]) != length_crc:
                raise CorruptRecord(path, "corrupt record length", offset, _compressed(header, offset))
            data, footer = f.read(length), f.read(4)
            if len(data) < length or len(footer) < 4:
                raise CorruptRecord(path, "truncated record", offset)
            if masked_crc(data) != struct.unpack("<I", footer)[0]:
                raise CorruptRecord(path, "corrupt record data", offset)
            yield data
            offset += 16 + length


def count_records(path: str) -> int:
    """The number of records in a TFRecord file, from its framing alone (no record's data is read)."""
    count, offset = 0, 0
    with fs.open(path, "rb") as f:
        size = _size(f)
        while (length := _record_length(f, path, offset)) is not None:
            _skip(f, path, offset, length, size)
            count, offset = count + 1, offset + 16 + length
    return count


def _size(f: IO[Any]) -> int:
    f.seek(0, 2)
    size = int(f.tell())
    f.seek(0)
    return size


def _skip(f: IO[Any], path: str, offset: int, length: int, size: int) -> None:
    """Moves past the data and footer of the record at ``offset`` (its header read) without reading them."""
    if offset + 16 + length > size:
        raise CorruptRecord(path, "truncated record", offset)
    f.seek(length + 4, 1)
