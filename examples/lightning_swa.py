"""Train on tfpipe shards with PyTorch Lightning on 8 processes, then average the last epochs' weights (SWA).

    python examples/lightning_swa.py --records records/demo/train --devices 8 --epochs 10 --swa-epochs 3

The Lightning recipe (a LightningModule, ``Trainer(devices=8, strategy="ddp")``, Lightning's own
``StochasticWeightAveraging``) with ``tfpipe.lightning.ShardDataModule`` as its data: the folds of a shard folder
as training and validation, every rank the same number of batches, a new order every epoch. On a machine without
accelerators ``--devices 8`` runs 8 CPU processes. The learning rate is ``--lr`` times the number of devices.

The last two lines are the validation fold's exact macro AUC, over all ranks' predictions:
``validation AUC <x>`` of the weights of the last epoch, then ``SWA validation AUC <x>`` of the weights averaged
by Lightning's ``StochasticWeightAveraging`` (it adds the weights as they stand at the start of each of the last
``--swa-epochs`` epochs, then recomputes the batch-norm statistics in one more pass).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from tfpipe.deps import require

require("pytorch_lightning")  # or one line saying what to install
import pytorch_lightning as pl

from tfpipe.errors import ArgumentParser, TfpipeError, check_count, run_cli
from tfpipe.lightning import ShardDataModule
from tfpipe.processes import die_with_parent
from tfpipe.torch import gather_rows, sync_buffers
from train.torch_models import add_recipe_arguments, build_model, check_model, model_inputs, validation_auc

PROG = "lightning_swa"
PARENT_PID = "TFPIPE_LIGHTNING_PARENT_PID"  # rank 0's pid, for the ranks it starts
SWA_LR = 0.1  # the constant LR of the SWA epochs, as a fraction of the peak


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Train on tfpipe shards with PyTorch Lightning and SWA.")
    p.add_argument("--devices", type=int, default=8, help="ranks: one process per device")
    p.add_argument("--epochs", type=int, default=24, help="epochs in all, the SWA epochs included")
    p.add_argument("--swa-epochs", type=int, default=4, help="the last epochs whose weights are averaged")
    add_recipe_arguments(p, per="device")
    return p


class Classifier(pl.LightningModule):
    """Multi-label (BCE on logits); validation AUC over every rank's predictions, each image once."""

    def __init__(self, model: str, num_classes: int, lr: float, swa_start: int) -> None:
        super().__init__()
        self.net, self.lr, self.swa_start, self.rows = build_model(model, num_classes), lr, swa_start, []
        self.loss = torch.nn.BCEWithLogitsLoss()
        self.auc: dict[int, float] = {}  # epoch -> validation AUC

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

    def configure_optimizers(self) -> Any:
        """AdamW at lr x devices on one cycle that ends where SWA starts (SWA then swaps in its own SWALR)."""
        peak = self.lr * self.trainer.world_size
        optimizer = torch.optim.AdamW(self.parameters(), lr=peak)
        steps = self.swa_start * len(self.trainer.datamodule.train_dataloader())  # RecordDataset's len()
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, peak, total_steps=max(steps, 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo, another rank died


@contextlib.contextmanager
def one_line_when_a_process_dies(trainer: pl.Trainer) -> Iterator[None]:
    """A rank or DataLoader worker that dies is one line, not every rank's traceback: the rank whose worker died
    says so; when a rank dies, rank 0 names it (its exit code or signal, from Lightning's launcher) and the others
    leave quietly. Ctrl-C, which Lightning turns into ``exit(1)`` after stopping the ranks, is exit code 130 and
    SIGTERM 143 (the codes a shell gives), said once, by rank 0."""
    try:
        yield
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
            procs = getattr(trainer.strategy.launcher, "procs", [])
            dead = [(rank, p.returncode) for rank, p in enumerate(procs, start=1) if p.poll() not in (None, 0)]
            for rank, code in dead[:1]:
                if code != 2:  # 2: it said why itself
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                    say(f"rank {rank} {how}; the other ranks were stopped")
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
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))  # the ranks share the machine's cores
    pl.seed_everything(args.seed, verbose=False)
    data = ShardDataModule(
        args.records, val_folds=[args.fold], batch_size=args.batch_size, workers=args.workers, seed=args.seed
    )
    model = Classifier(args.model, data.num_classes, args.lr, args.epochs - args.swa_epochs)
    swa = pl.callbacks.StochasticWeightAveraging(
        swa_lrs=args.lr * args.devices * SWA_LR, swa_epoch_start=args.epochs - args.swa_epochs, annealing_epochs=1
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs, callbacks=[swa],
        enable_checkpointing=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with one_line_when_a_process_dies(trainer):
        trainer.fit(model, datamodule=data)
        last = model.auc[args.epochs - 1]  # the last epoch's weights (SWA's batch-norm pass may add an epoch)
        model.auc.clear()
        trainer.validate(model, datamodule=data, verbose=False)  # the averaged weights
    if trainer.is_global_zero:
        print(f"validation AUC {last:.4f}", flush=True)
        print(f"SWA validation AUC {model.auc[trainer.current_epoch]:.4f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    # RecordDataset(batch_size=...) splits a rank's records among workers at batch boundaries: its len() is exact
    warnings.filterwarnings("ignore", "Your `IterableDataset` has `__len__` defined")
    # the one-cycle schedule steps per batch and ends where SWA starts; SWA then swaps in its SWALR, as it says
    warnings.filterwarnings("ignore", "SWA is currently only supported every epoch")
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")  # Lightning vs torch
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a rank Lightning started (or torchrun): ends with its parent
        # by the pid rank 0 left in the environment: a parent that died while this rank imported torch is gone
        # already, and os.getppid() would name init, whose death never comes
        die_with_parent(int(os.environ.get(PARENT_PID, os.getppid())))
    else:
        os.environ[PARENT_PID] = str(os.getpid())  # inherited by the ranks Lightning starts from this process
    return run_cli(PROG, run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
