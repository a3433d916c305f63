"""Image preparation: pass-through, conversions, orientation, resizing, corruption."""

import io

import cv2
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image, ImageOps

from tests.conftest import gradient_image, jpeg_bytes, save
from tfpipe.runtime.errors import TfpipeError
from tfpipe.writer.images import ImageSpec, prepare_image, reduction_factor


def decode_rgb(data):
    """Decodes stored bytes the way the reader will: TensorFlow, 3 channels."""
    return tf.io.decode_image(data, channels=3).numpy()


def test_plain_jpeg_passes_through_byte_for_byte():
    data = jpeg_bytes(gradient_image(30, 50))
    out, h, w, passed = prepare_image(data, ImageSpec(), "a.jpg")
    assert passed and out == data and (h, w) == (30, 50)


@pytest.mark.parametrize("kind", ["gray", "cmyk", "png", "rgba", "palette", "png16"])
def test_other_inputs_become_three_channel_jpeg(tmp_path, kind):
    path = save(tmp_path / ("x.png" if "png" in kind or kind in ("rgba", "palette") else "x.jpg"), kind, size=(20, 30))
    data = path.read_bytes()
    out, h, w, passed = prepare_image(data, ImageSpec(), str(path))
    assert not passed and (h, w) == (20, 30)
    with Image.open(io.BytesIO(out)) as im:
        assert im.format == "JPEG" and im.mode == "RGB"
    rgb = decode_rgb(out)
    assert rgb.shape == (20, 30, 3)
    if kind in ("png", "png16", "cmyk"):  # colour survives the conversion
        expected = gradient_image(20, 30).astype(int)
        assert np.abs(rgb.astype(int) - expected).mean() < 6


def test_alpha_is_composited_over_white(tmp_path):
    path = tmp_path / "half.png"
    rgba = np.zeros((8, 8, 4), np.uint8)  # black, 50% transparent
    rgba[..., 3] = 128
    Image.fromarray(rgba, "RGBA").save(path)
    rgb = decode_rgb(prepare_image(path.read_bytes(), ImageSpec(format="png"), "half.png")[0])
    assert np.all(np.abs(rgb.astype(int) - 127) <= 1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow(tmp_path, orientation):
    path = save(tmp_path / "o.jpg", "jpeg", size=(24, 40), orientation=orientation)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB")).astype(int)
    out, h, w, passed = prepare_image(path.read_bytes(), ImageSpec(format="png"), "o.jpg")
    assert not passed  # png output is always re-encoded
    got = decode_rgb(out).astype(int)
    assert got.shape == expected.shape and (h, w) == expected.shape[:2]
    assert np.abs(got - expected).mean() < 3


def test_orientation_is_applied_with_reduced_decoding(tmp_path):
    path = save(tmp_path / "big.jpg", "jpeg", size=(400, 800), orientation=6)  # stored landscape, shown portrait
    expected = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB").resize((32, 32), Image.BOX))
    got = decode_rgb(prepare_image(path.read_bytes(), ImageSpec(image_size=32, format="png"), "big.jpg")[0])
    assert np.abs(got.astype(int) - expected.astype(int)).mean() < 8


@pytest.mark.parametrize("fit", ["stretch", "crop", "pad"])
def test_resize_gives_square_output(fit):
    data = jpeg_bytes(gradient_image(60, 120))
    out, h, w, passed = prepare_image(data, ImageSpec(image_size=32, fit=fit), "a.jpg")
    assert (h, w) == (32, 32) and not passed
    rgb = decode_rgb(out)
    assert rgb.shape == (32, 32, 3)
    if fit == "pad":  # bars above and below
        assert rgb[0].mean() < 10 and rgb[-1].mean() < 10 and rgb[16].mean() > 40


def test_reduction_factor_keeps_enough_pixels():
    spec = ImageSpec(image_size=256)
    assert reduction_factor(2000, 1400, spec) == 4  # 1400/4 = 350 >= 256, /8 = 175 < 256
    assert reduction_factor(300, 300, spec) == 1
    assert reduction_factor(4096, 600, ImageSpec(image_size=256, fit="pad")) == 8  # longer side decides when padding
    assert reduction_factor(4000, 4000, ImageSpec()) == 1  # no resize: full decode


def test_tiny_and_huge_images(tmp_path):
    tiny = jpeg_bytes(np.full((1, 1, 3), 200, np.uint8))
    assert prepare_image(tiny, ImageSpec(image_size=16), "tiny.jpg")[1:3] == (16, 16)
    huge = cv2.imencode(".jpg", np.tile(gradient_image(64, 64), (80, 120, 1)))[1].tobytes()  # 5120 x 7680
    out, h, w, _ = prepare_image(huge, ImageSpec(image_size=64), "huge.jpg")
    assert (h, w) == (64, 64) and decode_rgb(out).shape == (64, 64, 3)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not an image at all", "not a readable image"),
        (jpeg_bytes(gradient_image(40, 40))[:300], "truncated"),  # cut inside the header
        (jpeg_bytes(gradient_image(40, 40))[:-200], "truncated"),  # cut inside the scan
    ],
)
def test_corrupt_data_raises_user_error_naming_file(data, message):
    with pytest.raises(TfpipeError, match=f"(?i)^bad.jpg: .*{message}"):
        prepare_image(data, ImageSpec(image_size=16), "bad.jpg")


def test_truncated_jpeg_is_caught_even_without_resize():
    with pytest.raises(TfpipeError, match="truncated"):
        prepare_image(jpeg_bytes(gradient_image(40, 40))[:-50], ImageSpec(), "bad.jpg")
