"""A SIGTERM is a save, not a loss: ``train.fit`` stopped mid-epoch saves the step, says where, and ``--resume``
continues there -- the schedule's step, the burn-in, SWA's average and the history as if nothing happened."""

import json
import os
import signal

import pytest

from tests.conftest import backend_keras
from tests.test_train import history, tiny_config
from tfpipe.runtime.errors import run_cli
from train.fit import fit
from train.keras.schedules import make_schedule, scaled_lr

keras = backend_keras()  # tf-keras, or Keras 3 on JAX (TFPIPE_TEST_BACKEND)


class SignalInEpoch(keras.callbacks.Callback):
    """Sends this process ``signum`` after the first step of ``epoch`` (0-based), as a preempted VM's agent would:
    a real signal, taken by the handler ``run_cli`` installed."""

    def __init__(self, epoch, signum=signal.SIGTERM):
        super().__init__()
        self.at, self.signum, self.epoch = epoch, signum, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.at and batch == 0:
            os.kill(os.getpid(), self.signum)


@pytest.mark.slow  # two jobs of a tiny model on 8 virtual replicas, about 40 s
@pytest.mark.backends
def test_sigterm_mid_epoch_saves_the_step_and_resume_trains_only_the_rest(shard_dir, tmp_path, capsys):
    """Epoch 2 of 3 (the first after a burn-in epoch, the first SWA averages) stopped by SIGTERM: exit 143 and the
    line; ``--resume`` says ``epoch 2, step 2``, trains its last step and epoch 3 only (the optimizer's steps, so
    the learning-rate schedule's step, go on from the backup), keeps the burn-in, averages both SWA epochs and
    records each epoch once; metrics.json counts the interrupted job."""
    run = tmp_path / "run"
    settings = {"burn_epochs": 1, "burn_lr": 1e-2, "epochs": 2, "swa_epochs": 2, "steps_per_execution": 1,
                "save_every": 2, "report": False, "verbose": 2}  # fmt: skip
    code = run_cli("train.fit", fit, tiny_config(shard_dir, run, callbacks=(SignalInEpoch(1),), **settings))
    said = capsys.readouterr()
    assert code == 143, said.err[-2000:]
    assert said.err.strip().splitlines()[-1] == (
        "train.fit: terminated (SIGTERM) at epoch 2, step 2; saved: --resume continues there"
    )
    assert [int(r["epoch"]) for r in history(run)] == [0]

    assert run_cli("train.fit", fit, tiny_config(shard_dir, run, resume=True, **settings)) == 0
    said = capsys.readouterr()
    assert "train.fit: resuming at epoch 2, step 2\n" in said.out, said.out[-3000:]
    rows = history(run)
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    m = json.loads((run / "metrics.json").read_text())
    steps = m["steps_per_epoch"]
    assert steps == 3 and m["optimizer_steps"] == 2 * steps  # fine-tuning's optimizer: none redone, none lost
    schedule = make_schedule("cosine", scaled_lr(1e-3, 8), steps, 2, 1.0)
    assert [float(r["lr"]) for r in rows[1:]] == pytest.approx(
        [float(schedule(k * steps - 1)) for k in (1, 2)]
    )  # each epoch's last step's
    assert m["swa"]["epochs_averaged"] == 2 and m["burn_epochs"] == 1
    assert m["interrupted"] == 1 and m["stops"] == [{"signal": "SIGTERM", "at": "epoch 2, step 2"}]
    assert not (run / "backup").exists()


@pytest.mark.slow  # two jobs of a tiny model on 8 virtual replicas, about 25 s
@pytest.mark.backends
def test_ctrl_c_inside_the_burn_in_saves_its_step_and_resume_continues_it(shard_dir, tmp_path, capsys):
    """Ctrl-C (SIGINT) in the burn-in's epoch: exit 130, its step saved in the burn-in's own backup; ``--resume``
    continues the burn-in at that step, then fine-tunes; each epoch once, the stop recorded as Ctrl-C's."""
    run = tmp_path / "run"
    settings = {"burn_epochs": 1, "burn_lr": 1e-2, "epochs": 1, "steps_per_execution": 1, "save_every": 0,
                "report": False, "verbose": 2}  # fmt: skip
    code = run_cli(
        "train.fit", fit, tiny_config(shard_dir, run, callbacks=(SignalInEpoch(0, signal.SIGINT),), **settings)
    )
    said = capsys.readouterr()
    assert code == 130 and said.err.strip().splitlines()[-1] == (
        "train.fit: interrupted at epoch 1, step 2; saved: --resume continues there"
    ), said.err[-2000:]
    assert not (run / "history.csv").exists() or history(run) == []
    assert (run / "backup" / "burn").is_dir()

    assert run_cli("train.fit", fit, tiny_config(shard_dir, run, resume=True, **settings)) == 0
    assert "train.fit: resuming at epoch 1, step 2\n" in capsys.readouterr().out
    assert [int(r["epoch"]) for r in history(run)] == [0, 1]
    m = json.loads((run / "metrics.json").read_text())
    assert m["stops"] == [{"signal": "SIGINT", "at": "epoch 1, step 2"}]
