"""The PyTorch reader: TensorFlow-free framing, same records as tf.data, each record once across workers and ranks."""

import collections
import glob
import os

import numpy as np
import pytest
import tensorflow as tf
import torch

import tfpipe
import tfpipe.read
from tfpipe import schema
from tfpipe.shards import open_shards
from tfpipe.tfrecord import CorruptRecord, read_records
from tfpipe.torch import RecordDataset


def test_framing_reader_matches_tensorflow(shard_dir):
    for path in sorted(glob.glob(os.path.join(shard_dir[0], "*.tfrec"))):
        ours = list(read_records(path))
        theirs = [r.numpy() for r in tf.data.TFRecordDataset(path)]
        assert ours == theirs and ours


def test_corrupt_and_truncated_files_are_named(shard_dir, tmp_path):
    path = sorted(glob.glob(os.path.join(shard_dir[0], "*.tfrec")))[0]
    data = bytearray(open(path, "rb").read())
    flipped, cut = tmp_path / "flipped.tfrec", tmp_path / "cut.tfrec"
    data[40] ^= 0x01
    flipped.write_bytes(bytes(data))
    cut.write_bytes(open(path, "rb").read()[:-10])
    for bad, word in ((flipped, "corrupt"), (cut, "truncated")):
        with pytest.raises(CorruptRecord, match=f"{bad.name}.*{word}"):
            list(read_records(str(bad)))


def test_same_images_and_targets_as_make_dataset(shard_dir):
    folder, labels, manifest = shard_dir
    rows = list(RecordDataset(folder, with_ids=True))
    assert [name for _, _, name in rows] == tfpipe.image_names(folder)  # written order without shuffle
    targets = np.concatenate([b[1] for b in tfpipe.make_dataset(folder, 16).as_numpy_iterator()])
    encoded = [schema.decode_example(r)[schema.IMAGE] for f in open_shards(folder).files for r in read_records(f)]
    for (image, target, name), data, tf_target in zip(rows, encoded, targets):
        assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
        # the same pixels as TensorFlow's accurate IDCT (its default, INTEGER_FAST, differs by a few levels)
        tf_image = tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_ACCURATE").numpy()
        assert np.abs(image.numpy().transpose(1, 2, 0).astype(int) - tf_image).max() <= 1
        assert target.tolist() == tf_target.tolist()
        assert [manifest.classes[i] for i in np.flatnonzero(target.numpy())] == sorted(labels[name])


def names_seen(datasets):
    return collections.Counter(name for ds in datasets for _, _, name in ds)


@pytest.mark.parametrize("world_size", [2, 12])  # 2: whole shards per rank; 12 > 8 shards: every n-th record
def test_ranks_read_disjoint_complete_parts(shard_dir, world_size):
    ranks = [RecordDataset(shard_dir[0], with_ids=True, rank=r, world_size=world_size) for r in range(world_size)]
    seen = names_seen(ranks)
    assert set(seen) == set(shard_dir[1]) and set(seen.values()) == {1}


def as_list(batch):  # module level: spawned workers unpickle it
    return batch


@pytest.mark.slow
def test_dataloader_workers_see_each_record_once_per_epoch_with_shuffling(shard_dir):
    ds = RecordDataset(shard_dir[0], folds=[0, 1, 2], shuffle=True, seed=3, with_ids=True)
    # spawn: this test process runs TensorFlow threads, and a fork of it could hang
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=3, multiprocessing_context="spawn", collate_fn=as_list
    )
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        names = [name for batch in loader for _, _, name in batch]
        assert collections.Counter(names) == collections.Counter(tfpipe.image_names(shard_dir[0], folds=[0, 1, 2]))
        orders.append(names)
    assert orders[0] != orders[1]  # a new order every epoch
