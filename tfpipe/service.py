"""A tf.data service for tfpipe's training input: a dispatcher and workers that read, decode and augment.

    python -m tfpipe.service dispatcher --port 5050 [--work-dir DIR] [--worker-timeout 60]
    python -m tfpipe.service worker --dispatcher HOST:5050 [--port 5051] [--address HOST]
    python -m train.fit ... --data-service grpc://HOST:5050     # or make_dataset(..., service=...)

Thin wrappers over TensorFlow's ``DispatchServer`` and ``WorkerServer``: each prints the address it serves at
and stays quiet until stopped (Ctrl-C, SIGTERM). A worker registers at the dispatcher under ``--address``
(default: this machine's host name) -- the address trainers dial to fetch its data; the data must be readable at
the same path from the workers (``gs://``, a shared disk). TensorFlow's gRPC servers listen on every interface
of the machine at the port given; a firewall decides who reaches them.

What ``served`` gives a training pipeline (``tfpipe.batches.training_batches``): the workers run one epoch --
records parsed, shuffled, decoded and augmented per image -- as a ``distributed_epoch`` job
(``ShardingPolicy.DYNAMIC``: the dispatcher hands each shard file to one worker), so every record of the epoch
comes once; the trainer repeats it (each epoch a new job) and makes the batches itself, so every batch is
whole (static shapes) and the epochs follow each other as in one process.

A worker that dies mid-epoch: the trainer's input waits for it -- TensorFlow's client has no timeout -- until a
worker is started again at the same address (``--address`` and ``--port``; give workers fixed ports for this).
The epoch then goes on; the records the dead worker held are missed by that epoch (TensorFlow's "at most once"),
none comes twice, and the next epoch reads every record again. Workers can be added at any time.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tfpipe.console import exit_now
from tfpipe.deps import require
from tfpipe.errors import ArgumentParser, TfpipeError, check_at_least, option, run_cli
from tfpipe.locks import check_not_a_file
from tfpipe.processes import MAX_PORT, host_and_port

if TYPE_CHECKING:
    import tensorflow as tf

PROG = "tfpipe.service"
GROUP = 32  # images a message from a worker: one gRPC round trip per group, not per image
WORKER_TIMEOUT = 60  # seconds without a worker's heartbeat before the dispatcher counts it lost
HEARTBEAT = 10  # seconds between a worker's heartbeats to the dispatcher
DAY = 86400
GET_WORKERS = "/tensorflow.data.DispatcherService/GetWorkers"  # TensorFlow's dispatcher.proto
STOP = {signal.SIGINT, signal.SIGTERM}  # what ends a server


def served(ds: tf.data.Dataset, service: str) -> tf.data.Dataset:
    """``ds`` (one epoch of examples) run on the service's workers, each shard file by one of them; examples
    again here. The groups a worker sends may be partial (its last files'): unbatched here, nothing is lost."""
    tf_ = require("tensorflow")
    dynamic = tf_.data.experimental.service.ShardingPolicy.DYNAMIC
    ds = ds.batch(GROUP)
    ds = ds.apply(tf_.data.experimental.service.distribute(processing_mode=dynamic, service=service))
    return ds.unbatch()


def check_service(
    address: str, setting: str = "data_service", python: str = "service", need_workers: bool = True
) -> None:
    """``address`` (``grpc://HOST:PORT``; a worker's ``--dispatcher`` may leave out ``grpc://``) is a dispatcher
    that answers, with a worker when ``need_workers``: TensorFlow's client would wait for either forever. One
    line otherwise, naming the setting as the user wrote it."""
    said = option(setting, address, python=f"{python}={address!r}")
    rest = address.removeprefix("grpc://")
    parts = host_and_port(rest)
    if (setting == "data_service" and rest == address) or "/" in rest or parts is None:
        raise TfpipeError(f"{said}: not {'grpc://' if setting == 'data_service' else ''}HOST:PORT")
    port = parts[1]
    if not 1 <= port <= MAX_PORT:
        raise TfpipeError(f"{said}: port {port} cannot be dialled (1..{MAX_PORT}: the port the dispatcher printed)")
    problem = dispatcher_problem(rest, need_workers)
    if problem:
        raise TfpipeError(f"{said}: {problem}")


def dispatcher_problem(target: str, need_workers: bool, timeout: float = 5.0) -> str | None:
    """What is wrong with ``target`` (HOST:PORT) as a tf.data service dispatcher, asked over gRPC (TensorFlow
    depends on grpcio) with the dispatcher's own ``GetWorkers`` call; None when nothing is."""
    grpc = require("grpc")  # TensorFlow's own dependency

    with grpc.insecure_channel(target) as channel:
        try:
            workers = channel.unary_unary(GET_WORKERS)(b"", timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "what answers there is not a tf.data service dispatcher (a worker's port?)"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"nothing answered there as a tf.data service dispatcher within {timeout:.0f} s"
            said = f"no tf.data service dispatcher answers ({e.code().name.lower()})"
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                return said
            return f"{said}; start one with python -m {PROG} dispatcher --port {target.rpartition(':')[2]}"
    if need_workers and not workers:  # the reply lists the workers: empty bytes, none
        return f"the dispatcher has no workers; start one with python -m {PROG} worker --dispatcher {target}"
    return None


def dispatcher(args: argparse.Namespace) -> None:
    check_port(args.port)
    if args.work_dir is not None:
        check_not_a_file(args.work_dir, "work_dir")
    check_at_least(3 * HEARTBEAT, worker_timeout=args.worker_timeout)  # three missed heartbeats, not one
    if args.worker_timeout > DAY:
        raise TfpipeError(f"{option('worker_timeout')} must be at most {DAY} seconds (got {args.worker_timeout:g})")
    tf_ = require("tensorflow")
    config = tf_.data.experimental.service.DispatcherConfig(
        port=args.port,
        work_dir=args.work_dir,
        fault_tolerant_mode=args.work_dir is not None,  # its journal lets a restarted dispatcher go on
        worker_timeout_ms=int(args.worker_timeout * 1000),
        job_gc_check_interval_ms=int(args.worker_timeout * 500),  # the same loop looks for silent workers
    )
    server = started(tf_.data.experimental.service.DispatchServer, config, args.port)
    print(f"tf.data service dispatcher at grpc://{socket.gethostname()}:{bound_port(server)}", flush=True)
    serve(server)


def worker(args: argparse.Namespace) -> None:
    check_port(args.port)
    check_service(args.dispatcher, setting="dispatcher", need_workers=False)
    tf_ = require("tensorflow")
    config = tf_.data.experimental.service.WorkerConfig(
        dispatcher_address=args.dispatcher.removeprefix("grpc://"),
        worker_address=f"{args.address}:%port%",  # what the dispatcher tells trainers to dial
        port=args.port,
        heartbeat_interval_ms=HEARTBEAT * 1000,  # well inside the dispatcher's --worker-timeout
    )
    server = started(tf_.data.experimental.service.WorkerServer, config, args.port)
    print(f"tf.data service worker at {args.address}:{bound_port(server)} for {args.dispatcher}", flush=True)
    serve(server)


def check_port(port: int) -> None:
    """A port to serve at: 0 (a free one) to 65535; TensorFlow would take 99999 as 34463."""
    if not 0 <= port <= MAX_PORT:
        raise TfpipeError(f"{option('port', port)}: a port is 0 (a free one) to {MAX_PORT}")


def started(server_class: Callable[[Any], Any], config: Any, port: int) -> Any:
    """The server, or one line: TensorFlow raises RuntimeError (the port is taken, the journal folder cannot
    be made) or NotImplementedError (the dispatcher did not answer its version) with a C++ message."""
    try:
        return server_class(config)
    except (RuntimeError, NotImplementedError) as e:
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        taken = "Could not start gRPC server" in said and port != 0
        where = "a free port" if port == 0 else f"port {port}{' (taken?)' if taken else ''}"
        raise TfpipeError(f"cannot start the {server_class.__name__} at {where}: {said}") from None


def serve(server: Any) -> None:
    """Serves until Ctrl-C or SIGTERM, then ends the process at once after the command's line.

    ``main`` blocks both signals before any thread starts, so every thread (TensorFlow's, gRPC's) inherits the
    block and the signal waits, pending, for ``sigwait`` here. A Python handler instead runs only when the main
    thread does: a signal the kernel handed to another thread left it asleep, and Ctrl-C was lost under CI's
    load (twice). ``server.join()`` would wait in C++ all the same. Ending at once: the server's own stop, as
    the process ends normally, took over a minute under that load."""
    received = signal.sigwait(STOP)
    print(f"{PROG}: {'interrupted' if received == signal.SIGINT else 'terminated (SIGTERM)'}", file=sys.stderr)
    del server  # held until here: the server lives while this waits
    exit_now(130 if received == signal.SIGINT else 143)  # the line passes TensorFlow's log filter first


def bound_port(server: Any) -> int:
    """The port a server listens at (port 0 asks the system for a free one)."""
    return int(server._server.bound_port())  # TensorFlow's public API does not say it


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Run a tf.data service dispatcher or worker for tfpipe's input.")
    roles = p.add_subparsers(dest="role", required=True)
    d = roles.add_parser("dispatcher", help="hands out the shard files of each epoch to the workers")
    d.add_argument("--port", type=int, default=5050, help="port to serve at (0: a free one, printed)")
    d.add_argument("--work-dir", help="a folder for the dispatcher's journal: a restarted dispatcher goes on")
    d.add_argument(
        "--worker-timeout",
        type=float,
        default=WORKER_TIMEOUT,
        help=f"seconds before a silent worker is lost (at least {3 * HEARTBEAT}; workers beat every {HEARTBEAT} s)",
    )
    w = roles.add_parser("worker", help="reads, decodes and augments what the dispatcher hands it")
    w.add_argument("--dispatcher", required=True, help="the dispatcher's HOST:PORT (grpc:// may lead)")
    w.add_argument("--port", type=int, default=0, help="port to serve at (0: a free one, printed)")
    w.add_argument("--address", default=socket.gethostname(), help="the host name trainers reach this worker by")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP)  # for ``serve``'s sigwait, before any thread starts
    try:
        return run_cli(PROG, dispatcher if args.role == "dispatcher" else worker, args)
    finally:  # a refusal: the caller's mask again (a Ctrl-C held meanwhile is dropped: the refusal is the answer)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


if __name__ == "__main__":
    sys.exit(main())
