"""Training on several machines with Keras: ``--strategy multiworker`` (``MultiWorkerMirroredStrategy``).

Every worker runs the same command with its own ``TF_CONFIG`` (the cluster and which task it is: the convention
every launcher writes)::

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:12345", "10.0.0.2:12345"]}, "task": {"type": "worker", "index": 0}}' \\
        python -m train.fit --records gs://bucket/train --run gs://bucket/runs/b0 --strategy multiworker

The chief (``task`` ``chief``, else worker 0) writes the run folder; the other workers train in a private
temporary folder, removed when they end (on ``--resume`` it starts as a copy of what they need of the chief's:
the backup of the last epoch, the burn-in's weights, the SWA average), and after training the chief alone scores
and saves the model. A worker that dies stops every other one, each with one line (its connections close at
once; a machine gone misses the coordination service's heartbeats).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tfpipe.runtime import fs
from tfpipe.runtime.errors import TfpipeError, option
from tfpipe.runtime.lifecycle import sigterm_restored
from tfpipe.runtime.net import MAX_PORT, host_and_port
from train.runs import run as run_files
from train.runs.run import RunConfig

if TYPE_CHECKING:
    import tensorflow as tf

JOBS = ("chief", "worker")  # the task types MultiWorkerMirroredStrategy trains with
EXAMPLE = '{"cluster": {"worker": ["HOST1:PORT", "HOST2:PORT"]}, "task": {"type": "worker", "index": 0}}'


def cluster_from_environment() -> dict[str, Any]:
    """``TF_CONFIG`` read and checked: a cluster of ``chief`` (at most one) and ``worker`` addresses
    (``HOST:PORT``, none twice) and this process's task in it. One line naming what is wrong otherwise:
    TensorFlow would wait for a mistyped cluster forever."""
    text = os.environ.get("TF_CONFIG")
    if not text:
        raise TfpipeError(
            f"{option('strategy', 'multiworker')} reads the cluster from TF_CONFIG, which is not set; set it on every "
            f"worker (its own task each), e.g. TF_CONFIG='{EXAMPLE}'"
        )
    try:
        config = json.loads(text)
    except ValueError as e:
        raise TfpipeError(f"TF_CONFIG is not JSON ({e}); e.g. TF_CONFIG='{EXAMPLE}'") from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise TfpipeError(f'TF_CONFIG needs a "cluster" and a "task" object; e.g. TF_CONFIG=\'{EXAMPLE}\'')
    if config.get("rpc_layer", "grpc") != "grpc":  # TensorFlow's servers speak gRPC only
        raise TfpipeError(f'TF_CONFIG\'s "rpc_layer" is {config["rpc_layer"]!r}; leave it out, or give "grpc"')
    check_cluster(cluster)
    check_task(task, cluster)
    return dict(config)


def check_cluster(cluster: dict[str, Any]) -> None:
    """Only chief and worker tasks, each a ``HOST:PORT``, no address twice, at most one chief."""
    other = sorted(set(cluster) - set(JOBS))
    if other:
        raise TfpipeError(
            f"TF_CONFIG's cluster has {other[0]!r} tasks; {option('strategy', 'multiworker')} trains with "
            '"chief" and "worker" tasks only (MultiWorkerMirroredStrategy has no parameter servers or evaluators)'
        )
    if not cluster.get("worker") and not cluster.get("chief"):
        raise TfpipeError('TF_CONFIG\'s cluster lists no "worker" addresses')
    seen: set[str] = set()
    for job in JOBS:
        addresses = cluster.get(job) or []
        if not isinstance(addresses, list) or (job in cluster and not addresses):  # [] would crash TensorFlow
            raise TfpipeError(f'TF_CONFIG\'s cluster {job!r}: a list of "HOST:PORT" addresses, not {cluster[job]!r}')
        if job == "chief" and len(addresses) > 1:
            raise TfpipeError('TF_CONFIG\'s cluster lists more than one "chief"')
        for address in addresses:
            parts = host_and_port(address)
            if parts is None or not 1 <= parts[1] <= MAX_PORT:
                raise TfpipeError(f"TF_CONFIG's cluster {job!r} lists {address!r}: not HOST:PORT (port 1..{MAX_PORT})")
            if address in seen:
                raise TfpipeError(f"TF_CONFIG's cluster lists {address} twice: each task needs its own port")
            seen.add(address)


def check_task(task: dict[str, Any], cluster: dict[str, Any]) -> None:
    """This process's task is one the cluster lists."""
    kind, index = task.get("type"), task.get("index")  # TensorFlow has no default index
    if kind not in JOBS or not cluster.get(kind):
        listed = " or ".join(repr(j) for j in JOBS if cluster.get(j))
        raise TfpipeError(f"TF_CONFIG's task type is {kind!r}; the cluster lists {listed} tasks")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[kind]):
        raise TfpipeError(
            f"TF_CONFIG's task index is {index!r}; the cluster lists {len(cluster[kind])} {kind} task"
            f"{'s' * (len(cluster[kind]) != 1)} (index 0..{len(cluster[kind]) - 1})"
        )


def connect() -> tf.distribute.MultiWorkerMirroredStrategy:
    """The strategy over ``TF_CONFIG``'s cluster: starts this worker's server at its address and waits until
    every worker has started (TensorFlow's wait, unbounded: said in the docs).

    No collective timeout (``CommunicationOptions(timeout_seconds=...)``): TensorFlow enforces it with a thread
    per collective op that lives as long as the timeout: with a timeout of a minute they pile up by hundreds a
    second on each worker until the workers abort (``std::system_error``, no thread left to start).
    A worker that dies is found without it: its connections close, and TensorFlow's coordination service
    misses its heartbeats."""
    import tensorflow as tf

    config = cluster_from_environment()
    with sigterm_restored():  # TensorFlow's coordination service swallows SIGTERM: a worker would train on
        try:
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
        except tf.errors.UnknownError as e:  # its server could not listen
            if "Could not start gRPC server" not in str(e):
                raise
            task = config["task"]
            address = config["cluster"][task["type"]][task["index"]]
            raise TfpipeError(
                f"{task['type']} {task['index']} cannot listen at {address} (TF_CONFIG): the port is taken, or "
                "the address is not this machine's"
            ) from None
    return strategy


def is_multiworker(strategy: tf.distribute.Strategy) -> bool:
    return type(strategy).__name__.startswith(("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy"))


def check_one_machine(strategy: Any) -> None:
    """Predicting runs on one machine: rows would come in the workers' order."""
    if strategy == "multiworker" or is_multiworker(strategy):
        raise TfpipeError(f"predicting runs on one machine: use {option('strategy')} auto, tpu, gpu or cpu")


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes the run: every process of one machine, the chief of a cluster."""
    return not is_multiworker(strategy) or bool(strategy.extended.should_checkpoint)


def task_name(strategy: tf.distribute.Strategy) -> str:
    """``worker 1`` / ``chief 0``: this process in its cluster."""
    resolver = strategy.cluster_resolver
    return f"{resolver.task_type} {resolver.task_id}"


def chief_name(strategy: tf.distribute.Strategy) -> str:
    """The task that writes the run: ``chief 0`` when the cluster has one, else ``worker 0``."""
    return "chief 0" if "chief" in strategy.cluster_resolver.cluster_spec().jobs else "worker 0"


def peer_named(message: str, strategy: tf.distribute.Strategy) -> str:
    """The first task other than this one a TensorFlow error names (``/job:worker/replica:0/task:1``), with its
    address; else "a worker"."""
    resolver = strategy.cluster_resolver
    for job, index in re.findall(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)", message):
        if (job, int(index)) == (resolver.task_type, resolver.task_id):
            continue
        try:
            return f"{job} {index} ({resolver.cluster_spec().task_address(job, int(index))})"
        except (ValueError, KeyError):
            return f"{job} {index}"
    return "a worker"


PEER_ERRORS = ("UnavailableError", "DeadlineExceededError", "CancelledError", "AbortedError")


@contextlib.contextmanager
def peers_answering(strategy: tf.distribute.Strategy, run: str) -> Iterator[None]:
    """A worker that stops answering ends this one in one line instead of a traceback: a killed worker's
    connections close at once, a machine gone misses the coordination service's heartbeats."""
    if not is_multiworker(strategy):
        yield
        return
    import tensorflow as tf

    try:
        yield
    except tf.errors.OpError as e:
        peer = peer_named(str(e), strategy)
        if type(e).__name__ not in PEER_ERRORS or peer == "a worker":  # names no other task: not a peer's failure
            raise
        what = "stopped answering" if "Deadline" not in type(e).__name__ else "did not answer in time"
        raise TfpipeError(
            f"{task_name(strategy)}: {peer} {what}, so this worker stopped (that task's own output says why); the "
            f"epochs saved in {run}, if any, are kept: {option('resume', True)} on every worker continues them"
        ) from None


def in_a_cluster() -> bool:
    """Whether this process joined a multi-worker cluster (TensorFlow's coordination service is configured);
    asks nothing of a process that has not imported TensorFlow."""
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context  # the one place that knows

    return getattr(context.context(), "coordination_service", None) is not None


def check_same_start(strategy: tf.distribute.Strategy, run: str, start: tuple[int, ...]) -> None:
    """Every worker starts from the same point: ``start`` (epochs done, the burn-in done, a digest of the
    settings and the shards) is compared across workers with two sums (equal on every worker exactly when the
    values are: Cauchy-Schwarz), so all of them agree or all refuse. Workers started with other settings, or a
    run folder that is not on storage every worker reads (a worker resuming from nothing), would otherwise
    train different epochs and wait for each other's steps."""
    import tensorflow as tf

    values = tf.constant(start, tf.float64)

    @tf.function  # run eagerly, a strategy's run warns of its overhead
    def sums() -> tf.Tensor:
        return strategy.reduce("SUM", strategy.run(lambda: tf.stack([values, values * values])), axis=None)

    total, squares = tf.unstack(sums())
    if not bool(tf.reduce_all(total * total == squares * strategy.num_replicas_in_sync)):
        raise TfpipeError(
            f"{task_name(strategy)}: the workers do not start alike (this one: {start[0]} epoch"
            f"{'s' * (start[0] != 1)} done, a digest of its settings {start[2]}); every worker needs the same "
            f"command, and with {option('resume', True)} the same run folder {run} on storage every worker reads "
            "(gs://)"
        )


def copy_for_resume(chief_run: str, own: str, names: tuple[str, ...]) -> None:
    """A worker's private run folder ``own`` starts as a copy of ``names`` (files and folders, those that exist;
    a name ending in ``*``: every file of its folder it begins) of the chief's run folder: what a resumed job
    reads (the last epoch's backup, the burn-in's weights, the SWA average), so every worker continues from the
    same epoch. Names are listed, not globbed: a run folder's own ``[`` or ``*`` is a character. A folder this
    worker cannot read is one line."""
    import tensorflow as tf

    try:
        for name in names:
            folder, _, stem = name.rpartition("/")
            found = [name] if not stem.endswith("*") else [
                f"{folder}/{n}" if folder else n
                for n in (fs.listdir(fs.join(chief_run, folder)) if fs.isdir(fs.join(chief_run, folder)) else [])
                if n.startswith(stem[:-1])
            ]  # fmt: skip
            for relative in found:
                if fs.exists(fs.join(chief_run, relative)):
                    copy_tree(fs.join(chief_run, relative), fs.join(own, relative))
    except tf.errors.OpError as e:
        raise TfpipeError(
            f"cannot read the chief's run folder {chief_run} to resume from ({str(e).splitlines()[0][:160]}); every "
            "worker needs it on storage it reads (gs://)"
        ) from None


def copy_tree(source: str, target: str) -> None:
    import tensorflow as tf

    if not fs.isdir(source):
        fs.makedirs(target.rpartition("/")[0])
        tf.io.gfile.copy(source, target, overwrite=True)
        return
    fs.makedirs(target)
    for name in fs.listdir(source):
        copy_tree(fs.join(source, name.rstrip("/")), fs.join(target, name.rstrip("/")))


def records_here(own: str, records: str) -> None:
    """The copy of the chief's ``config.json`` in a worker's folder ``own`` names this worker's shard folder:
    a worker may reach the same shards by another path (the dataset id, compared, says they are the same)."""
    if fs.exists(run_files.path(own, run_files.CONFIG)):
        config = RunConfig.load(own)
        dataclasses.replace(config, records=records, settings=dict(config.settings, records=records)).save(own)
