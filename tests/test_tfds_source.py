"""TFDS as a writer source, offline: tfds.testing.mock_data stands in for the prepared dataset."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import tfpipe
from tfpipe.runtime.errors import TfpipeError
from tfpipe.sources.tfds import TfdsSource, read_tfds
from tfpipe.write import write_shards
from tfpipe.writer.images import ImageSpec


def test_cifar10_class_labels_round_trip(tmp_path):
    with tfds.testing.mock_data(num_examples=24):
        items, names, single = read_tfds(TfdsSource("cifar10"))
        manifest = write_shards(
            TfdsSource("cifar10"),
            str(tmp_path / "out"),
            spec=ImageSpec(image_size=16),
            num_shards=2,
            workers=0,
            progress=False,
        )
    assert single and names == tfds.builder("cifar10").info.features["label"].names
    assert list(manifest.classes) == names and manifest.single_label and manifest.num_examples == 24
    assert manifest.id_column == "id"
    assert all(len(item.labels) == 1 for item in items)
    expected = {item.name: names.index(item.labels[0]) for item in items}
    ds = tfpipe.make_dataset(str(tmp_path / "out"), 8, label_mode="class_id", with_ids=True)
    got = {}
    for images, class_ids, ids in ds.as_numpy_iterator():
        assert images.shape[1:] == (16, 16, 3)
        got.update({i.decode(): int(c) for i, c in zip(ids, class_ids)})
    assert got == expected


def test_unknown_dataset_and_wrong_label_key_are_clear_errors():
    with pytest.raises(TfpipeError, match="no_such_dataset"):
        read_tfds(TfdsSource("no_such_dataset"))
    with tfds.testing.mock_data(num_examples=4):
        with pytest.raises(TfpipeError, match="'image' is not a ClassLabel"):
            read_tfds(TfdsSource("cifar10", label_key="image"))


def test_unlabeled_split_has_no_targets(tmp_path):
    with tfds.testing.mock_data(num_examples=6):
        manifest = write_shards(
            TfdsSource("cifar10", split="test", labeled=False),
            str(tmp_path / "out"),
            spec=ImageSpec(image_size=8),
            split="test",
            num_shards=1,
            workers=0,
            progress=False,
        )
    assert manifest.labeled is False and manifest.num_examples == 6
    targets = tfpipe.read_targets(str(tmp_path / "out"), 10)
    assert targets.shape == (6, 10) and not np.any(targets)
