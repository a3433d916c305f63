"""Keras 3 on JAX over several processes (``--backend jax --strategy multiworker``): one JAX program over every
process's devices (JAX's multi-controller runtime), the way the hosts of a TPU pod slice train together.

Every process runs the same command. On a TPU pod slice the hosts find each other (``keras.distribution.initialize``
reads the TPU's own environment); elsewhere the cluster is in Keras' own variables, set on every process::

    KERAS_DISTRIBUTION_JOB_ADDRESSES=10.0.0.1:4321 KERAS_DISTRIBUTION_NUM_PROCESSES=2 KERAS_DISTRIBUTION_PROCESS_ID=0 \\
        python -m train.fit --backend jax --strategy multiworker --records gs://bucket/train --run gs://bucket/runs/b0

(the address is process 0's, where JAX's coordination service listens). On CPUs ``--replicas N`` gives each
process N XLA host devices, and their collectives go over gloo. Each process reads its own share of the shards
(``tfpipe.tf.passes.shard_for_input``, as TensorFlow's workers do) and feeds its own devices; Keras assembles the
global batch. Process 0 writes the run folder; the others train in private folders (``train.keras.trainer``).

Besides JAX's collectives, three things tie the processes together (``Processes``):

- ``PeerWatch``: a TCP connection from each process to process 0. A process that ends without saying it would
  (killed, out of memory, an error of its own) closes it, and every other ends in one line at once: JAX's
  coordination service would abort them, with a C++ stack trace, only after its heartbeat timeout (100 s).
- ``agree``: a stop (SIGTERM: a TPU VM's maintenance event) that any process noted is every process's, at the same
  step, so each saves there.
- ``same_start``: where each process starts and a digest of its settings, compared before the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tfpipe.runtime.console import stdout_on_stderr
from tfpipe.runtime.errors import TfpipeError, command, option
from tfpipe.runtime.lifecycle import BAD_INPUT, exit_now
from tfpipe.runtime.net import MAX_PORT, host_and_port
from train.accel.tpus import tpu_present

ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"  # Keras' variables (keras.distribution.initialize reads them)
COUNT = "KERAS_DISTRIBUTION_NUM_PROCESSES"
INDEX = "KERAS_DISTRIBUTION_PROCESS_ID"
EXAMPLE = f"{ADDRESSES}=HOST:PORT {COUNT}=2 {INDEX}=0"
CONNECT_SECONDS = 120  # the processes have all joined JAX's program: each connects to process 0 at once


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Process 0's ``HOST:PORT`` (JAX's coordination service), how many processes, and which this one is; all None
    on a TPU pod slice, whose hosts JAX finds itself."""

    coordinator: str | None = None
    count: int | None = None
    index: int | None = None


def cluster_from_environment(environ: Mapping[str, str]) -> Cluster:
    """Keras' three variables read and checked, or a TPU pod slice's own environment where none is set. One line
    naming what is wrong otherwise: JAX would wait five minutes for a mistyped cluster, then fail in C++."""
    given = {name: environ.get(name, "").strip() for name in (ADDRESSES, COUNT, INDEX)}
    what = f"{option('strategy', 'multiworker')} with {option('backend', 'jax')}"
    if not any(given.values()):
        if tpu_present():
            return Cluster()
        raise TfpipeError(
            f"{what} reads the cluster from {ADDRESSES}, {COUNT} and {INDEX} (Keras' own), which are not set; set "
            f"them on every process (its own {INDEX} each), e.g. {EXAMPLE}"
        )
    missing = [name for name, value in given.items() if not value]
    if missing:
        raise TfpipeError(f"{missing[0]} is not set; {what} needs {ADDRESSES}, {COUNT} and {INDEX}, e.g. {EXAMPLE}")
    count = whole_number(COUNT, given[COUNT], 1, None)
    index = whole_number(INDEX, given[INDEX], 0, count - 1)
    addresses = [a.strip() for a in given[ADDRESSES].split(",")]
    if len(addresses) not in (1, count):
        raise TfpipeError(
            f"{ADDRESSES} lists {len(addresses)} addresses for {count} processes ({COUNT}): give process 0's "
            "HOST:PORT alone, or one for each process"
        )
    for address in addresses:
        parts = host_and_port(address)
        if parts is None or not 1 <= parts[1] <= MAX_PORT:
            raise TfpipeError(f"{ADDRESSES} lists {address!r}: not HOST:PORT (port 1..{MAX_PORT})")
    if len(set(addresses)) != len(addresses):
        raise TfpipeError(f"{ADDRESSES} lists an address twice: each process needs its own")
    return Cluster(addresses[0], count, index)


def whole_number(name: str, text: str, low: int, high: int | None) -> int:
    if not re.fullmatch("[0-9]{1,9}", text) or int(text) < low or (high is not None and int(text) > high):
        span = f"{low}..{high}" if high is not None else f"{low} or more"
        raise TfpipeError(f"{name} is {text!r}: a whole number, {span}")
    return int(text)


def join(cluster: Cluster) -> None:
    """Joins the JAX program of ``cluster`` (``keras.distribution.initialize``: JAX's distributed runtime, and one
    random seed for every process), the CPU's collectives over gloo; JAX waits up to five minutes for every
    process. A process that joined already (a notebook's own ``initialize``) is left as it is."""
    import jax
    import keras
    from jax._src import distributed  # where JAX keeps whether this process joined

    from train.backends.choice import jax_started

    if distributed.global_state.client is not None:
        return
    if jax_started():
        raise TfpipeError(
            "JAX already started in this process, so it cannot join a cluster: start the job in a new process "
            "(in a notebook: restart the kernel and make the devices first)"
        )
    check_listens(cluster)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of several processes
    try:
        keras.distribution.initialize(cluster.coordinator, cluster.count, cluster.index)
    except Exception as e:  # JAX's runtime errors: a port taken, a process that never came
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        where = cluster.coordinator or "the TPU pod slice's coordinator"
        raise TfpipeError(f"process {cluster.index}: cannot join the cluster at {where} ({said})") from None


def check_listens(cluster: Cluster) -> None:
    """Process 0 starts JAX's coordination service at the cluster's address: a port taken there, or an address
    that is not this machine's, ends the process in JAX's C++ with a segmentation fault and no word of why. Said
    in one line first (a bind tried and let go)."""
    found = host_and_port(cluster.coordinator)
    if cluster.index != 0 or found is None:
        return
    host, port = found
    try:
        with socket.create_server((host.strip("[]"), port)):
            pass
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise TfpipeError(
            f"process 0 cannot listen at {cluster.coordinator} ({ADDRESSES}: {why}): the port is taken, or the "
            "address is not this machine's"
        ) from None


def coordinator_host() -> str:
    """The host of process 0, where JAX's coordination service listens (read from JAX: on a TPU pod slice JAX
    found it)."""
    from jax._src import distributed

    address = distributed.global_state.coordinator_address or ""
    found = host_and_port(address)
    return found[0].strip("[]") if found else "127.0.0.1"


class Processes:
    """This process among the processes of one JAX program (``join``): the ``train.accel.workers.Workers`` of a
    JAX job. Process 0 is the chief, which writes the run."""

    collective_saves = False  # a JAX backup reads the replicated weights on this process: no collective

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count
        self.many, self.chief = count > 1, index == 0
        self.name, self.chief_name = f"process {index}", "process 0"
        self.watch = PeerWatch(index, count)
        self.stopped_together = False  # a stop every process agreed on (``agree``) ends this one

    def gather(self, values: Sequence[int]) -> Any:
        """Every process's ``values``, a row each in process order (JAX's allgather: a collective; gloo's line
        as a new group of it connects goes to stderr's noise filter)."""
        import numpy as np
        from jax.experimental import multihost_utils

        with stdout_on_stderr():
            return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int64)))

    def connect(self) -> None:
        """The ``PeerWatch`` connections made (every process at once, after ``join``)."""
        if self.many:
            self.watch.connect(self.gather, coordinator_host())

    def same_start(self, run: str, start: tuple[int, ...]) -> None:
        """Every process starts from the same point (``train.keras.trainer.start_point``), or every one refuses."""
        rows = self.gather(start)
        unlike = [i for i, row in enumerate(rows) if (row != rows[self.index]).any()]
        if unlike:
            raise TfpipeError(
                f"{self.name}: the processes do not start alike (process {unlike[0]} differs from this one: "
                f"{start[0]} epoch{'s' * (start[0] != 1)} done, a digest of its settings {start[2]}); every process "
                f"needs the same command, and with {option('resume', True)} the same run folder {run} on storage "
                "every process reads (gs://)"
            )

    def agree(self, received: int | None) -> int | None:
        """The stop any process noted (its signal; the highest), the same on every process: called at the same
        steps by every process."""
        found = int(self.gather([received or 0]).max()) or None
        self.stopped_together = self.stopped_together or found is not None
        return found

    def from_chief(self, values: Sequence[int]) -> list[int]:
        """Process 0's ``values`` on every process (a collective: every process passes as many)."""
        return [int(v) for v in self.gather(values)[0]]

    @contextlib.contextmanager
    def answering(self, run: str) -> Iterator[None]:
        """Within the block a process that ends ends this one in a line (``PeerWatch``); this one ending on an
        error of its own says nothing to the others (they end on its silence), a stop they agreed on says bye.
        Each block is a round of the job (``train.cv``: one a fold): a bye ends the round it is said in."""
        self.watch.begin(run)
        try:
            yield
        except KeyboardInterrupt:
            self.watch.bye() if self.stopped_together else self.watch.quiet.set()
            raise
        except BaseException:
            self.watch.quiet.set()  # its own line says why; the others' ends are no news now
            raise

    def trained(self) -> None:
        """This process is past its last collective: the others' ends are no news now; one other than the chief
        says so (its bye)."""
        self.watch.quiet.set()
        if not self.chief:
            self.watch.bye()

    def finished(self) -> None:
        """The job's end: the chief says bye (the run is written); another process waits for it, so its exit
        code says whether the run was."""
        if self.chief:
            self.watch.bye()
        elif self.many:
            self.watch.wait_for_chief()


class PeerWatch:
    """A TCP connection from every process to process 0 (at the coordinator's host, a port process 0 picks and
    tells the others through JAX's allgather). A process that ends a round of the job on purpose says ``bye R``
    (its training done; a stop every process agreed on); one whose connection closes without it (killed, out of
    memory, an error of its own) ends every other in one line, at once: process 0 tells the others which process
    it was. A job has one round (``train.fit``) or several, one a fold (``train.cv``): a connection that closed
    after a round's bye ends the others when the next round begins."""

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count
        self.prog, self.resume, self.run = command() or "tfpipe", option("resume", True), ""
        self.quiet = threading.Event()  # this process ends this round on purpose: a peer's end is no news
        self.peers: dict[int, socket.socket] = {}
        self.round = 0  # the rounds begun (``begin``); every process begins the same ones
        self.byes: dict[int, int] = {}  # the last round each peer said bye in
        self.closed: set[int] = set()  # the peers whose connection closed
        self.changed = threading.Condition()

    def begin(self, run: str) -> None:
        """A new round (a run trained into ``run``): a peer whose connection closed since ends this process now."""
        with self.changed:
            self.round, self.run = self.round + 1, run
            self.quiet.clear()
            gone = sorted(p for p in self.closed if not self.said_bye(p))
        if gone:
            self.lost(gone[0])

    def said_bye(self, peer: int) -> bool:
        return self.byes.get(peer, 0) >= self.round

    def connect(self, gather: Any, host: str) -> None:
        server = socket.create_server((host, 0)) if self.index == 0 else None
        port = int(gather([server.getsockname()[1] if server else 0])[0][0])
        if server is not None:
            with server:
                server.settimeout(CONNECT_SECONDS)
                for _ in range(self.count - 1):
                    conn, _ = server.accept()
                    conn.settimeout(None)
                    peer = int(conn.recv(16).decode("ascii").strip())
                    self.peers[peer] = conn
        else:
            conn = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
            conn.sendall(f"{self.index}\n".encode("ascii"))
            conn.settimeout(None)
            self.peers[0] = conn
        for peer, conn in self.peers.items():
            threading.Thread(target=self.listen, args=(peer, conn), daemon=True, name=f"tfpipe-peer-{peer}").start()

    def listen(self, peer: int, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn.makefile("r", encoding="ascii") as lines:
            for line in lines:
                words = line.split()
                if words[:1] == ["bye"] and len(words) == 2:
                    self.note(peer, bye=int(words[1]))
                elif words[:1] == ["lost"] and len(words) == 2 and not self.quiet.is_set():
                    self.end(int(words[1]))
        if not self.note(peer, bye=None) and not self.quiet.is_set():
            self.lost(peer)

    def note(self, peer: int, bye: int | None) -> bool:
        """Notes that ``peer`` said bye in round ``bye``, or (None) that its connection closed; returns whether it
        said bye in this round."""
        with self.changed:
            if bye is None:
                self.closed.add(peer)
            else:
                self.byes[peer] = max(bye, self.byes.get(peer, 0))
            self.changed.notify_all()
            return self.said_bye(peer)

    def lost(self, peer: int) -> None:
        """``peer`` closed its connection without a bye: process 0 tells the others which, then each ends."""
        for other, conn in self.peers.items():
            if other != peer:
                with contextlib.suppress(OSError):
                    conn.sendall(f"lost {peer}\n".encode("ascii"))
        self.end(peer)

    def end(self, peer: int) -> None:
        print(
            f"{self.prog}: error: process {self.index}: process {peer} ended before the job did, so this process "
            f"stopped (that process's own output says why); the epochs saved in {self.run or 'the run folder'}, if "
            f"any, are kept: {self.resume} on every process continues them",
            file=sys.stderr,
            flush=True,
        )
        exit_now(BAD_INPUT)  # as a TfpipeError would: its line said why

    def bye(self) -> None:
        """This process ends on purpose: said to every process it is connected to."""
        self.quiet.set()
        for conn in self.peers.values():
            with contextlib.suppress(OSError):
                conn.sendall(f"bye {self.round}\n".encode("ascii"))

    def wait_for_chief(self) -> None:
        """Until process 0 says bye in this round (the run written) or ends without it: then one line."""
        with self.changed:
            self.changed.wait_for(lambda: self.said_bye(0) or 0 in self.closed)
            written = self.said_bye(0)
        if not written:
            raise TfpipeError(
                f"process {self.index}: process 0 ended before it wrote the run {self.run} (its own output says why)"
            )
