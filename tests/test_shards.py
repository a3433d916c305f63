"""The shard-folder core: one resolver behind every reader (same files, same refusals), the shard count, the
TensorFlow-free CRC check, and the one multi-hot conversion."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tfpipe
from tfpipe.format import schema
from tfpipe.format.shards import open_shards, verify
from tfpipe.format.tfrecord import LocalRecordWriter
from tfpipe.inspect import inspect_shards
from tfpipe.runtime.errors import TfpipeError
from tfpipe.torch.dataset import RecordDataset
from tfpipe.writer.job import SHARD_MULTIPLE, TARGET_SHARD_BYTES, num_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readers():
    """Every way to open ``records``, as (name, function(records, folds))."""
    return [
        ("make_dataset", lambda r, folds: tfpipe.make_dataset(r, 4, folds=folds, num_classes=3, image_size=32)),
        ("RecordDataset", lambda r, folds: RecordDataset(r, folds=folds, num_classes=3)),
        ("count_examples", lambda r, folds: tfpipe.count_examples(r, folds)),
        ("image_names", lambda r, folds: tfpipe.image_names(r, folds)),
    ]


@pytest.mark.parametrize("name,open_with", readers())
def test_every_reader_refuses_the_same_bad_folds(shard_dir, name, open_with, tmp_path):
    folder, _, _ = shard_dir
    with pytest.raises(TfpipeError) as outside:
        open_with(folder, [9])
    assert str(outside.value) == f"{folder}: folds [9] outside 0..3 (written with 4 folds)"
    files = list(open_shards(folder).files)  # a list of the folder's files: its manifest's folds
    assert open_shards(files, [1]).files == open_shards(folder, [1]).files
    copies = [shutil.copy(f, tmp_path) for f in files]  # the same files where no manifest is: no folds to pick
    with pytest.raises(TfpipeError) as unfolded:
        open_with(copies, [1])
    assert "were asked for, but these shards were written without folds" in str(unfolded.value)


@pytest.mark.parametrize("name,open_with", readers())
def test_every_reader_sees_the_same_files_per_fold(shard_dir, name, open_with):
    folder, _, manifest = shard_dir
    expected = sum(s.count for s in manifest.shards if s.fold in (1, 2))
    if name == "count_examples":
        assert open_with(folder, [1, 2]) == expected
    elif name == "RecordDataset":
        assert sum(1 for _ in open_with(folder, [1, 2])) == expected
    elif name == "image_names":
        assert len(open_with(folder, [1, 2])) == expected
    else:
        assert sum(int(b[0].shape[0]) for b in open_with(folder, [1, 2])) == expected


def test_folder_glob_and_list_open_to_the_same_files(shard_dir):
    folder, _, _ = shard_dir
    by_folder = open_shards(folder)
    assert open_shards(f"{folder}/*.tfrec").files == by_folder.files
    assert open_shards(list(reversed(by_folder.files))).files == by_folder.files  # written order, whatever given
    with pytest.raises(TfpipeError, match="no shard files found"):
        open_shards(f"{folder}/*.tfrecord")
    with pytest.raises(TfpipeError, match="no shard files found"):
        open_shards("")  # an unset variable


def test_shard_count_is_a_multiple_of_eight_when_the_data_allows():
    for records in (512, 1000, 5000, 100_000):
        for gigabytes in (0.1, 1, 5, 40):
            n = num_shards(records, gigabytes * 2**30)
            big_enough = records // 64 >= SHARD_MULTIPLE
            assert (n % SHARD_MULTIPLE == 0) == big_enough, (records, gigabytes, n)
            assert n * 64 <= records or n == 1
    assert num_shards(100_000, 40 * 2**30) == 40 * 2**30 // TARGET_SHARD_BYTES // 8 * 8 + 8  # ~150 MB each
    assert num_shards(100, 2**30) == 1  # fewer than 64 records a shard: one shard
    assert num_shards(1000, 2**30, requested=3) == 3


def test_verify_needs_no_tensorflow(shard_dir):
    folder, _, _ = shard_dir
    code = (
        "import sys\nfrom tfpipe.format.shards import open_shards, verify\n"
        "print(verify(open_shards(sys.argv[1])), 'tensorflow' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, folder],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=120,
    )
    assert done.stdout.strip() == "[] False", done.stderr


def test_verify_names_a_miscount_and_a_corrupt_shard(shard_dir, tmp_path):
    folder, _, manifest = shard_dir
    first = manifest.shards[0]
    data = bytearray(open(os.path.join(folder, first.file), "rb").read())
    data[-10] ^= 0xFF  # a flipped byte inside the last record's payload
    bad = tmp_path / first.file
    bad.write_bytes(bytes(data))
    miscounted = tmp_path / "zz-7.tfrec"  # the name claims 7 records (and sorts after the other)
    miscounted.write_bytes(open(os.path.join(folder, manifest.shards[1].file), "rb").read())
    problems = verify(open_shards([str(bad), str(miscounted)]))
    assert problems[0].startswith(f"{bad}: corrupt record data at byte")
    assert problems[1] == (
        f"{miscounted}: holds {manifest.shards[1].count} records, expected 7 (the number its name ends in, read as "
        "its count: the Kaggle convention NAME-COUNT.tfrec; rename a file whose name ends in another number)"
    )


def test_inspect_names_records_that_are_not_examples(tmp_path):
    path = tmp_path / "other-0.tfrec"
    with LocalRecordWriter(str(path)) as w:
        w.write(b"\xff\xff\xff not a protobuf")
    with pytest.raises(TfpipeError, match=f"{path}: its records are not tf.train.Example protos"):
        inspect_shards(str(path), stream=open(os.devnull, "w"))


def test_multi_hot_is_exact_and_refuses_indices_outside_the_classes():
    y = schema.multi_hot([[0, 2], [], [1]], 3)
    assert y.tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0]] and y.dtype == np.float32
    with pytest.raises(TfpipeError, match="class index 3 outside 0..2"):
        schema.multi_hot([[0], [3]], 3)
    with pytest.raises(TfpipeError, match="class index -1"):
        schema.multi_hot([[-1]], 3)


@pytest.mark.parametrize("split", ["train", "test", "my-split.v2"])
@pytest.mark.parametrize("fold", [None, 0, 12])
@pytest.mark.parametrize("total", [1, 10, 101, 1000])
def test_one_shard_name_template_writes_and_reads_back_every_name(split, fold, total):
    """Issue #33: every shard name goes through ``SHARD_NAMES``; what it writes it parses back whole, the count
    at the end is what readers count without a manifest, and a foreign name parses to None but keeps its count."""
    from tfpipe.format.names import SHARD_NAMES, ShardName
    from tfpipe.format.shards import shard_counts

    for index in {0, total // 2, total - 1}:
        name = SHARD_NAMES.name(split, index, total, 2071, fold)
        assert SHARD_NAMES.parse(name) == ShardName(split, fold, index, total, 2071)
        assert SHARD_NAMES.count(name) == 2071 and SHARD_NAMES.is_shard(name)
        assert shard_counts([f"gs://b/x/{name}"]) == {f"gs://b/x/{name}": 2071}
    names = sorted(SHARD_NAMES.name(split, i, total, 5, fold) for i in range(min(total, 12)))
    assert [SHARD_NAMES.parse(n).index for n in names] == list(range(min(total, 12)))  # zero-padded: sorts in order
    assert SHARD_NAMES.parse("ld_train00-1338.tfrec") is None and SHARD_NAMES.count("ld_train00-1338.tfrec") == 1338
    assert SHARD_NAMES.count("isic-2020.tfrec") == 2020 and SHARD_NAMES.count("train.tfrecord") is None
    assert SHARD_NAMES.count("train-fold0-07.tfrec") is None and SHARD_NAMES.count("empty-0.tfrec") == 0  # an index


def test_a_corrupt_record_error_crosses_processes_whole():
    """``CorruptRecord`` says what and where as fields (``shard_checks`` reads them, not its text); pickled (a
    Beam or pool worker's) it keeps them, and rebuilt from its message alone (torch re-raises a DataLoader
    worker's error as ``type(message)``) it is still one."""
    import pickle

    from tfpipe.format.tfrecord import CorruptRecord

    e = CorruptRecord("a.tfrec", "corrupt record length", 0, " (GZIP-compressed)")
    back = pickle.loads(pickle.dumps(e))
    assert (back.path, back.what, back.offset, back.note, str(back)) == (
        "a.tfrec", "corrupt record length", 0, " (GZIP-compressed)", "a.tfrec: corrupt record length at byte 0 (GZIP-compressed)"
    )  # fmt: skip
    assert str(CorruptRecord(str(e))) == str(e) and isinstance(CorruptRecord(str(e)), CorruptRecord)
