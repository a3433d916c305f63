"""Ranks a command starts on this machine (``examples/torch_ddp.py --processes N``): spawned together, watched
together, stopped together, and one line naming the rank that went first.

    spawn_ranks(run_rank, (args, config, free_port(), os.getpid()), nprocs=8)

The launcher side of ``tfpipe.runtime.lifecycle``: however the command leaves (a rank's error, Ctrl-C, SIGTERM) no rank
trains on, and a rank that only lost another one (gloo's error in a collective) exits with ``LOST_A_RANK`` and
says nothing, so its launcher names the rank that really went first (killed by a signal, out of memory), which
only the launcher can see. torch is imported where it is used: tfpipe itself does not need it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from tfpipe.runtime.errors import TfpipeError
from tfpipe.runtime.lifecycle import BAD_INPUT, LOST_A_RANK, Terminated, stop_processes

# A rank started by spawn_ranks whose collective failed because another rank is gone exits with this code and says
# nothing: its parent names the rank that went first. Before, the surviving rank's "lost another rank" line could
# reach the parent before the killed rank's death did.


class World(NamedTuple):
    """This process as one rank of a launcher's world (``torchrun``'s environment for ``env://``)."""

    rank: int
    size: int
    local_rank: int
    local_size: int | None  # the ranks on this machine (LOCAL_WORLD_SIZE: torchrun's); None: not said

    @property
    def nodes(self) -> int:
        """The machines (torchrun's), as Lightning counts them; 1 when the launcher did not say."""
        return max(1, self.size // self.local_size) if self.local_size else 1


def launched() -> World | None:
    """This process's rank when a launcher started it as one (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set, as torchrun sets them; ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` too, else one machine);
    None when run as a plain script or as a rank of Lightning's own launcher (which sets no ``RANK``). An
    environment that is not a rank of a world is refused, never taken for one machine: both recipes read it here."""
    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK") + ("LOCAL_WORLD_SIZE",) * ("LOCAL_WORLD_SIZE" in os.environ)
    numbers = {k: os.environ.get(k, "0") for k in names}
    if all(v.isdigit() for v in numbers.values()):
        rank, size, local_rank = (int(numbers[k]) for k in names[:3])
        local_size = int(numbers["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in numbers else None
        if rank < size and (local_size is None or 0 <= local_rank < local_size <= size):
            return World(rank, size, local_rank, local_size)
    shown = ", ".join(f"{k}={v}" for k, v in numbers.items())
    raise TfpipeError(f"the launcher's environment is not a rank of a world ({shown})")


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Runs ``fn(rank, *args)`` in ``nprocs`` spawned processes and waits for them; any rank's failure stops
    every other one, in one line (``TfpipeError``; ``SystemExit(2)`` when that rank said why itself)."""
    import torch.multiprocessing as mp

    ranks = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    with ranks_stopped_on_exit(ranks.processes):
        try:
            while not ranks.join():
                pass
        except mp.ProcessExitedException as e:
            if e.exit_code == BAD_INPUT:
                raise SystemExit(BAD_INPUT) from None
            index, how = first_gone(ranks.processes, e)
            if how is None:  # that rank said why on stderr
                raise SystemExit(BAD_INPUT) from None
            raise TfpipeError(f"rank {index} {how}; the other ranks were stopped") from None
        except mp.ProcessRaisedException as e:  # its traceback is in the message: the last line
            last = [line for line in str(e).splitlines() if line.strip()][-1]
            raise TfpipeError(f"rank {e.error_index} failed: {last}; the other ranks were stopped") from None


def first_gone(processes: Sequence[Any], e: Any, wait_seconds: float = 5.0) -> tuple[int, str | None]:
    """(rank, how it ended) of the rank that ended first: the one ``e`` names, unless it only lost another rank
    (``LOST_A_RANK``), whose end is then waited for (it is already gone: at most ``wait_seconds``). None: that
    rank ended with exit code 2, having said why itself."""
    if e.exit_code != LOST_A_RANK:
        return e.error_index, f"was killed by {e.signal_name}" if e.signal_name else f"exited with code {e.exit_code}"
    deadline = time.monotonic() + wait_seconds
    for index, process in enumerate(processes):
        process.join(max(0.0, deadline - time.monotonic()))
        code = process.exitcode
        if code is not None and code < 0:
            return index, f"was killed by {signal.Signals(-code).name}"
        if code not in (None, 0, LOST_A_RANK):
            return index, None if code == BAD_INPUT else f"exited with code {code}"
    return e.error_index, "lost another rank (gloo)"


@contextlib.contextmanager
def ranks_stopped_on_exit(processes: Sequence[Any], grace_seconds: float = 5.0) -> Iterator[None]:
    """However this process leaves the block (Ctrl-C, an error, a SIGTERM: exit 143 with a line, as every
    command), no rank trains on (``tfpipe.runtime.lifecycle.stop_processes``: SIGTERM, then SIGKILL after
    ``grace_seconds``; Python would otherwise wait for them at exit: they are not daemons). torch's own notes on
    stopping them are held back: the one line the command prints says what happened."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        yield
    except Terminated as e:  # run_cli's SIGTERM: the line says the ranks went with it
        raise Terminated(f"{e}; every rank stopped", e.signum) from None
    finally:
        stop_processes(processes, grace_seconds)


def check_same_start(settings: Mapping[str, object], rank: int) -> None:
    """Every rank of a started process group starts alike: ``settings`` (a recipe's flags and the dataset ids of
    its shards, ``train.torch.run.start_settings``) are gathered from every rank and compared with rank 0's, so
    all of them refuse together, in the same line naming the first setting that differs. Ranks started with
    another ``--lr`` would otherwise train together, their weights drifting apart, and others fail late with
    messages that blame the data. ``train.fit --strategy multiworker`` checks its workers the same way."""
    import torch.distributed as dist

    if not dist.is_initialized():  # one process: nothing to compare
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(settings))
    refused = next(((r, s[REFUSED]) for r, s in enumerate(everyone) if REFUSED in s), None)
    if refused is not None:
        raise TfpipeError(f"rank {rank}: rank {refused[0]} refused to start ({refused[1]}); no rank trains")
    first = everyone[0]
    for key in [*first, *(k for s in everyone for k in s if k not in first)]:
        other = next((r for r, s in enumerate(everyone) if s.get(key) != first.get(key)), None)
        if other is not None:
            raise TfpipeError(
                f"rank {rank}: the ranks do not start alike: {key} is {everyone[other].get(key)!r} on rank {other} "
                f"and {first.get(key)!r} on rank 0; start every rank with the same command (paths may differ "
                "between machines, the shards they name may not)"
            )


REFUSED = "refused"  # a rank's settings in check_same_start: the line it refused to start with instead


def refuse_to_the_others(line: str, rank: int, world_size: int, wait_seconds: float = 60.0) -> None:
    """A launcher's rank that refused its command before the ranks met (a bad ``--records``, a missing package)
    still meets them (``env://``, waiting at most ``wait_seconds``) and hands them its refusal as its settings
    in ``check_same_start``: they then refuse too, in one line naming it, instead of waiting for torch's 30
    minutes."""
    import datetime

    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=wait_seconds)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        dist.all_gather_object([None] * world_size, {REFUSED: line})
    except (RuntimeError, TimeoutError, ValueError):  # the others never came: nobody to tell
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
