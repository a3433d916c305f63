"""The processes that train one run together, as one of them sees them (``Workers``): one process alone
(``ALONE``), TensorFlow's multi-worker cluster (``TfWorkers``, ``train.accel.cluster``), or the processes of one
JAX program (``train.accel.hosts.Processes``). The trainer asks its backend for them
(``train.backends.Backend.workers``) and writes no branch of its own for a cluster."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

from tfpipe.runtime.errors import TfpipeError
from train.accel import cluster


class Workers(Protocol):
    """This process among the processes training one run."""

    many: bool  # several processes train the run; the chief alone writes it
    chief: bool  # this process writes the run
    name: str  # this process: ``worker 1`` (TensorFlow's task), ``process 1`` (JAX's)
    chief_name: str  # the one that writes the run
    collective_saves: bool  # a backup is a collective: saved at the same steps by every process, or not at all

    def same_start(self, run: str, start: tuple[int, ...]) -> None:
        """Every process starts from the same point (``start``), or every one refuses in one line."""
        ...

    def from_chief(self, values: Sequence[int]) -> list[int]:
        """The chief's ``values`` on every process (every process passes as many): what the chief alone read or
        decided (``train.cv``: where each fold stands)."""
        ...

    def answering(self, run: str) -> contextlib.AbstractContextManager[None]:
        """Within the block, a process that stops answering ends this one in one line."""
        ...

    def agree(self, received: int | None) -> int | None:
        """The stop (a signal) this process acts on at a step every process calls it at: any process's."""
        ...

    def trained(self) -> None:
        """This process is past the last step every process takes together."""
        ...

    def finished(self) -> None:
        """The job's end on this process (the chief: the run written)."""
        ...


class Alone:
    """One process trains the run and writes it."""

    many, chief, name, chief_name, collective_saves = False, True, "", "", False

    def same_start(self, run: str, start: tuple[int, ...]) -> None:
        pass

    def from_chief(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def answering(self, run: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def agree(self, received: int | None) -> int | None:
        return received

    def trained(self) -> None:
        pass

    def finished(self) -> None:
        pass


ALONE = Alone()


class TfWorkers(Alone):
    """The workers of ``MultiWorkerMirroredStrategy`` (``train.accel.cluster``): each stops at its own step (a stop
    is not agreed on: the chief's line names the backup ``--resume`` continues from)."""

    many, collective_saves = True, True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.chief = cluster.is_chief(strategy)
        self.name, self.chief_name = cluster.task_name(strategy), cluster.chief_name(strategy)

    def same_start(self, run: str, start: tuple[int, ...]) -> None:
        cluster.check_same_start(self.strategy, run, start)

    def from_chief(self, values: Sequence[int]) -> list[int]:
        raise TfpipeError("a TensorFlow multi-worker cluster trains one run (train.fit); train.cv is refused first")

    def answering(self, run: str) -> contextlib.AbstractContextManager[None]:
        return cluster.peers_answering(self.strategy, run)
