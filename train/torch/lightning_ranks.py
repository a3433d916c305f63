"""The supervision of Lightning's ranks on one machine (``examples/lightning_swa.py``), the launcher side of
``tfpipe.runtime.lifecycle`` for Lightning's own launcher:

    ranks_end_with_rank_zero()  # first thing in main: a rank Lightning started ends with rank 0
    trainer = pl.Trainer(..., strategy="ddp", callbacks=[StopOnSigterm(), ...])
    with supervised(trainer, "lightning_swa"):
        trainer.fit(model, datamodule=data)

A rank or DataLoader worker that dies is one line naming it, not every rank's traceback; Ctrl-C exits 130 and
SIGTERM 143, said once by rank 0; no rank is left. Lightning's own ways are replaced where they fail: its watch
SIGKILLs rank 0 (no line), its SIGTERM handler runs a collective inside the handler (a hang). It subclasses
Lightning's private ``_ChildProcessObserver`` and patches its launcher's ``_launch_process_observer``: the tests
of ``examples/lightning_swa.py`` pin what a new Lightning changes. Install with ``pip install 'tfpipe[lightning]'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from tfpipe.runtime.deps import require

require("pytorch_lightning")
import pytorch_lightning as pl
from lightning_fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from pytorch_lightning.strategies.launchers import subprocess_script as lightning_launcher

from tfpipe.runtime.lifecycle import (
    BAD_INPUT,
    INTERRUPTED,
    STOPS,
    TERMINATED,
    dead_worker_line,
    die_with_parent,
    exit_now,
    on_sigterm,
    sigterm_restored,
    stop_behind,
)
from train.torch.ranks import check_same_start

PARENT_PID = "TFPIPE_LIGHTNING_PARENT_PID"  # rank 0's pid, for the ranks it starts


def ranks_end_with_rank_zero() -> None:
    """A rank Lightning started (or torchrun) ends with its parent, by the pid rank 0 left in the environment: a
    parent that died while this rank imported torch is gone already, and ``os.getppid()`` would name init, whose
    death never comes. Rank 0 leaves its pid there for the ranks it starts."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        die_with_parent(int(os.environ.get(PARENT_PID, os.getppid())))
    else:
        os.environ[PARENT_PID] = str(os.getpid())  # inherited by the ranks Lightning starts from this process


def without_tips() -> None:
    """``NoTips`` on Lightning's rank-zero log and its watch's log."""
    for logger in ("pytorch_lightning.utilities.rank_zero", _ChildProcessObserver.__module__):
        logging.getLogger(logger).addFilter(NoTips())


@contextlib.contextmanager
def supervised(trainer: pl.Trainer, prog: str) -> Iterator[None]:
    """Within the block, ``trainer``'s ranks are watched by ``RankObserver`` and what ends them is one line of
    ``prog`` (``one_line_when_a_process_dies``). SIGTERM is ``StopOnSigterm``'s from the start, also while the
    ranks start, before Lightning's first stage (``run_cli``'s would raise a ``KeyboardInterrupt``, which Lightning
    turns into Ctrl-C's ``exit(1)``: a SIGTERM then said "interrupted", exit 130)."""
    watch = RankWatch(prog)
    with sigterm_restored():
        StopOnSigterm().install(trainer)
        with ranks_watched(watch), one_line_when_a_process_dies(trainer, watch):
            yield


class StopOnSigterm(pl.Callback):
    """SIGTERM without collectives: Lightning's own handler broadcasts a tensor from inside the signal handler,
    which can meet another rank's all-reduce and wait for good. Once
    Lightning has installed its handler (at each stage's start), this one replaces it: rank 0 passes the signal to
    the ranks it started, and every rank exits with SIGTERM's code of ``tfpipe.runtime.lifecycle.STOPS`` (143, said once
    by rank 0, ``supervised``). A ``SystemExit``, not the library's ``Terminated``: Lightning answers a
    ``KeyboardInterrupt`` by SIGKILLing the ranks and ``exit(1)``."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.install(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.install(trainer)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.install(trainer)

    def install(self, trainer: pl.Trainer) -> None:
        def handler(signum: int, frame: Any) -> None:
            launcher = trainer.strategy.launcher
            if launcher is not None and trainer.is_global_zero:
                launcher.kill(signum)
            raise SystemExit(TERMINATED)

        on_sigterm(handler)


class SameStart(pl.Callback):
    """Every rank starts alike (``train.torch.ranks.check_same_start``), checked as Lightning first sets the ranks up
    (for fitting, or predicting only): before the first step, on every rank."""

    def __init__(self, settings: dict[str, object]) -> None:
        self.settings, self.checked = settings, False

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        if not self.checked:
            check_same_start(self.settings, trainer.global_rank)
            self.checked = True


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
    """What rank 0 and its watch over the ranks share: the command's name (``prog``), ``leaving`` (rank 0 is
    saying why it stops, or has finished with the ranks) and ``first_dead`` (the rank that ended first, and its
    code)."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.leaving = threading.Event()
        self.first_dead: tuple[int, int] | None = None


class RankObserver(_ChildProcessObserver):
    """Lightning's watch over the ranks it starts (every 5 s), which says why instead of SIGKILLing rank 0.
    Lightning's own, once a rank has ended with a non-zero code, SIGKILLs the other ranks *and rank 0*: rank 0
    then ends with -9 and no line -- also while it is saying why itself (a Ctrl-C: "interrupted" printed, then
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
            line = rank_died_line(self.watch.prog, *self.watch.first_dead)
            if line:
                print(line, file=sys.stderr, flush=True)
            exit_now(BAD_INPUT)  # rank 0 is stuck (waiting for the ranks to meet): no exception would reach it


@contextlib.contextmanager
def ranks_watched(watch: RankWatch) -> Iterator[None]:
    """Lightning's launcher starts ``RankObserver`` instead of its own observer, while this lasts (rank 0)."""
    own = lightning_launcher._launch_process_observer
    lightning_launcher._launch_process_observer = lambda child_processes: RankObserver(
        watch, os.getpid(), child_processes
    ).start()
    try:
        yield
    finally:
        lightning_launcher._launch_process_observer = own


def first_dead_rank(procs: Sequence[Any]) -> tuple[int, int] | None:
    """The first rank Lightning started (1, 2, ...) that has ended with a non-zero code, and the code."""
    return next(((rank, p.returncode) for rank, p in enumerate(procs, start=1) if p.poll() not in (None, 0)), None)


def rank_died_line(prog: str, rank: int, code: int) -> str | None:
    """The error line naming a rank that ended with ``code``; None for code 2, a rank that said why itself."""
    if code == 2:
        return None
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"{prog}: error: rank {rank} {how}; the other ranks were stopped"


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
    except SystemExit as e:
        if e.code == TERMINATED:  # StopOnSigterm's
            terminated(trainer, watch.prog)
        if not trainer.interrupted:
            raise
        if trainer.received_sigterm:
            terminated(trainer, watch.prog)
        if not trainer.is_global_zero:
            raise SystemExit(INTERRUPTED) from None  # rank 0 says it
        raise KeyboardInterrupt from None
    except Exception as e:
        if trainer.received_sigterm:  # a rank that the SIGTERM stopped mid-start (gloo, a worker): told to stop
            terminated(trainer, watch.prog)
        if stop_behind(e) is not None:  # Ctrl-C to the process group ended the workers too: said once, by rank 0
            raise (KeyboardInterrupt() if trainer.is_global_zero else SystemExit(INTERRUPTED)) from None
        worker = dead_worker_line(e)  # torch's RuntimeError, or a connection to the worker broken as it died
        if worker:
            say(watch.prog, f"rank {trainer.global_rank}: {worker}")
        elif not (isinstance(e, RuntimeError) and any(words in str(e) for words in PEER_GONE)):
            raise  # a bug: its traceback
        elif trainer.is_global_zero:
            dead = watch.first_dead or first_dead_rank(getattr(trainer.strategy.launcher, "procs", []))
            line = rank_died_line(watch.prog, *dead) if dead else None
            if line:
                print(line, file=sys.stderr, flush=True)
        raise SystemExit(BAD_INPUT) from None


def terminated(trainer: pl.Trainer, prog: str) -> NoReturn:
    """SIGTERM (Lightning forwards it to every rank): exit 143, the code a shell gives, said once by rank 0."""
    if trainer.is_global_zero:
        print(f"{prog}: {STOPS[signal.SIGTERM][1]}; every rank stopped", file=sys.stderr, flush=True)
    raise SystemExit(TERMINATED) from None


def say(prog: str, line: str) -> None:
    print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
