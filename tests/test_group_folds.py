"""Group folds (issue #36): every image of a group (patient, video, site) in one fold, the labels still
stratified as well as the groups allow, recorded in the manifest and shown by inspect; refused where it cannot
hold."""

import json

import numpy as np
import pytest

import tfpipe
from tests.conftest import save, write_csv
from tfpipe.inspect import main as inspect_main
from tfpipe.runtime.errors import TfpipeError
from tfpipe.sources.folds import assign_folds, fold_balance
from tfpipe.write import main


def grouped_targets(num_groups, seed=0, classes=6, most=11):
    """Synthetic multi-label records in groups of 1..``most`` images that share their group's labels (as the
    photographs of one patient do)."""
    rng = np.random.default_rng(seed)
    targets, groups = [], []
    for g in range(num_groups):
        labels = sorted(rng.choice(classes, size=rng.integers(0, 3), replace=False).tolist())
        for _ in range(rng.integers(1, most + 1)):
            targets.append(labels)
            groups.append(f"patient-{g}")
    return targets, groups


def test_no_group_crosses_folds_and_every_class_stays_balanced():
    targets, groups = grouped_targets(260)
    folds = assign_folds(targets, 6, 5, seed=0, groups=groups)
    fold_of_group = {}
    for group, fold in zip(groups, folds):
        assert fold_of_group.setdefault(group, fold) == fold, f"{group} is in folds {fold_of_group[group]} and {fold}"
    balance = fold_balance(targets, folds, 6, 5)
    assert balance.deviation <= 0.05, balance  # each class within 5% of an even share in every fold (1.8% here)
    assert balance.largest - balance.smallest <= 0.1 * len(targets) / 5, balance  # sizes within 10% (5% here)
    # Without groups the images of one patient spread over the folds: what flatters validation.
    spread = assign_folds(targets, 6, 5, seed=0)
    assert sum(len({f for g, f in zip(groups, spread) if g == name}) > 1 for name in set(groups)) > 100
    assert assign_folds(targets, 6, 5, seed=0, groups=groups) == folds  # the seed decides
    assert assign_folds(targets, 6, 5, seed=1, groups=groups) != folds


def test_fewer_groups_than_folds_is_refused():
    targets, groups = grouped_targets(3)
    with pytest.raises(TfpipeError, match="needs at least 4 groups, and the images come from 3"):
        assign_folds(targets, 6, 4, groups=groups)


@pytest.fixture
def grouped_folder(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for i in range(24):
        save(images / f"img{i:02d}.jpg", size=(20, 20), seed=i)
        rows.append((f"img{i:02d}", ["a", "b", "a b", ""][i // 3 % 4], f"p{i // 3}"))  # 8 patients of 3 images
    return tmp_path, write_csv(tmp_path / "train.csv", ["image", "labels", "patient"], rows)


def test_a_grouped_write_keeps_each_group_in_one_fold_and_says_how_even(grouped_folder, capsys):
    root, csv = grouped_folder
    out = root / "out"
    args = ["--csv", str(csv), "--images", str(root / "images"), "--image-size", "8", "--workers", "0"]
    assert main([*args, "--out", str(out), "--num-folds", "4", "--group-col", "patient"]) == 0
    said, warned = capsys.readouterr()
    assert "reads like a group" not in warned
    assert "folds by group 'patient': 4 folds of 6-6 images, no group in two; the class furthest from" in said, said
    manifest = tfpipe.open_shards(str(out)).manifest
    assert manifest.group_column == "patient" and "4 folds by group 'patient'" in repr(manifest)
    for k in range(4):
        patients = {int(name[3:]) // 3 for name in tfpipe.image_names(str(out), folds=[k])}
        assert len(patients) == 2, (k, patients)  # two whole patients of three images each
    assert inspect_main([str(out), "--no-sheet"]) == 0
    assert "4 folds by group 'patient' (manifest)" in capsys.readouterr().out

    plain = root / "plain"  # no groups: the manifest as before (no group_column key), the same dataset id rules
    assert main([*args, "--out", str(plain), "--num-folds", "4"]) == 0
    assert "group_column" not in json.loads((plain / "manifest.json").read_text())
    hint = [ln for ln in capsys.readouterr().err.splitlines() if "reads like a group" in ln]  # issue #54: a hint
    assert hint == [
        f"tfpipe.write: warning: {csv}: column 'patient' reads like a group (8 values over 24 rows) and the folds "
        "were drawn without it: images of one patient in both training and validation folds make validation "
        "over-promise; write again with --group-col patient to keep each in one fold (a hint: nothing was refused)"
    ]

    edited = json.loads((out / "manifest.json").read_text())
    edited["group_column"] = ""
    (out / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(TfpipeError, match="field 'group_column' names the CSV column folds were made by"):
        tfpipe.open_shards(str(out))


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--group-col", "patient"], "--group-col keeps each group in one fold, and no folds are asked for"),
        (["--group-col", "site", "--num-folds", "2"], "'site'"),
        (["--group-col", "patient", "--num-folds", "9"], "--num-folds 9 needs at least 9 groups"),
    ],
)
def test_a_group_setting_that_cannot_hold_is_one_line(grouped_folder, tmp_path, capsys, extra, says):
    root, csv = grouped_folder
    args = ["--csv", str(csv), "--images", str(root / "images"), "--out", str(tmp_path / "o"), "--workers", "0"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_an_image_without_a_group_is_named(grouped_folder, tmp_path):
    root, csv = grouped_folder
    lines = csv.read_text().splitlines()
    lines[5] = lines[5].rsplit(",", 1)[0] + ","  # row 5: no patient
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(TfpipeError, match="row 5, column 'patient': empty group"):
        tfpipe.write_shards(tfpipe.Source(str(root / "images"), csv=str(csv), group_col="patient"), str(tmp_path / "o"),
                            num_folds=2, workers=0, progress=False)  # fmt: skip
    for missing in (
        "nan",
        " None",
        "NA",
        "none",
    ):  # pandas' spelling of an empty cell is no group of its own (issue #53)
        lines[5], lines[7] = lines[5].rsplit(",", 1)[0] + "," + missing, lines[7].rsplit(",", 1)[0] + ",nan"
        csv.write_text("\n".join(lines) + "\n")
        with pytest.raises(TfpipeError, match=f"row 5, column 'patient': '{missing.strip()}' is a missing-value spel"):
            tfpipe.write_shards(tfpipe.Source(str(root / "images"), csv=str(csv), group_col="patient"),
                                str(tmp_path / "o"), num_folds=2, workers=0, progress=False)  # fmt: skip
    with pytest.raises(TfpipeError, match="group_col names a CSV column, and images in a folder per class"):
        tfpipe.write_shards(tfpipe.Source(str(root / "images"), group_col="patient"), str(tmp_path / "o"),
                            num_folds=2, workers=0, progress=False)  # fmt: skip


@pytest.mark.parametrize(
    "spelling, says",
    [
        ("p3\u200b", r"holds U\+200B ZERO WIDTH SPACE, an invisible character that would make a group of its own"),
        ("P3", r"groups 'p3' \(row 10\) and 'P3' \(row 12\) differ only in case"),
    ],
)
def test_one_group_spelled_two_ways_is_refused_as_labels_are(grouped_folder, tmp_path, spelling, says):
    """One patient written two ways would be two groups, split between folds while the writer said none is."""
    root, csv = grouped_folder
    lines = csv.read_text().splitlines()
    lines[12] = lines[12].rsplit(",", 1)[0] + "," + spelling  # row 12: the third image of patient p3
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(TfpipeError, match=says):
        tfpipe.write_shards(tfpipe.Source(str(root / "images"), csv=str(csv), group_col="patient"), str(tmp_path / "o"),
                            num_folds=2, workers=0, progress=False)  # fmt: skip


def test_groups_by_the_ids_or_the_labels_and_groups_too_large_are_told(grouped_folder, tmp_path, capsys):
    root, csv = grouped_folder
    for column, says in (("labels", "names the column of the labels"), ("image", "names the column of the ids")):
        with pytest.raises(TfpipeError, match=f"group_col={column!r} {says}"):
            tfpipe.write_shards(tfpipe.Source(str(root / "images"), csv=str(csv), group_col=column),
                                str(tmp_path / "o"), num_folds=2, workers=0, progress=False)  # fmt: skip
    lines = csv.read_text().splitlines()  # 18 of 24 images in one group: folds cannot be even
    lines[1:19] = [line.rsplit(",", 1)[0] + ",big" for line in lines[1:19]]
    csv.write_text("\n".join(lines) + "\n")
    tfpipe.write_shards(tfpipe.Source(str(root / "images"), csv=str(csv), group_col="patient"), str(tmp_path / "big"),
                        num_folds=3, workers=0, progress=False)  # fmt: skip
    err = capsys.readouterr().err
    assert "warning: folds of 3 to 18 images where an even split is 8: some groups are too large" in err, err


def test_a_source_of_ones_own_with_groups_is_recorded_and_checked(tmp_path, capsys):
    """A ``SourceProtocol`` of one's own whose items carry ``group``: the manifest calls it "group"; an empty
    or non-string group is refused; a shard count the folds cannot share evenly is said."""
    from tfpipe.sources.source import Item, Source

    images = tmp_path / "images"
    images.mkdir()
    for i in range(12):
        save(images / f"{i}.jpg", size=(16, 16), seed=i)

    class Mine(Source):
        def items(self, skip_bad=False):
            return [Item(str(images / f"{i}.jpg"), str(i), ("ab"[i % 2],), group=self.groups[i]) for i in range(12)], []

    def write_mine(groups, out):
        source = Mine(str(images))
        object.__setattr__(source, "groups", groups)
        return tfpipe.write_shards(source, str(tmp_path / out), num_folds=3, num_shards=8, workers=0, progress=False)

    manifest = write_mine([f"g{i // 2}" for i in range(12)], "ok")
    assert manifest.group_column == "group" and len(manifest.shards) == 9
    said = capsys.readouterr()
    assert "folds by group 'group'" in said.out and "9 shards written where num_shards=8 asked for 8" in said.err
    for bad in ("", 5):
        with pytest.raises(TfpipeError, match=f"has the group {bad!r}, and other images have one"):
            write_mine([bad] + [f"g{i // 2}" for i in range(1, 12)], "bad")


def test_only_a_column_named_for_a_group_gets_the_hint():
    """The hint's names (hostile round of issue #54): Kaggle's camel-case and id spellings are groups; another
    figure about a group (its count, its model) is not."""
    from tfpipe.sources.csv import reads_like_a_group

    groups = ["patient", "PatientID", "patientId", "patientid", "StudyInstanceUID", "Case Number", "scene_id", "videos"]
    others = ["site_count", "is_site_visit", "camera_model", "user_rating", "AgeGroup", "image", "labels", "width"]
    assert [reads_like_a_group(c) for c in groups + others] == [True] * len(groups) + [False] * len(others)


def distinct(root):
    """The grouped folder's images made all distinct: seeds 18 and 20 draw one colour, so img20 copies img18."""
    save(root / "images" / "img20.jpg", size=(20, 20), seed=24)


def with_copies(root, csv):
    """The grouped folder (all distinct) plus two byte-identical copies: ``dup-b`` of img01 (label a) labelled b
    in img01's patient p0, ``dup-c`` of img04 (patient p1) in patient p5."""
    import shutil

    distinct(root)
    shutil.copy(root / "images" / "img01.jpg", root / "images" / "dup-b.jpg")
    shutil.copy(root / "images" / "img04.jpg", root / "images" / "dup-c.jpg")
    with open(csv, "a") as f:
        f.write("dup-b,b,p0\ndup-c,b,p5\n")
    rows = [line.split(",") for line in csv.read_text().splitlines()[1:]]
    return [[{"a": 0, "b": 1}[c] for c in labels.split()] for _, labels, _ in rows], [p for *_, p in rows]


def folds_by_name(out, k):
    return {name: f for f in range(k) for name in tfpipe.image_names(str(out), folds=[f])}


def test_identical_images_stay_in_one_fold_their_groups_joined_and_their_labels_kept(grouped_folder, capsys):
    """Issue #65: a copy in another fold than its original makes validation score an image it trained on."""
    from tfpipe.tf.columns import read_targets

    root, csv = grouped_folder
    targets, groups = with_copies(root, csv)
    naive, naive_grouped = assign_folds(targets, 2, 4, seed=0), assign_folds(targets, 2, 4, seed=0, groups=groups)
    assert naive[1] != naive[24] and naive[4] != naive[25] and naive_grouped[3] != naive_grouped[15]  # would split
    args = ["--csv", str(csv), "--images", str(root / "images"), "--image-size", "8", "--workers", "0", "--no-progress"]
    for extra, merged in (([], ""), (["--group-col", "patient"], " (2 groups merged into 1)")):
        out = root / f"out{len(extra)}"
        assert main([*args, "--out", str(out), "--num-folds", "4", *extra]) == 0
        said, warned = capsys.readouterr()
        line = f"tfpipe.write: 2 byte-identical images kept in the fold of the image they copy{merged}"
        assert line in said.splitlines(), said
        assert "1 image is labelled otherwise than the image it copies (e.g. dup-b [b], img01 [a])" in warned
        assert "in another fold" not in warned, warned
        fold = folds_by_name(out, 4)
        assert fold["dup-b"] == fold["img01"] and fold["dup-c"] == fold["img04"], fold
        if extra:  # p1 and p5 joined: all six images in one fold
            assert len({fold[f"img{i:02d}"] for i in (3, 4, 5, 15, 16, 17)}) == 1, fold
        stored = dict(zip(tfpipe.image_names(str(out)), read_targets(str(out), 2).tolist()))
        assert stored["dup-b"] == [0, 1] and stored["img01"] == [1, 0] and stored["dup-c"] == [0, 1]  # as given
        assert main([*args, "--out", str(out), "--num-folds", "4", *extra, "--resume"]) == 0  # the same plan
        assert "this write already finished" in capsys.readouterr().out


def test_without_copies_the_folds_and_fingerprint_are_as_before(grouped_folder):
    from tfpipe.writer.images import ImageSpec
    from tfpipe.writer.job import input_identities, job_fingerprint, plan_job

    root, csv = grouped_folder
    distinct(root)
    rows = [line.split(",") for line in csv.read_text().splitlines()[1:]]
    targets = [[{"a": 0, "b": 1}[c] for c in labels.split()] for _, labels, _ in rows]
    for group_col in (None, "patient"):
        source = tfpipe.Source(str(root / "images"), csv=str(csv), group_col=group_col)
        job = plan_job(source, ImageSpec(), None, "train", None, 4, 0, False)
        groups = [p for *_, p in rows] if group_col else None
        fold = {
            item.name: s["fold"] for item, s in zip(job.items, (s for s in job.shard_plan for _ in range(s["size"])))
        }
        assert [fold[name] for name, *_ in rows] == assign_folds(targets, 2, 4, seed=0, groups=groups)
        assert job.kept is None
        assert job.fingerprint == job_fingerprint(job.items, job.targets, job.classes, job.shard_plan, ImageSpec(),
                                                  "train", input_identities(job.items), job.group_column)  # fmt: skip


def test_copies_join_groups_by_union_and_refuse_too_few_distinct_images():
    from tfpipe.sources.folds import merge_groups

    merged = merge_groups(["g0", "g1", "g2", "g3", "g1", "g3"], [0, 1, 2, 3, 0, 2])  # g1-g0, g3-g2
    assert merged.groups == ["g0", "g0", "g2", "g2", "g0", "g2"] and (merged.merged, merged.into) == (4, 2)
    targets = [[0], [1], [0], [1]]
    assert assign_folds(targets, 2, 2, copies=[0, 1, 2, 3]) == assign_folds(targets, 2, 2)
    folds = assign_folds(targets, 2, 2, copies=[0, 1, 0, 1])
    assert folds[0] == folds[2] and folds[1] == folds[3] and folds[0] != folds[1]
    with pytest.raises(TfpipeError, match="num_folds=3 is more than the 2 distinct images"):
        assign_folds(targets, 2, 3, copies=[0, 1, 0, 1])
