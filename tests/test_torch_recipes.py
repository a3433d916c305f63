"""The PyTorch recipes (issue #25): DDP on 8 CPU processes never hangs and shares out every record, the examples
learn the demo, and the Lightning DataModule keeps RecordDataset's guarantees."""

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import tfpipe
from tests.conftest import save, write_csv
from tfpipe.runtime.errors import TfpipeError
from tfpipe.runtime.net import free_port
from tfpipe.torch.dataset import RecordDataset, unique_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUC_LINE = re.compile(r"^(SWA )?validation AUC (\d\.\d+)$")


def run_python(args, timeout, env=None, **kwargs):
    """A fresh interpreter (no TensorFlow: DataLoader workers may fork) in the repository."""
    env = env or {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kwargs
    )


@pytest.fixture(scope="module")
def unequal_shards(tmp_path_factory):
    """43 labeled images in 3 shards of 15, 14 and 14 records: no count here divides by 8."""
    from tfpipe import ImageSpec, Source, write_shards

    root = tmp_path_factory.mktemp("unequal")
    (root / "images").mkdir()
    rows = []
    for i in range(43):
        save(root / "images" / f"u{i:02d}.jpg", size=(20, 24), seed=i)
        rows.append((f"u{i:02d}", ["a", "b", "a b", ""][i % 4]))
    csv = write_csv(root / "train.csv", ["image", "labels"], rows)
    out = str(root / "records")
    write_shards(Source(str(root / "images"), csv=str(csv)), out, spec=ImageSpec(image_size=16), num_shards=3,
                 workers=0, progress=False)  # fmt: skip
    return out, sorted(name for name, _ in rows)


@pytest.mark.slow
def test_a_ddp_epoch_on_8_ranks_with_2_workers_ends_and_reads_every_record(unequal_shards, tmp_path):
    """8 gloo ranks x 2 DataLoader workers, 2 epochs of DDP training on 43 records in 3 unequal shards: every
    rank the same number of batches (else the all-reduce waits forever: the timeout fails the test), every record
    read, and only the padding (48 - 43 = 5 records) read twice."""
    records, names = unequal_shards
    out = tmp_path / "seen.json"
    done = run_python(["-m", "tests.ddp_epoch", records, str(out), "8", "2"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    for epoch in ("0", "1"):
        seen = [r[epoch] for r in ranks]
        assert {r["batches"] for r in seen} == {r["len_loader"] for r in seen} == {2}  # 6 records a rank, batch 4
        counts = collections.Counter(n for r in seen for n in r["names"])
        assert sorted(counts) == names and sum(counts.values()) == 48
        assert sorted(counts.values()).count(2) == 5 and max(counts.values()) == 2
    assert ranks[0]["0"]["names"] != ranks[0]["1"]["names"]  # set_epoch reached the persistent workers


@pytest.fixture(scope="module")
def demo_test_shards(tmp_path_factory):
    """60 unlabeled images of the demo's kind at 48 px (demo_shards' size): a test set to submit predictions of."""
    from tfpipe.demo import make_demo

    root = tmp_path_factory.mktemp("demo_test")
    make_demo(str(root / "data"), train=1, test=60, seed=1)
    out = str(root / "records")
    tfpipe.write_shards(tfpipe.Source(str(root / "data" / "images"), csv=str(root / "data" / "test.csv"), labeled=False),
                        out, spec=tfpipe.ImageSpec(image_size=48), split="test", workers=0, progress=False)  # fmt: skip
    return out


def check_run_and_submission(run, submission, test_records, models, printed_auc):
    """The run folder a recipe saved and its submission: config.json a run's (the recipe named), each model's
    weights load into the recipe's model, metrics.json holds the printed AUC exactly, and the submission has one
    row per test image, in the shards' written order, with labels of the run's classes only."""
    import pandas as pd

    from train.runs.run import RunConfig
    from train.torch.models import build_model
    from train.torch.run import load_weights, written_ids

    config = RunConfig.load(run)
    assert config.settings["recipe"] in ("torch_ddp", "lightning_swa") and config.image_size == 48
    weights = [load_weights(run, name) for name in models]
    for state in weights:
        build_model("small-cnn", len(config.classes)).load_state_dict(state)  # strict: every tensor, no other
    if len(weights) == 2:  # the last epoch's and SWA's: two models
        assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    metrics = json.loads((Path(run) / "metrics.json").read_text())
    assert f"{metrics['validation_auc']:.4f}" == printed_auc
    df = pd.read_csv(submission, dtype=str, keep_default_na=False)
    assert list(df.columns) == ["image", "labels"] and len(df) == 60
    assert list(df["image"]) == written_ids(tfpipe.open_shards(test_records))
    assert {c for row in df["labels"] for c in row.split()} <= set(config.classes)
    assert df["labels"].str.len().sum() > 0  # a trained model labels some images


@pytest.mark.slow
def test_torch_ddp_example_learns_the_demo_on_8_processes_and_submits(demo_shards, demo_test_shards, tmp_path):
    run = tmp_path / "run"
    done = run_python(
        ["examples/torch_ddp.py", "--records", demo_shards, "--processes", "8", "--epochs", "24", "--batch-size", "8",
         "--run", str(run), "--predict", demo_test_shards, "--out", str(run / "submission.csv")],
        timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    epochs = [ln for ln in lines if ln.startswith("epoch ")]  # between them, the heartbeat's "torch_ddp: ..." lines
    assert epochs[0].startswith("epoch 1/24: loss") and "(the epoch's mean, rank 0)" in epochs[0] and len(epochs) == 24
    assert f"saved {run}/model.pt" in lines and lines[-2] == f"wrote {run}/submission.csv: 60 rows"
    auc = AUC_LINE.match(lines[-1]).group(2)
    assert float(auc) >= 0.85  # chance is 0.5; measured 0.92 on this machine (24 epochs, about 3 minutes)
    check_run_and_submission(run, run / "submission.csv", demo_test_shards, ["model.pt"], auc)


def torchrun_nodes(commands, tmp_path, timeout):
    """Runs each torchrun command (a "node") at once, waits for all, kills any left; returns them and their
    (stdout, stderr) log files (files: no pipe fills up)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo"}
    logs = [(tmp_path / f"node{i}.out", tmp_path / f"node{i}.err") for i in range(len(commands))]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=out.open("w"), stderr=err.open("w"))
             for command, (out, err) in zip(commands, logs)]  # fmt: skip
    try:
        for node in nodes:
            node.wait(timeout=timeout)
    finally:
        for node in nodes:
            node.kill()
    return nodes, logs


@pytest.mark.slow
def test_torch_ddp_under_torchrun_on_two_nodes_trains_on_4_ranks_and_submits(demo_shards, demo_test_shards, tmp_path):
    """Two torchrun agents (two "nodes") of 2 ranks each meet at a c10d rendezvous on 127.0.0.1: the script starts
    no processes of its own, takes its rank and world from torchrun (4 ranks: the run's metrics say so), and global
    rank 0 alone prints, saves the run and submits. 4 epochs: that the recipe learns is the 8-process test's (24
    epochs there; 4 here took 45 s instead of 115 s alone, 173 s beside CI's other tests)."""
    run, port = tmp_path / "run", free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test", "--",
                "examples/torch_ddp.py", "--records", demo_shards, "--epochs", "4", "--batch-size", "8",
                "--run", str(run), "--predict", demo_test_shards, "--out", str(run / "submission.csv")]  # fmt: skip
    nodes, logs = torchrun_nodes([torchrun, torchrun], tmp_path, timeout=900)
    outputs = [(out.read_text(), err.read_text()) for out, err in logs]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    printed = [out.strip().splitlines() for out, _ in outputs]
    lines = max(printed, key=len)  # the node of global rank 0
    assert min(len(p) for p in printed) == 0  # the other node's ranks print nothing
    assert len([ln for ln in lines if ln.startswith("epoch ")]) == 4
    assert f"saved {run}/model.pt" in lines and lines[-2] == f"wrote {run}/submission.csv: 60 rows"
    auc = AUC_LINE.match(lines[-1]).group(2)
    check_run_and_submission(run, run / "submission.csv", demo_test_shards, ["model.pt"], auc)
    assert json.loads((run / "metrics.json").read_text())["ranks"] == 4


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.slow) for s in ("examples/torch_ddp.py", "examples/lightning_swa.py")]
)
def test_torchrun_nodes_started_with_other_settings_are_refused_on_every_rank(shard_dir, tmp_path, script):
    """Two torchrun nodes whose commands differ in --lr (issue #53: they trained together and exited 0, the
    ranks' weights drifting apart): every rank refuses before the first step, in one line naming the setting
    and both values; no run folder is written."""
    port = free_port()
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "alike", "--",
                 script, "--records", shard_dir[0], "--epochs", "2", "--lr", lr, "--run", str(tmp_path / f"run{i}"),
                 *(["--swa-epochs", "1"] if "lightning" in script else [])]
                for i, lr in enumerate(["0.001", "0.05"])]  # fmt: skip
    nodes, logs = torchrun_nodes(commands, tmp_path, timeout=300)
    if "lightning" not in script:  # a node that refuses its own command (no shards there) tells the other one
        commands[1][commands[1].index("--records") + 1] = str(tmp_path / "nowhere")
        endpoint = f"127.0.0.1:{free_port()}"  # a new rendezvous
        for command in commands:
            command[command.index("--rdzv-endpoint") + 1] = endpoint
        (tmp_path / "refused").mkdir()
        _, refused_logs = torchrun_nodes(commands, tmp_path / "refused", timeout=300)
        said = [
            [ln for ln in err.read_text().splitlines() if ln.startswith("torch_ddp: error: ")]
            for _, err in refused_logs
        ]
        assert said == [
            [
                f"torch_ddp: error: rank 0: rank 1 refused to start ({tmp_path / 'nowhere'}: no shard files found); no rank trains"
            ],
            [f"torch_ddp: error: {tmp_path / 'nowhere'}: no shard files found"],
        ], [err.read_text()[-2000:] for _, err in refused_logs]
    prog = os.path.basename(script).removesuffix(".py")
    for i, (out, err) in enumerate(logs):
        said = [ln for ln in err.read_text().splitlines() if ln.startswith(f"{prog}: error: ")]
        assert nodes[i].returncode != 0 and said == [
            f"{prog}: error: rank {i}: the ranks do not start alike: --lr is 0.05 on rank 1 and 0.001 on rank 0; "
            "start every rank with the same command (paths may differ between machines, the shards they name may not)"
        ], err.read_text()[-3000:]
        assert "epoch 1" not in out.read_text() and not (tmp_path / f"run{i}" / "model.pt").exists()


def test_torch_ddp_under_a_launcher_refuses_a_disagreeing_processes_once_a_machine(shard_dir):
    """The launcher's world (WORLD_SIZE) and --processes disagree: refused before training, in one line from the
    machine's local rank 0, silently by rank 1; both still meet (at 127.0.0.1) to tell each other, and end at
    once instead of one waiting 30 minutes for the other."""
    port = str(free_port())
    ranks = []
    for rank in ("0", "1"):
        launcher = {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port}  # fmt: skip
        ranks.append(subprocess.Popen(
            [sys.executable, "examples/torch_ddp.py", "--records", shard_dir[0], "--processes", "8"], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, **launcher}, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    said = [rank.communicate(timeout=120)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2] and "Traceback" not in said[0] + said[1], said
    line = "torch_ddp: error: --processes 8 but the launcher started 2 ranks (WORLD_SIZE); leave --processes out"
    assert said[0].startswith(line) and said[0].count("\n") == 1 and said[1] == "", said


@pytest.mark.slow
def test_lightning_swa_example_learns_the_demo_on_2_devices_and_submits(demo_shards, demo_test_shards, tmp_path):
    """Also: off a terminal, a line for every epoch and none of Lightning's tips. 2 devices of 16, 16 epochs: the
    8-rank path is the DDP recipe's test; 8 Lightning processes of 8 for 24 epochs took 126 s alone (and 128 s in
    CI), these 48 s (AUC 0.90, SWA 0.89; 2 x 32 for 24 epochs took 73 s alone but 136 s in CI: CPU work counts)."""
    run = tmp_path / "run"
    done = run_python(
        ["examples/lightning_swa.py", "--records", demo_shards, "--devices", "2", "--epochs", "16",
         "--swa-epochs", "4", "--batch-size", "16", "--run", str(run), "--predict", demo_test_shards,
         "--out", str(tmp_path / "submission.csv")],
        timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    epochs = [ln for ln in lines if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in epochs] == [f"epoch {e}/16" for e in range(1, 17)]
    assert all("loss" not in ln or "(the epoch's mean, rank 0)" in ln for ln in epochs)  # one loss, said so
    assert "Tip" not in done.stderr and "predict returned None" not in done.stderr
    assert f"saved {run}/model.pt and model-swa.pt" in lines
    assert lines[-4].startswith("lightning_swa: predicting with model") and "validation AUC" in lines[-4]
    assert lines[-3] == f"wrote {tmp_path}/submission.csv: 60 rows"
    last, swa = (AUC_LINE.match(line) for line in lines[-2:])
    assert last.group(1) is None and swa.group(1) == "SWA "
    assert float(last.group(2)) >= 0.85 and float(swa.group(2)) >= 0.85  # measured 0.90 and 0.89 on this machine
    check_run_and_submission(run, tmp_path / "submission.csv", demo_test_shards, ["model.pt", "model-swa.pt"],
                             last.group(2))  # fmt: skip
    metrics = json.loads((run / "metrics.json").read_text())
    assert f"{metrics['swa_validation_auc']:.4f}" == swa.group(2)
    assert metrics["swa"]["model"] == "model-swa.pt" and metrics["swa"]["epochs_averaged"] == 4
    assert set(metrics["swa"]["report"]) == set(metrics["report"]) - {"model"}  # as train.fit writes the SWA's


@pytest.mark.parametrize("script", ["torch_ddp.py", "lightning_swa.py"])
def test_the_examples_refuse_bad_input_in_one_line_before_starting_processes(script, unequal_shards):
    done = run_python([f"examples/{script}", "--records", unequal_shards[0]], timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "has no folds: write it with --num-folds 4" in done.stderr


def test_unique_rows_take_the_padding_out_and_never_merge_other_images():
    names, probs, targets = unique_rows(
        ["b", "a", "c", "a"], np.array([0.2, 0.1, 0.3, 0.1]), np.array([[0], [1], [0], [1]]), expected=3
    )
    assert names == ["a", "b", "c"] and probs.tolist() == [0.1, 0.2, 0.3] and targets.tolist() == [[1], [0], [0]]
    for ids, targets, expected, says in (
        (["a", "a"], [[0], [1]], None, "read twice with other targets"),  # two folders with the same names
        (["", ""], [[0], [0]], None, "without an image_name"),
        (["a", "b"], [[0], [0]], 3, "2 distinct image names where 3 images were read"),
    ):
        with pytest.raises(TfpipeError, match=says):
            unique_rows(ids, np.zeros(len(ids)), np.array(targets), expected=expected)


def test_the_data_module_deals_the_folds_and_passes_the_epoch_on(shard_dir):
    pytest.importorskip("pytorch_lightning")
    from tfpipe.torch.lightning import ShardDataModule

    data = ShardDataModule(shard_dir[0], val_folds=[1], batch_size=4)
    data.setup("fit")
    loader = data.train_dataloader()
    assert data.train_folds == [0, 2, 3] and len(data.train_set) == len(
        tfpipe.image_names(shard_dir[0], folds=[0, 2, 3])
    )
    assert len(loader) == -(-len(data.train_set) // 4)
    orders = []
    for epoch in (0, 1):
        data.trainer = type("Trainer", (), {"current_epoch": epoch, "global_rank": 0, "world_size": 1})()
        orders.append([t.tolist() for _, t in loader])
        assert data.train_set.epoch == epoch
    assert orders[0] != orders[1]
    images, targets, names = next(iter(data.val_dataloader()))
    assert images.dtype == torch.uint8 and targets.shape == (4, 3) and len(names) == 4
    for bad, says in (([7], "has folds 0..3"), ([0, 1, 2, 3], "has folds 0..3"), ([], "fold ids"), (0, "fold ids")):
        with pytest.raises(TfpipeError, match=says):
            ShardDataModule(shard_dir[0], val_folds=bad)


def test_record_dataset_refuses_a_rank_outside_the_world(shard_dir):
    with pytest.raises(TfpipeError, match="rank must be in 0..3"):
        RecordDataset(shard_dir[0], rank=4, world_size=4)


def recipe_config(classes=("a", "b", "c"), image_size=32, recipe="torch_ddp"):
    from train.runs.run import RunConfig

    return RunConfig(classes=tuple(classes), image_size=image_size, single_label=False, fit="stretch",
                     dataset_id=None, fold=0, records="x", settings={"recipe": recipe}, stored_size=image_size)  # fmt: skip


def save_run(run, config, weights, metrics, written=()):
    from train.torch.run import begin_run, end_run

    begin_run(run, config)
    for name in written:  # a report's file (train.decide.validation writes them between the two)
        (Path(run) / name).write_text("x")
    end_run(run, weights, metrics)


def test_a_recipe_writes_only_a_new_or_empty_run_folder_or_its_own_run_with_overwrite(tmp_path):
    from train.torch.run import check_run_folder

    run = tmp_path / "run"
    check_run_folder(str(run), overwrite=False)  # new
    run.mkdir()
    check_run_folder(str(run), overwrite=False)  # empty
    save_run(str(run), recipe_config(), {"model-swa.pt": {"w": torch.ones(2)}}, {"validation_auc": 0.5},
             ["thresholds-swa.json", "val_predictions-swa.csv"])  # fmt: skip
    with pytest.raises(TfpipeError, match="already holds a run of torch_ddp; pass overwrite=True"):
        check_run_folder(str(run), overwrite=False)
    check_run_folder(str(run), overwrite=True)
    save_run(str(run), recipe_config(), {"model.pt": {"w": torch.zeros(2)}}, {"validation_auc": 0.7})
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "files.json", "metrics.json", "model.pt"]  # no SWA
    (run / "notes.txt").write_text("mine")
    with pytest.raises(TfpipeError, match=r"holds what no recipe wrote \(notes.txt\)"):
        check_run_folder(str(run), overwrite=True)
    (run / "notes.txt").unlink()
    (run / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()), "recipe": None}))
    with pytest.raises(TfpipeError, match="holds what no recipe wrote"):  # a train.fit run, say: never replaced
        check_run_folder(str(run), overwrite=True)


def test_a_recipe_refuses_test_shards_that_do_not_fit_its_run_before_training(shard_dir, tmp_path):
    import argparse

    from train.torch.run import check_predict

    def args(**kw):
        return argparse.Namespace(**{"predict": shard_dir[0], "out": str(tmp_path / "s.csv"), "probabilities": False,
                                     "overwrite": False, **kw})  # fmt: skip

    assert check_predict(recipe_config(), args(), "torch_ddp") is not None
    with pytest.raises(TfpipeError, match=r"its classes \(a, b, c\) are not the run's \(circle, square\)"):
        check_predict(recipe_config(("circle", "square")), args(), "torch_ddp")
    with pytest.raises(TfpipeError, match="images stored at 32 px, the run's training images at 48 px"):
        check_predict(recipe_config(image_size=48), args(), "torch_ddp")
    (tmp_path / "s.csv").write_text("the user's own file\n")
    with pytest.raises(TfpipeError, match="s.csv exists and was not written by train.predict"):
        check_predict(recipe_config(), args(), "torch_ddp")
    assert check_predict(recipe_config(), args(overwrite=True), "torch_ddp") is not None  # asked: replaced


@pytest.mark.parametrize("script", ["torch_ddp.py", "lightning_swa.py"])
def test_the_examples_refuse_a_foreign_run_folder_in_one_line_before_starting_processes(script, shard_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.csv").write_text("image,labels\n")
    done = run_python([f"examples/{script}", "--records", shard_dir[0], "--run", str(tmp_path / "run")], timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "holds what no recipe wrote (train.csv)" in done.stderr
    assert (tmp_path / "run" / "train.csv").read_text() == "image,labels\n"


def test_a_submission_never_replaces_a_link_a_folder_or_tfpipes_own_files(shard_dir, tmp_path):
    """--out is checked before training, whatever --overwrite says: a name ending in / is a folder (it was made,
    then refused after training), a link would become a file (/dev/stdout into a log), and a run's or a shard
    folder's own files (model.pt, config.json, manifest.json) are never written over by a CSV."""
    from train.prediction.submission import check_destination

    with pytest.raises(TfpipeError, match="new/ is a folder"):
        check_destination(str(tmp_path / "new") + "/", overwrite=True)
    assert not (tmp_path / "new").exists()
    for name in ("model.pt", "config.json", "metrics.json", "manifest.json", "train-0-of-1-3.tfrec"):
        (tmp_path / name).write_text("tfpipe's")
        with pytest.raises(TfpipeError, match=f"{re.escape(name)} is a name tfpipe's own files have"):
            check_destination(str(tmp_path / name), overwrite=True)
        assert (tmp_path / name).read_text() == "tfpipe's"
    (tmp_path / "log.txt").write_text("a log")
    (tmp_path / "stdout").symlink_to(tmp_path / "log.txt")
    with pytest.raises(TfpipeError, match="stdout is a link"):
        check_destination(str(tmp_path / "stdout"), overwrite=True)


def test_predict_wants_an_out_and_a_shard_folder_with_its_manifest(shard_dir, tmp_path):
    import argparse

    from train.torch.run import check_predict

    args = argparse.Namespace(predict=shard_dir[0], out="", probabilities=False, overwrite=False)
    with pytest.raises(TfpipeError, match="out is empty"):
        check_predict(recipe_config(), args, "torch_ddp")
    import shutil

    (tmp_path / "bare").mkdir()
    for f in Path(shard_dir[0]).glob("*.tfrec"):  # the shards alone, without their manifest
        shutil.copy(f, tmp_path / "bare")
    args = argparse.Namespace(predict=str(tmp_path / "bare" / "*.tfrec"), out=str(tmp_path / "s.csv"),
                              probabilities=False, overwrite=False)  # fmt: skip
    with pytest.raises(TfpipeError, match=r"\*.tfrec: no manifest.json; predict takes a shard folder"):
        check_predict(recipe_config(), args, "torch_ddp")


def test_a_folder_named_like_a_run_file_is_not_the_runs_and_a_deleted_submissions_record_is(tmp_path):
    from train.prediction.submission import write_submission
    from train.torch.run import check_run_folder

    run = tmp_path / "run"
    save_run(str(run), recipe_config(), {}, {"validation_auc": 0.5})
    write_submission(str(run / "submission.csv"), "image,labels\nx,a\n", overwrite=False)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # its record is not kept here
    (run / ".submission.csv.tfpipe").write_text("0" * 64 + "\n")  # where an earlier tfpipe kept it
    (run / "submission.csv").unlink()  # deleted by its user: the old record stays, and is tfpipe's
    check_run_folder(str(run), overwrite=True)
    (run / "model.pt").mkdir()
    (run / "model.pt" / "mine.txt").write_text("mine")
    with pytest.raises(TfpipeError, match=r"holds what no recipe wrote \(model.pt\)"):
        check_run_folder(str(run), overwrite=True)


def test_the_lightning_recipes_watch_stops_the_other_ranks_and_leaves_rank_zero_to_say_why():
    """Lightning's own watch SIGKILLs rank 0 too once a rank has ended (exit -9, no line, even mid-"interrupted");
    the recipe's (``train.torch.lightning_ranks``) stops the other ranks, notes which ended first, and leaves rank 0
    (here: this process) alone."""
    from train.torch.lightning_ranks import RankObserver, RankWatch

    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    ranks[1].kill()
    ranks[1].wait()
    watch = RankWatch("lightning_swa")
    watch.leaving.set()  # rank 0 is saying why itself
    assert RankObserver(watch, os.getpid(), ranks)._run() is True  # one look, as Lightning's thread takes
    assert watch.first_dead == (2, -9)
    assert [p.wait(10) for p in ranks] == [-9, -9, -9]


@pytest.fixture(scope="module")
def recipe_run(shard_dir, trained_run, tmp_path_factory):
    """A 1-epoch torch_ddp run on the shards the Keras session run trained on, with its submission: (run folder,
    the submission, the flags it ran with, what it printed)."""
    root = tmp_path_factory.mktemp("recipe")
    run = root / "run"
    common = ["--batch-size", "4", "--run", str(run), "--predict", trained_run[2]]
    done = run_python(["examples/torch_ddp.py", "--records", shard_dir[0], "--epochs", "1", "--processes", "1",
                       *common, "--out", str(root / "a.csv")], timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return run, root / "a.csv", common, done.stdout


def test_a_recipe_run_reports_as_train_fit_and_reads_back(recipe_run, shard_dir, trained_run, tmp_path):
    """Issue #54: a recipe's validation goes through train.fit's report code -- metrics.json carries the same
    figures under the same keys as a Keras run's (compared with one here), val_predictions.csv and thresholds.json
    alike, the printed class table names its model -- and train.inspect reads it back; the model --predict-only
    loads is labelled at the thresholds file, never at 0.5 when it is gone."""
    import shutil

    from train.decide.validation import RUN_FIGURES
    from train.inspect import folder_info
    from train.runs.run import RunConfig
    from train.torch.run import load_saved, load_weights

    run, _, _, printed = recipe_run
    assert "per class, model.pt, 1 view, at the thresholds of thresholds.json:" in printed.splitlines()
    mine, theirs = (json.loads((Path(r) / "metrics.json").read_text()) for r in (run, trained_run[0]))
    assert set(RUN_FIGURES) <= set(mine) & set(theirs) and mine["replicas"] == 1
    assert mine["report"]["model"] == "model.pt" and set(mine["report"]) == set(theirs["report"])
    validated = tfpipe.image_names(shard_dir[0], folds=[0])
    assert mine["val_examples"] == mine["report"]["examples"] == len(validated)
    assert {k: set(v) for k, v in mine["report"]["per_class"].items()} == {
        k: set(v) for k, v in theirs["report"]["per_class"].items()
    }
    tables = [pd.read_csv(Path(r) / "val_predictions.csv", keep_default_na=False) for r in (run, trained_run[0])]
    assert list(tables[0].columns) == list(tables[1].columns)
    assert list(tables[0]["image_name"]) == validated  # in written order
    tuned = json.loads((run / "thresholds.json").read_text())
    assert [tuned[c] for c in tuned] == [mine["report"]["per_class"][c]["threshold"] for c in tuned]
    assert len(set(tuned.values())) > 1  # tuned per class, not the one 0.5 of before
    info = folder_info(str(run))
    assert info["trained_by"] == "torch_ddp" and info["finished"] and info["predicts_with"]["model"] == "model.pt"
    assert info["models"][0]["scores"] == mine["report"] and info["shards"]["here"] == "same"

    copy = tmp_path / "run"
    shutil.copytree(run, copy)  # the module's run stays as it is
    (copy / "thresholds.json").write_text(json.dumps({**tuned, next(iter(tuned)): 0.99}))  # edited: refused (#64)
    with pytest.raises(TfpipeError, match=r"thresholds.json: not the file this folder's job wrote \(of model.pt"):
        load_saved(str(copy), RunConfig.load(str(copy)))
    shutil.copy(copy / "config.json", copy / "model.pt")  # weights replaced: refused before torch reads them
    with pytest.raises(TfpipeError, match=r"model.pt: not the file this folder's job wrote"):
        load_weights(str(copy), "model.pt")
    (copy / "thresholds.json").unlink()  # never a label at 0.5 instead of the tuned thresholds (hostile round)
    with pytest.raises(TfpipeError, match=r"thresholds.json: missing; the run labels at the thresholds tuned"):
        load_saved(str(copy), RunConfig.load(str(copy)))


@pytest.mark.slow  # about 10 s: two ranks start torch
def test_predict_only_writes_the_training_jobs_submission_again_on_two_ranks(recipe_run, tmp_path):
    """Issue #54: --predict-only predicts with the saved run, training nothing; two ranks each predict their share
    and the rows are gathered: the submission is byte for byte the one the training job wrote."""
    _, submitted, common, _ = recipe_run
    again = run_python(["examples/torch_ddp.py", "--predict-only", "--processes", "2", *common,
                        "--out", str(tmp_path / "b.csv")], timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [
        "torch_ddp: predicting with model.pt (the run has no SWA model)",
        f"wrote {tmp_path / 'b.csv'}: 40 rows",
    ]
    assert submitted.read_bytes() == (tmp_path / "b.csv").read_bytes()


def test_a_recipe_run_on_single_label_shards_is_single_label_and_submits_one_class_a_row(tmp_path):
    """Second hostile round of issue #54: the recipes recorded every run as multi-label, so single-label shards
    (a class column) got per-class thresholds and rows of several labels. The run is now the shards' kind: the
    report scores the argmax and writes no thresholds, the submission holds one class a row."""
    import argparse

    from tfpipe.sources.source import LabelFormat
    from train.torch.report import validation_report
    from train.torch.run import run_config, write_predictions, written_ids

    (tmp_path / "images").mkdir()
    rows = [(f"im{i:02d}", ["cat", "dog", "fox"][i % 3]) for i in range(24)]
    for i, (name, _) in enumerate(rows):
        save(tmp_path / "images" / f"{name}.jpg", size=(16, 16), seed=i)
    csv = write_csv(tmp_path / "train.csv", ["image", "label"], rows)
    source = tfpipe.Source(str(tmp_path / "images"), csv=str(csv), label_format=LabelFormat(class_col="label"))
    records = str(tmp_path / "records")
    tfpipe.write_shards(source, records, spec=tfpipe.ImageSpec(image_size=16), num_folds=3, workers=0, progress=False)
    args = argparse.Namespace(records=records, fold=0, predict=records, out=str(tmp_path / "s.csv"),
                              probabilities=False, overwrite=False, model="small-cnn")  # fmt: skip
    config = run_config("torch_ddp", args, tfpipe.open_shards(records))
    assert config.single_label
    ids = sorted(tfpipe.image_names(records, folds=[0]))
    probs = np.random.default_rng(0).uniform(size=(len(ids), 3))
    targets = np.eye(3)[[["cat", "dog", "fox"].index(dict(rows)[n]) for n in ids]]
    done = validation_report(str(tmp_path), tfpipe.open_shards(records), config, (ids, probs, targets))
    assert done.scores["per_class"]["cat"]["threshold"] is None and not (tmp_path / "thresholds.json").exists()
    test_ids = written_ids(tfpipe.open_shards(records))
    write_predictions(config, args, tfpipe.open_shards(records), (test_ids, np.random.rand(24, 3)), None)
    labels = pd.read_csv(tmp_path / "s.csv", keep_default_na=False)["label"]  # the training CSV's column name
    assert all(len(cell.split()) == 1 for cell in labels)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),  # a plain script
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "8"}, None),  # a rank of Lightning's own launcher: no RANK
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (5, 8, 1, 4)),
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2, 0, None)),  # not torchrun's: Lightning keeps its own devices
        ({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE=x"),
        ({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"),
        ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE=9"),
        ({"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_RANK=4"),
        ({"RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (5, 7, 1, 4)),  # uneven nodes
        ({"RANK": "8", "WORLD_SIZE": "8"}, "RANK=8, WORLD_SIZE=8, LOCAL_RANK=0"),
    ],
)
def test_one_torchrun_environment_parser_for_both_recipes_refuses_a_bad_one(monkeypatch, env, expected):
    """Issue #62: torch_ddp and lightning_swa read torchrun's environment through ``train.torch.ranks.launched``;
    the stricter reading won (Lightning's took a bad LOCAL_WORLD_SIZE for one machine and trained)."""
    from train.torch.ranks import launched

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if "RANK" in env:
        env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(expected, str):
        with pytest.raises(TfpipeError, match="the launcher's environment is not a rank of a world") as e:
            launched()
        assert expected in str(e.value)
    else:
        assert launched() == expected
    for recipe in ("torch_ddp.py", "lightning_swa.py"):  # neither reads the launcher's variables itself
        assert 'WORLD_SIZE"' not in Path(ROOT, "examples", recipe).read_text(), recipe
