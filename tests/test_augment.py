"""Each augmentation, eagerly and inside Dataset.map (they must agree), with targets mixed correctly."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.tf import augment as A

SEED = tf.constant([3, 4], tf.int64)


def image(size=16, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, 256, (size, size, 3)), tf.uint8)


def in_dataset(fn, *args):
    """Runs fn(*args) inside a tf.data map (graph mode), returns the result."""
    return next(iter(tf.data.Dataset.from_tensors(args).map(fn)))


IMAGE_OPS = {  # per image, before batching
    "resized_crop": A.make_resized_crop(16, (0.3, 1.0), (0.75, 1.33)),
    "random_erasing": A.make_random_erasing(1.0),
}
BATCH_OPS = {  # one op per batch, after batching
    "flip": A.Augment(flip=True, crop=None, brightness=0, contrast=0, saturation=0),
    "pad_crop": A.Augment(flip=False, crop="pad", pad=4, brightness=0, contrast=0, saturation=0),
    "colour": A.Augment(flip=False, crop=None, brightness=0.2, contrast=0.2, saturation=0.2),
    "all": A.Augment(pad=4),
}


def seed(i):
    return tf.constant([i, 7], tf.int64)


def batch(n=8, size=16):
    return tf.constant(np.random.default_rng(1).integers(0, 256, (n, size, size, 3)), tf.uint8)


@pytest.mark.parametrize("name", sorted(IMAGE_OPS))
def test_image_op_eager_equals_dataset_map(name):
    op = IMAGE_OPS[name]
    x = image()
    outputs = [op(x, seed(i)) for i in range(8)]
    for i, eager in enumerate(outputs):
        assert eager.shape == x.shape and eager.dtype == x.dtype
        np.testing.assert_array_equal(eager.numpy(), in_dataset(op, x, seed(i)).numpy())
    assert any(not np.array_equal(o.numpy(), x.numpy()) for o in outputs)  # it does something


@pytest.mark.parametrize("name", sorted(BATCH_OPS))
def test_batch_op_eager_equals_dataset_map_and_xla_equals_plain(name):
    aug = BATCH_OPS[name]
    xla, plain = A.make_batch_augment(aug, 16), A.make_batch_augment(dataclasses.replace(aug, jit=False), 16)
    x = batch()
    out = xla(x, SEED)
    assert out.shape == x.shape and out.dtype == tf.uint8
    assert not np.array_equal(out.numpy(), x.numpy())  # it does something
    np.testing.assert_array_equal(out.numpy(), in_dataset(xla, x, SEED).numpy())
    diff = np.abs(out.numpy().astype(int) - plain(x, SEED).numpy().astype(int))
    assert diff.max() <= 1  # XLA may fuse float ops differently: at most one step of rounding apart


def test_flip_is_identity_or_mirror_per_image():
    x = batch(n=16)
    out = A.make_batch_augment(BATCH_OPS["flip"], 16)(x, SEED).numpy()
    mirrored = [np.array_equal(o, xi[:, ::-1]) for o, xi in zip(out, x.numpy())]
    assert all(m or np.array_equal(o, xi) for m, o, xi in zip(mirrored, out, x.numpy()))
    assert any(mirrored) and not all(mirrored)  # drawn per image


def window_offsets(out, x, pad, mirror=False):
    """Offsets (dy, dx) at which ``out`` (or its mirror) is a window of the zero-padded ``x``."""
    size = x.shape[0]
    padded = np.pad(x, [(pad, pad), (pad, pad), (0, 0)])
    target = out[:, ::-1] if mirror else out
    return [
        (dy, dx)
        for dy in range(2 * pad + 1)
        for dx in range(2 * pad + 1)
        if np.array_equal(target, padded[dy : dy + size, dx : dx + size])
    ]


def test_pad_crop_is_a_shifted_window_of_the_zero_padded_image():
    x = batch(n=8).numpy()
    out = A.make_batch_augment(BATCH_OPS["pad_crop"], 16)(tf.constant(x), SEED).numpy()
    offsets = [window_offsets(o, xi, 4) for o, xi in zip(out, x)]
    assert all(offsets)
    assert len({o[0] for o in offsets}) > 1  # drawn per image


def test_pad_crop_then_flip():
    """Crop first, then mirror the crop: each output is a window, or a mirrored window, of the padded image."""
    aug = A.Augment(flip=True, crop="pad", pad=3, brightness=0, contrast=0, saturation=0)
    x = batch(n=16).numpy()
    out = A.make_batch_augment(aug, 16)(tf.constant(x), SEED).numpy()
    kinds = [bool(window_offsets(o, xi, 3, mirror=True)) for o, xi in zip(out, x)]
    assert all(k or window_offsets(o, xi, 3) for k, o, xi in zip(kinds, out, x))
    assert any(kinds) and not all(kinds)


def test_default_pad_is_an_eighth_of_the_side():
    x = batch(n=8, size=32).numpy()
    out = A.make_batch_augment(A.Augment(flip=False, brightness=0, contrast=0, saturation=0), 32)(
        tf.constant(x), SEED
    ).numpy()
    assert all(window_offsets(o, xi, 4) for o, xi in zip(out, x))


def test_random_erasing_changes_one_rectangle():
    x = tf.zeros([32, 32, 3], tf.uint8)
    for i in range(4):
        changed = np.any(A.make_random_erasing(1.0)(x, seed(i)).numpy() != 0, axis=2)
        rows, cols = np.where(changed)
        assert changed.sum() > 0
        assert changed[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].mean() > 0.95  # a filled box
    assert not A.make_random_erasing(0.0)(x, SEED).numpy().any()


def test_colour_jitter_stays_in_range_and_varies_per_image():
    x = tf.fill([6, 4, 4, 3], 128.0)
    out = A.make_colour_jitter(0.3, 0.0, 0.0)(x, SEED).numpy()
    assert out.min() >= 0 and out.max() <= 255
    assert len({round(float(o[0, 0, 0]), 3) for o in out}) > 1
    assert all(np.all(o == o[0, 0, 0]) for o in out)  # brightness shifts a whole image alike


def test_no_batch_op_when_everything_is_off():
    assert A.make_batch_augment(A.NO_AUGMENT, 16) is None


def labelled_batch(n=6, size=8, classes=6):
    """Image i is flat grey 30*i; its target is class i alone."""
    imgs = tf.constant(np.stack([np.full((size, size, 3), 30 * i) for i in range(n)]), tf.uint8)
    return imgs, tf.one_hot(tf.range(n), classes)


@pytest.mark.parametrize("run", ["eager", "dataset"])
def test_mixup_mixes_targets_like_pixels(run):
    imgs, targets = labelled_batch()
    op = A.make_mixup(0.4)
    mixed, mixed_targets = op(imgs, targets, SEED) if run == "eager" else in_dataset(op, imgs, targets, SEED)
    values = mixed.numpy()[:, 0, 0, 0].astype(float)
    expected = (mixed_targets.numpy() * 30 * np.arange(6)).sum(1)  # pixel = sum of weight * source grey
    np.testing.assert_allclose(values, expected, atol=0.51)
    np.testing.assert_allclose(mixed_targets.numpy().sum(1), 1.0, atol=1e-6)


@pytest.mark.parametrize("run", ["eager", "dataset"])
def test_cutmix_target_weights_equal_pasted_area(run):
    imgs, targets = labelled_batch(size=16)
    op = A.make_cutmix(1.0)
    mixed, mixed_targets = op(imgs, targets, SEED) if run == "eager" else in_dataset(op, imgs, targets, SEED)
    mixed, mixed_targets = mixed.numpy(), mixed_targets.numpy()
    for i in range(6):
        share = np.array([(mixed[i, :, :, 0] == 30 * j).mean() for j in range(6)])
        np.testing.assert_allclose(mixed_targets[i], share, atol=1e-6)


def test_multi_hot_targets_mix_as_weighted_sums():
    imgs = tf.zeros([2, 8, 8, 3], tf.uint8)
    targets = tf.constant([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # two labels vs an empty list
    _, mixed = A.make_mixup(0.4)(imgs, targets, SEED)
    m = mixed.numpy()
    assert np.allclose(m[:, 0], m[:, 1]) and np.all(m[:, 2] == 0) and np.all((m >= 0) & (m <= 1))


def test_augment_image_keeps_uint8_shape_eager_and_graph():
    ops = A.image_ops(A.Augment(erasing=2, crop="resized"), 16)
    assert len(ops) == 3 and A.image_ops(A.Augment(), 16) == []  # pad crop, flip, colour run per batch
    out = A.augment_image(image(), SEED, ops)
    graph = in_dataset(lambda x, s: A.augment_image(x, s, ops), image(), SEED)
    assert out.dtype == tf.uint8 and out.shape == (16, 16, 3)
    assert np.array_equal(out.numpy(), graph.numpy())


def test_crop_window_for_decode_and_crop():
    begin, size = A.crop_window(tf.constant([100, 200, 3]), (0.5, 1.0), (0.75, 1.33), SEED)
    area = int(size[0]) * int(size[1])
    assert 0.5 * 20000 * 0.95 <= area <= 20000
    assert int(begin[0]) + int(size[0]) <= 100 and int(begin[1]) + int(size[1]) <= 200


def test_batch_mix_choice():
    assert A.batch_mix(A.Augment()) is None
    imgs, targets = labelled_batch()
    out, t = A.batch_mix(A.Augment(mixup=0.2, cutmix=1.0))(imgs, targets, SEED)
    assert out.shape == imgs.shape and t.shape == targets.shape
