"""Image read -> decode -> orient -> resize -> encode, with OpenCV and Pillow.

Runs in the writer's DataLoader workers, so nothing here imports TensorFlow.
Pillow reads only the header (format, mode, size, EXIF orientation) to decide
what to do; OpenCV does the decoding (with DCT-domain downscaling through
``IMREAD_REDUCED_COLOR_{2,4,8}`` when the target is much smaller), resizing
and encoding.
"""
import contextlib
import dataclasses
import io

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tfpipe.errors import TfpipeError, renamed

FITS = ("stretch", "crop", "pad")
FORMATS = ("jpeg", "png")
JPEG_FORMATS = ("JPEG", "MPO")  # MPO: the multi-picture JPEG some phones write; its first picture is a JPEG
EXIF_ORIENTATION = 0x0112
PAD_VALUE = 0  # colour of the bars added by fit="pad"
ALPHA_BACKGROUND = 255  # transparent pixels are composited over white
_REDUCED = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_COLOR_8}


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """How stored images are made.

    Attributes:
      image_size: side of the square output in pixels, or None to keep the source size
        (JPEG sources that need no conversion are then copied byte for byte). ``size=`` is
        its 0.1 name, still accepted with a warning.
      fit: how a non-square source becomes square: "stretch" (resize both sides,
        keeps everything in view), "crop" (shorter side to ``size``, centre crop)
        or "pad" (longer side to ``size``, pad the rest).
      format: "jpeg" or "png".
      quality: JPEG quality, 1-100.
      max_pixels: larger sources are refused before decoding (a 100 MP PNG needs
        300 MB per worker; such files are usually scans or mistakes).
    """

    image_size: int | None = None
    fit: str = "stretch"
    format: str = "jpeg"
    quality: int = 95
    max_pixels: int = 100_000_000
    size: dataclasses.InitVar[int | None] = None  # tfpipe 0.1's name of image_size

    def __post_init__(self, size):
        if size is not None:
            renamed("ImageSpec(size=...)", "ImageSpec(image_size=...)")
            object.__setattr__(self, "image_size", size)


@contextlib.contextmanager
def _pillow_size_limit_lifted():
    """Lifts Pillow's decompression-bomb limit while we read a header (our ``max_pixels`` decides, before any
    decoding) and puts the caller's limit back afterwards: the process's own setting is never left changed."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def read_header(data, name):
    """Returns (format, mode, (width, height), orientation) from the file header."""
    try:
        with _pillow_size_limit_lifted(), Image.open(io.BytesIO(data)) as im:
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


def jpeg_is_complete(data):
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
    # finds it in the last bytes of a complete file (the whole-file search for the last scan marker
    # cost 0.3 ms on a 500 kB photo: 20% of the pass-through time).
    return data.rfind(b"\xff\xd9", first_scan) > first_scan


def _first_scan(data):
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
        pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return None


def can_pass_through(fmt, mode, orientation, spec):
    """Whether the source bytes can be stored as they are."""
    return spec.image_size is None and spec.format == "jpeg" and fmt == "JPEG" and mode == "RGB" and orientation == 1


def reduction_factor(width, height, spec):
    """Largest k in (1, 2, 4, 8) such that decoding at 1/k still covers the target."""
    if spec.image_size is None:
        return 1
    side = max(width, height) if spec.fit == "pad" else min(width, height)
    k = 8
    while k > 1 and side // k < spec.image_size:
        k //= 2
    return k


def orient(img, orientation):
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


def to_bgr8(img):
    """Converts any decoded array (gray, gray+alpha, BGR, BGRA; 8 or 16 bit) to 3-channel uint8 BGR."""
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype != np.uint8:
        img = cv2.normalize(img, None, 0, 255, cv2.NORM_MINMAX).astype(np.uint8)
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


def decode(data, fmt, size, orientation, spec, name):
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


def _decode_upright_with_pillow(data, name):
    """Pillow's decode turned by its EXIF orientation, as BGR(A) or gray (to_bgr8 finishes the conversion)."""
    try:
        with _pillow_size_limit_lifted(), Image.open(io.BytesIO(data)) as im:
            im = ImageOps.exif_transpose(im)
            if im.mode in ("I;16", "I;16B", "I;16L", "L", "LA", "RGB", "RGBA"):
                arr = np.asarray(im)
            else:  # palette, CMYK, YCbCr, 1-bit, ...: through RGB(A), as Pillow converts them
                arr = np.asarray(im.convert("RGBA" if "transparency" in im.info or "A" in im.mode else "RGB"))
    except Exception as e:  # Pillow raises many types for broken data
        raise TfpipeError(f"{name}: image data is corrupt or truncated ({type(e).__name__})") from None
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 2:
        arr = arr.astype(np.uint16)
    if arr.ndim == 3 and arr.shape[2] in (3, 4):
        arr = arr[:, :, [2, 1, 0, 3][: arr.shape[2]]]  # RGB(A) -> BGR(A), OpenCV's order
    return np.ascontiguousarray(arr)


def fit_to_square(img, spec):
    """Resizes an upright BGR image to ``spec.image_size`` square, per ``spec.fit``."""
    h, w = img.shape[:2]
    s = spec.image_size
    if spec.fit == "stretch":
        return _resize(img, s, s)
    if spec.fit == "crop":
        scale = s / min(h, w)
        nh, nw = max(s, round(h * scale)), max(s, round(w * scale))
        img = _resize(img, nw, nh)
        top, left = (nh - s) // 2, (nw - s) // 2
        return img[top:top + s, left:left + s]
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    img = _resize(img, nw, nh)
    top, left = (s - nh) // 2, (s - nw) // 2
    return cv2.copyMakeBorder(img, top, s - nh - top, left, s - nw - left, cv2.BORDER_CONSTANT,
                              value=(PAD_VALUE,) * 3)


def _resize(img, width, height):
    h, w = img.shape[:2]
    if (w, h) == (width, height):
        return img
    # INTER_AREA is the right filter for shrinking; it is blurry when enlarging.
    interp = cv2.INTER_AREA if width < w and height < h else cv2.INTER_CUBIC
    return cv2.resize(img, (width, height), interpolation=interp)


def encode(img, spec):
    """Encodes a BGR image as JPEG or PNG bytes."""
    if spec.format == "png":
        ok, buf = cv2.imencode(".png", img)
    else:
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, spec.quality])
    if not ok:
        raise RuntimeError(f"OpenCV failed to encode a {img.shape} image")
    return buf.tobytes()


def prepare_image(data, spec, name):
    """Turns a source file's bytes into stored bytes.

    Args:
      data: the file's bytes.
      spec: an ``ImageSpec``.
      name: how to call the file in error messages.

    Returns:
      (encoded bytes, height, width, passed_through).

    Raises:
      TfpipeError: the data is not a readable, complete image.
    """
    fmt, mode, size, orientation = read_header(data, name)
    if size[0] == 0 or size[1] == 0:
        raise TfpipeError(f"{name}: image has zero size {size[0]}x{size[1]}")
    if size[0] * size[1] > spec.max_pixels:
        raise TfpipeError(f"{name}: {size[0]}x{size[1]} is {size[0] * size[1] / 1e6:.0f} MP, above the "
                          f"{spec.max_pixels / 1e6:g} MP limit (raise --max-pixels / ImageSpec.max_pixels to write it, or skip bad images: --skip-bad / skip_bad=True)")
    if fmt in JPEG_FORMATS and not jpeg_is_complete(data):
        raise TfpipeError(f"{name}: JPEG data is truncated (no end-of-image marker)")
    if can_pass_through(fmt, mode, orientation, spec):
        return data, size[1], size[0], True
    img = decode(data, fmt, size, orientation, spec, name)
    if spec.image_size is not None:
        img = fit_to_square(img, spec)
    return encode(img, spec), img.shape[0], img.shape[1], False
