"""TFRecord framing without TensorFlow: writing local files, and reading (for the PyTorch reader).

Each record is: length (uint64, little-endian), masked CRC-32C of the length,
the data, masked CRC-32C of the data — the format of
``tensorflow/core/lib/io/record_writer.cc``. Byte-identical to
``tf.io.TFRecordWriter`` (tested). Remote paths use TensorFlow's writer.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Protocol

import google_crc32c

from tfpipe import fs

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
        from tfpipe.deps import require

        return require("tensorflow").io.TFRecordWriter(path)
    return LocalRecordWriter(path)


class CorruptRecord(Exception):
    """A TFRecord file whose framing or checksums are wrong (the message names the file and offset)."""


def read_records(path: str) -> Iterator[bytes]:
    """Yields the payload of every record of a TFRecord file, checking both CRCs (like TensorFlow's reader).

    Raises ``CorruptRecord`` naming ``path`` and the byte offset on a truncated
    file or a checksum mismatch.
    """
    with fs.open(path, "rb") as f:
        offset = 0
        while True:
            header = f.read(12)
            if not header:
                return
            if len(header) < 12:
                raise CorruptRecord(f"{path}: truncated record header at byte {offset}")
            (length,), (length_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
            if masked_crc(header[:8]) != length_crc:
                raise CorruptRecord(f"{path}: corrupt record length at byte {offset}")
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                raise CorruptRecord(f"{path}: truncated record at byte {offset}")
            if masked_crc(data) != struct.unpack("<I", footer)[0]:
                raise CorruptRecord(f"{path}: corrupt record data at byte {offset}")
            yield data
            offset += 16 + length
