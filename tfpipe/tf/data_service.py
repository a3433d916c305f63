"""The tf.data service as tfpipe's readers use it (no command here: ``python -m tfpipe.service`` starts the
servers, ``tfpipe/service.py``).

What ``served`` gives a training pipeline (``tfpipe.tf.batches.training_batches``): the workers run one epoch --
records parsed, shuffled, decoded and augmented, batched, the batches augmented -- as a ``distributed_epoch``
job (``ShardingPolicy.DYNAMIC``: the dispatcher hands each shard file to one worker), so every record of the epoch
comes once; the trainer repeats it (each epoch a new job) and only ``rebatch``es: whole batches pass as they
are, a worker's short last batch of an epoch is joined to the next, so every batch is whole (static shapes) and
the epochs follow each other as in one process. Sent uncompressed: decoded pixels barely compress, and
decompressing them would cost the trainer about a third of the CPU it still spends once the workers make
the batches (``bench/service.py`` measures the service).

Every worker the dispatcher lists must answer this machine before training starts (``check_service``: a worker
registered under an address the trainer cannot dial would be waited for forever). A worker that dies mid-epoch:
the trainer's input waits for it -- TensorFlow's client has no timeout -- until a worker is started again at the
same address (``--address`` and ``--port``; give workers fixed ports for this). The epoch then goes on; the
records the dead worker held are missed by that epoch (TensorFlow's "at most once"), none comes twice, and the
next epoch reads every record again. ``train.fit`` waits ``GONE_SECONDS`` for it (``WorkerWatch``), then ends in
one line. Workers can be added at any time. Local shard paths are sent absolute (``Shards.absolute``): a worker
resolves a relative one in its own folder.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tfpipe.runtime.deps import require
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.runtime.lifecycle import BAD_INPUT, exit_now
from tfpipe.runtime.net import MAX_PORT, host_and_port

if TYPE_CHECKING:
    import tensorflow as tf

COMMAND = "tfpipe.service"  # the command that starts a dispatcher or worker, named in the lines here
GET_WORKERS = "/tensorflow.data.DispatcherService/GetWorkers"  # TensorFlow's dispatcher.proto
WORKER_TASKS = "/tensorflow.data.WorkerService/GetWorkerTasks"  # TensorFlow's worker.proto: what any worker answers
GONE_SECONDS = 120.0  # a worker silent this long while no training step ends: the trainer stops waiting for it
POLL_SECONDS = 10.0


def served(ds: tf.data.Dataset, service: str) -> tf.data.Dataset:
    """``ds`` (one epoch, in batches) run on the service's workers, each shard file by one of them; the same
    elements here, sent uncompressed (one gRPC message a batch)."""
    tf_ = require("tensorflow")
    dynamic = tf_.data.experimental.service.ShardingPolicy.DYNAMIC
    served_ = tf_.data.experimental.service.distribute(processing_mode=dynamic, service=service, compression=None)
    return ds.apply(served_)


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

    try:
        workers = _call(target, GET_WORKERS, timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return "what answers there is not a tf.data service dispatcher (a worker's port?)"
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"nothing answered there as a tf.data service dispatcher within {timeout:.0f} s"
        said = f"no tf.data service dispatcher answers ({e.code().name.lower()})"
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            return said
        return f"{said}; start one with python -m {COMMAND} dispatcher --port {target.rpartition(':')[2]}"
    if need_workers and not workers:  # the reply lists the workers: empty bytes, none
        return f"the dispatcher has no workers; start one with python -m {COMMAND} worker --dispatcher {target}"
    if need_workers:  # a worker the dispatcher lists but this machine cannot dial: the trainer would wait forever
        for address in worker_addresses(workers):
            problem = worker_problem(address, timeout)
            if problem:
                return (
                    f"its worker {address} {problem}; start the worker with --address set to a name or IP this "
                    f"machine reaches it by (python -m {COMMAND} worker --address HOST), or stop a worker that is gone"
                )
    return None


def worker_addresses(reply: bytes) -> list[str]:
    """The addresses in the dispatcher's ``GetWorkersResponse`` (``repeated WorkerInfo workers = 1``, each with
    ``string address = 1``), read from the wire format: TensorFlow ships no Python class for it."""
    return [dict(_fields(info)).get(1, b"").decode("utf-8", "replace") for field, info in _fields(reply) if field == 1]


def _fields(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(field number, bytes) of each length-delimited field of a protobuf message; varints are skipped."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        if key & 7 == 2:
            n, i = _varint(data, i)
            yield key >> 3, data[i : i + n]
            i += n
        elif key & 7 == 0:
            _, i = _varint(data, i)
        else:  # no other wire type in these messages
            return


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def worker_problem(address: str, timeout: float = 5.0) -> str | None:
    """Why ``address`` (HOST:PORT) does not answer as a tf.data service worker (its ``GetWorkerTasks``), None when
    it does."""
    grpc = require("grpc")

    try:
        _call(address, WORKER_TASKS, timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"did not answer from this machine within {timeout:.0f} s"
        return f"does not answer from this machine ({e.code().name.lower()})"
    return None


def _call(target: str, method: str, timeout: float) -> bytes:
    """One gRPC call with an empty request (every call asked here takes one) to ``target`` (HOST:PORT); its reply's
    bytes, or ``grpc.RpcError``."""
    grpc = require("grpc")

    with grpc.insecure_channel(target) as channel:
        reply: bytes = channel.unary_unary(method)(b"", timeout=timeout)
    return reply


class WorkerWatch:
    """While a trainer consumes a service: every ``poll`` seconds the dispatcher's workers are dialled, and a
    worker that has not answered for ``gone_seconds`` while no training step ended ends the process in one line
    (``end``; by default ``tfpipe.runtime.lifecycle.exit_now(BAD_INPUT)``): TensorFlow's client waits for a lost worker
    forever, so a dead or unreachable worker would otherwise leave the trainer saying "still compiling" or nothing at
    all. A worker restarted at the same address within ``gone_seconds`` (the epoch then goes on) is waited for; so is
    one that the trainer does not need (steps still ending)."""

    def __init__(
        self,
        service: str,
        prog: str,
        gone_seconds: float = GONE_SECONDS,
        poll: float = POLL_SECONDS,
        end: Callable[[str], None] | None = None,
    ) -> None:
        self.target, self.prog = service.removeprefix("grpc://"), prog
        self.gone_seconds, self.poll, self.end = gone_seconds, poll, end or _end_now
        self.resume = option("resume", True)  # spelt here: the watching thread does not see the command's context
        self.last_step = time.monotonic()
        self.silent_since: dict[str, float] = {}  # worker address -> when it first did not answer
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="tfpipe-service-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stepped(self) -> None:
        self.last_step = time.monotonic()

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(self.poll):
            line = self.check()
            if line and not self.stopped.is_set():
                self.end(line)
                return

    def check(self) -> str | None:
        """One round: the line that ends training, or None."""
        now = time.monotonic()
        listed = set(worker_addresses(_get_workers(self.target, self.poll)))
        for address in listed | set(self.silent_since):  # one the dispatcher dropped is still missed
            if worker_problem(address, min(self.poll, 5.0)) is None:
                self.silent_since.pop(address, None)
            else:
                self.silent_since.setdefault(address, now)
        for address, since in self.silent_since.items():
            waited = now - max(since, self.last_step)
            if waited >= self.gone_seconds:
                return (
                    f"{self.prog}: error: the tf.data service worker {address} has not answered for "
                    f"{now - since:.0f} s and training waited for it {waited:.0f} s; start it again at that address "
                    f"(python -m {COMMAND} worker --address HOST --port PORT), then {self.resume} "
                    "continues from the last backup"
                )
        return None


def _get_workers(target: str, timeout: float) -> bytes:
    """The dispatcher's ``GetWorkers`` reply; empty when the dispatcher does not answer (the workers are dialled
    as last seen)."""
    grpc = require("grpc")

    try:
        return _call(target, GET_WORKERS, timeout)
    except grpc.RpcError:
        return b""


def _end_now(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    exit_now(BAD_INPUT)
