"""The tf.data service as tfpipe's readers use it (no command here: ``python -m tfpipe.service`` starts the
servers, ``tfpipe/service.py``).

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

from typing import TYPE_CHECKING

from tfpipe.deps import require
from tfpipe.errors import TfpipeError, option
from tfpipe.net import MAX_PORT, host_and_port

if TYPE_CHECKING:
    import tensorflow as tf

COMMAND = "tfpipe.service"  # the command that starts a dispatcher or worker, named in the lines here
GROUP = 32  # images a message from a worker: one gRPC round trip per group, not per image
GET_WORKERS = "/tensorflow.data.DispatcherService/GetWorkers"  # TensorFlow's dispatcher.proto


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
            return f"{said}; start one with python -m {COMMAND} dispatcher --port {target.rpartition(':')[2]}"
    if need_workers and not workers:  # the reply lists the workers: empty bytes, none
        return f"the dispatcher has no workers; start one with python -m {COMMAND} worker --dispatcher {target}"
    return None
