"""The reader against the writer: exact rows, order, folds, shapes, distribution, caching."""

import shutil

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.format.shards import open_shards
from tfpipe.runtime.errors import TfpipeError
from tfpipe.tf import columns, passes, read
from tfpipe.tf.augment import NO_AUGMENT, Augment

CLASSES = ["a", "b", "c"]


def written_names(manifest, folder):
    import os

    from tfpipe.format import schema

    names = []
    for name in sorted(manifest.files):
        path = os.path.join(folder, name)
        names += [schema.decode_example(r.numpy())["image_name"].decode() for r in tf.data.TFRecordDataset(path)]
    return names


@pytest.fixture(scope="module")
def shards(shard_dir):
    out, labels, manifest = shard_dir
    return out, labels, written_names(manifest, out)


def multi_hot(labels):
    return [1.0 if c in labels else 0.0 for c in CLASSES]


def test_evaluation_round_trip_exact_rows_in_written_order(shards):
    out, labels, order = shards
    rows, names = [], []
    for images, targets, ids in read.make_dataset(out, 16, with_ids=True):
        assert images.dtype == tf.uint8 and images.shape[1:] == (32, 32, 3)
        rows += targets.numpy().tolist()
        names += [n.decode() for n in ids.numpy()]
    assert names == order  # shards sorted by name, then record order
    assert rows == [multi_hot(labels[n]) for n in names]
    assert sum(1 for r in rows if not any(r)) == 8  # empty label lists are all-zero rows


def test_last_partial_batch_is_kept_unless_dropped(shards):
    out = shards[0]
    assert [int(x.shape[0]) for x, _ in read.make_dataset(out, 16)] == [16, 16, 8]
    assert [int(x.shape[0]) for x, _ in read.make_dataset(out, 16, drop_remainder=True)] == [16, 16]
    default_buffer = read.ReadOptions(read_buffer=None)  # TensorFlow's own read-ahead, as before issue #55
    assert [int(x.shape[0]) for x, _ in read.make_dataset(out, 16, options=default_buffer)] == [16, 16, 8]


def test_image_names_companion_matches_batches(shards):
    out, _, order = shards
    assert columns.image_names(out) == order
    assert columns.count_examples(out) == 40


@pytest.mark.parametrize(
    "augment, cache",
    [
        (Augment(mixup=0.4, cutmix=1.0, erasing=2), True),
        (Augment(crop="resized", crop_scale=(0.3, 1.0)), False),  # decode_and_crop_jpeg path
        (Augment(crop="resized"), True),  # crop of cached pixels
    ],
)
def test_training_shapes_are_static_and_dtypes_right(shards, augment, cache):
    ds = read.make_dataset(shards[0], 8, training=True, augment=augment, cache=cache)
    images_spec, targets_spec = ds.element_spec
    assert images_spec.shape == (8, 32, 32, 3) and images_spec.dtype == tf.uint8
    assert targets_spec.shape == (8, 3) and targets_spec.dtype == tf.float32
    for images, targets in ds.take(6):  # repeats past one epoch (40 records = 5 batches)
        assert images.shape == (8, 32, 32, 3)
        t = targets.numpy()
        assert np.all((t >= 0) & (t <= 1))


@pytest.mark.parametrize("cache", [True, False])
def test_training_epoch_sees_every_record_once(shards, cache):
    out, labels, _ = shards
    ds = read.make_dataset(out, 1, training=True, with_ids=True, augment=NO_AUGMENT, cache=cache, seed=3)
    first_epoch = [(ids.numpy()[0].decode(), t.numpy()[0].tolist()) for _, t, ids in ds.take(40)]
    assert sorted(n for n, _ in first_epoch) == sorted(labels)
    assert all(t == multi_hot(labels[n]) for n, t in first_epoch)
    assert [n for n, _ in first_epoch] != sorted(labels)  # shuffled


def test_seeded_training_is_reproducible(shards):
    def first_batches(seed):
        ds = read.make_dataset(shards[0], 8, training=True, seed=seed, augment=Augment(erasing=1, mixup=0.2))
        return [(x.numpy(), y.numpy()) for x, y in ds.take(3)]

    a, b, c = first_batches(7), first_batches(7), first_batches(8)
    assert all(np.array_equal(x1, x2) and np.array_equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not all(np.array_equal(x1, x2) for (x1, _), (x2, _) in zip(a, c))


def test_folds_select_disjoint_shards_covering_everything(shards):
    out, labels, _ = shards
    train_folds, val_folds = read.fold_split(out, 2)
    assert train_folds == [0, 1, 3] and val_folds == [2]
    val = columns.image_names(out, folds=val_folds)
    train = columns.image_names(out, folds=train_folds)
    assert not set(val) & set(train) and sorted(val + train) == sorted(labels)
    assert columns.count_examples(out, val_folds) == len(val)
    with pytest.raises(TfpipeError, match="fold 9"):
        read.fold_split(out, 9)


def test_resize_in_pipeline_and_cache_give_same_pixels(shards):
    out = shards[0]
    plain = np.concatenate([x.numpy() for x, _ in read.make_dataset(out, 16, image_size=24, cache=False)])
    cached_ds = read.make_dataset(out, 16, image_size=24, cache=True)
    first = np.concatenate([x.numpy() for x, _ in cached_ds])
    second = np.concatenate([x.numpy() for x, _ in cached_ds])  # served from the cache
    assert plain.shape == (40, 24, 24, 3)
    assert np.array_equal(plain, first) and np.array_equal(first, second)


def foreign(out, folder):
    """The shard files of ``out`` copied where no manifest is (shards another tool wrote), in written order."""
    folder.mkdir()
    return [shutil.copy(f, folder) for f in open_shards(out).files]


def test_single_label_modes(shards, tmp_path):
    """On files without a manifest (no claim to check) the modes take each record's first label; on this
    multi-label folder itself (or a glob or list of its files) they are refused (tests/test_contracts.py)."""
    out, labels, order = shards
    files = foreign(out, tmp_path / "foreign")
    _, ids = next(iter(read.make_dataset(files, 40, label_mode="class_id", num_classes=3, image_size=32)))
    expected = [CLASSES.index(labels[n][0]) if labels[n] else -1 for n in order]
    assert ids.dtype == tf.int32 and ids.numpy().tolist() == expected
    _, one_hot = next(iter(read.make_dataset(files, 40, label_mode="one_hot", num_classes=3, image_size=32)))
    rows = [[1.0 if c == e else 0.0 for c in range(len(CLASSES))] for e in expected]  # no label: a zero row
    assert -1 in expected and one_hot.numpy().tolist() == rows


def test_class_count_must_agree_with_the_shards(shards, tmp_path):
    """Fewer classes than the records hold would drop labels (tf.one_hot zeroes them): refused, never silent."""
    out = shards[0]
    with pytest.raises(TfpipeError, match="num_classes=2, but the shards hold 3 classes"):
        read.make_dataset(out, 8, num_classes=2)
    files = foreign(out, tmp_path / "foreign")  # no manifest to compare with: the pipeline itself stops
    with pytest.raises(tf.errors.InvalidArgumentError, match="class index >= num_classes=2"):
        list(read.make_dataset(files, 8, num_classes=2, image_size=32))


def test_distributed_on_eight_virtual_replicas_covers_each_record_once(shards):
    out, labels, _ = shards
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(8)])
    global_batch = 8 * 3  # 40 records: the last global batch is partial

    def dataset_fn(ctx):
        return read.make_dataset(out, ctx.get_per_replica_batch_size(global_batch), with_ids=True, input_context=ctx)

    seen = []
    for _, _, ids in strategy.distribute_datasets_from_function(dataset_fn):
        for local in strategy.experimental_local_results(ids):
            seen += [n.decode() for n in local.numpy()]
    assert sorted(seen) == sorted(labels)


@pytest.mark.parametrize("pipelines", [3, 16])  # fewer and more input pipelines than the 8 files
@pytest.mark.parametrize("training", [False, True])
def test_input_pipelines_read_disjoint_complete_parts(shards, pipelines, training):
    out, labels, _ = shards
    parts = []
    for i in range(pipelines):
        ctx = tf.distribute.InputContext(
            num_input_pipelines=pipelines, input_pipeline_id=i, num_replicas_in_sync=pipelines
        )
        files, by_record = passes.shard_for_input(open_shards(out).files, ctx)
        assert by_record == (pipelines > 8)
        ds = read.make_dataset(out, 1, training=training, with_ids=True, input_context=ctx, augment=NO_AUGMENT)
        n = (
            sum(1 for _ in tf.data.TFRecordDataset(files).shard(pipelines, i))
            if by_record
            else columns.count_examples(files)
        )
        parts.append([ids.numpy()[0].decode() for _, _, ids in ds.take(n)])
    flat = [n for part in parts for n in part]
    assert len(flat) == len(set(flat)) == 40 and set(flat) == set(labels)


def test_foreign_files_need_classes_and_size(shards, tmp_path):
    foreign(shards[0], tmp_path / "foreign")
    pattern = str(tmp_path / "foreign" / "*.tfrec")
    with pytest.raises(TfpipeError, match="num_classes"):
        read.make_dataset(pattern, 4, image_size=32)
    with pytest.raises(TfpipeError, match="image_size"):
        read.make_dataset(pattern, 4, num_classes=3)
    images, _ = next(iter(read.make_dataset(pattern, 4, image_size=32, num_classes=3)))
    assert images.shape == (4, 32, 32, 3)


def test_reads_from_ram_filesystem(shards):
    out = shards[0]
    remote = "ram://bucket/read-test"
    tf.io.gfile.makedirs(remote)
    for name in tf.io.gfile.listdir(out):
        tf.io.gfile.copy(f"{out}/{name}", f"{remote}/{name}", overwrite=True)
    assert columns.image_names(remote) == columns.image_names(out)
    x, _ = next(iter(read.make_dataset(remote, 4, training=True)))
    assert x.shape == (4, 32, 32, 3)


def test_the_readme_snippet_for_canonical_kaggle_readers_gives_multi_hot_batches(shard_dir):
    """The docs' two lines for the usual notebook reader: without them .batch() fails on our variable-length
    targets; with them the batches equal make_dataset's."""
    from tests.readme_cells import NOTEBOOK_PAGE, fenced_blocks

    (snippet,) = fenced_blocks(NOTEBOOK_PAGE, "canonical")
    namespace = {"GCS_PATH": shard_dir[0]}
    exec(snippet, namespace)
    images, labels = [np.concatenate(parts) for parts in zip(*[(i.numpy(), t.numpy()) for i, t in namespace["ds"]])]
    expected_images, expected = [
        np.concatenate(parts)
        for parts in zip(*[(i.numpy(), t.numpy()) for i, t in read.make_dataset(shard_dir[0], 16)])
    ]
    np.testing.assert_array_equal(labels, expected)
    np.testing.assert_array_equal(images, expected_images)
    assert labels.sum(1).min() == 0 and labels.sum(1).max() == 3  # empty lists and three labels both present
    without = snippet.replace('tf.reduce_sum(tf.one_hot(example["target"], NUM_CLASSES), axis=0)', 'example["target"]')
    assert without != snippet
    namespace = {"GCS_PATH": shard_dir[0]}
    exec(without, namespace)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Cannot add tensor to the batch"):
        list(namespace["ds"])


def test_make_dataset_is_a_column_of_public_stages(shard_dir):
    """The stages, composed by hand, give what make_dataset gives; a stage of one's own fits between them."""
    folder = shard_dir[0]
    shards = open_shards(folder, [1, 2])
    parser = read.Parser.for_shards(shards)
    assert (parser.image_size, parser.num_classes, parser.label_mode) == (32, 3, "multi_hot")
    ds = read.read_in_order(shards)
    ds = read.evaluation_batches(ds, parser, 8)
    ds = ds.map(lambda b: dict(b, image=255 - b["image"]))  # one's own step, on named tensors
    ds = read.as_tuples(ds, ids=True)
    staged = [(x.numpy(), y.numpy(), i.numpy()) for x, y, i in ds]
    whole = [(x.numpy(), y.numpy(), i.numpy()) for x, y, i in read.make_dataset(folder, 8, folds=[1, 2], with_ids=True)]
    assert len(staged) == len(whole) > 1
    for (xs, ys, ids), (xw, yw, idw) in zip(staged, whole):
        assert np.array_equal(xs, 255 - xw) and np.array_equal(ys, yw) and list(ids) == list(idw)
    train = read.read_shuffled(shards, seed=1, deterministic=True)
    train = read.training_batches(train, parser, 4, augment=NO_AUGMENT, seed=1, deterministic=True)
    images, targets = next(iter(read.as_tuples(train)))
    assert images.shape == (4, 32, 32, 3) and images.dtype == tf.uint8 and targets.shape == (4, 3)
    padded = read.pad_to_replicas(read.evaluation_batches(read.read_in_order(shards), parser, 7), 7, shards)
    weights = np.concatenate([w.numpy() for _, _, w in read.as_tuples(padded, weights=True)])
    assert weights.sum() == shards.num_examples and len(weights) % 7 == 0


def test_parser_for_shards_checks_what_is_asked_against_the_manifest(shard_dir):
    shards = open_shards(shard_dir[0])
    with pytest.raises(TfpipeError, match="label_mode"):
        read.Parser.for_shards(shards, label_mode="softmax")
    with pytest.raises(TfpipeError, match="label_mode='multi_hot'"):  # multi-label shards: one-hot drops labels
        read.Parser.for_shards(shards, label_mode="one_hot")
    assert read.Parser.for_shards(shards, image_size=24).stored_size == 32


def test_pad_to_replicas_rounds_up_whatever_the_stream_holds(shard_dir):
    """Every replica of 8 gets a batch on the last step even when a step of one's own (take) shortened the stream."""
    shards = open_shards(shard_dir[0])
    parser = read.Parser.for_shards(shards)
    ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
    for take in (9, 16, 40):
        ds = read.evaluation_batches(read.read_in_order(shards).take(take), parser, 2)
        weights = [w.numpy() for _, _, w in read.as_tuples(read.pad_to_replicas(ds, 2, shards, ctx), weights=True)]
        assert len(weights) % 8 == 0 and len(weights) >= -(-take // 2) and np.concatenate(weights).sum() == take
    with pytest.raises(TfpipeError, match="no weight"):
        read.as_tuples(read.evaluation_batches(read.read_in_order(shards), parser, 2), weights=True)
    with pytest.raises(TfpipeError, match="pad_batches is for evaluation"):
        read.make_dataset(shard_dir[0], 4, training=True, pad_batches=True)
    with pytest.raises(TfpipeError, match="cache must be"):
        read.make_dataset(shard_dir[0], 4, cache="off")
