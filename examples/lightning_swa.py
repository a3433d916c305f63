"""Train on tfpipe shards with PyTorch Lightning on 8 processes, then average the last epochs' weights (SWA).

    python examples/lightning_swa.py --records records/demo/train --devices 8 --epochs 10 --swa-epochs 3 \
        --run runs/lightning --predict records/demo/test --out runs/lightning/submission.csv

The Lightning recipe (a LightningModule, ``Trainer(devices=8, strategy="ddp")``, Lightning's own
``StochasticWeightAveraging``) with ``tfpipe.torch.lightning.ShardDataModule`` as its data: the folds of a shard folder
as training and validation, every rank the same number of batches, a new order every epoch. On a machine without
accelerators ``--devices 8`` runs 8 CPU processes; under ``torchrun`` each machine runs the ranks torchrun started
(``--devices`` and the number of machines come from it). The learning rate is ``--lr`` times the number of ranks.

The last two lines are the validation fold's exact macro AUC, over all ranks' predictions:
``validation AUC <x>`` of the weights of the last epoch, then ``SWA validation AUC <x>`` of the weights averaged
by Lightning's ``StochasticWeightAveraging`` (it adds the weights as they stand at the start of each of the last
``--swa-epochs`` epochs, then recomputes the batch-norm statistics in one more pass). ``--run`` saves both models'
weights (``model.pt``, ``model-swa.pt``), ``config.json`` and ``metrics.json`` there (``train.torch.run``);
``--predict RECORDS`` then predicts those shards with the SWA model on every rank and writes ``train.predict``'s
submission CSV at ``--out`` (one row per image, labels at probability 0.5).

On a terminal Lightning draws its progress bar; in a log (stdout not a terminal) a line ends every epoch, with a
line at least every 15 s between (``console.Heartbeat``), and Lightning's tips are left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tfpipe.runtime.deps import require

require("pytorch_lightning")  # or one line saying what to install
import pytorch_lightning as pl

from tfpipe.format.shards import open_shards
from tfpipe.runtime import console
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_count, check_positive, option, run_cli
from tfpipe.runtime.lifecycle import loader_dies_with_this_process
from tfpipe.torch import RecordDataset, gather_rows, sync_buffers
from tfpipe.torch.lightning import ShardDataModule
from train.decide.choice import RunScores
from train.runs.run import RunConfig
from train.torch.lightning_ranks import SameStart, StopOnSigterm, ranks_end_with_rank_zero, supervised, without_tips
from train.torch.models import (
    add_recipe_arguments,
    build_model,
    check_model,
    model_inputs,
    recipe_loss,
    validation_auc,
)
from train.torch.ranks import launched
from train.torch.report import described, model_reports, run_metrics
from train.torch.run import (
    MODEL,
    MODEL_SWA,
    add_run_arguments,
    begin_run,
    end_run,
    load_saved,
    prepare,
    recipe_choice_line,
    start_settings,
    swa_beats,
    write_predictions,
)

PROG = "lightning_swa"
SWA_LR = 0.1  # the constant LR of the SWA epochs, as a fraction of the peak


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Train on tfpipe shards with PyTorch Lightning and SWA.")
    p.add_argument(
        "--devices", type=int, help="ranks on this machine: one process per device (default 8; under torchrun: its own)"
    )
    p.add_argument("--epochs", type=int, default=24, help="epochs in all, the SWA epochs included")
    p.add_argument("--swa-epochs", type=int, default=4, help="the last epochs whose weights are averaged")
    add_recipe_arguments(p, per="device")
    add_run_arguments(p)
    return p


class Classifier(pl.LightningModule):
    """Multi-label (BCE on logits); validation AUC over every rank's predictions, each image once."""

    def __init__(
        self, model: str, num_classes: int, lr: float, swa_start: int, epochs: int, loss: torch.nn.Module
    ) -> None:
        super().__init__()
        self.net, self.lr, self.swa_start = build_model(model, num_classes), lr, swa_start
        self.rows: list[tuple[Any, ...]] = []  # this rank's (names, probabilities[, targets]) of the phase so far
        self.epochs = epochs  # asked for: SWA's batch-norm pass adds one to the trainer's max_epochs
        self.loss = loss  # train.torch.models.recipe_loss
        self.auc: dict[int, float] = {}  # epoch -> validation AUC
        self.last_weights: dict[str, torch.Tensor] = {}  # of the last epoch, before SWA puts in its average
        self.swa_weights: dict[str, torch.Tensor] = {}  # the average, as validated
        self.val_rows: dict[bool, tuple[Any, ...]] = {}  # swa -> the validation rows of that model, every rank's
        self.predicted: tuple[list[str], np.ndarray] | None = None  # every rank's test rows, each image once
        self.loss_sum, self.loss_steps = 0.0, 0  # this epoch's, this rank's: its mean is the loss we show

    @property
    def data(self) -> ShardDataModule:
        """The trainer's data module (fitting and validating)."""
        data = getattr(self.trainer, "datamodule", None)
        assert isinstance(data, ShardDataModule)
        return data

    @property
    def predicting(self) -> RecordDataset:
        """The shards being predicted (``PredictData``'s, this rank's share)."""
        dataset = getattr(self.trainer.predict_dataloaders, "dataset", None)
        assert isinstance(dataset, RecordDataset)
        return dataset

    @property
    def mean_loss(self) -> float | None:
        """The mean training loss of this epoch's steps so far, on this rank: the one loss figure shown."""
        return self.loss_sum / self.loss_steps if self.loss_steps else None

    def on_train_epoch_start(self) -> None:
        self.loss_sum, self.loss_steps = 0.0, 0

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        images, targets = batch
        loss = self.loss(self.net(model_inputs(images, training=True)), targets)
        self.loss_sum, self.loss_steps = self.loss_sum + float(loss.detach()), self.loss_steps + 1
        self.log("loss", loss, prog_bar=True)  # the bar's (a terminal): Lightning's mean of recent steps
        return loss

    def on_validation_epoch_start(self) -> None:
        sync_buffers(self.net)  # every rank scores with rank 0's batch-norm statistics: one model

    def validation_step(self, batch: Any, index: int) -> None:
        images, targets, names = batch
        probs = torch.sigmoid(self.net(model_inputs(images, training=False)))
        self.rows.append((list(names), probs.cpu().numpy(), targets.cpu().numpy()))

    def on_validation_epoch_end(self) -> None:
        names = [n for part in self.rows for n in part[0]]
        columns = (np.concatenate([p[k] for p in self.rows]) for k in (1, 2))
        val_set = self.data.val_set
        assert val_set is not None  # built by the data module's setup
        rows = gather_rows(names, *columns, expected=val_set.num_records)
        self.rows.clear()
        auc = validation_auc(*rows[1:])  # the same on every rank: from every rank's rows
        self.auc[self.current_epoch] = auc
        self.log("val_auc", auc, prog_bar=True, sync_dist=True)
        if self.trainer.state.fn == "fit" and self.current_epoch == self.epochs - 1:
            self.last_weights = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}
            self.val_rows[False] = rows
        elif self.trainer.state.fn == "validate":  # the averaged weights (run() validates them after fit)
            self.val_rows[True] = rows
            self.swa_weights = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}

    def predict_step(self, batch: Any, index: int) -> None:
        images, _, names = batch
        probs = torch.sigmoid(self.net(model_inputs(images, training=False)))
        self.rows.append((list(names), probs.cpu().numpy()))

    def on_predict_epoch_end(self) -> None:
        names = [n for part in self.rows for n in part[0]]
        probs = np.concatenate([p[1] for p in self.rows])
        self.predicted = gather_rows(names, probs, expected=self.predicting.num_records)
        self.rows.clear()

    def configure_optimizers(self) -> Any:
        """AdamW at lr x ranks on one cycle that ends where SWA starts (SWA then swaps in its own SWALR)."""
        peak = self.lr * self.trainer.world_size
        optimizer = torch.optim.AdamW(self.parameters(), lr=peak)
        steps = self.swa_start * len(self.data.train_dataloader())  # RecordDataset's len()
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, peak, total_steps=max(steps, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LineProgress(pl.Callback):
    """Progress for a log, on rank 0: a line at the end of every epoch, and ``console.Heartbeat``'s line at least
    every 15 s while a phase runs (training, validating, SWA's batch-norm pass, predicting)."""

    def __init__(self, epochs: int) -> None:
        self.epochs, self.beat = epochs, console.Heartbeat(PROG)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            e = trainer.current_epoch
            doing = f"epoch {e + 1}/{self.epochs}" if e < self.epochs else "SWA: batch-norm statistics of the average"
            self.beat.start(doing)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.is_global_zero and trainer.current_epoch < self.epochs:
            loss = getattr(module, "mean_loss", None)
            done = f"step {trainer.fit_loop.epoch_loop.batch_progress.current.completed}/{trainer.num_training_batches}"
            shown = f", loss {loss:.4f} (mean so far)" if loss is not None else ""
            self.beat.update(f"epoch {trainer.current_epoch + 1}/{self.epochs}: {done}{shown}")

    def on_validation_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.beat.start("validating")

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """After the epoch's validation (Lightning validates inside the training epoch)."""
        auc = getattr(module, "auc", {}).get(trainer.current_epoch)
        if trainer.is_global_zero and trainer.current_epoch < self.epochs and auc is not None:
            loss = getattr(module, "mean_loss", None)
            shown = f"loss {loss:.4f} (the epoch's mean, rank 0), " if loss is not None else ""
            print(f"epoch {trainer.current_epoch + 1}/{self.epochs}: {shown}validation AUC {auc:.4f}", flush=True)
            self.beat.stop()

    def on_predict_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.beat.start("predicting")

    def teardown(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.beat.stop()


def torchrun_nodes(args: argparse.Namespace) -> int:
    """The machines (Lightning's ``num_nodes``): under torchrun (``train.torch.ranks.launched``) its world over
    its ranks a machine, which ``--devices`` becomes (given, it must agree); 1 elsewhere (``--devices`` 8 by
    default)."""
    world = launched()
    if world is None or world.local_size is None:  # not torchrun's (it says LOCAL_WORLD_SIZE)
        args.devices = 8 if args.devices is None else args.devices
        return 1
    if args.devices not in (None, world.local_size):
        raise TfpipeError(
            f"{option('devices', args.devices)} but the launcher started {console.counted(world.local_size, 'rank')} "
            f"on this machine (LOCAL_WORLD_SIZE); leave {option('devices')} out under torchrun"
        )
    args.devices = world.local_size
    return world.nodes


def run(args: argparse.Namespace) -> None:
    nodes = torchrun_nodes(args)
    check_count(1, devices=args.devices, epochs=args.epochs, swa_epochs=args.swa_epochs)
    check_positive(lr=args.lr)
    if args.swa_epochs >= args.epochs:
        raise TfpipeError(f"--swa-epochs {args.swa_epochs} must leave epochs to train first (--epochs {args.epochs})")
    # the run folder may be written, the test shards fit the run: checked once, by the process that starts the
    # ranks (each rank runs this function again; only rank 0 writes the run); --predict-only: the saved run's
    # model, on every rank
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    config = prepare(PROG, args, build_parser()) if first or args.predict_only else None
    check_model(args.model)  # one line here, before the ranks start
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))  # the ranks share the machine's cores
    pl.seed_everything(args.seed, verbose=False)
    if args.predict_only:
        return predict_saved(args, config, nodes)
    start = time.monotonic()
    data = ShardDataModule(
        args.records, val_folds=[args.fold], batch_size=args.batch_size, workers=args.workers, seed=args.seed,
        sampling=args.sampling,
    )  # fmt: skip
    loss = recipe_loss(args.class_weight, RecordDataset(data.shards, folds=data.train_folds))
    model = Classifier(args.model, data.num_classes, args.lr, args.epochs - args.swa_epochs, args.epochs, loss)
    swa = pl.callbacks.StochasticWeightAveraging(
        swa_lrs=args.lr * args.devices * nodes * SWA_LR,
        swa_epoch_start=args.epochs - args.swa_epochs + 1,  # Lightning counts this one from 1 (its swa_start: -1)
        annealing_epochs=1,
    )
    trainer = ranks_trainer(args, nodes, [swa])
    # a rank or worker that dies, Ctrl-C, SIGTERM: one line (train.torch.lightning_ranks)
    with supervised(trainer, PROG):
        trainer.fit(model, datamodule=data)
        last = model.auc[args.epochs - 1]  # the last epoch's weights (SWA's batch-norm pass may add an epoch)
        model.auc.clear()
        trainer.validate(model, datamodule=data, verbose=False)  # the averaged weights
        swa_chosen = swa_beats(last, model.auc[trainer.current_epoch])  # as predict_saved chooses
        if args.predict:
            if not swa_chosen:
                model.net.load_state_dict(model.last_weights)
            trainer.predict(model, datamodule=PredictData(args), return_predictions=False)
    if trainer.is_global_zero and config is not None:
        counts = (data.train_set.num_records, data.val_set.num_records) if data.train_set and data.val_set else (0, 0)
        metrics = run_metrics(PROG, args, config, trainer.world_size, counts, round(time.monotonic() - start, 1))
        finish(args, config, model, metrics, swa_chosen)


def ranks_trainer(args: argparse.Namespace, nodes: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    """The trainer of every rank: ``--devices`` processes on each of ``nodes`` machines, DDP, our lines in a log."""
    bar = console.on_terminal()  # Lightning's bar for a person; lines for a log
    alike = SameStart(start_settings(args))  # every rank the same flags and shards, or none trains
    return pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=nodes, strategy="ddp", max_epochs=args.epochs,
        callbacks=[*callbacks, StopOnSigterm(), alike, *([] if bar else [LineProgress(args.epochs)])],
        enable_progress_bar=bar, enable_checkpointing=False, logger=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip


class PredictData(pl.LightningDataModule):
    """This rank's share of ``--predict`` (each rank as many batches; the padding's repeats are taken out),
    made once the trainer knows the rank."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        args, trainer = self.args, self.trainer
        assert trainer is not None
        test = RecordDataset(
            args.predict, with_ids=True, batch_size=args.batch_size, rank=trainer.global_rank,
            world_size=trainer.world_size,
        )  # fmt: skip
        workers = args.workers
        return torch.utils.data.DataLoader(
            test, batch_size=args.batch_size, num_workers=workers,
            worker_init_fn=loader_dies_with_this_process() if workers else None,
        )  # fmt: skip


def predict_saved(args: argparse.Namespace, config: RunConfig | None, nodes: int) -> None:
    """``--predict-only``: every rank predicts its share of ``--predict`` with the saved run's model (the better
    by validation AUC), rank 0 writes the submission at that model's tuned thresholds."""
    assert config is not None
    net, thresholds, line = load_saved(args.run, config)
    loss = torch.nn.BCEWithLogitsLoss()  # unused: it predicts only
    model = Classifier(args.model, len(config.classes), args.lr, 1, args.epochs, loss)
    model.net.load_state_dict(net.state_dict())
    trainer = ranks_trainer(args, nodes, [])
    if trainer.is_global_zero:
        print(f"{PROG}: {line}", flush=True)
    with supervised(trainer, PROG):
        trainer.predict(model, datamodule=PredictData(args), return_predictions=False)
    if trainer.is_global_zero and model.predicted is not None:
        print(write_predictions(config, args, open_shards(args.predict), model.predicted, thresholds), flush=True)


def finish(
    args: argparse.Namespace, config: RunConfig, model: Classifier, metrics: dict[str, Any], swa_chosen: bool
) -> None:
    """Rank 0 at the end: both models' validation reports (train.fit's: tuned thresholds, exact scores, the
    per-class tables) and the run folder, the submission of the better model at its thresholds, then the two AUC
    lines (the last)."""
    if args.run:
        begin_run(args.run, config)
    part, done = model_reports(args.run, open_shards(args.records), config, model.val_rows, args.swa_epochs)
    if args.run:
        end_run(args.run, {MODEL: model.last_weights, MODEL_SWA: model.swa_weights}, {**metrics, **part})
        print(f"saved {args.run}/{MODEL} and {MODEL_SWA}", flush=True)
    print("\n".join([*described(part["report"], MODEL), *described(part["swa"]["report"], MODEL_SWA)]), flush=True)
    if args.predict and model.predicted is not None:
        scores = RunScores(part["report"], part["swa"]["report"], has_swa=True)  # decided by AUC, as swa_beats
        print(f"{PROG}: {recipe_choice_line(swa_chosen, scores)}")
        thresholds = done[swa_chosen].thresholds
        print(write_predictions(config, args, open_shards(args.predict), model.predicted, thresholds), flush=True)
    print(f"validation AUC {part['validation_auc']:.4f}", flush=True)
    print(f"SWA validation AUC {part['swa_validation_auc']:.4f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    # RecordDataset(batch_size=...) splits a rank's records among workers at batch boundaries: its len() is exact
    warnings.filterwarnings("ignore", "Your `IterableDataset` has `__len__` defined")
    # the one-cycle schedule steps per batch and ends where SWA starts; SWA then swaps in its SWALR, as it says
    warnings.filterwarnings("ignore", "SWA is currently only supported every epoch")
    warnings.filterwarnings("ignore", "predict returned None")  # predict_step keeps the rows itself, for all ranks
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")  # Lightning vs torch
    without_tips()  # Lightning's advertisements out of the log
    ranks_end_with_rank_zero()
    return run_cli(PROG, run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
