"""Checks that last the whole job (issue #32): one writer per folder whatever the thread, claims carried by the
input (a glob reads its folder's manifest, one size rule, an image known by its content), and no raw error passed
through (every JSON read back is strict, a CSV row must match its header, a full disk names the file)."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

import tfpipe
from tests.conftest import save, sigint_as_a_terminal_sends_it, write_csv
from tfpipe.runtime.errors import TfpipeError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_source(root, n=12, size=(40, 56), seed=0):
    """``n`` labeled JPEGs under ``root``: a ``tfpipe.Source``."""
    from tfpipe import Source

    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(n):
        save(root / "images" / f"img{i:02d}.jpg", size=size, seed=seed + i)
        rows.append((f"img{i:02d}", ["a", "b", "a b", ""][i % 4]))
    return Source(str(root / "images"), csv=str(write_csv(root / "train.csv", ["image", "labels"], rows)))


def write(source, out, **kwargs):
    from tfpipe.writer.images import ImageSpec

    kwargs.setdefault("spec", ImageSpec(image_size=16))
    return tfpipe.write_shards(source, str(out), workers=0, progress=False, **kwargs)


# ------------------------------------------------------------------------ 3: one writer per folder, per job
def test_a_folder_locked_by_another_job_of_this_process_is_refused_until_it_ends(tmp_path):
    """The lock is the job's token, not its host and pid: a job of this same process (another thread) holding the
    folder is live, not a lock "left by this process" to take over (that let two threads commit into one folder,
    both shards corrupt)."""
    from tfpipe.runtime.locks import locked_folder

    source, out = small_source(tmp_path / "src"), tmp_path / "out"
    with locked_folder(str(out), "tfpipe.write"):
        failed = []
        thread = threading.Thread(target=lambda: failed.append(_refusal(source, out)))
        thread.start()
        thread.join()
        assert "being written by another tfpipe.write (this process (another thread)" in failed[0]
        assert not os.path.exists(out / "manifest.json")
    assert write(source, out).num_examples == 12  # the lock went with its job


def _refusal(source, out):
    try:
        write(source, out)
    except TfpipeError as e:
        return str(e)
    return "written"


def test_two_threads_writing_one_folder_leave_one_finished_dataset_that_verifies(tmp_path):
    """Started together from one process: each write either finishes or is refused in one line (never a raw
    error), at least one finishes, and what is in the folder verifies, record by record."""
    source, out = small_source(tmp_path / "src", n=24), tmp_path / "out"
    for attempt in range(3):
        shutil.rmtree(out, ignore_errors=True)
        start, outcomes = threading.Barrier(2), []

        def one_job(start=start, outcomes=outcomes):
            start.wait()
            try:
                outcomes.append(write(source, out, num_shards=4).num_examples)
            except TfpipeError as e:
                outcomes.append(str(e))

        jobs = [threading.Thread(target=one_job) for _ in range(2)]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join()
        assert 24 in outcomes, (attempt, outcomes)
        refused = [o for o in outcomes if o != 24]
        said = ("being written by another tfpipe.write", "being taken by another job just now", "already holds shards")
        assert all(any(words in o for words in said) for o in refused), refused  # each a one-line refusal
        shards = tfpipe.open_shards(str(out))
        assert tfpipe.verify(shards) == [] and shards.num_examples == 24


# ----------------------------------------------------------------- 2: claims carried by the input
def test_a_glob_or_a_list_of_files_is_read_with_its_folders_manifest(tmp_path):
    source = small_source(tmp_path / "src")
    ordered, reordered = tmp_path / "abc", tmp_path / "cba"
    write(source, ordered, num_shards=2, classes=["a", "b"])
    write(source, reordered, num_shards=2, classes=["b", "a"])
    for records in (f"{reordered}/*.tfrec", sorted(str(p) for p in reordered.glob("*.tfrec"))):
        shards = tfpipe.open_shards(records)
        assert shards.classes == ["b", "a"] and shards.folder == str(reordered), records
        assert shards.num_examples == 12
    one = sorted(reordered.glob("*.tfrec"))[:1]  # a part of the folder: its own counts, the folder's claims
    assert tfpipe.open_shards([str(one[0])]).num_examples == tfpipe.open_shards(str(reordered)).counts[str(one[0])]
    assert tfpipe.open_shards([one[0]]).files == (str(one[0]),)  # a pathlib.Path is a path too
    for listed, why in [
        ([str(reordered)], "lists the folder .*cba: a list names shard files; pass the folder itself"),
        ([str(one[0]), f"{reordered}/gone.tfrec"], "lists .*gone.tfrec, which does not exist"),
        ([str(one[0]), 3], "lists 3, not a path"),
    ]:
        with pytest.raises(TfpipeError, match=why):
            tfpipe.open_shards(listed)

    shutil.copy(one[0], ordered / "stray-00000-of-00001-6.tfrec")  # a file the manifest there does not list
    with pytest.raises(TfpipeError, match="stray-00000.*not a shard of its folder"):
        tfpipe.open_shards(f"{ordered}/*.tfrec")
    os.remove(ordered / "stray-00000-of-00001-6.tfrec")
    with pytest.raises(TfpipeError, match=r"differ in classes.*read one folder at a time"):
        tfpipe.open_shards(sorted(str(p) for p in [*ordered.glob("*.tfrec"), *reordered.glob("*.tfrec")]))
    twin = tmp_path / "twin"  # another folder of the same meaning: read together, each checked by its manifest
    write(source, twin, num_shards=2, classes=["a", "b"], split="extra")
    both = sorted(str(p) for p in [*ordered.glob("*.tfrec"), *twin.glob("*.tfrec")])
    shards = tfpipe.open_shards(both)
    assert shards.classes == ["a", "b"] and shards.num_examples == 24 and shards.dataset_id == ""
    shutil.copytree(ordered, tmp_path / "copy")  # the same shard names twice: which count is whose is a guess
    with pytest.raises(TfpipeError, match="two shards named train-00-of-02-6.tfrec"):
        tfpipe.open_shards(f"{tmp_path}/[ac]*[cy]/*.tfrec")  # abc and copy
    (tmp_path / "copy" / "manifest.json").unlink()  # files without a manifest beside files with one
    with pytest.raises(TfpipeError, match=r"copy, which has no manifest.json, .* read them apart"):
        tfpipe.open_shards(f"{tmp_path}/[ac]*[cy]/*.tfrec")
    with open(both[-1], "ab") as f:
        f.write(b"x")
    with pytest.raises(TfpipeError, match="manifest.json says"):
        tfpipe.open_shards(both)


def test_two_writes_of_one_dataset_read_together_are_refused_by_fit_and_predict(trained_run, shard_dir, tmp_path):
    """A glob over two folders of the same images (written again with another seed: other folds) would validate
    on images it trains on, and a submission would hold every id twice: train.fit refuses files of several
    folders that hold one image twice, train.predict records that hold one id twice."""
    from tfpipe import Source
    from tfpipe.writer.images import ImageSpec
    from train.fit import FitConfig, fit
    from train.predict import predict

    root = os.path.dirname(shard_dir[0])
    again = tmp_path / "again"
    tfpipe.write_shards(Source(f"{root}/images", csv=f"{root}/train.csv"), str(again), spec=ImageSpec(image_size=32),
                        num_folds=4, seed=1, workers=0, progress=False)  # fmt: skip
    both = sorted([*map(str, again.glob("*.tfrec")), *tfpipe.open_shards(shard_dir[0]).files])
    with pytest.raises(
        TfpipeError, match=r"the files given hold 40 images twice \(e.g. .* in .* and .* in .*read one folder"
    ):
        fit(FitConfig(records=both, run=str(tmp_path / "run"), strategy="cpu", model="small-cnn", epochs=1))
    assert not (tmp_path / "run").exists()
    with pytest.raises(TfpipeError, match="is in two records, and a submission keys each image once"):
        predict(trained_run[0], both, str(tmp_path / "s.csv"), strategy="cpu")
    assert not (tmp_path / "s.csv").exists()


def test_predict_refuses_a_glob_of_shards_in_another_class_order(trained_run, shard_dir, tmp_path):
    from tfpipe import Source
    from tfpipe.writer.images import ImageSpec
    from train.predict import predict

    run, _, _ = trained_run
    root = os.path.dirname(shard_dir[0])
    other = tmp_path / "reordered"
    tfpipe.write_shards(Source(f"{root}/images", csv=f"{root}/train.csv"), str(other),
                        spec=ImageSpec(image_size=32), classes=["c", "b", "a"], workers=0, progress=False)  # fmt: skip
    for records in (str(other), f"{other}/*.tfrec"):
        with pytest.raises(TfpipeError, match=r"its classes \(c, b, a\) are not the run's \(a, b, c\)"):
            predict(run, records, str(tmp_path / "s.csv"), strategy="cpu")
    assert not (tmp_path / "s.csv").exists()


def test_one_size_rule_for_fit_and_predict(trained_run):
    """The reader resizes stored images to the model's input: a run records the size its training shards were
    stored at, and train.predict wants shards stored alike (then resized as in training), whatever the input."""
    from train.prediction.submission import check_stored_size
    from train.runs.run import RunConfig, from_dict

    run, _, _ = trained_run
    config = RunConfig.load(run)
    assert config.stored_size == 32 == json.loads(open(f"{run}/config.json").read())["stored_image_size"]
    resized = RunConfig(("a",), 33, False, "stretch", None, None, "", stored_size=32)  # --image-size 33 on 32 px
    check_stored_size(resized, 32, "records")  # its own training shards
    with pytest.raises(TfpipeError, match=r"stored at 33 px, the run's training images at 32 px, resized to 33"):
        check_stored_size(resized, 33, "records")
    older = RunConfig(("a",), 32, False, "stretch", None, None, "")  # a run that did not record it
    check_stored_size(older, 32, "records")
    with pytest.raises(TfpipeError, match="stored at 64 px, the run's training images at 32 px; write"):
        check_stored_size(older, 64, "records")
    check_stored_size(older, None, "records")  # unknown both ways: as before tfpipe 1.1
    data = json.loads(open(f"{run}/config.json").read())
    assert from_dict(dict(data, stored_image_size="own"), "c").stored_size == "own"
    with pytest.raises(TfpipeError, match="stored_image_size.*pixels, 'own' or null"):
        from_dict(dict(data, stored_image_size="big"), "c")
    own = RunConfig(("a",), 32, False, "stretch", None, None, "", stored_size="own")  # written without a size
    check_stored_size(own, None, "records")
    with pytest.raises(
        TfpipeError,
        match=r"stored at 32 px, the run's training images at their own sizes .*"
        r"resized to 32 px as read; write the shards again with ImageSpec\(image_size=None\)",
    ):
        check_stored_size(own, 32, "records")
    with pytest.raises(
        TfpipeError,
        match=r"stored at their own sizes .*training images at 32 px; write the "
        r"shards again with ImageSpec\(image_size=32\)",
    ):
        check_stored_size(config, None, "records")


def test_a_write_reports_copies_of_one_image_their_other_labels_and_other_folds(tmp_path, capsys):
    """One image under two names is reported (byte-identical once stored, whatever the names), with what makes it
    matter: another answer for the same image, or a copy in another fold (validation on trained-on images). The
    shards hold every copy as given."""
    source = small_source(tmp_path / "src")  # labels cycle a, b, "a b", ""
    images = tmp_path / "src" / "images"
    shutil.copy(images / "img00.jpg", images / "dup-a.jpg")  # the same labels as img00 (a)
    shutil.copy(images / "img00.jpg", images / "dup-b.jpg")  # another answer for the same image
    with open(source.csv, "a") as f:
        f.write("dup-a,a\ndup-b,b\n")
    capsys.readouterr()
    manifest = write(source, tmp_path / "out", num_folds=2)
    assert manifest.num_examples == 14  # nothing merged or dropped
    err = capsys.readouterr().err
    assert "warning: 2 images are byte-identical to an earlier image once stored (e.g. dup-a = img00)" in err, err
    assert "warning: 1 image is labelled otherwise than the image it copies (e.g. dup-b [b], img00 [a])" in err
    fold_of = {n: k for k in (0, 1) for n in tfpipe.image_names(str(tmp_path / "out"), folds=[k])}
    moved = sum(fold_of[d] != fold_of["img00"] for d in ("dup-a", "dup-b"))
    assert ("in another fold than the image it copies" in err) == bool(moved), (fold_of, err)
    assert len(err.strip().splitlines()) == 2 + bool(moved)

    write(small_source(tmp_path / "clean"), tmp_path / "clean-out")  # no copies: not a word
    assert "warning" not in capsys.readouterr().err


def test_copies_in_other_folds_are_named_with_both_folds():
    from tfpipe.writer.copies import Copy, Stored, copy_lines

    a, b = Stored("a", frozenset({0}), 0), Stored("b", frozenset({0}), 3)
    lines = copy_lines([Copy(b, a)], ["cat"])
    assert (
        len(lines) == 2
        and "1 image is in another fold than the image it copies (e.g. b in fold 3, a in fold 0)" in (lines[1])
    )


def test_an_image_is_known_by_its_content_and_every_image_given_is_scored(trained_run, shard_dir, tmp_path, capsys):
    """Labeled shards of *different* images whose ids repeat the run's are not "its own data, written again"; a
    copy of an image it validated on, renamed, is. The score over all the images given is printed either way."""
    import pandas as pd

    from tfpipe.writer.images import ImageSpec
    from train.predict import predict

    run, _, _ = trained_run
    (tmp_path / "images").mkdir()
    rows = []
    for i in range(12):  # the run's own ids (im00..im11; it validated on some of them), other pictures
        save(tmp_path / "images" / f"im{i:02d}.jpg", size=(36, 52), seed=100 + i)
        rows.append((f"im{i:02d}", ["a", "b c", "", "c"][i % 4]))

    def scored(name):
        csv = write_csv(tmp_path / f"{name}.csv", ["image", "labels"], rows)
        tfpipe.write_shards(tfpipe.Source(str(tmp_path / "images"), csv=str(csv)), str(tmp_path / name),
                            spec=ImageSpec(image_size=32), classes=["a", "b", "c"], workers=0, progress=False)  # fmt: skip
        df = predict(run, str(tmp_path / name), "", labels=True, threshold=0.4, strategy="cpu", progress=True)
        return df.attrs["evaluation"], capsys.readouterr().out

    result, said = scored("others")
    assert set(result) == {"thresholds", "own_training_shards", "all", "metric"} and result["all"]["examples"] == 12
    assert "scores on the labeled shards" in said and "validated on" not in said, said

    validated = pd.read_csv(f"{run}/val_predictions.csv", dtype=str, keep_default_na=False)["image_name"]
    trained = sorted(set(shard_dir[1]) - set(validated))[0]
    for name, copied in (("renamed", validated[0]), ("renamed-too", trained)):  # one validated on, one trained on
        shutil.copy(f"{os.path.dirname(shard_dir[0])}/images/{copied}.jpg", tmp_path / "images" / f"{name}.jpg")
        rows.append((name, " ".join(shard_dir[1][copied])))
    result, said = scored("with-copies")
    parts = [result[part]["examples"] for part in ("all", "held_out", "trained_on", "unseen")]
    assert parts == [14, 1, 1, 12] and "(14 images)" in said, said
    assert "warning: of these images 1 it validated on and 1 it trained on" in said, said
    assert (
        "scores on the images the run never saw (12 images)" in said and "per class, on the images it never saw" in said
    )


# ----------------------------------------------------------------- 5: no raw error passed through
def test_every_json_file_read_back_refuses_a_key_given_twice(tmp_path):
    from tfpipe.format.manifest import Manifest
    from tfpipe.runtime import fs
    from train.runs.thresholds import load_thresholds

    (tmp_path / "thresholds.json").write_text('{"a": 0.3, "b": 0.5, "a": 0.9}')
    with pytest.raises(TfpipeError, match=r"thresholds.json: run file gives the key 'a' twice"):
        load_thresholds(str(tmp_path), ["a", "b"])
    (tmp_path / "thresholds.json").write_text("[0.3, 0.5]")
    with pytest.raises(TfpipeError, match=r"expected an object of class name: threshold \(got a list: 0.3, 0.5\)"):
        load_thresholds(str(tmp_path), ["a", "b"])
    (tmp_path / "x.json").write_text('{"outer": {"k": 1, "k": 2}}')  # nested objects too
    with pytest.raises(TfpipeError, match="gives the key 'k' twice"):
        fs.read_json(str(tmp_path / "x.json"))

    folder = tmp_path / "records"
    write(small_source(tmp_path / "src"), folder)
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(text.replace('"split": "train"', '"split": "train", "split": "test"', 1))
    with pytest.raises(TfpipeError, match="manifest gives the key 'split' twice"):
        Manifest.load(str(folder))


def test_a_shard_this_user_cannot_read_is_named_before_reading_starts(shard_dir, tmp_path):
    """A shard of mode 000 (as root: with the capabilities that read anything dropped, ``setpriv``): one line
    naming it; before, train.fit and train.predict ended in TensorFlow's PermissionDeniedError traceback."""
    folder = tmp_path / "shards"
    shutil.copytree(shard_dir[0], folder)
    locked = sorted(folder.glob("*.tfrec"))[1]
    locked.chmod(0)
    code = "import sys, tfpipe; tfpipe.open_shards(sys.argv[1])"
    drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
    cmd = [*(drop if os.geteuid() == 0 else []), sys.executable, "-c", code, str(folder)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1 and "Traceback" in done.stderr  # from Python: a TfpipeError, naming the file
    assert f"TfpipeError: {locked}: this user cannot read it (permission denied); give it read access" in done.stderr


def test_the_run_files_read_back_on_resume_and_predict_are_checked_whole(tmp_path):
    """``history.csv`` (which --resume counts epochs by) and ``train_digests.txt`` (which predict tells trained-on
    images by) are input too: an edited or cut file is one line naming it, never a wrong count or an empty set."""
    from train.runs.run import load_digests, read_history, save_digests

    run = tmp_path / "run"
    run.mkdir()
    save_digests(str(run), ["0123456789abcdef", "fedcba9876543210"])
    assert load_digests(str(run)) == {"0123456789abcdef", "fedcba9876543210"}
    whole = (run / "train_digests.txt").read_text()
    for damaged, says in [
        ("", "does not hold the number of digests its first line says"),  # emptied
        (whole.rsplit("\n", 2)[0] + "\n", "does not hold the number"),  # the last digest cut off
        (whole + "0123456789abcdeX\n", "'0123456789abcdeX' is not an image digest"),
    ]:
        (run / "train_digests.txt").write_text(damaged)
        with pytest.raises(TfpipeError, match=f"train_digests.txt: (it )?{says}"):
            load_digests(str(run))

    head = "epoch,auc,loss,lr,val_auc,val_loss\n"
    (run / "history.csv").write_text(head + "0,0.5,0.7,0.001,0.5,0.7\n1,0.6,0.6,0.001,0.6,0.6\n")
    assert [r["epoch"] for r in read_history(str(run))] == ["0", "1"]
    for damaged, says in [
        (head + "0,0.5,0.7,0.001,0.5,0.7\n0,0.5,0.7,0.001,0.5,0.7\n", "line 3 has epoch '0' where epoch 1 belongs"),
        (head + "0,0.5,0.7,0.001,0.5,0.7,9\n", "line 2 has 7 fields where the header has 6"),
        (head + "nan,0.5,0.7,0.001,0.5,0.7\n", "line 2 has epoch 'nan' where epoch 0 belongs"),
        ("", "no header naming the epoch column"),
    ]:
        (run / "history.csv").write_text(damaged)
        with pytest.raises(TfpipeError, match=f"history.csv: {says}"):
            read_history(str(run))


@pytest.mark.parametrize(
    "lines, says",
    [
        (["image,labels", "img00,a,b", "img01,b"], "line 2 has 3 fields where the header has 2"),  # pandas: an index
        (["image,labels", "img00,a", "img01,b,", "img02,"], "line 3 has 3 fields where the header has 2"),
        (["image,labels,extra", "img00,a,1", "img01"], "line 3 has 1 field where the header has 3"),
        (["image,labels", "img00,circle\rstar"], "line 2: a line break inside a field that is not in quotes"),
    ],
)
def test_a_csv_row_that_does_not_match_its_header_is_refused_naming_it(tmp_path, lines, says):
    from tfpipe.sources.csv import read_csv

    (tmp_path / "train.csv").write_bytes(("\n".join(lines) + "\n\n").encode())  # a blank line at the end: no row
    with pytest.raises(TfpipeError, match=says):
        read_csv(str(tmp_path / "train.csv"))
    (tmp_path / "ok.csv").write_text('image,labels,where\nimg00,a b,"x, y"\n\nimg01,,\n')  # quoted commas, blank lines
    assert [r[1] for r in read_csv(str(tmp_path / "ok.csv"))] == ["img00", "img01"]


def on_a_small_disk(script, disk, megabytes):
    """Runs the shell ``script`` with ``disk`` a tmpfs of ``megabytes`` of its own (a private mount namespace,
    gone with the process: ``unshare``, as root or in a user namespace)."""
    mount = f"mount -t tmpfs -o size={megabytes}m tfpipe-test {disk} && cd {disk} && "
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(["unshare", *flags, "sh", "-c", mount + script], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip


def test_a_full_disk_names_the_file_and_the_way_on(tmp_path):
    """A real full disk (a small tmpfs): the shard being written is named with what is kept and ``--resume``;
    after space is freed, ``--resume`` finishes a dataset that verifies. A JSON file written atomically names
    itself too (a ``write`` into an open file names none)."""
    source = small_source(tmp_path / "src", n=60, size=(96, 96))
    disk = tmp_path / "disk"
    disk.mkdir()
    py, src = sys.executable, tmp_path / "src"
    args = f"--csv {src}/train.csv --images {src}/images --out records --image-size 96 --num-shards 6 --workers 0"
    done = on_a_small_disk(
        f"head -c 930k /dev/urandom > filler && "
        f"{py} -m tfpipe.write {args} --no-progress 2> first.err; echo $? > first.rc; "
        f"rm filler && {py} -m tfpipe.write {args} --no-progress --resume > resume.out && "
        f"{py} -m tfpipe.inspect records --verify > /dev/null && cat first.rc first.err && "
        f"head -c 1000k /dev/urandom > filler2; "
        f'{py} -c \'from tfpipe.runtime import fs; fs.write_atomic("config.json", "x" * 400000)\'',
        disk,
        1,
    )
    rc, err, *_ = done.stdout.splitlines() + [""]
    assert rc == "2" and "Traceback" not in err, (done.stdout, done.stderr)
    assert ".staging/train-0000" in err and ".part: No space left on device (the disk or quota is full" in err, err
    assert "kept in records/.staging: run it again with --resume" in err, err
    assert done.returncode == 1 and "config.json" in done.stderr.splitlines()[-1], done.stderr[-2000:]
    assert "No space left on device" in done.stderr.splitlines()[-1]
    del source


# ----------------------------------------------------------------- 1: checks at both ends of every pass
@pytest.mark.parametrize("num_shards", [8, 5], ids=["same-names", "renamed-shards"])
def test_the_torch_reader_ends_a_pass_read_across_a_rewrite_with_the_rewrite(shard_dir, tmp_path, num_shards):
    """The folder rewritten (labels corrected) while ``RecordDataset`` reads an epoch: the epoch never ends
    normally with some targets of the new write; shards renamed under it are named as the rewrite, not a raw
    ``FileNotFoundError``."""
    from tfpipe import Source
    from tfpipe.torch.dataset import RecordDataset
    from tfpipe.writer.images import ImageSpec

    folder = tmp_path / "records"
    shutil.copytree(shard_dir[0], folder)
    ds = RecordDataset(str(folder))
    epoch = iter(ds)
    first = [next(epoch) for _ in range(10)]
    root = os.path.dirname(shard_dir[0])
    tfpipe.write_shards(Source(f"{root}/images", csv=f"{root}/train.csv"), str(folder), spec=ImageSpec(image_size=32),
                        num_folds=4, num_shards=num_shards, workers=0, progress=False, overwrite=True,
                        classes=["c", "b", "a"])  # fmt: skip
    with pytest.raises(TfpipeError, match="was rewritten while this job read it"):
        first += list(epoch)
    assert len(first) == 10


def test_a_tf_data_pass_read_across_a_rewrite_ends_in_an_error_naming_the_folder(tmp_path):
    """``make_dataset``'s passes check the folder in TensorFlow ops as each shard opens and once more after the
    last record (as RecordDataset's do): a pass whose records were read across a rewrite (another class order:
    every target means another class) ends in an error, never normally. A pass of an unchanged folder ends."""
    import tensorflow as tf

    from tfpipe.tf.read import read_in_order

    source, out = small_source(tmp_path / "src"), tmp_path / "out"
    write(source, out, num_shards=3, classes=["a", "b"])
    shards = tfpipe.open_shards(str(out))
    assert len(list(read_in_order(shards))) == 12  # unchanged: the pass ends
    lazy = tf.data.Options()  # nothing read ahead, so the rewrite below falls inside the pass, not after it
    lazy.autotune.enabled, lazy.experimental_optimization.inject_prefetch = False, False
    records = iter(read_in_order(shards).with_options(lazy))
    for _ in range(12):  # every record of the pass read, then the folder rewritten
        next(records)
    write(source, out, num_shards=3, classes=["b", "a"], overwrite=True)
    with pytest.raises(TfpipeError, match=r"out was rewritten while this job read it \(its manifest.json no longer"):
        with tfpipe.naming_corrupt_shards(shards):
            next(records)  # the end of the pass: an error, not StopIteration
    ds = tfpipe.make_dataset(shards, 4)  # opened before this rewrite: its first shard is refused
    write(source, out, num_shards=3, classes=["a", "b"], overwrite=True, seed=3)
    with pytest.raises(TfpipeError, match="rewritten while this job read it"):
        with tfpipe.naming_corrupt_shards(shards):
            list(ds)


def cut_shard(path, keep):
    """Rewrites the shard at ``path`` with its records ``keep`` (a slice or list of indices): a shard cut short
    at a record boundary, or grown, in place -- what a copy in place or a file still being written leaves."""
    from tfpipe.format.tfrecord import RecordWriter, read_records

    records = list(read_records(str(path)))
    with RecordWriter(str(path)) as w:
        for i in keep if isinstance(keep, list) else range(len(records))[keep]:
            w.write(records[i])


def test_a_pass_over_a_shard_cut_short_or_grown_after_it_was_opened_is_refused_naming_it(tmp_path):
    """Each shard's record count is checked in TensorFlow ops as a pass reaches its end (issue #53): a shard cut
    at a record boundary, or grown by a record, after the folder was opened ends every pass -- make_dataset's,
    the columns' -- in one line naming the shard and both counts, never a pass of 11 records."""
    from tfpipe.tf.read import read_in_order

    source, out = small_source(tmp_path / "src"), tmp_path / "out"
    write(source, out, num_shards=3, classes=["a", "b"])
    shards = tfpipe.open_shards(str(out))
    second = shards.files[1]
    evaluation = tfpipe.make_dataset(shards, 4)
    cut_shard(second, slice(0, 3))  # 4 records -> 3
    for a_pass in (lambda: list(evaluation), lambda: tfpipe.image_names(shards), lambda: list(read_in_order(shards))):
        with pytest.raises(TfpipeError, match=rf"{re.escape(second)}: holds 3 records, expected 4: it changed while"):
            with tfpipe.naming_corrupt_shards(shards):
                a_pass()
    cut_shard(second, [0, 1, 2, 2, 1])  # 5 records
    training = tfpipe.make_dataset(shards, 4, training=True, seed=0, image_size=16)
    with pytest.raises(TfpipeError, match=rf"{re.escape(second)}: holds 5 records, expected 4"):
        with tfpipe.naming_corrupt_shards(shards):
            for _ in training.take(6):  # one epoch is 3 batches: the grown shard is read within two
                pass


def test_a_pass_over_files_without_a_count_says_once_that_it_cannot_check_them(tmp_path):
    """Files renamed without the count tfpipe.write puts in their names, read as a list (no manifest): the pass
    reads them whole but cannot check their counts, and says so (once a reader, as a warning)."""
    import warnings

    source, out = small_source(tmp_path / "src"), tmp_path / "out"
    write(source, out, num_shards=2, classes=["a", "b"])
    files = []
    for i, f in enumerate(tfpipe.open_shards(str(out)).files):
        files.append(str(tmp_path / f"part-0{i}.tfrec"))  # a zero-padded index, not a count
        shutil.copy(f, files[-1])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert len(list(tfpipe.make_dataset(files, 4, num_classes=2, image_size=16).unbatch())) == 12
    assert [str(w.message) for w in said] == [
        f"{files[0]} and 1 more shard files: some files carry no record count (no manifest, no count in their "
        "names): a pass over them cannot check that it read each file whole"
    ]
    named = str(tmp_path / "part-7.tfrec")  # a name ending in a number is read as its count (Kaggle's way)
    shutil.copy(files[0], named)
    with pytest.raises(TfpipeError, match=r"part-7.tfrec: holds 6 records, expected 7 \(the number its name ends in"):
        with tfpipe.naming_corrupt_shards([named]):
            list(tfpipe.make_dataset([named], 4, num_classes=2, image_size=16))


@pytest.mark.parametrize("change", ["cut", "swap"])
def test_predict_refuses_a_test_shard_changed_while_the_model_loads(trained_run, tmp_path, monkeypatch, change):
    """The cases that wrote a submission of shifted rows: a test shard cut short at a record boundary, or two
    shards of equal counts swapped, while the model loads. Every pass checks each shard's count, and each row
    carries a hash of its image's name through predict: one line, no submission."""
    import train.prediction.inference
    from train.predict import predict

    run, _, test = trained_run
    copy = tmp_path / "test"
    shutil.copytree(test, copy)
    shards = tfpipe.open_shards(str(copy))
    a, b = [f for f in shards.files if shards.counts[f] == shards.counts[shards.files[-1]]][-2:]
    loading = train.prediction.inference.load_run

    def load_and_change(*args):
        model = loading(*args)
        if change == "cut":
            cut_shard(b, slice(0, -1))
        else:
            os.rename(a, f"{a}.x"), os.rename(b, a), os.rename(f"{a}.x", b)
        return model

    monkeypatch.setattr(train.prediction.inference, "load_run", load_and_change)
    out = tmp_path / "submission.csv"
    says = rf"{re.escape(b)}: holds \d+ records, expected \d+: it changed" if change == "cut" else "is another image"
    with pytest.raises(TfpipeError, match=says):
        predict(run, str(copy), str(out), strategy="cpu", probabilities=True, swa=False, progress=False)
    assert not out.exists()


# "copied" is the same check by another change: make test-slow
@pytest.mark.parametrize("change", ["cut", pytest.param("copied", marks=pytest.mark.slow)])
def test_a_validation_shard_changed_during_training_ends_the_report_in_one_line(shard_dir, tmp_path, change):
    """Training reads cached images after the first epoch; the report reads the validation shards again: a
    shard cut meanwhile is named in one line (before: a FailedPreconditionError traceback), and so is one whose
    second record was overwritten by its first (the count kept; before: a report of one image twice)."""
    import tf_keras as keras

    from train.fit import FitConfig, fit

    folder = tmp_path / "records"
    shutil.copytree(shard_dir[0], folder)
    opened = tfpipe.open_shards(str(folder), folds=[0])
    shard, count = opened.files[0], opened.counts[opened.files[0]]

    class CutAfterEpoch1(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                cut_shard(shard, slice(0, 2) if change == "cut" else [0, 0, *range(2, count)])

    cfg = FitConfig(records=str(folder), run=str(tmp_path / "run"), model="small-cnn", epochs=2, batch_size=4,
                    strategy="cpu", verbose=0, callbacks=(CutAfterEpoch1(),))  # fmt: skip
    says = rf"{re.escape(shard)}: holds 2 records, expected \d+: it changed while" if change == "cut" else (
        r"the id '\w+' is in two validation records \(a shard changed while this job read it\?\)"
    )  # fmt: skip
    with pytest.raises(TfpipeError, match=says):
        fit(cfg)


def test_a_fit_interrupted_in_its_report_resumes_without_training_again(shard_dir, tmp_path, monkeypatch):
    """Ctrl-C after the last epoch (saving the model, in the report): ``--resume`` continues from the kept backup
    with nothing to train, reports, and counts every epoch once. A run folder whose history has epochs and no
    backup (what tfpipe 1.0 left there) is refused rather than trained again from scratch."""
    import train.keras.trainer
    from tests.test_train_contracts import small
    from train.fit import fit

    run = tmp_path / "run"
    real = train.keras.trainer.reports

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train.keras.trainer, "reports", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fit(small(shard_dir, run, epochs=2))
    assert not (run / "model.keras").exists() and os.listdir(run / "backup" / "fine-tune")
    monkeypatch.setattr(train.keras.trainer, "reports", real)
    left = tmp_path / "left-by-1.0"
    shutil.copytree(run, left)
    shutil.rmtree(left / "backup")

    (run / "model.tmp-1a2b3c4d.keras").write_bytes(b"half a model")  # left by a job killed while saving
    (run / "mine.tmp-1a2b3c4d").write_text("the user's")
    metrics = fit(small(shard_dir, run, epochs=2, resume=True)).metrics
    assert not (run / "model.tmp-1a2b3c4d.keras").exists() and (run / "mine.tmp-1a2b3c4d").exists()
    history = (run / "history.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in history[1:]] == ["0", "1"] and metrics["epochs"] == 2
    assert (run / "model.keras").exists() and not (run / "backup").exists()  # finished: no backup kept
    import pandas as pd  # the speed and time of the run, not of the job that resumed it (which trained nothing)

    timing = pd.read_csv(run / "history.csv")[["images_per_sec", "seconds"]]
    assert (timing > 0).all().all() and metrics["images_per_sec"] == round(timing["images_per_sec"].iloc[1], 1)
    assert metrics["seconds"] >= round(timing["seconds"].sum(), 1)
    with pytest.raises(TfpipeError, match=r"history.csv lists 2 epochs but no backup is left to continue from"):
        fit(small(shard_dir, left, epochs=2, resume=True))


@pytest.mark.slow  # two train.fit processes, 30-60 s
def test_a_real_ctrl_c_after_saving_the_model_then_resume_finishes_the_run_once(shard_dir, tmp_path):
    """The issue's case as a user meets it: SIGINT to ``train.fit`` once it says "saving model.keras", then
    ``--resume``: exit 130, then a finished run with every epoch once and ``--epochs 1`` reported as 1 epoch."""
    import signal

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.fit", "--records", shard_dir[0], "--run", str(run), "--strategy", "cpu",
           "--model", "small-cnn", "--batch-size", "8", "--epochs", "1", "--steps-per-execution", "1",
           "--verbose", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    sigint_as_a_terminal_sends_it()
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if "saving model.keras" in line:
                job.send_signal(signal.SIGINT)
                break
        assert job.wait(120) == 130, job.stderr.read()[-2000:]
    finally:
        job.kill()
    assert job.stderr.read().strip().splitlines()[-1] == (
        "train.fit: interrupted: every epoch is saved; --resume writes the model and report"
    )
    done = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    history = (run / "history.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in history[1:]] == ["0"], history
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["epochs"] == 1 and (run / "model.keras").exists()
    assert metrics["stops"] == [{"signal": "SIGINT", "at": "the report"}]  # the stopped job, counted


# ----------------------------------------------------------------- 4: children that always die
def processes_marked(mark):
    """The processes whose environment carries ``TFPIPE_TEST_MARK=mark``: a job's ranks, their DataLoader workers
    and multiprocessing's helpers all inherit it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"TFPIPE_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def children(parents, mark):
    """The marked processes whose parent is one of ``parents``."""
    found = []
    for pid in processes_marked(mark):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) in parents:
                    found.append(pid)
        except OSError:
            continue
    return found


def none_left(mark, seconds=15):
    import time

    deadline = time.monotonic() + seconds
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_marked(mark)


def start_ddp(records, mark):
    cmd = [sys.executable, "examples/torch_ddp.py", "--records", records, "--processes", "2", "--workers", "2",
           "--epochs", "40", "--batch-size", "8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT, "TFPIPE_TEST_MARK": mark}
    sigint_as_a_terminal_sends_it()
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_line(job, starting):
    for line in job.stdout:
        if line.startswith(starting):
            return line
    raise AssertionError(job.stderr.read()[-3000:])


@pytest.mark.slow  # three runs of examples/torch_ddp.py, about a minute
@pytest.mark.parametrize("how", ["ctrl-c", "kill-main", "kill-a-rank"])
def test_the_ddp_recipe_leaves_no_process_behind_and_says_why_in_one_line(demo_shards, how):
    """Ctrl-C to the main process ends every rank within seconds (exit 130, instead of training every epoch left);
    ``kill -9`` of the main process while the ranks' DataLoader workers start leaves no worker or helper behind;
    a rank killed mid-training is one line naming it (not 72 lines of traceback), and the others stop."""
    import signal
    import time
    import uuid

    mark = uuid.uuid4().hex
    job = start_ddp(demo_shards, mark)
    try:
        if how == "kill-main":
            deadline = time.monotonic() + 60
            while not children(children([job.pid], mark), mark) and time.monotonic() < deadline:
                time.sleep(0.02)  # until the ranks' first DataLoader workers start
            job.kill()
            job.wait(30)
        else:
            first_line(job, "epoch 1/40")
            if how == "ctrl-c":
                job.send_signal(signal.SIGINT)
            else:
                os.kill(max(children([job.pid], mark)), signal.SIGKILL)
            code = job.wait(30)
            err = job.stderr.read().strip()
            assert len(err.splitlines()) == 1 and "Traceback" not in err, err
            if how == "ctrl-c":
                assert code == 130 and "interrupted" in err, (code, err)
            else:
                assert code == 2 and re.search(r"rank [01] was killed by SIGKILL; the other ranks were stopped", err), (
                    err
                )
        assert none_left(mark) == []
    finally:
        job.kill()
        for pid in processes_marked(mark):
            os.kill(pid, 9)


THREAD_THEN_MAIN = """
import sys, threading, time
from tfpipe.torch.lightning import ShardDataModule

data = ShardDataModule(sys.argv[1], workers=1, batch_size=4)
loader = data.val_dataloader()
seen = []
first = threading.Thread(target=lambda: seen.append(sum(len(b[0]) for b in loader)))
first.start()
first.join()  # the thread that started the persistent worker has ended
time.sleep(1.5)
seen.append(sum(len(b[0]) for b in loader))
print(seen)
"""


def test_persistent_workers_started_from_a_thread_that_ends_live_on(shard_dir):
    """``ShardDataModule(workers=1)``: epoch 1 iterated in a thread that then ends, epoch 2 in the main thread. The
    kernel's parent-death signal belongs to the thread that started a worker: the workers are watched by a thread
    of their own instead, so they neither die with that thread nor outlive the process."""
    done = subprocess.run([sys.executable, "-c", THREAD_THEN_MAIN, shard_dir[0]], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    n = tfpipe.count_examples(shard_dir[0], folds=[0])
    assert done.stdout.strip() == f"[{n}, {n}]"


KILLED_IN_COMMIT = """
import os, signal, sys
import tfpipe
from tfpipe.runtime import fs
from tfpipe.writer.images import ImageSpec

real, moved = fs.rename, []

def rename(src, dst, overwrite=False):  # kill -9 once two shards are in place: no cleanup runs
    if dst.endswith(".tfrec"):
        if len(moved) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        moved.append(dst)
    return real(src, dst, overwrite)

fs.rename = rename
source = tfpipe.Source(sys.argv[1] + "/images", csv=sys.argv[1] + "/train.csv")
tfpipe.write_shards(source, sys.argv[2], spec=ImageSpec(image_size=16), num_shards=4, workers=0, progress=False)
"""


@pytest.mark.parametrize("how", ["--resume", "--overwrite"])
def test_a_write_killed_in_its_commit_is_finished_by_resume_or_replaced_by_overwrite(tmp_path, how):
    """``kill -9`` after 2 of 4 shards moved into the folder, before the manifest: ``--resume`` finishes that
    commit (the staged manifest says where each shard goes) and ``--overwrite`` replaces it; before, both were
    refused (the moved shards were "not written by tfpipe.write") and the folder needed hands."""
    from tfpipe.write import main

    small_source(tmp_path / "src")
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_COMMIT, str(tmp_path / "src"), str(out)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, timeout=120)  # fmt: skip
    assert killed.returncode == -9 and len(list(out.glob("*.tfrec"))) == 2 and not (out / "manifest.json").exists()
    args = ["--csv", str(tmp_path / "src" / "train.csv"), "--images", str(tmp_path / "src" / "images")]
    assert main([*args, "--out", str(out), "--image-size", "16", "--num-shards", "4", "--workers", "0", how]) == 0
    shards = tfpipe.open_shards(str(out))
    assert shards.num_examples == 12 and len(shards.files) == 4 and tfpipe.verify(shards) == []
    assert sorted(p.name for p in out.iterdir()) == sorted([*map(os.path.basename, shards.files), "manifest.json"])


def test_two_jobs_taking_over_one_dead_lock_at_once_never_both_hold_it(tmp_path):
    """A lock left by a dead job, and two jobs starting together: each judges it dead; the one that takes it away
    second must not take away the first one's fresh lock (it did in 156 of 300 tries: both then held the folder)."""
    import socket

    from tfpipe.runtime.locks import LOCK, WriteLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    both = 0
    for trial in range(150):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        (folder / LOCK).write_text(json.dumps({"id": "gone", "host": socket.gethostname(), "pid": int(dead.stdout)}))
        start, held = threading.Barrier(2), []

        def job(start=start, held=held, folder=folder):
            lock = WriteLock(str(folder), None)
            start.wait()
            try:
                lock.__enter__()
            except TfpipeError:
                return
            held.append(lock)

        jobs = [threading.Thread(target=job) for _ in range(2)]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        both += len(held) == 2
        assert len(held) >= 1 and [lock.held() for lock in held].count(True) == 1, trial
        for lock in held:
            lock.__exit__(None, None, None)
    assert both == 0


def test_a_shard_file_given_twice_is_refused(shard_dir):
    """Read twice, its records would be counted, trained on and scored twice (and the torch reader failed)."""
    f = tfpipe.open_shards(shard_dir[0]).files[0]
    for records in ([f, f], [f, os.path.join(os.path.dirname(f), ".", os.path.basename(f))]):
        with pytest.raises(TfpipeError, match="is given twice"):
            tfpipe.open_shards(records)


def test_a_model_file_whose_config_is_damaged_is_one_line(trained_run, tmp_path):
    """The config.json inside model.keras is read as strictly as every JSON file read back."""
    import zipfile

    from train.keras.run_model import load_model

    run, _, _ = trained_run
    with zipfile.ZipFile(f"{run}/model.keras") as z:
        members = {n: z.read(n) for n in z.namelist()}
    config = members["config.json"].decode()
    for name, text, says in (
        ("twice", config.replace('"class_name": ', '"class_name": "Dense", "class_name": ', 1), "gives the key"),
        ("cut", config[:40], "is not valid JSON"),
        ("wrong", '{"class_name": [1, 2, 3]}', "does not describe a model Keras can build"),
    ):
        path = tmp_path / f"{name}.keras"
        with zipfile.ZipFile(path, "w") as z:
            for member, data in members.items():
                z.writestr(member, text if member == "config.json" else data)
        with pytest.raises(TfpipeError, match=f"{name}.keras: its config.json {says}"):
            load_model(str(path))


def test_the_command_prints_the_scores_also_without_progress(trained_run, shard_dir, tmp_path, capsys):
    from train.predict import main

    run, _, _ = trained_run
    args = ["--run", run, "--records", shard_dir[0], "--out", str(tmp_path / "s.csv"), "--strategy", "cpu"]
    assert main([*args, "--no-progress"]) == 0
    assert "scores on the labeled shards" in capsys.readouterr().out


@pytest.mark.slow  # three runs of examples/lightning_swa.py, about a minute
@pytest.mark.parametrize(
    "how", ["ctrl-c", "sigterm", "sigterm-as-ranks-start", "kill-a-rank", "kill-a-rank-as-it-starts", "kill-a-worker"]
)
def test_the_lightning_recipe_stops_every_rank_and_says_why_in_one_line(demo_shards, how):
    """Lightning's own launcher: Ctrl-C is exit 130 (Lightning made it 1); a rank killed is named by rank 0 and a
    DataLoader worker killed by its rank, in one line each instead of every rank's traceback; nothing is left.
    Lightning's own watch over the ranks would SIGKILL rank 0 (exit -9, silent) once a rank has ended: also while
    rank 0 says why (a Ctrl-C in CI), and when a rank dies before the ranks have met."""
    import signal
    import time
    import uuid

    mark = uuid.uuid4().hex
    cmd = [sys.executable, "examples/lightning_swa.py", "--records", demo_shards, "--devices", "2", "--epochs", "400",
           "--swa-epochs", "2", "--batch-size", "8", "--workers", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT, "TFPIPE_TEST_MARK": mark}
    sigint_as_a_terminal_sends_it()
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def rank_one():
        for pid in children([job.pid], mark):
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"LOCAL_RANK=1" in f.read().split(b"\0"):
                    return pid
        return None

    try:
        deadline = time.monotonic() + 120
        while not rank_one() and time.monotonic() < deadline:
            time.sleep(0.05)
        if how == "sigterm-as-ranks-start":  # rank 1 still importing torch: its parent dies before it could know
            job.send_signal(signal.SIGTERM)
            code, err = job.wait(60), job.stderr.read()
            assert code == 143 and "Traceback" not in err, (code, err[-3000:])  # rank 0's own handler: not -15
            assert none_left(mark, seconds=60) == []  # rank 1 leaves as soon as it has started; it stayed for good
            return
        if how == "kill-a-rank-as-it-starts":  # rank 0 waits for it to meet the others: only the watch can see it
            os.kill(rank_one(), signal.SIGKILL)
        else:
            while not (rank_one() and len(children([job.pid], mark)) > 1) and time.monotonic() < deadline:
                time.sleep(0.2)  # rank 1 and rank 0's first DataLoader worker
            time.sleep(3)
            rank = rank_one()
            if how in ("ctrl-c", "sigterm"):
                job.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
            else:
                os.kill(rank if how == "kill-a-rank" else min(set(children([job.pid], mark)) - {rank}), signal.SIGKILL)
        code = job.wait(60)
        err = job.stderr.read()
        ours = [line for line in err.splitlines() if line.startswith("lightning_swa:")]
        if how == "sigterm":  # the code a shell gives a terminated process; one line once Lightning's handler runs
            assert code == 143 and "Traceback" not in err, (code, err[-3000:])
            assert ours == ["lightning_swa: terminated (SIGTERM); every rank stopped"], err[-3000:]
            assert none_left(mark) == []
            return
        assert "Traceback" not in err and len(ours) == 1, err[-3000:]
        expected = {
            "ctrl-c": (130, "lightning_swa: interrupted"),
            "kill-a-rank": (2, "lightning_swa: error: rank 1 was killed by SIGKILL; the other ranks were stopped"),
            "kill-a-rank-as-it-starts": (2, "lightning_swa: error: rank 1 was killed by SIGKILL; the other ranks"),
            "kill-a-worker": (2, "lightning_swa: error: rank 0: DataLoader worker (pid"),
        }[how]
        assert code == expected[0] and ours[0].startswith(expected[1]), (code, ours)
        assert none_left(mark) == []
    finally:
        job.kill()
        for pid in processes_marked(mark):
            os.kill(pid, 9)


def test_a_folders_record_of_its_files_is_input_too(tmp_path):
    """Issue #64: ``files.json`` is checked like every file read back: a folder of a tfpipe that keeps it and has
    none, a file it does not list, an entry of the wrong shape, each one line; a folder of an older tfpipe is read
    with a warning that its files are not checked."""
    import warnings

    from train.runs import files
    from train.runs.run import RUN_VERSION, check_file
    from train.runs.thresholds import load_thresholds, save_thresholds

    config = {"classes": ["a", "b"], "image_size": 8, "single_label": False, "fit": "stretch", "dataset_id": "d"}
    (tmp_path / "config.json").write_text(json.dumps({"run_version": 2, **config}))
    (tmp_path / "thresholds.json").write_text('{"a": 0.3, "b": 0.5}')
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert load_thresholds(str(tmp_path), ["a", "b"]) == [0.3, 0.5]
    assert [str(w.message) for w in said] == [
        f"{tmp_path} was written by an earlier tfpipe, which kept no record of its files: thresholds.json is used "
        "unchecked"
    ]
    (tmp_path / "config.json").write_text(json.dumps({"run_version": RUN_VERSION, **config}))
    with pytest.raises(TfpipeError, match=r"files.json: missing, the record of the files this folder's job wrote"):
        load_thresholds(str(tmp_path), ["a", "b"])
    save_thresholds(str(tmp_path), ["a", "b"], [0.3, 0.5], "model-swa.keras", "-swa", views=2)  # recorded
    assert load_thresholds(str(tmp_path), ["a", "b"], swa=True, views=2) == [0.3, 0.5]
    with pytest.raises(TfpipeError, match=r"thresholds.json: not in files.json, .*: copied in from elsewhere\?"):
        load_thresholds(str(tmp_path), ["a", "b"])
    files.record(str(tmp_path), ["thresholds.json"], "model-swa.keras", 1)  # recorded as another model's
    with pytest.raises(TfpipeError, match=r"recorded as the file \(of model-swa.keras, 1 view\), not of model.keras"):
        load_thresholds(str(tmp_path), ["a", "b"])
    record = json.loads((tmp_path / "files.json").read_text())
    for damage in ({"sha256": "x"}, {"views": 0}, {"extra": 1}):
        entry = dict(record["files"]["thresholds.json"], **damage)
        (tmp_path / "files.json").write_text(json.dumps({**record, "files": {"thresholds.json": entry}}))
        with pytest.raises(TfpipeError, match=r"files.json: its entry 'thresholds.json' is not a file's record"):
            check_file(str(tmp_path), "thresholds.json", "remedy")
    (tmp_path / "files.json").write_text(json.dumps({**record, "files": {"../x": record["files"]["thresholds.json"]}}))
    with pytest.raises(TfpipeError, match=r"its entry '../x' is not a file's record"):
        files.read(str(tmp_path))
