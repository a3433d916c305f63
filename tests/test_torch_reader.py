"""The PyTorch reader: TensorFlow-free framing, same records as tf.data, each record once across workers and ranks."""

import collections
import glob
import itertools
import os
import signal

import numpy as np
import pytest
import tensorflow as tf
import torch

import tfpipe
import tfpipe.tf.read
from tfpipe.format import schema
from tfpipe.format.shards import open_shards
from tfpipe.format.tfrecord import CorruptRecord, count_records, read_records
from tfpipe.runtime.errors import TfpipeError
from tfpipe.runtime.lifecycle import dead_worker_line
from tfpipe.torch.dataset import RecordDataset, deal, worker_range


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


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [2, 3, 8, 12])  # 40 records: divides by 2 and 8, not by 3 or 12
def test_ranks_get_equal_shares_like_distributed_sampler(shard_dir, world_size, drop_last):
    ranks = [
        RecordDataset(shard_dir[0], with_ids=True, rank=r, world_size=world_size, drop_last=drop_last, shuffle=True)
        for r in range(world_size)
    ]
    per_rank = [[name for _, _, name in ds] for ds in ranks]
    share = 40 // world_size if drop_last else -(-40 // world_size)
    assert [len(names) for names in per_rank] == [len(ds) for ds in ranks] == [share] * world_size
    seen = collections.Counter(name for names in per_rank for name in names)
    if drop_last:  # disjoint, and only the rest past the last whole share left out
        assert set(seen.values()) == {1} and len(seen) == share * world_size
    else:  # every record, and the padding repeats records once each
        assert set(seen) == set(shard_dir[1])
        assert sum(seen.values()) - 40 == share * world_size - 40 == sum(1 for n in seen.values() if n == 2)


def test_the_deal_covers_every_position_once_in_order():
    """``deal`` over shards of unequal (and zero) counts, slices that wrap past the end: the positions it reads
    are exactly the asked ones, in order; workers split a share at batch boundaries."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        counts = [int(c) for c in rng.integers(0, 7, rng.integers(1, 6))]
        total = sum(counts)
        stream = [(f, i) for f, c in enumerate(counts) for i in range(c)]
        start = int(rng.integers(0, 3 * total + 1))
        stop = start + int(rng.integers(0, 3 * total + 1))
        got = [
            (int(s.file), i)
            for s in deal([str(f) for f in range(len(counts))], counts, start, stop)
            for i in range(s.start, s.stop)
        ]
        assert got == ([stream[p % total] for p in range(start, stop)] if total else [])
    for size, workers, batch in [(10, 2, 4), (7, 3, 2), (5, 8, 1), (0, 2, 3), (9, 1, 4)]:
        parts = [worker_range(size, w, workers, batch) for w in range(workers)]
        assert parts[0][0] == 0 and parts[-1][1] == size and all(a[1] == b[0] for a, b in itertools.pairwise(parts))
        assert sum(-(-(hi - lo) // batch) for lo, hi in parts) == -(-size // batch)  # exactly len(loader) batches


def test_a_shard_that_changes_after_it_was_opened_is_an_error(shard_dir, tmp_path):
    """The deal trusts the counts it took when opened (a manifest's are checked against each shard's size): a
    shard edited since (a record cut off, one added) is named, never a shorter or longer epoch."""
    import shutil

    for path in open_shards(shard_dir[0]).files:
        shutil.copy(path, tmp_path)
    victim = sorted(tmp_path.glob("*.tfrec"))[0]
    records = list(read_records(str(victim)))
    for kept in (records[:-1], records + records[:1]):
        ds = RecordDataset(str(tmp_path / "*.tfrec"), num_classes=3)
        with open(victim, "wb") as f:
            for r in kept:
                f.write(_framed(r))
        with pytest.raises(TfpipeError, match=f"{victim.name} holds (fewer|more) than the {len(records)} records"):
            list(ds)
        with open(victim, "wb") as f:
            for r in records:
                f.write(_framed(r))


def test_a_number_in_a_foreign_files_name_is_not_a_count(shard_dir, tmp_path):
    """Files without a manifest are counted by their framing: "part-0" or "isic-2020" names no record count."""
    import shutil

    first = open_shards(shard_dir[0]).files[0]
    n = count_records(first)
    for name in ("part-0.tfrec", "isic-2020.tfrec"):
        shutil.copy(first, tmp_path / name)
        ds = RecordDataset(str(tmp_path / name), num_classes=3)
        assert len(ds) == len(list(ds)) == n


def test_bad_ranks_seeds_and_shares_are_refused_in_one_line(shard_dir):
    for kwargs, says in (
        ({"rank": True, "world_size": 2}, "rank must be a whole number"),
        ({"seed": -1}, "seed must be"),
        ({"seed": "x"}, "seed must be a whole number"),
        ({"rank": 0, "world_size": 41, "drop_last": True}, "40 records cannot give each of 41 ranks one"),
    ):
        with pytest.raises(TfpipeError, match=says):
            RecordDataset(shard_dir[0], **kwargs)
    ds = RecordDataset(shard_dir[0], drop_last=True)
    ds.world_size, ds.rank = 41, 3  # as torch.distributed would tell it: len() refuses too, not 0 batches
    with pytest.raises(TfpipeError, match="drop_last=False"):
        len(ds)
    with pytest.raises(TfpipeError, match="below 2"):
        ds.set_epoch(2**63)


def test_truncated_files_are_named_when_records_are_skipped_or_counted(shard_dir, tmp_path):
    path = open_shards(shard_dir[0]).files[0]
    cut = tmp_path / "cut.tfrec"
    cut.write_bytes(open(path, "rb").read()[:-10])
    for read in (lambda: count_records(str(cut)), lambda: list(read_records(str(cut), start=5))):
        with pytest.raises(CorruptRecord, match="cut.tfrec: truncated record at byte"):
            read()


def test_dataloader_workers_under_forkserver_live(shard_dir):
    """The workers' die-with-parent hook: under forkserver a worker's parent is the server, not this process."""
    import functools

    from tfpipe.runtime.lifecycle import worker_dies_with_parent

    ds = RecordDataset(shard_dir[0], folds=[0], with_ids=True)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=1, multiprocessing_context="forkserver", collate_fn=as_list,
        worker_init_fn=functools.partial(worker_dies_with_parent, os.getpid()),
    )  # fmt: skip
    assert sorted(name for batch in loader for _, _, name in batch) == tfpipe.image_names(shard_dir[0], folds=[0])


def _framed(record):
    import io

    from tfpipe.format.tfrecord import LocalRecordWriter

    buf = io.BytesIO()
    writer = LocalRecordWriter.__new__(LocalRecordWriter)
    writer._file = buf
    writer.write(record)
    return buf.getvalue()


def test_foreign_files_without_counts_are_counted_by_their_framing(shard_dir, tmp_path):
    import shutil

    for i, path in enumerate(open_shards(shard_dir[0]).files):
        shutil.copy(path, tmp_path / f"part{i}.tfrecord")  # no count in the name, no manifest
    ds = RecordDataset(str(tmp_path / "*.tfrecord"), num_classes=3, rank=1, world_size=3)
    assert len(ds) == 14 and len(list(ds)) == 14
    assert count_records(str(tmp_path / "part0.tfrecord")) == len(list(read_records(str(tmp_path / "part0.tfrecord"))))


def as_list(batch):  # module level: spawned workers unpickle it
    return batch


BROKEN_SHARER = """
import os, socket, sys, time
import torch
from multiprocessing import resource_sharer
from tfpipe.runtime.lifecycle import loader_dies_with_this_process

class Consumed(torch.utils.data.IterableDataset):
    def __iter__(self):  # in the worker: a reader connects to its resource sharer and is gone (stopped)
        address, _ = resource_sharer.DupFd(os.pipe()[0])._id
        with socket.socket(socket.AF_UNIX) as reader:
            reader.connect(address)
        time.sleep(0.5)  # the sharer's thread meets the broken connection
        yield 1

init = loader_dies_with_this_process() if sys.argv[1] == "tfpipe" else None
print(len(list(torch.utils.data.DataLoader(Consumed(), num_workers=1, worker_init_fn=init))))
"""


@pytest.mark.parametrize("init", ["tfpipe", "none"])
def test_a_worker_whose_reader_is_stopped_prints_no_traceback(init):
    """A DataLoader worker serves its batches' shared memory through multiprocessing's resource sharer; a reader
    stopped mid-connection (Ctrl-C to a DDP rank) made the worker print a traceback before it ended with it. With
    tfpipe's ``worker_init_fn`` nothing is printed; without it (the control) the traceback is, so the test can fail.
    A fresh process: DataLoader workers are forked, and this one has TensorFlow's threads."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BROKEN_SHARER, init], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    assert ("Traceback" in done.stderr) == (init == "none"), done.stderr


def test_a_worker_killed_as_it_hands_over_a_batch_is_named_and_a_live_one_is_not():
    """A DataLoader worker killed while it hands over a batch cuts the connection first: its reader gets an
    EOFError (or a ConnectionResetError), not torch's "is killed by signal" (twice in CI, the Lightning recipe's
    line then the error's traceback). ``dead_worker_line`` names the worker from the loader in the error's
    traceback; the same error while the worker lives is not a death, and keeps its traceback."""
    loader = torch.utils.data.DataLoader(range(8), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    batches = iter(loader)
    next(batches)

    def cut(timeout=None):
        raise EOFError  # what the reader of a connection cut by the worker's death raises

    batches._data_queue.get = cut
    with pytest.raises(EOFError) as caught:
        next(batches)
    assert dead_worker_line(caught.value) is None
    worker = batches._workers[0]
    # torch's SIGCHLD handler would raise its own error for a worker it watches: this one is taken off its watch
    # (a signal mask on this thread would not do: another thread may take the signal, and Python then runs the
    # handler here anyway -- it did in CI)
    torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
    batches._worker_pids_set = False
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(30)
    assert dead_worker_line(caught.value) == f"DataLoader worker (pid {worker.pid}) is killed by signal: Killed"
    batches._shutdown_workers()
    told = RuntimeError("DataLoader worker (pid(s) 7) exited unexpectedly")
    told.__cause__ = RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed. ")
    assert dead_worker_line(told) == "DataLoader worker (pid 7) is killed by signal: Killed"  # torch's own words


@pytest.mark.slow
def test_persistent_workers_see_each_record_once_and_a_new_order_every_epoch(shard_dir):
    ds = RecordDataset(shard_dir[0], folds=[0, 1, 2], shuffle=True, seed=3, with_ids=True, batch_size=4)
    # spawn: this test process runs TensorFlow threads, and a fork of it could hang
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=3, multiprocessing_context="spawn", collate_fn=as_list, persistent_workers=True
    )
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)  # the workers started in epoch 0 and live on: they read it from shared memory
        batches = list(loader)
        assert len(batches) == len(loader) == -(-len(ds) // 4)  # 30 records: 8 batches, the last one short
        names = [name for batch in batches for _, _, name in batch]
        assert collections.Counter(names) == collections.Counter(tfpipe.image_names(shard_dir[0], folds=[0, 1, 2]))
        orders.append(names)
    assert len({tuple(o) for o in orders}) == 3  # a new order every epoch


def test_ranks_read_their_slices_from_a_remote_folder(shard_dir):
    """ram:// (a stand-in for gs://): skipping to a slice's start seeks in tf.io.gfile's files too."""
    remote = "ram://bucket/torch-ranks"
    tf.io.gfile.makedirs(remote)
    for name in tf.io.gfile.listdir(shard_dir[0]):
        tf.io.gfile.copy(f"{shard_dir[0]}/{name}", f"{remote}/{name}", overwrite=True)
    for rank in range(3):
        here, there = (
            [name for _, _, name in RecordDataset(folder, with_ids=True, rank=rank, world_size=3)]
            for folder in (shard_dir[0], remote)
        )
        assert here == there and len(here) == 14
