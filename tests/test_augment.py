"""Each augmentation, eagerly and inside Dataset.map (they must agree), with targets mixed correctly."""
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import augment as A

SEED = tf.constant([3, 4], tf.int64)


def image(size=16, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, 256, (size, size, 3)), tf.uint8)


def in_dataset(fn, *args):
    """Runs fn(*args) inside a tf.data map (graph mode), returns the result."""
    return next(iter(tf.data.Dataset.from_tensors(args).map(fn)))


IMAGE_OPS = {
    "flip": A.flip,
    "pad_crop": A.make_pad_crop(4),
    "resized_crop": A.make_resized_crop(16, (0.3, 1.0), (0.75, 1.33)),
    "colour_jitter": A.make_colour_jitter(0.2, 0.2, 0.2),
    "random_erasing": A.make_random_erasing(1.0),
}
FLOAT_OPS = {"colour_jitter", "random_erasing"}


def seed(i):
    return tf.constant([i, 7], tf.int64)


@pytest.mark.parametrize("name", sorted(IMAGE_OPS))
def test_image_op_eager_equals_dataset_map(name):
    op = IMAGE_OPS[name]
    x = image()
    if name in FLOAT_OPS:
        x = tf.cast(x, tf.float32)
    outputs = [op(x, seed(i)) for i in range(8)]
    for i, eager in enumerate(outputs):
        assert eager.shape == x.shape and eager.dtype == x.dtype
        np.testing.assert_allclose(eager.numpy(), in_dataset(op, x, seed(i)).numpy(), atol=1e-3)
    assert any(not np.array_equal(o.numpy(), x.numpy()) for o in outputs)  # it does something


def test_flip_is_identity_or_mirror():
    x = image().numpy()
    outs = [A.flip(tf.constant(x), seed(i)).numpy() for i in range(12)]
    assert all(np.array_equal(o, x) or np.array_equal(o, x[:, ::-1]) for o in outs)
    assert any(np.array_equal(o, x) for o in outs) and any(np.array_equal(o, x[:, ::-1]) for o in outs)


def test_pad_crop_is_a_shifted_window_of_the_zero_padded_image():
    x = image().numpy()
    padded = np.pad(x, [(4, 4), (4, 4), (0, 0)])
    offsets = set()
    for i in range(8):
        out = A.make_pad_crop(4)(tf.constant(x), seed(i)).numpy()
        hits = [(dy, dx) for dy in range(9) for dx in range(9) if np.array_equal(out, padded[dy:dy + 16, dx:dx + 16])]
        assert hits
        offsets.add(hits[0])
    assert len(offsets) > 1


def test_random_erasing_changes_one_rectangle():
    x = tf.zeros([32, 32, 3])
    for i in range(4):
        changed = np.any(A.make_random_erasing(1.0)(x, seed(i)).numpy() != 0, axis=2)
        rows, cols = np.where(changed)
        assert changed.sum() > 0
        assert changed[rows.min():rows.max() + 1, cols.min():cols.max() + 1].mean() > 0.95  # a filled box
    assert not A.make_random_erasing(0.0)(x, SEED).numpy().any()


def test_colour_jitter_stays_in_range_and_varies():
    x = tf.fill([4, 4, 3], 128.0)
    outs = [A.make_colour_jitter(0.3, 0.0, 0.0)(x, seed(i)).numpy() for i in range(6)]
    assert all(o.min() >= 0 and o.max() <= 255 for o in outs)
    assert len({round(float(o[0, 0, 0]), 3) for o in outs}) > 1


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
    geometric, photometric = A.image_ops(A.Augment(erasing=2), 16)
    assert len(geometric) == 2 and len(photometric) == 3
    out = A.augment_image(image(), SEED, geometric, photometric)
    graph = in_dataset(lambda x, s: A.augment_image(x, s, geometric, photometric), image(), SEED)
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
