"""Image read -> decode -> orient -> resize -> encode, with OpenCV and Pillow.

Runs in the writer's DataLoader workers, so nothing here imports TensorFlow.
Pillow reads only the header (format, mode, size, EXIF orientation) to decide
what to do; OpenCV does the decoding (with DCT-domain downscaling through
``IMREAD_REDUCED_COLOR_{2,4,8}`` when the target is much smaller), resizing
and encoding.

A source file is read bounded (``read_bounded``, opened by ``tfpipe.writer.encode``):
its size is checked against ``ImageSpec.max_bytes`` before it is opened, a file
above 4 MiB has its header read and its declared pixels checked against
``ImageSpec.max_pixels`` before the rest is read, and no more than
``max_bytes`` is ever read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Iterator
from typing import IO, TypeAlias

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tfpipe.runtime.errors import TfpipeError, check_count, option

FITS = ("stretch", "crop", "pad")
FORMATS = ("jpeg", "png")
JPEG_FORMATS = ("JPEG", "MPO")  # MPO: the multi-picture JPEG some phones write; its first picture is a JPEG
EXIF_ORIENTATION = 0x0112
JPEG_MAX_SIDE = 65535  # the JPEG format stores each side in 16 bits
READ_CHUNK = 1 << 20  # reads of a file that grew after its size was taken
# Files up to this size are read whole before their header is parsed (from memory: under half the time of reading the
# header from the file and then the file again, a share of a JPEG's pass-through); larger ones header first.
WHOLE_READ_BYTES = 4 << 20
PAD_VALUE = 0  # colour of the bars added by fit="pad"
ALPHA_BACKGROUND = 255  # transparent pixels are composited over white
_REDUCED = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}
# ``read_header``'s answer: (format, mode, (width, height), EXIF orientation 1-8); format is Pillow's (None if unknown).
ImageHeader: TypeAlias = tuple[str | None, str, tuple[int, int], int]


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """How stored images are made, and which sources are refused. Checked when made: a size, quality or limit
    that is not a whole number in range, or an unknown fit or format, is a ``TfpipeError`` before any work.

    Attributes:
      image_size: side of the square output in pixels (a whole number >= 1), or None to keep the source size
        (JPEG sources that need no conversion are then copied byte for byte).
      fit: how a non-square source becomes square: "stretch" (resize both sides,
        keeps everything in view), "crop" (shorter side to ``size``, centre crop)
        or "pad" (longer side to ``size``, pad the rest). A degenerate source (1 x N) is
        fitted like any other.
      format: "jpeg" or "png". JPEG holds at most 65535 pixels per side: a longer source
        without ``image_size`` is refused (store it as PNG, or resize it).
      quality: JPEG quality, 1-100.
      max_pixels: sources whose header declares more pixels (width x height) are refused
        before decoding, and files above 4 MiB before more than their header is read (a 100 MP
        PNG needs 300 MB per worker; such files are usually scans or mistakes). On the command
        line ``--max-pixels`` in megapixels.
      max_bytes: source files larger than this are refused before they are opened (the default,
        1 GB, holds any 100 MP image, even 16-bit RGBA without compression); at most this much
        of a file is ever read. On the command line ``--max-bytes`` in megabytes.
    """

    image_size: int | None = None
    fit: str = "stretch"
    format: str = "jpeg"
    quality: int = 95
    max_pixels: int = 100_000_000
    max_bytes: int = 1_000_000_000

    def __post_init__(self) -> None:
        # Checked here, so the Python API and the command line refuse the same values before any worker starts.
        check_count(
            1, image_size=self.image_size, quality=self.quality, max_pixels=self.max_pixels, max_bytes=self.max_bytes
        )
        if self.quality > 100:
            raise TfpipeError(f"{option('quality')} must be in 1..100 (got {self.quality})")
        for name, value, known in (("fit", self.fit, FITS), ("format", self.format, FORMATS)):
            if value not in known:
                raise TfpipeError(f"{option(name)} must be one of {', '.join(known)} (got {value!r})")
        for name in ("image_size", "quality", "max_pixels", "max_bytes"):  # NumPy integers -> int: JSON takes them
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))


def from_millions(value: float, name: str) -> int:
    """A limit given in millions on the command line (``--max-pixels 100`` is 100 MP, ``--max-bytes 1000`` is
    1000 MB) as a whole number for ``ImageSpec``. NaN, infinity, zero or less is a ``TfpipeError`` (``int(nan)``
    would be a traceback, ``-1`` a limit nothing passes)."""
    if not (math.isfinite(value) and value > 0):
        raise TfpipeError(f"{option(name)} must be a positive, finite number (got {value})")
    return max(1, round(value * 1e6))


@contextlib.contextmanager
def _pillow_size_limit_lifted() -> Iterator[None]:
    """Lifts Pillow's decompression-bomb limit while we read a header (our ``max_pixels`` decides, before any
    decoding) and puts the caller's limit back afterwards: the process's own setting is never left changed."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def read_header(source: bytes | bytearray | memoryview | IO[bytes], name: str) -> ImageHeader:
    """Returns (format, mode, (width, height), orientation) from the file header.

    ``source`` is the file's bytes or an open binary file: Pillow then reads only what the format's header needs
    (a JPEG up to its first scan, 1 kB to a few hundred kB with large EXIF or ICC segments; a PNG its
    chunks before the pixels; GIF and BMP under 1 kB; a TIFF its first directory, wherever it is, often at the
    end; a WebP the whole file). No fixed prefix would do: a TIFF's directory and a WebP's header need the end.
    """
    try:
        fp = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
        with _pillow_size_limit_lifted(), Image.open(fp) as im:
            if im.format == "PNG":  # Pillow's getexif() on a PNG decodes all pixels to look for a late eXIf chunk
                exif = Image.Exif()
                if "exif" in im.info:
                    exif.load(im.info["exif"])
            else:  # JPEG, MPO (phones' multi-picture JPEG), WebP, TIFF, ...: wherever Pillow finds EXIF
                exif = im.getexif()
            orientation = exif.get(EXIF_ORIENTATION, 1)
            return im.format, im.mode, im.size, orientation if orientation in range(1, 9) else 1
    except UnidentifiedImageError:  # also a header that declares a zero width or height
        raise TfpipeError(f"{name}: not a readable image (unknown format or invalid header)") from None
    except Exception as e:  # Pillow raises many types for unreadable data
        raise TfpipeError(f"{name}: not a readable image ({type(e).__name__}: {e})") from None


def check_header(header: ImageHeader, spec: ImageSpec, name: str) -> None:
    """Refuses a source whose header declares no pixels, or more than ``spec.max_pixels``."""
    width, height = header[2]
    if width == 0 or height == 0:
        raise TfpipeError(f"{name}: image has zero size {width}x{height}")
    if width * height > spec.max_pixels:
        raise TfpipeError(
            f"{name}: {width}x{height} is {_millions(width * height)} MP, above the "
            f"{_millions(spec.max_pixels)} MP limit (raise --max-pixels / ImageSpec.max_pixels to "
            "write it, or skip bad images: --skip-bad / skip_bad=True)"
        )


def check_file_size(nbytes: int, spec: ImageSpec, name: str) -> int:
    """Refuses a source file larger than ``spec.max_bytes``; returns ``nbytes``."""
    if nbytes > spec.max_bytes:
        raise TfpipeError(
            f"{name}: the file is {_millions(nbytes)} MB, above the {_millions(spec.max_bytes)} MB limit "
            "(raise --max-bytes / ImageSpec.max_bytes to write it, or skip bad images: --skip-bad / "
            "skip_bad=True)"
        )
    return nbytes


def _millions(n: float) -> str:
    return f"{n / 1e6:,.6g}"  # 3,221.23 MB; 0.12 MP; 200 MP


def read_bounded(f: IO[bytes], size: int, spec: ImageSpec, name: str) -> tuple[bytes, ImageHeader]:
    """(bytes, header) of an open, seekable image file of ``size`` bytes (as its stat said), checked against
    ``spec``'s limits: never more than ``spec.max_bytes`` is read (a file that grew past it since its size was
    taken is refused too), and a file above ``WHOLE_READ_BYTES`` has its header read and checked first, so a
    source declaring more than ``spec.max_pixels`` is refused before the rest is read."""
    check_file_size(size, spec, name)
    header: ImageHeader | None = None
    if size > WHOLE_READ_BYTES:
        header = read_header(f, name)
        check_header(header, spec, name)
        f.seek(0)
    data = _read_at_most(f, spec.max_bytes + 1, size)
    check_file_size(len(data), spec, name)
    if header is None:
        header = read_header(data, name)
        check_header(header, spec, name)
    return data, header


def _read_at_most(f: IO[bytes], limit: int, expected: int) -> bytes:
    """Up to ``limit`` bytes to the end of ``f``: first the ``expected`` size and one byte more in one read
    (``read(n)`` allocates ``n`` at once, so never ``read(limit)``), then, if that byte came (the file grew), the
    rest in chunks."""
    chunks, total, want = [], 0, expected + 1
    while total < limit:
        want = min(want, limit - total)
        chunk = f.read(want)
        if not chunk:  # the end (an unbuffered read may return less than asked before it: 2 GB at most on Linux)
            break
        chunks.append(chunk)
        total += len(chunk)
        if len(chunk) < want and total >= expected:  # short at the expected size: the end, without another read
            break
        want = READ_CHUNK
    return b"".join(chunks)  # one chunk: the same object, no copy


def jpeg_is_complete(data: bytes) -> bool:
    """True when the JPEG has an end-of-image marker after its last scan.

    Truncated downloads are the common corruption; they lack that marker.
    (Inside entropy-coded data 0xFF is always stuffed, so the markers cannot
    appear by accident.)
    """
    if data[:2] != b"\xff\xd8":
        return False
    first_scan = _first_scan(data)
    if first_scan is None:  # unusual header layout: the slower whole-file check
        return data.rfind(b"\xff\xd9") > data.rfind(b"\xff\xda") > 0
    # After the first scan starts, 0xFF 0xD9 can only be the end-of-image marker. Searching backwards
    # finds it in the last bytes of a complete file (a whole-file search for the last scan marker
    # would cost about a fifth of a photo's pass-through time).
    return data.rfind(b"\xff\xd9", first_scan) > first_scan


def _first_scan(data: bytes) -> int | None:
    """Offset of the first start-of-scan marker, found by walking the header segments (their lengths
    skip embedded thumbnails), or None when the layout is not the usual one."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xDA:
            return pos
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return None


def can_pass_through(fmt: str | None, mode: str, orientation: int, spec: ImageSpec) -> bool:
    """Whether the source bytes can be stored as they are."""
    return spec.image_size is None and spec.format == "jpeg" and fmt == "JPEG" and mode == "RGB" and orientation == 1


def reduction_factor(width: int, height: int, spec: ImageSpec) -> int:
    """Largest k in (1, 2, 4, 8) such that decoding at 1/k still covers the target."""
    if spec.image_size is None:
        return 1
    side = max(width, height) if spec.fit == "pad" else min(width, height)
    k = 8
    while k > 1 and side // k < spec.image_size:
        k //= 2
    return k


def orient(img: np.ndarray, orientation: int) -> np.ndarray:
    """Applies an EXIF orientation (1-8) to a decoded HxWxC array."""
    ops = {
        2: lambda a: a[:, ::-1],
        3: lambda a: a[::-1, ::-1],
        4: lambda a: a[::-1],
        5: lambda a: a.transpose(1, 0, 2),
        6: lambda a: a.transpose(1, 0, 2)[:, ::-1],
        7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],
        8: lambda a: a.transpose(1, 0, 2)[::-1],
    }
    return np.ascontiguousarray(ops[orientation](img)) if orientation in ops else img


def to_bgr8(img: np.ndarray) -> np.ndarray:
    """Converts any decoded array (gray, gray+alpha, BGR, BGRA; 8 or 16 bit) to 3-channel uint8 BGR."""
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        # OpenCV allocates the output when dst is None; its stubs require an array there.
        img = cv2.normalize(img, None, 0, 255, cv2.NORM_MINMAX).astype(np.uint8)  # type: ignore[call-overload]
    if img.ndim == 2:
        img = img[:, :, None]
    channels = img.shape[2]
    if channels in (2, 4):  # composite the alpha channel over a plain background
        alpha = img[:, :, -1:].astype(np.float32) / 255.0
        colour = img[:, :, :-1].astype(np.float32)
        img = (colour * alpha + ALPHA_BACKGROUND * (1.0 - alpha) + 0.5).astype(np.uint8)
        channels -= 1
    if channels == 1:
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    return img


def decode(
    data: bytes, fmt: str | None, size: tuple[int, int], orientation: int, spec: ImageSpec, name: str
) -> np.ndarray:
    """Decodes to uint8 BGR, upright (as Pillow's ``ImageOps.exif_transpose`` shows it), using reduced decoding
    where it is free.

    JPEG and MPO are decoded by OpenCV with its own orientation handling off and turned here. Other formats
    with an orientation are decoded by Pillow and turned by ``exif_transpose`` itself: OpenCV applies a TIFF's
    orientation whatever the flags say, and ignores it in PNG and WebP, so it cannot be trusted there.
    """
    if fmt in JPEG_FORMATS:
        k = reduction_factor(*size, spec)
        img = cv2.imdecode(np.frombuffer(data, np.uint8), _REDUCED[k] | cv2.IMREAD_IGNORE_ORIENTATION)
    elif orientation != 1:
        return to_bgr8(_decode_upright_with_pillow(data, name))
    else:  # keep alpha and 16-bit depth so that to_bgr8 converts them deliberately
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        if img is None:  # formats OpenCV reads only through the colour path (e.g. some GIFs)
            img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if img is None or img.size == 0:
        raise TfpipeError(f"{name}: image data is corrupt or truncated (could not decode)")
    return orient(to_bgr8(img), orientation)


def _decode_upright_with_pillow(data: bytes, name: str) -> np.ndarray:
    """Pillow's decode turned by its EXIF orientation, as BGR(A) or gray (to_bgr8 finishes the conversion)."""
    try:
        with _pillow_size_limit_lifted(), Image.open(io.BytesIO(data)) as im:
            upright = ImageOps.exif_transpose(im)
            if upright.mode in ("I;16", "I;16B", "I;16L", "L", "LA", "RGB", "RGBA"):
                arr = np.asarray(upright)
            else:  # palette, CMYK, YCbCr, 1-bit, ...: through RGB(A), as Pillow converts them
                arr = np.asarray(
                    upright.convert("RGBA" if "transparency" in upright.info or "A" in upright.mode else "RGB")
                )
    except Exception as e:  # Pillow raises many types for broken data
        raise TfpipeError(f"{name}: image data is corrupt or truncated ({type(e).__name__})") from None
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 2:
        arr = arr.astype(np.uint16)
    if arr.ndim == 3 and arr.shape[2] in (3, 4):
        arr = arr[:, :, [2, 1, 0, 3][: arr.shape[2]]]  # RGB(A) -> BGR(A), OpenCV's order
    return np.ascontiguousarray(arr)


def fit_to_square(img: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """Resizes an upright BGR image to ``spec.image_size`` square, per ``spec.fit``."""
    h, w = img.shape[:2]
    s = spec.image_size
    assert s is not None, "fit_to_square needs spec.image_size"
    if spec.fit == "stretch":
        return _resize(img, s, s)
    if spec.fit == "crop":  # cut the centre square first: a 1 x 70000 strip scaled up first would need GBs at 128 px
        side = min(h, w)
        top, left = (h - side) // 2, (w - side) // 2
        return _resize(np.ascontiguousarray(img[top : top + side, left : left + side]), s, s)
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    img = _resize(img, nw, nh)
    top, left = (s - nh) // 2, (s - nw) // 2
    return cv2.copyMakeBorder(img, top, s - nh - top, left, s - nw - left, cv2.BORDER_CONSTANT, value=(PAD_VALUE,) * 3)


def _resize(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """INTER_AREA where a side shrinks (each output pixel averages what it covers, so even a 70000-pixel side
    keeps its mean instead of a few sampled pixels), INTER_CUBIC where it grows (INTER_AREA is blurry there). A
    resize that shrinks one side and grows the other (a 1 x N strip) takes the two in turn."""
    h, w = img.shape[:2]
    if width < w and height > h:
        img = cv2.resize(img, (width, h), interpolation=cv2.INTER_AREA)
    elif height < h and width > w:
        img = cv2.resize(img, (w, height), interpolation=cv2.INTER_AREA)
    h, w = img.shape[:2]
    if (w, h) == (width, height):
        return img
    interp = cv2.INTER_AREA if width <= w and height <= h else cv2.INTER_CUBIC
    return cv2.resize(img, (width, height), interpolation=interp)


def encode(img: np.ndarray, spec: ImageSpec) -> bytes:
    """Encodes a BGR image as JPEG or PNG bytes."""
    if spec.format == "png":
        ok, buf = cv2.imencode(".png", img)
    else:
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, spec.quality])
    if not ok:
        raise RuntimeError(f"OpenCV failed to encode a {img.shape} image")
    return buf.tobytes()


def check_encodable(img: np.ndarray, spec: ImageSpec, name: str) -> None:
    """Refuses what the stored format cannot hold: JPEG stores at most 65535 pixels per side."""
    h, w = img.shape[:2]
    if spec.format == "jpeg" and max(h, w) > JPEG_MAX_SIDE:
        raise TfpipeError(
            f"{name}: {w}x{h} is too long for JPEG ({JPEG_MAX_SIDE} pixels per side at most); resize "
            "it (--image-size / ImageSpec.image_size) or store PNG (--format png / ImageSpec.format)"
        )


def prepare_image(
    data: bytes, spec: ImageSpec, name: str, header: ImageHeader | None = None
) -> tuple[bytes, int, int, bool]:
    """Turns a source file's bytes into stored bytes.

    Args:
      data: the file's bytes.
      spec: an ``ImageSpec``.
      name: how to call the file in error messages.
      header: ``read_header``'s answer when the caller already read and checked it (``read_bounded``).

    Returns:
      (encoded bytes, height, width, passed_through).

    Raises:
      TfpipeError: the data is not a readable, complete image, or is above a limit.
    """
    if header is None:
        check_file_size(len(data), spec, name)
        header = read_header(data, name)
        check_header(header, spec, name)
    fmt, mode, size, orientation = header
    if fmt in JPEG_FORMATS and not jpeg_is_complete(data):
        raise TfpipeError(f"{name}: JPEG data is truncated (no end-of-image marker)")
    if can_pass_through(fmt, mode, orientation, spec):
        return data, size[1], size[0], True
    img = decode(data, fmt, size, orientation, spec, name)
    if spec.image_size is not None:
        img = fit_to_square(img, spec)
    check_encodable(img, spec, name)
    return encode(img, spec), img.shape[0], img.shape[1], False
