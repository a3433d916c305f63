"""One image to one serialized record: the per-image work of every writer runner.

A leaf: it needs only the image codec (``tfpipe.writer.images``), the schema and the
file layer, so the DataLoader workers (``tfpipe.write``) and Beam's workers
(``tfpipe.writer.beam``) import it without the orchestration, pandas or TFDS.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfpipe.format import schema
from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError
from tfpipe.writer.images import ImageHeader, ImageSpec, check_file_size, prepare_image, read_bounded

if TYPE_CHECKING:
    from tfpipe.sources.source import Item


def encode_item(item: Item, target: Sequence[int] | None, spec: ImageSpec) -> tuple[bytes, None] | tuple[None, str]:
    """One image to one serialized record: read, decode, resize, encode, serialize.

    Returns (record, None), or (None, error message) for a problem with the
    user's data, so the caller applies the error policy (stop, or skip and
    report) in input order. Used by the DataLoader workers and the Beam runner.
    """
    try:
        if item.data is not None:  # e.g. from TFDS
            data, header = item.data, None
        else:
            data, header = read_source(item.path, spec)
        image, height, width, _ = prepare_image(data, spec, item.path, header=header)
    except TfpipeError as e:
        return None, str(e)
    except OSError as e:
        return None, f"{item.path}: cannot read ({e.strerror or e})"
    except Exception as e:  # tf.errors.* from tf.io.gfile for remote inputs
        if not type(e).__module__.startswith("tensorflow"):
            raise
        return None, f"{item.path}: cannot read ({type(e).__name__})"
    values: dict[str, schema.FeatureValue] = {
        schema.IMAGE: image,
        schema.IMAGE_NAME: item.name,
        schema.HEIGHT: height,
        schema.WIDTH: width,
    }
    if target is not None:
        values[schema.TARGET] = target
    return schema.encode_example(values), None


def read_source(path: str, spec: ImageSpec) -> tuple[bytes, ImageHeader]:
    """(bytes, header) of a source file, bounded: its size is checked before it is opened, its header before the
    rest is read (``tfpipe.writer.images.read_bounded``). A local path must be a regular file (links followed)."""
    if fs.is_remote(path):  # a bucket holds objects only: no FIFOs or devices
        size = check_file_size(fs.size(path), spec, path)
        with fs.open(path, "rb") as f:
            return read_bounded(f, size, spec, path)
    size = check_file_size(_check_regular(os.stat(path), path).st_size, spec, path)
    # Non-blocking, so that a file swapped for a FIFO since the stat cannot block the open (it then reads as
    # empty; a device swapped in is read no further than max_bytes). Reads of a regular file are not affected.
    # Unbuffered: a small file is read in one call either way, and a buffer's copy cost 12 us of a JPEG's 90 us.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb", buffering=0) as f:
        return read_bounded(f, size, spec, path)


def _check_regular(st: os.stat_result, path: str) -> os.stat_result:
    """Refuses anything but a regular file, naming what it is (and where a link points)."""
    kind = fs.not_regular(st.st_mode)
    if kind:
        target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise TfpipeError(f"{path}: is {kind}{target}, not a regular file; images must be regular files")
    return st
