"""Whether a communicator's ranks are still in step: after a collective that
failed out of step (a timed-out rank's messages may still arrive, into the
next exchange: the ranks then wait in different collectives, and read each
other's data as sizes), or a step cancelled part way, every later exchange
over that communicator is refused (`in_step`), by any `DataParallel`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from monadl.distributed._comm import Communicator, RankFailure
from monadl.errors import OperandError

__all__ = ["in_step"]

_BROKEN: Final[dict[int, tuple[object, str]]] = {}
"""Why each communicator's ranks may be out of step, by the id of what it
wraps (`_underlying`; held here, so the id stays its own): however the
communicator was made again (``mpi_world()`` wraps ``MPI.COMM_WORLD`` anew
at each call), and whether or not it hashes."""


def _underlying(comm: Communicator) -> object:
    """What ``comm`` sends through: the innermost of its ``_comm`` wrappings
    (an MPI communicator's mpi4py one), else ``comm`` itself."""
    inner: object = comm
    while (wrapped := getattr(inner, "_comm", None)) is not None and wrapped is not inner:
        inner = wrapped
    return inner


def _break(comm: Communicator, why: str) -> None:
    inner = _underlying(comm)
    _BROKEN[id(inner)] = (inner, why)


_RUNNING: Final[set[int]] = set()
"""The communicators (by `_underlying`'s id) a step or a broadcast is exchanging over now."""


@contextmanager
def in_step(comm: Communicator) -> Iterator[None]:
    """Refuse to exchange over ``comm`` once its ranks may be out of step, or
    while another step exchanges over it here; note a failure that leaves
    them out of step."""
    inner = _underlying(comm)
    if id(inner) in _RUNNING:  # (refused here alone, before any exchange: the ranks stay in step)
        raise OperandError(
            "a step or a broadcast over this communicator is already running on this rank (another task's "
            "train() or broadcast(), of this DataParallel or another over the same communicator): their "
            "collectives would interleave and pair differently on each rank; await one before the next"
        )
    entry = _BROKEN.get(id(inner))
    if entry is not None:
        raise RankFailure(
            {},
            f"the ranks may be out of step after an earlier step ({entry[1]}); end the job and restart "
            "it (from a checkpoint); for a slow rank, give the communicator a longer timeout",
            in_step=False,
        )
    _RUNNING.add(id(inner))
    try:
        yield
    except RankFailure as failure:
        if not failure.in_step:
            _break(comm, failure.reason or str(failure))
        raise
    except BaseException:  # (cancelled: the other ranks wait for this one, maybe inside a collective)
        _break(comm, f"rank {comm.rank}'s step was stopped part way (cancelled, or an error of the runtime)")
        raise
    finally:
        _RUNNING.discard(id(inner))
