"""Train on tfpipe shards with PyTorch: 8 processes with DistributedDataParallel, or PyTorch/XLA on TPU cores.

    python examples/torch_ddp.py --records records/demo/train --processes 8 --epochs 24 \
        --run runs/torch_ddp --predict records/demo/test --out runs/torch_ddp/submission.csv
    python examples/torch_ddp.py --records records/demo/train --epochs 24 --xla   # a TPU VM / Kaggle TPU
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        examples/torch_ddp.py --records DIR --run runs/torch_ddp             # on each of 2 machines

The 8-core recipe of the PyTorch/XLA tutorials, with tfpipe's shards as its data. On a machine without TPU cores,
``--processes 8`` runs 8 CPU processes (gloo), each a stand-in for one core: a dry run of the TPU configuration.
What the TPU recipe's calls become here:

    xmp.spawn(fn, nprocs=8)                     torch.multiprocessing.spawn(run, nprocs=8)
    xm.xrt_world_size() / xm.get_ordinal()      dist.get_world_size() / dist.get_rank() (RecordDataset reads them)
    DistributedSampler(num_replicas, rank)      RecordDataset: each rank the same number of records, set_epoch
    MpDeviceLoader(loader, device)              the DataLoader itself
    xm.optimizer_step(optimizer)                loss.backward() (DDP averages the gradients) + optimizer.step()

The learning rate is ``--lr`` times the number of processes (the global batch grows with them). Every epoch ends
with the validation fold's exact macro AUC, over all ranks' predictions made with rank 0's batch-norm statistics
(padding removed); the last line is
``validation AUC <x>``. ``--run`` saves the model's weights (``model.pt``), ``config.json`` and ``metrics.json``
there (``train.torch.run``); ``--predict RECORDS`` then predicts those shards on every rank and writes
``train.predict``'s submission CSV at ``--out`` (one row per image, labels at probability 0.5).
``--xla`` runs the same steps with torch_xla (``xmp.spawn``, ``MpDeviceLoader``,
``xm.optimizer_step``) on every device it finds (``PJRT_DEVICE=TPU``, or ``PJRT_DEVICE=CPU``: one CPU device).

Launched by ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``),
each process is one rank of the launcher's world (gloo, ``env://``) and starts none of its own; ``--processes``
is then the launcher's world size (given, it must agree). Global rank 0 prints and writes the run folder and the
submission; the other ranks print nothing but a refusal (one line a machine: its local rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tfpipe.format.shards import open_shards
from tfpipe.runtime import console
from tfpipe.runtime.errors import (
    ArgumentParser,
    TfpipeError,
    as_command,
    check_count,
    check_positive,
    error_line,
    option,
    run_cli,
)
from tfpipe.runtime.lifecycle import (
    BAD_INPUT,
    INTERRUPTED,
    LOST_A_RANK,
    die_with_parent,
    loader_dies_with_this_process,
    stop_behind,
)
from tfpipe.runtime.net import free_port
from tfpipe.torch import RecordDataset, folds_apart, gather_rows, sync_buffers, unique_rows
from train.runs.run import RunConfig
from train.torch.models import (
    add_recipe_arguments,
    build_model,
    check_model,
    model_inputs,
    recipe_loss,
    validation_auc,
)
from train.torch.ranks import World, check_same_start, launched, refuse_to_the_others, spawn_ranks
from train.torch.report import described, model_reports, run_metrics
from train.torch.run import (
    MODEL,
    add_run_arguments,
    begin_run,
    end_run,
    load_saved,
    prepare,
    start_settings,
    write_predictions,
)

PROG = "torch_ddp"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Train on tfpipe shards with PyTorch DDP or PyTorch/XLA.")
    p.add_argument(
        "--processes", type=int, help="ranks: one per TPU core they stand in for (default 8; under torchrun: its world)"
    )
    p.add_argument("--epochs", type=int, default=24, help="passes over the training folds")
    add_recipe_arguments(p, per="process")
    add_run_arguments(p)
    p.add_argument("--xla", action="store_true", help="PyTorch/XLA: xmp.spawn over the devices torch_xla finds")
    return p


def datasets(args: argparse.Namespace, rank: int | None, world_size: int | None) -> tuple[RecordDataset, RecordDataset]:
    """(training folds, validation fold) for one rank: the same number of records on every rank."""
    shards = open_shards(args.records)
    folds = folds_apart(shards, [args.fold])
    common: dict[str, Any] = {"batch_size": args.batch_size, "rank": rank, "world_size": world_size}
    train = RecordDataset(shards, folds=folds, shuffle=True, seed=args.seed, sampling=args.sampling, **common)
    return train, RecordDataset(shards, folds=[args.fold], with_ids=True, **common)


def loader(ds: RecordDataset, args: argparse.Namespace) -> torch.utils.data.DataLoader:
    workers = args.workers
    return torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,  # RecordDataset.set_epoch reaches them through shared memory
        worker_init_fn=loader_dies_with_this_process() if workers else None,
    )


def train_epoch(
    model: torch.nn.Module,
    loss_fn: torch.nn.Module,
    batches: Any,
    step: Callable[[], None],
    device: Any,
    where: Callable[[str], None],
) -> float:
    """One pass over ``batches``; ``step`` applies the gradients, ``where`` hears the step and loss so far (rank
    0's heartbeat says them every 15 s, from a thread: also while one step waits long). Returns this rank's mean
    loss."""
    model.train()
    total, count = 0.0, 0
    for i, (images, targets) in enumerate(batches):
        loss = loss_fn(model(model_inputs(images.to(device), training=True)), targets.to(device))
        loss.backward()
        step()
        total, count = total + float(loss.detach()), count + 1
        where(f"step {i + 1}, loss {total / count:.4f} (mean so far)")
    return total / max(count, 1)


@torch.no_grad()
def predict(model: torch.nn.Module, batches: Any, device: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(image names, probabilities, targets) of this rank's share of the validation fold."""
    model.eval()
    names: list[str] = []
    probs, targets = [], []
    for images, target, batch_names in batches:
        probs.append(torch.sigmoid(model(model_inputs(images.to(device), training=False))).cpu().numpy())
        targets.append(target.cpu().numpy())
        names += batch_names
    return names, np.concatenate(probs), np.concatenate(targets)


def fit(
    rank: int, world_size: int, args: argparse.Namespace, device: Any, xla: Any = None
) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The loop every rank runs; ``xla`` is torch_xla's ``xla_model`` module under ``--xla``. Returns the model
    (every rank's alike: rank 0's batch-norm statistics) and its validation rows (``gather_rows``': ids,
    probabilities, targets), every rank's."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts them)
    train, val = datasets(args, rank, world_size) if xla else datasets(args, None, None)  # None: from dist
    net = build_model(args.model, train.num_classes).to(device)
    loss_fn = recipe_loss(args.class_weight, train).to(device)
    model = net if xla or world_size == 1 else DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size)
    train_loader, val_loader = loader(train, args), loader(val, args)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr * world_size, total_steps=args.epochs * len(train_loader)
    )

    beat = console.Heartbeat(PROG) if rank == 0 else None  # a line at least every 15 s while an epoch runs

    def say(line: str) -> None:
        if beat is not None:
            print(line, flush=True)
            beat.stop()

    def where(doing: str) -> None:
        if beat is not None:
            beat.update(f"epoch {epoch + 1}/{args.epochs}: {doing}")

    def step() -> None:
        xla.optimizer_step(optimizer) if xla else optimizer.step()  # xla: all-reduces the gradients first
        optimizer.zero_grad()
        schedule.step()

    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        batches = xla_loader(train_loader, device) if xla else train_loader
        if beat is not None:
            beat.start(f"epoch {epoch + 1}/{args.epochs}: starting")
        loss = train_epoch(model, loss_fn, batches, step, device, where)
        where("validating")
        rows = validate(net, val_loader, val.num_records, device, xla)
        auc = validation_auc(*rows[1:])
        say(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f} (the epoch's mean, rank 0), validation AUC {auc:.4f}")
    return net, rows


def validate(net: torch.nn.Module, data: Any, images: int, device: Any, xla: Any) -> tuple[Any, ...]:
    """The validation fold's rows (ids, probabilities, targets): every rank predicts its share with the same model
    (rank 0's batch-norm statistics), the rows are gathered and the padding's repeats taken out."""
    if xla is None:
        sync_buffers(net)
        return gather_rows(*predict(net, data, device), expected=images)
    import torch_xla.runtime as xr

    if xr.world_size() > 1:
        xla.broadcast_master_param(net)  # parameters and buffers of core 0
    return mesh_rows(xla, *predict(net, xla_loader(data, device), device), expected=images)


def test_rows(net: torch.nn.Module, args: argparse.Namespace, device: Any, xla: Any) -> tuple[list[str], np.ndarray]:
    """(ids, probabilities) of every image of ``--predict``, each once, on every rank: each predicts its share."""
    rank = world_size = None  # from torch.distributed
    if xla is not None:
        import torch_xla.runtime as xr

        rank, world_size = xr.global_ordinal(), xr.world_size()
    test = RecordDataset(args.predict, with_ids=True, batch_size=args.batch_size, rank=rank, world_size=world_size)
    data = loader(test, args)
    if xla is None:
        ids, probs = gather_rows(*predict(net, data, device)[:2], expected=test.num_records)
    else:
        ids, probs = mesh_rows(xla, *predict(net, xla_loader(data, device), device)[:2], expected=test.num_records)
    return list(ids), probs


def finish(
    net: torch.nn.Module, val_rows: Any, args: argparse.Namespace, config: RunConfig, rows: Any, seconds: float
) -> None:
    """Rank 0 after training: the validation report (train.fit's: tuned thresholds, exact scores, the per-class
    table) and the run folder, the submission at those thresholds, then the AUC line (the last line)."""
    shards = open_shards(args.records)
    if args.run:
        begin_run(args.run, config)
    part, done = model_reports(args.run, shards, config, {False: val_rows})
    if args.run:
        train, val = datasets(args, 0, args.processes)
        counts = (train.num_records, val.num_records)
        metrics = {**run_metrics(PROG, args, config, args.processes, counts, seconds), **part}
        end_run(args.run, {MODEL: net.state_dict()}, metrics)
        print(f"saved {args.run}/{MODEL}", flush=True)
    print("\n".join(described(part["report"], MODEL)), flush=True)
    if rows is not None:
        print(write_predictions(config, args, open_shards(args.predict), rows, done[False].thresholds), flush=True)
    print(f"validation AUC {part['validation_auc']:.4f}", flush=True)


def xla_loader(data: torch.utils.data.DataLoader, device: Any) -> Any:
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    return MpDeviceLoader(data, device)


def mesh_rows(xla: Any, names: list[str], *columns: np.ndarray, expected: int) -> tuple[Any, ...]:
    """``gather_rows`` for torch_xla: every core's rows, each image once (sent as tensors: ``mesh_reduce``
    unpickles with ``weights_only``, which takes no NumPy arrays)."""
    mine = [(names, *(torch.from_numpy(c) for c in columns))]
    parts = xla.mesh_reduce("validation_rows", mine, lambda lists: [part for each in lists for part in each])
    merged = (torch.cat([p[k + 1] for p in parts]).numpy() for k in range(len(columns)))
    return unique_rows([name for p in parts for name in p[0]], *merged, expected=expected)


def run_rank(rank: int, args: argparse.Namespace, config: RunConfig, port: int, parent: int) -> None:
    """One of ``--processes`` CPU processes: a gloo process group, then the loop."""
    die_with_parent(parent)
    torch.set_num_threads(1)  # the processes share the machine's cores; more threads each only contend
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.processes)
    train_rank(rank, args, config, supervised=True)


def train_rank(rank: int, args: argparse.Namespace, config: RunConfig, supervised: bool = False) -> None:
    """One rank of a started process group: the loop, the predictions, rank 0's run folder. Its errors are one
    line and exit code 2, settings spelt as flags (``as_command``); a ``supervised`` rank (spawn_ranks') that lost
    another rank exits with ``tfpipe.runtime.lifecycle.LOST_A_RANK`` instead, its parent saying why."""
    try:
        with as_command(PROG):
            check_same_start(start_settings(args), rank)  # the same flags and shards on every rank, or none trains
            if args.predict_only:
                return predict_saved(rank, args, config, torch.device("cpu"), None)
            start = time.monotonic()
            net, val_rows = fit(rank, args.processes, args, torch.device("cpu"))
            rows = test_rows(net, args, torch.device("cpu"), None) if args.predict else None
            if rank == 0:
                finish(net, val_rows, args, config, rows, round(time.monotonic() - start, 1))
    except Exception as e:  # bad input (from a DataLoader worker too), a worker that died, a full disk, gloo's
        stop = stop_behind(e)  # Ctrl-C or SIGTERM to the process group ends the workers too: the stop is the news
        if stop is not None:
            raise stop from None
        line = error_line(e, who=f"rank {rank}: ")  # the one line of tfpipe.runtime.errors.run_cli, for a rank
        if line:
            print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
            sys.exit(BAD_INPUT)
        if not (isinstance(e, RuntimeError) and "gloo" in str(e)):
            raise  # a bug: its traceback
        # gloo's: another rank died (killed, out of memory) mid-collective
        if supervised:
            sys.exit(LOST_A_RANK)
        first = str(e).strip().splitlines()[0]
        print(f"{PROG}: error: rank {rank} lost another rank ({first}); stopping", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    finally:
        dist.destroy_process_group()


def run_xla(index: int, args: argparse.Namespace, config: RunConfig, parent: int) -> None:
    """One torch_xla device (a TPU core): what ``xmp.spawn`` runs."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    die_with_parent(parent)
    if args.predict_only:
        return predict_saved(xr.global_ordinal(), args, config, torch_xla.device(), xm)
    start = time.monotonic()
    net, val_rows = fit(xr.global_ordinal(), xr.world_size(), args, torch_xla.device(), xla=xm)
    rows = test_rows(net, args, torch_xla.device(), xm) if args.predict else None
    if xr.global_ordinal() == 0:
        finish(net.cpu(), val_rows, args, config, rows, round(time.monotonic() - start, 1))


def predict_saved(rank: int, args: argparse.Namespace, config: RunConfig, device: Any, xla: Any) -> None:
    """``--predict-only``: every rank predicts its share of ``--predict`` with the saved run's model (the better
    by validation AUC), rank 0 writes the submission at that model's tuned thresholds."""
    net, thresholds, line = load_saved(args.run, config)
    if rank == 0:
        print(f"{PROG}: {line}", flush=True)
    rows = test_rows(net.to(device), args, device, xla)
    if rank == 0:
        print(write_predictions(config, args, open_shards(args.predict), rows, thresholds), flush=True)


def check_processes(args: argparse.Namespace, world: World | None) -> None:
    """``args.processes`` becomes the world's size: 8 by default, the launcher's under one (given, it must
    agree); a launcher's ranks are not torch_xla's devices."""
    if world is None:
        args.processes = 8 if args.processes is None else args.processes
        check_count(1, processes=args.processes)
        return
    if args.xla:
        raise TfpipeError(f"{option('xla')} starts its own processes; run it without torchrun")
    if args.processes not in (None, world[1]):
        raise TfpipeError(
            f"{option('processes', args.processes)} but the launcher started {console.counted(world[1], 'rank')} "
            f"(WORLD_SIZE); leave {option('processes')} out under torchrun"
        )
    args.processes = world[1]


def run(args: argparse.Namespace) -> None:
    world = launched()
    if world is not None:  # the launcher's agent is the parent: this rank dies with it, also while checking
        die_with_parent(os.getppid())
    try:
        config = checked(args, world)
    except (TfpipeError, OSError) as e:
        if world is None:
            raise
        if world[2] == 0:  # every rank of a machine finds the same: its local rank 0 says it
            line = error_line(e) or str(e)
            print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
        refuse_to_the_others(str(e), world[0], world[1])  # the other machines' ranks refuse too, not wait 30 min
        raise SystemExit(BAD_INPUT) from None
    if world is not None:
        try:
            run_launched(args, config, world)
        except KeyboardInterrupt:  # Ctrl-C reaches every rank of the terminal's machine: its local rank 0 says it
            if world[2] != 0:
                raise SystemExit(INTERRUPTED) from None
            raise
    elif args.xla:
        from tfpipe.runtime.deps import require

        require("torch_xla")
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(run_xla, args=(args, config, os.getpid()))
    else:
        # any rank's failure stops all, in one line (train.torch.ranks: the launcher side of tfpipe.runtime.lifecycle)
        spawn_ranks(run_rank, (args, config, free_port(), os.getpid()), args.processes)


def checked(args: argparse.Namespace, world: World | None) -> RunConfig:
    """Everything that can be refused before a process starts (under a launcher: before its ranks meet), in one
    line: the settings, the records and folds, the model, the run folder and the shards of ``--predict``."""
    check_processes(args, world)
    check_count(1, epochs=args.epochs, batch_size=args.batch_size)
    check_positive(lr=args.lr)
    check_count(0, workers=args.workers)
    config = prepare(
        PROG, args, build_parser()
    )  # reads only: the run folder may be written, the test shards fit the run
    if not args.predict_only:
        datasets(args, 0, args.processes)
    check_model(args.model)
    return config  # reads only: the run folder may be written, the test shards fit the run


def run_launched(args: argparse.Namespace, config: RunConfig, world: World) -> None:
    """This process as one rank of a launcher's world: its process group (``env://``), then the loop. Ranks
    that do not all arrive (another machine refused its command, or was never started) end in one line when
    torch's wait for them runs out (30 minutes)."""
    try:
        dist.init_process_group("gloo", init_method="env://", rank=world[0], world_size=world[1])
    except (RuntimeError, TimeoutError) as e:  # torch's DistStoreError and gloo's errors are RuntimeErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise TfpipeError(f"rank {world[0]}: the {world[1]} ranks did not meet at {where} ({first})") from None
    train_rank(world[0], args, config)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
