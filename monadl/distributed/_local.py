"""Ranks as threads of one process: a `Communicator` for tests and examples.

`run_local` runs one coroutine per rank, each in its own thread with its own
event loop, joined by an in-process communicator that implements every
collective as one exchange: each rank deposits its array under the
collective's sequence number and, once all have, reads every rank's. It needs
no MPI, so the data-parallel protocol (agreement, faults, sparse rows) is
tested in milliseconds; `MpiCommunicator` runs the same protocol across
processes.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, final

import anyio
import numpy as np
import numpy.typing as npt

from monadl.distributed._comm import DEFAULT_TIMEOUT, Communicator, Pending, RankFailure, poll

THREADS_IDLE: Final = 1e-4
"""Seconds between a thread rank's tests of an exchange (about a millisecond
in fact: the event loop's timer rounds up to its own): its event loop waits
them out without the interpreter's lock, which the rank it waits for needs
(testing back to back, as an MPI rank does, starved it)."""

__all__ = ["LocalCommunicator", "run_local"]

T = TypeVar("T")


@final
@dataclass(slots=True)
class _Board:
    """What the ranks have deposited, per collective, until every rank has read it."""

    size: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    slots: dict[int, list[Any]] = field(default_factory=dict)
    reads: dict[int, int] = field(default_factory=dict)
    ended: dict[int, str] = field(default_factory=dict)  # ranks whose thread is done, and how


@final
class LocalCommunicator(Communicator):
    """One rank of a group of ranks in this process (see `run_local`)."""

    __slots__ = ("_board", "_rank", "_sequence", "timeout")

    def __init__(self, board: _Board, rank: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._board = board
        self._rank = rank
        self._sequence = 0
        self.timeout = timeout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._board.size

    async def allgather(self, send: npt.NDArray[Any], counts: Sequence[int]) -> npt.NDArray[Any]:
        return np.concatenate(_alike(await self._exchange(send, "all-gather"), "all-gather", rows=True))

    async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return _sum(await self._exchange(send, "all-reduce"))

    def start_allreduce(self, send: npt.NDArray[Any]) -> Pending:
        key = self._deposit(send)
        return _LocalPending(self, key)

    async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
        return _alike(await self._exchange(buffer, "broadcast"), "broadcast")[root].copy()

    async def _exchange(self, send: npt.NDArray[Any], what: str) -> list[npt.NDArray[Any]]:
        key = self._deposit(send)
        await poll(lambda: self._arrived(key), self.timeout, what, self._rank, spin=0.0, idle=THREADS_IDLE)
        return self._collect(key)

    def _deposit(self, send: npt.NDArray[Any]) -> int:
        board, key = self._board, self._sequence
        self._sequence += 1
        with board.lock:
            # (a copy of its own: np.array(send, copy=True) warned of a tensor's __array__, which takes no copy=)
            board.slots.setdefault(key, [None] * board.size)[self._rank] = np.asarray(send).copy()
        return key

    def _arrived(self, key: int) -> bool:
        parts = self._board.slots[key]
        if all(part is not None for part in parts):
            return True
        gone = {r: self._board.ended[r] for r, part in enumerate(parts) if part is None and r in self._board.ended}
        if gone:  # (a rank whose thread is done never deposits: no timeout to wait for)
            raise RankFailure(
                {},
                "; ".join(f"rank {r} ended ({how}) before this collective" for r, how in gone.items())
                + (_FEWER if "it returned" in gone.values() else ""),
                in_step=False,
            )
        return False

    def _collect(self, key: int) -> list[npt.NDArray[Any]]:
        board = self._board
        with board.lock:
            parts = list(board.slots[key])
            board.reads[key] = board.reads.get(key, 0) + 1
            if board.reads[key] == board.size:
                del board.slots[key], board.reads[key]
        return parts


@final
class _LocalPending(Pending):
    __slots__ = ("_comm", "_key")

    def __init__(self, comm: LocalCommunicator, key: int) -> None:
        self._comm, self._key = comm, key

    def test(self) -> bool:
        return self._comm._arrived(self._key)

    async def wait(self) -> npt.NDArray[Any]:
        comm = self._comm
        await poll(self.test, comm.timeout, "all-reduce", comm.rank, spin=0.0, idle=THREADS_IDLE)
        return _sum(comm._collect(self._key))


_FEWER: Final = (
    " (a rank that returned made fewer exchanges: fewer batches, say; DataParallel.finish() at the end of "
    "every rank's data names each rank's step)"
)


def _alike(parts: list[npt.NDArray[Any]], what: str, rows: bool = False) -> list[npt.NDArray[Any]]:
    """``parts``, if every rank sent the same shape (past the first axis, for ``rows``) and dtype.

    MPI needs them alike, and fails, truncates or hangs where they are not;
    NumPy would broadcast a (1,) array into a (3,) one, or promote a dtype,
    silently. So ranks in threads refuse what ranks in processes cannot do,
    every rank with the same error.
    """
    first = parts[0]
    skip = 1 if rows else 0
    if any(p.shape[skip:] != first.shape[skip:] or p.dtype != first.dtype for p in parts):
        sent = ", ".join(f"{p.dtype}{list(p.shape)} on rank {r}" for r, p in enumerate(parts))
        alike = "rows of the same shape" if rows else "the same shape"
        raise ValueError(f"{what} of arrays that differ between ranks: {sent} (every rank must send {alike} and dtype)")
    return parts


def _sum(parts: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    total = _alike(parts, "all-reduce")[0].copy()
    with np.errstate(over="ignore"):  # as in MPI: an overflow is the caller's to find in the sum
        for part in parts[1:]:  # in rank order on every rank, so every rank gets the same bits
            total += part
    return total


def run_local(
    size: int, main: Callable[[Communicator], Awaitable[T]], timeout: float = DEFAULT_TIMEOUT, backend: str = "asyncio"
) -> list[T]:
    """Run ``main(comm)`` as ``size`` ranks, each in a thread with its own event loop.

    ``backend`` is anyio's (``"asyncio"`` or ``"trio"``). Returns each
    rank's result in rank order; if a rank raised, re-raises, once all
    threads are done, the lowest rank's error that is no `RankFailure` (a
    rank's own: the others' only say they lost it), else the lowest rank's,
    with the other ranks' errors as notes. A collective waiting for a rank
    whose thread is done raises `RankFailure` at once, not at its timeout.

    >>> async def main(comm: Communicator) -> float:
    ...     return float((await comm.allreduce(np.array([comm.rank + 1.0])))[0])
    >>> run_local(3, main)
    [6.0, 6.0, 6.0]
    """
    board = _Board(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def rank_thread(rank: int) -> None:
        how = "it returned"
        try:
            results[rank] = anyio.run(main, LocalCommunicator(board, rank, timeout), backend=backend)
        except BaseException as error:
            errors[rank] = error
            how = f"it raised {type(error).__name__}: {error}"
        finally:
            with board.lock:
                board.ended[rank] = how

    threads = [threading.Thread(target=rank_thread, args=(rank,), name=f"rank {rank}") for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:  # a rank's own error first (a RankFailure of the others only says that they lost it)
        _, error = min(failed, key=lambda item: (isinstance(item[1], RankFailure), item[0]))
        for other, theirs in failed:
            if theirs is not error:
                error.add_note(f"run_local: rank {other} raised {type(theirs).__name__}: {theirs}")
        raise error
    return results
