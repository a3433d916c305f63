"""Train on tfpipe shards with PyTorch Lightning on 8 processes, then average the last epochs' weights (SWA).

    python examples/lightning_swa.py --records records/demo/train --devices 8 --epochs 10 --swa-epochs 3 \
        --run runs/lightning --predict records/demo/test --out runs/lightning/submission.csv

The Lightning recipe (a LightningModule, ``Trainer(devices=8, strategy="ddp")``, Lightning's own
``StochasticWeightAveraging``) with ``tfpipe.lightning.ShardDataModule`` as its data: the folds of a shard folder
as training and validation, every rank the same number of batches, a new order every epoch. On a machine without
accelerators ``--devices 8`` runs 8 CPU processes. The learning rate is ``--lr`` times the number of devices.

The last two lines are the validation fold's exact macro AUC, over all ranks' predictions:
``validation AUC <x>`` of the weights of the last epoch, then ``SWA validation AUC <x>`` of the weights averaged
by Lightning's ``StochasticWeightAveraging`` (it adds the weights as they stand at the start of each of the last
``--swa-epochs`` epochs, then recomputes the batch-norm statistics in one more pass). ``--run`` saves both models'
weights (``model.pt``, ``model-swa.pt``), ``config.json`` and ``metrics.json`` there (``train.torch_run``);
``--predict RECORDS`` then predicts those shards with the SWA model on every rank and writes ``train.predict``'s
submission CSV at ``--out`` (one row per image, labels at probability 0.5).

On a terminal Lightning draws its progress bar; in a log (stdout not a terminal) a line ends every epoch, with a
line at least every 15 s between (``console.Heartbeat``), and Lightning's tips are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from tfpipe.deps import require

require("pytorch_lightning")  # or one line saying what to install
import pytorch_lightning as pl
from lightning_fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from pytorch_lightning.strategies.launchers import subprocess_script as lightning_launcher

from tfpipe import console, lifecycle
from tfpipe.errors import ArgumentParser, TfpipeError, check_count, run_cli
from tfpipe.lifecycle import die_with_parent, loader_dies_with_this_process
from tfpipe.lightning import ShardDataModule
from tfpipe.shards import open_shards
from tfpipe.torch import RecordDataset, gather_rows, sync_buffers
from train.run import RunConfig
from train.torch_models import add_recipe_arguments, build_model, check_model, model_inputs, validation_auc
from train.torch_run import (
    MODEL,
    MODEL_SWA,
    add_run_arguments,
    prepare,
    save_run,
    write_predictions,
)

PROG = "lightning_swa"
PARENT_PID = "TFPIPE_LIGHTNING_PARENT_PID"  # rank 0's pid, for the ranks it starts
SWA_LR = 0.1  # the constant LR of the SWA epochs, as a fraction of the peak


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Train on tfpipe shards with PyTorch Lightning and SWA.")
    p.add_argument("--devices", type=int, default=8, help="ranks: one process per device")
    p.add_argument("--epochs", type=int, default=24, help="epochs in all, the SWA epochs included")
    p.add_argument("--swa-epochs", type=int, default=4, help="the last epochs whose weights are averaged")
    add_recipe_arguments(p, per="device")
    add_run_arguments(p)
    return p


class Classifier(pl.LightningModule):
    """Multi-label (BCE on logits); validation AUC over every rank's predictions, each image once."""

    def __init__(self, model: str, num_classes: int, lr: float, swa_start: int, epochs: int) -> None:
        super().__init__()
        self.net, self.lr, self.swa_start, self.rows = build_model(model, num_classes), lr, swa_start, []
        self.epochs = epochs  # asked for: SWA's batch-norm pass adds one to the trainer's max_epochs
        self.loss = torch.nn.BCEWithLogitsLoss()
        self.auc: dict[int, float] = {}  # epoch -> validation AUC
        self.last_weights: dict[str, torch.Tensor] = {}  # of the last epoch, before SWA puts in its average
        self.predicted: tuple[list[str], np.ndarray] | None = None  # every rank's test rows, each image once

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        images, targets = batch
        loss = self.loss(self.net(model_inputs(images, training=True)), targets)
        self.log("loss", loss, prog_bar=True)
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
        _, probs, targets = gather_rows(names, *columns, expected=self.trainer.datamodule.val_set.num_records)
        self.rows.clear()
        auc = validation_auc(probs, targets)  # the same on every rank: from every rank's rows
        self.auc[self.current_epoch] = auc
        self.log("val_auc", auc, prog_bar=True, sync_dist=True)
        if self.trainer.state.fn == "fit" and self.current_epoch == self.epochs - 1:
            self.last_weights = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}

    def predict_step(self, batch: Any, index: int) -> None:
        images, _, names = batch
        probs = torch.sigmoid(self.net(model_inputs(images, training=False)))
        self.rows.append((list(names), probs.cpu().numpy()))

    def on_predict_epoch_end(self) -> None:
        names = [n for part in self.rows for n in part[0]]
        probs = np.concatenate([p[1] for p in self.rows])
        self.predicted = gather_rows(names, probs, expected=self.trainer.predict_dataloaders.dataset.num_records)
        self.rows.clear()

    def configure_optimizers(self) -> Any:
        """AdamW at lr x devices on one cycle that ends where SWA starts (SWA then swaps in its own SWALR)."""
        peak = self.lr * self.trainer.world_size
        optimizer = torch.optim.AdamW(self.parameters(), lr=peak)
        steps = self.swa_start * len(self.trainer.datamodule.train_dataloader())  # RecordDataset's len()
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
            loss = trainer.callback_metrics.get("loss")
            done = f"step {trainer.fit_loop.epoch_loop.batch_progress.current.completed}/{trainer.num_training_batches}"
            shown = f", loss {float(loss):.4f}" if loss is not None else ""
            self.beat.update(f"epoch {trainer.current_epoch + 1}/{self.epochs}: {done}{shown}")

    def on_validation_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.beat.start("validating")

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """After the epoch's validation (Lightning validates inside the training epoch)."""
        auc = getattr(module, "auc", {}).get(trainer.current_epoch)
        if trainer.is_global_zero and trainer.current_epoch < self.epochs and auc is not None:
            loss = trainer.callback_metrics.get("loss")
            shown = f"loss {float(loss):.4f}, " if loss is not None else ""
            print(f"epoch {trainer.current_epoch + 1}/{self.epochs}: {shown}validation AUC {auc:.4f}", flush=True)
            self.beat.stop()

    def on_predict_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.beat.start("predicting")

    def teardown(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.beat.stop()


class Terminated(SystemExit):
    """Raised by ``StopOnSigterm``'s handler: the job was told to stop."""


class StopOnSigterm(pl.Callback):
    """SIGTERM without collectives: Lightning's own handler broadcasts a tensor from inside the signal handler,
    which can meet another rank's all-reduce and wait for good (seen once in CI: no exit within 60 s). Once
    Lightning has installed its handler (at each stage's start), this one replaces it: rank 0 passes the signal to
    the ranks it started, and every rank raises ``Terminated`` (exit 143, said once by rank 0)."""

    def _install(self, trainer: pl.Trainer, *args: Any) -> None:
        def handler(signum: int, frame: Any) -> None:
            launcher = trainer.strategy.launcher
            if launcher is not None and trainer.is_global_zero:
                launcher.kill(signum)
            raise Terminated(143)

        signal.signal(signal.SIGTERM, handler)

    on_train_start = on_validation_start = on_predict_start = _install


class NoTips(logging.Filter):
    """Lightning's advertisements ("💡 Tip: ... try installing ...") out of the log, its ``max_epochs=N+1
    reached`` (N+1: SWA's batch-norm pass counts as an epoch) and its watch's "Child process ... terminated ...
    Forcefully terminating all other processes" (rank 0 says it in one line); its other lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (
            text.startswith(("💡 Tip", "`Trainer.fit` stopped: `max_epochs=")) or "Forcefully terminating" in text
        )


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, another rank died
RANK_ZERO_GRACE_SECONDS = 20.0  # for rank 0 to notice a dead rank and say so, before the watch says it


class RankWatch:
    """What rank 0 and its watch over the ranks share: ``leaving`` (rank 0 is saying why it stops, or has
    finished with the ranks) and ``first_dead`` (the rank that ended first, and its code)."""

    def __init__(self) -> None:
        self.leaving = threading.Event()
        self.first_dead: tuple[int, int] | None = None


class RankObserver(_ChildProcessObserver):
    """Lightning's watch over the ranks it starts (every 5 s), which says why instead of SIGKILLing rank 0.
    Lightning's own, once a rank has ended with a non-zero code, SIGKILLs the other ranks *and rank 0*: rank 0
    then ends with -9 and no line -- also while it was saying why itself (a Ctrl-C in CI: "interrupted" printed,
    exit -9) or waiting at the start for a rank that died (exit 137, silent). This one stops the other ranks as
    Lightning does (a rank waiting in a collective ignores SIGTERM), then leaves rank 0 to say why; a rank 0 that
    has not begun to within ``RANK_ZERO_GRACE_SECONDS`` (still waiting for the ranks to meet) is ended here, with
    the line naming the rank."""

    def __init__(self, watch: RankWatch, main_pid: int, child_processes: list[Any]) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes)
        self.watch = watch

    def _terminate_all(self) -> None:
        self.watch.first_dead = first_dead_rank(self._child_processes)
        for proc in self._child_processes:
            proc.send_signal(signal.SIGKILL)  # a no-op for a rank already ended
        if not self.watch.leaving.wait(RANK_ZERO_GRACE_SECONDS) and self.watch.first_dead:
            line = rank_died_line(*self.watch.first_dead)
            if line:
                print(line, file=sys.stderr, flush=True)
            lifecycle.exit_now(2)  # rank 0 is stuck (waiting for the ranks to meet): no exception would reach it


@contextlib.contextmanager
def ranks_watched(watch: RankWatch) -> Iterator[None]:
    """Lightning's launcher starts ``RankObserver`` instead of its own observer, while this lasts (rank 0)."""
    own = lightning_launcher._launch_process_observer
    lightning_launcher._launch_process_observer = lambda procs: RankObserver(watch, os.getpid(), procs).start()
    try:
        yield
    finally:
        lightning_launcher._launch_process_observer = own


def first_dead_rank(procs: Sequence[Any]) -> tuple[int, int] | None:
    """The first rank Lightning started (1, 2, ...) that has ended with a non-zero code, and the code."""
    return next(((rank, p.returncode) for rank, p in enumerate(procs, start=1) if p.poll() not in (None, 0)), None)


def rank_died_line(rank: int, code: int) -> str | None:
    """The error line naming a rank that ended with ``code``; None for code 2, a rank that said why itself."""
    if code == 2:
        return None
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"{PROG}: error: rank {rank} {how}; the other ranks were stopped"


@contextlib.contextmanager
def one_line_when_a_process_dies(trainer: pl.Trainer, watch: RankWatch) -> Iterator[None]:
    """A rank or DataLoader worker that dies is one line, not every rank's traceback: the rank whose worker died
    says so; when a rank dies, rank 0 names it (its exit code or signal, from Lightning's launcher) and the others
    leave quietly. Ctrl-C, which Lightning turns into ``exit(1)`` after stopping the ranks, is exit code 130 and
    SIGTERM 143 (the codes a shell gives), said once, by rank 0."""
    try:
        try:
            yield
        finally:
            watch.leaving.set()  # rank 0 says why itself (or is done with the ranks): the watch ends no process
    except Terminated:  # StopOnSigterm's
        terminated(trainer)
    except SystemExit:
        if not trainer.interrupted:
            raise
        if trainer.received_sigterm:
            terminated(trainer)
        if not trainer.is_global_zero:
            raise SystemExit(130) from None  # rank 0 says it
        raise KeyboardInterrupt from None
    except RuntimeError as e:
        if trainer.received_sigterm:  # a rank that the SIGTERM stopped mid-start (gloo, a worker): told to stop
            terminated(trainer)
        text = str(e)
        last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
        if "DataLoader worker" in text:
            say(f"rank {trainer.global_rank}: {last[0].strip()}")
        elif not any(words in text for words in PEER_GONE):
            raise  # a bug: its traceback
        elif trainer.is_global_zero:
            dead = watch.first_dead or first_dead_rank(getattr(trainer.strategy.launcher, "procs", []))
            line = rank_died_line(*dead) if dead else None
            if line:
                print(line, file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def terminated(trainer: pl.Trainer) -> NoReturn:
    """SIGTERM (Lightning forwards it to every rank): exit 143, the code a shell gives, said once by rank 0."""
    if trainer.is_global_zero:
        print(f"{PROG}: terminated (SIGTERM); every rank stopped", file=sys.stderr, flush=True)
    raise SystemExit(143) from None


def say(line: str) -> None:
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> None:
    check_count(1, devices=args.devices, epochs=args.epochs, swa_epochs=args.swa_epochs)
    if args.swa_epochs >= args.epochs:
        raise TfpipeError(f"--swa-epochs {args.swa_epochs} must leave epochs to train first (--epochs {args.epochs})")
    check_model(args.model)  # one line here, before the ranks start
    # the run folder may be written, the test shards fit the run: checked once, by the process that starts the
    # ranks (each rank runs this function again; only rank 0 writes the run)
    config = prepare(PROG, args) if os.environ.get("LOCAL_RANK", "0") == "0" else None
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))  # the ranks share the machine's cores
    pl.seed_everything(args.seed, verbose=False)
    data = ShardDataModule(
        args.records, val_folds=[args.fold], batch_size=args.batch_size, workers=args.workers, seed=args.seed
    )
    model = Classifier(args.model, data.num_classes, args.lr, args.epochs - args.swa_epochs, args.epochs)
    swa = pl.callbacks.StochasticWeightAveraging(
        swa_lrs=args.lr * args.devices * SWA_LR, swa_epoch_start=args.epochs - args.swa_epochs, annealing_epochs=1
    )
    bar = console.on_terminal()  # Lightning's bar for a person; lines for a log
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
        callbacks=[swa, StopOnSigterm(), *([] if bar else [LineProgress(args.epochs)])], enable_progress_bar=bar,
        enable_checkpointing=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    watch = RankWatch()
    with ranks_watched(watch), one_line_when_a_process_dies(trainer, watch):
        trainer.fit(model, datamodule=data)
        last = model.auc[args.epochs - 1]  # the last epoch's weights (SWA's batch-norm pass may add an epoch)
        model.auc.clear()
        trainer.validate(model, datamodule=data, verbose=False)  # the averaged weights
        if args.predict:
            trainer.predict(model, dataloaders=test_loader(args, trainer), return_predictions=False)
    if trainer.is_global_zero:
        finish(args, config, model, {"validation_auc": last, "swa_validation_auc": model.auc[trainer.current_epoch]})


def test_loader(args: argparse.Namespace, trainer: pl.Trainer) -> torch.utils.data.DataLoader:
    """This rank's share of ``--predict`` (each rank as many batches; the padding's repeats are taken out)."""
    test = RecordDataset(
        args.predict, with_ids=True, batch_size=args.batch_size, rank=trainer.global_rank, world_size=trainer.world_size
    )
    workers = {"num_workers": args.workers, "worker_init_fn": loader_dies_with_this_process() if args.workers else None}
    return torch.utils.data.DataLoader(test, batch_size=args.batch_size, **workers)


def finish(args: argparse.Namespace, config: RunConfig | None, model: Classifier, metrics: dict[str, float]) -> None:
    """Rank 0 at the end: the run folder, the submission (the SWA model's), then the two AUC lines (the last)."""
    if args.run and config is not None:
        weights = {MODEL: model.last_weights, MODEL_SWA: model.net.state_dict()}
        save_run(args.run, config, weights, dict(metrics, epochs=args.epochs, ranks=args.devices))
        print(f"saved {args.run}/{MODEL} and {MODEL_SWA}", flush=True)
    if args.predict and config is not None and model.predicted is not None:
        print(write_predictions(config, args, open_shards(args.predict), *model.predicted) + " (SWA model)", flush=True)
    print(f"validation AUC {metrics['validation_auc']:.4f}", flush=True)
    print(f"SWA validation AUC {metrics['swa_validation_auc']:.4f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    # RecordDataset(batch_size=...) splits a rank's records among workers at batch boundaries: its len() is exact
    warnings.filterwarnings("ignore", "Your `IterableDataset` has `__len__` defined")
    # the one-cycle schedule steps per batch and ends where SWA starts; SWA then swaps in its SWALR, as it says
    warnings.filterwarnings("ignore", "SWA is currently only supported every epoch")
    warnings.filterwarnings("ignore", "predict returned None")  # predict_step keeps the rows itself, for all ranks
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")  # Lightning vs torch
    for logger in ("pytorch_lightning.utilities.rank_zero", _ChildProcessObserver.__module__):
        logging.getLogger(logger).addFilter(NoTips())
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a rank Lightning started (or torchrun): ends with its parent
        # by the pid rank 0 left in the environment: a parent that died while this rank imported torch is gone
        # already, and os.getppid() would name init, whose death never comes
        die_with_parent(int(os.environ.get(PARENT_PID, os.getppid())))
    else:
        os.environ[PARENT_PID] = str(os.getpid())  # inherited by the ranks Lightning starts from this process
    return run_cli(PROG, run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
