"""A tf.data service for tfpipe's training input: a dispatcher and workers that read, decode and augment.

    python -m tfpipe.service dispatcher --port 5050 [--work-dir DIR] [--worker-timeout 60]
    python -m tfpipe.service worker --dispatcher HOST:5050 [--port 5051] [--address HOST]
    python -m train.fit ... --data-service grpc://HOST:5050     # or make_dataset(..., service=...)

Thin wrappers over TensorFlow's ``DispatchServer`` and ``WorkerServer``: each prints the address it serves at
and stays quiet until stopped (Ctrl-C, SIGTERM). A worker registers at the dispatcher under ``--address``
(default: this machine's host name) -- the address trainers dial to fetch its data; the data must be readable at
the same path from the workers (``gs://``, a shared disk). TensorFlow's gRPC servers listen on every interface
of the machine at the port given; a firewall decides who reaches them.

The engine, what a training pipeline calls: ``tfpipe.tf.data_service``.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tfpipe.runtime.deps import require
from tfpipe.runtime.errors import ArgumentParser, TfpipeError, check_at_least, option, run_cli
from tfpipe.runtime.lifecycle import signals_held, wait_for_a_stop
from tfpipe.runtime.locks import check_not_a_file
from tfpipe.runtime.net import MAX_PORT
from tfpipe.tf.data_service import check_service

PROG = "tfpipe.service"
WORKER_TIMEOUT = 60  # seconds without a worker's heartbeat before the dispatcher counts it lost
HEARTBEAT = 10  # seconds between a worker's heartbeats to the dispatcher
DAY = 86400


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
    """Serves until Ctrl-C or SIGTERM, then ends the process at once after the command's line
    (``tfpipe.runtime.lifecycle.wait_for_a_stop``: ``main`` held both signals before any thread started)."""
    wait_for_a_stop(PROG)  # the server lives while this waits: ``server`` is held until the process ends


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
    with signals_held():  # for ``serve``'s sigwait, before any thread starts (a refusal puts the mask back)
        return run_cli(PROG, dispatcher if args.role == "dispatcher" else worker, args)


if __name__ == "__main__":
    sys.exit(main())
