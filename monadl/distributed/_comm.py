"""How ranks exchange arrays: the collectives data parallelism needs, on MPI.

`Communicator` is the small interface the data-parallel step is written
against: rank and size, all-gather (of equal or of varying sizes), a summing
all-reduce and a broadcast, each ``async`` so that the event loop keeps
running while a collective is in flight. `MpiCommunicator` implements it with
mpi4py's non-blocking collectives (``Iallreduce``, ``Iallgatherv``,
``Ibcast``), polled from the event loop with a deadline: a rank that died or
hangs is reported as a `RankFailure` after ``timeout`` seconds instead of
blocking every other rank forever (a blocking MPI call could not be
cancelled, in a thread or not).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol, final

import anyio
import numpy as np
import numpy.typing as npt

from monadl.errors import MonadlError

__all__ = ["Communicator", "MpiCommunicator", "Pending", "RankFailure", "agree", "mpi_world", "seconds"]

DEFAULT_TIMEOUT: Final = 300.0  # seconds a collective may wait for the slowest rank


class RankFailure(MonadlError, RuntimeError):
    """A data-parallel step that some rank could not take; no rank stepped.

    Raised on every rank alike. ``failures`` maps each failed rank to why it
    failed (its exception, or a non-finite gradient); it is empty when no
    one rank is to blame, which ``reason`` then says: a peer never answered
    (it died, or hangs), the ranks hold models of different shapes, or they
    have parted (at different steps, or some ended their training).
    ``in_step``: whether the ranks may go on training. False after a
    collective that timed out or failed: a slow rank's messages may still
    arrive, into another exchange (then `DataParallel` refuses to step again);
    and where the ranks parted: each would pair its batches with others'.

    ``outcome`` begins the message: what no rank did (`DataParallel.broadcast`'s
    says no rank took the root's weights).

    >>> str(RankFailure({1: "ValueError: bad batch"}))
    'no rank stepped: rank 1 failed: ValueError: bad batch'
    """

    def __init__(
        self, failures: Mapping[int, str], reason: str = "", in_step: bool = True, *, outcome: str = "no rank stepped"
    ) -> None:
        self.failures = dict(failures)
        self.reason = reason
        self.in_step = in_step
        parts = [f"rank {rank} failed: {why}" for rank, why in sorted(self.failures.items())]
        super().__init__(f"{outcome}: " + "; ".join(parts + ([reason] if reason else [])))


class Communicator(ABC):
    """The collectives of data-parallel training, awaited without blocking the loop.

    Every rank must call the same collectives in the same order, as in MPI.
    Arrays go in and come out as NumPy arrays (device arrays go through
    `monadl.distributed.NcclReducer`).
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's index among the ranks, from 0."""

    @property
    @abstractmethod
    def size(self) -> int:
        """How many ranks take part."""

    @abstractmethod
    async def allgather(self, send: npt.NDArray[Any], counts: Sequence[int]) -> npt.NDArray[Any]:
        """Every rank's ``send`` concatenated in rank order; ``counts[r]`` is rank r's length."""

    @abstractmethod
    async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The elementwise sum of every rank's ``send`` (the same shape on every rank)."""

    @abstractmethod
    async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
        """``root``'s ``buffer`` on every rank (the others pass one of the same shape)."""

    async def allreduce_many(self, sends: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        """`allreduce` of each buffer (gradient buckets); a library may keep them all in flight at once."""
        return [await self.allreduce(send) for send in sends]

    def start_allreduce(self, send: npt.NDArray[Any]) -> Pending:
        """Start `allreduce` of ``send`` now and return it in flight (the overlap's buckets).

        Collectives started this way must be awaited (`Pending.wait`) in the
        order they were started; other collectives may start and end while
        they are in flight (`DataParallel`'s status round does, as MPI's
        non-blocking collectives allow), in the same order on every rank. By
        default it starts only when awaited (a communicator without
        non-blocking collectives overlaps nothing, correctly).
        """
        return _Deferred(self, send)


class Pending(ABC):
    """A collective in flight: `test` drives it on and says whether it is done."""

    @abstractmethod
    def test(self) -> bool:
        """Progress (MPI moves data inside such calls); True once done."""

    @abstractmethod
    async def wait(self) -> npt.NDArray[Any]:
        """Its result, yielding to the event loop until it is done (with the communicator's deadline)."""


@final
class _Deferred(Pending):
    __slots__ = ("_comm", "_send")

    def __init__(self, comm: Communicator, send: npt.NDArray[Any]) -> None:
        self._comm, self._send = comm, send

    def test(self) -> bool:
        return False

    async def wait(self) -> npt.NDArray[Any]:
        return await self._comm.allreduce(self._send)


@final
class Polled(Pending):
    """A request whose test is ``done`` (an MPI request's, a CUDA event's), polled with a deadline."""

    __slots__ = ("_done", "_errors", "_out", "_patience", "_rank", "_what")

    def __init__(
        self,
        done: Callable[[], bool],
        out: Any,
        patience: float,
        what: str,
        rank: int,
        errors: type[Exception] | None = None,
    ) -> None:
        self._done, self._out, self._patience, self._what, self._rank, self._errors = (
            done,
            out,
            patience,
            what,
            rank,
            errors,
        )

    def test(self) -> bool:
        try:
            return self._done()
        except Exception as error:
            if self._errors is None or not isinstance(error, self._errors):
                raise
            raise RankFailure({}, f"rank {self._rank}: error in {self._what}: {error}", in_step=False) from error

    async def wait(self) -> Any:
        await poll(self.test, self._patience, self._what, self._rank)
        return self._out


class _Request(Protocol):
    def Test(self) -> bool: ...


@final
class MpiCommunicator(Communicator):
    """An mpi4py communicator (``MPI.COMM_WORLD`` by default) as a `Communicator`.

    Args:
        comm: an ``mpi4py.MPI.Intracomm``; None for ``MPI.COMM_WORLD``.
        timeout: seconds a collective waits for the other ranks before it
            raises `RankFailure` (a dead or hung rank); generous by default
            because a slow but healthy rank also makes the others wait.

    >>> comm = MpiCommunicator()  # doctest: +SKIP
    """

    __slots__ = ("_comm", "timeout")

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        try:
            from mpi4py import MPI
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                f"{error}: MPI data parallelism needs mpi4py (pip install 'monadl[mpi]', with an MPI library); "
                "without it, monadl.distributed.run_local runs ranks as threads of one process",
                name=error.name,
            ) from None

        self._comm: Any = MPI.COMM_WORLD if comm is None else comm
        self.timeout = timeout

    @property
    def rank(self) -> int:
        return int(self._comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self._comm.Get_size())

    async def allgather(self, send: npt.NDArray[Any], counts: Sequence[int]) -> npt.NDArray[Any]:
        send = np.ascontiguousarray(send)
        rest = send.shape[1:]
        per_row = math.prod(rest)
        out = np.empty((sum(counts), *rest), send.dtype)
        request = self._comm.Iallgatherv(send, [out, [c * per_row for c in counts]])
        await self._wait(request, "all-gather")
        return out

    async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        from mpi4py import MPI

        send = np.ascontiguousarray(send)
        out = np.empty_like(send)
        await self._wait(self._comm.Iallreduce(send, out, op=MPI.SUM), "all-reduce")
        return out

    async def allreduce_many(self, sends: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        # Every bucket's request is started before any is waited for, so MPI
        # pipelines them; the order of starts is the same on every rank.
        from mpi4py import MPI

        sends = [np.ascontiguousarray(s) for s in sends]
        outs = [np.empty_like(s) for s in sends]
        requests = [self._comm.Iallreduce(s, o, op=MPI.SUM) for s, o in zip(sends, outs)]
        await poll(lambda: bool(MPI.Request.Testall(requests)), self.timeout, "all-reduce", self.rank, MPI.Exception)
        return outs

    async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
        buffer = np.ascontiguousarray(buffer)
        await self._wait(self._comm.Ibcast(buffer, root=root), "broadcast")
        return buffer

    def start_allreduce(self, send: npt.NDArray[Any]) -> Pending:
        from mpi4py import MPI

        send = np.ascontiguousarray(send)
        out = np.empty_like(send)
        request = self._comm.Iallreduce(send, out, op=MPI.SUM)
        return Polled(request.Test, out, self.timeout, "all-reduce", self.rank, MPI.Exception)

    async def _wait(self, request: _Request, what: str) -> None:
        from mpi4py import MPI

        await poll(request.Test, self.timeout, what, self.rank, MPI.Exception)


async def poll(
    done: Callable[[], bool],
    patience: float,
    what: str,
    rank: int,
    errors: type[Exception] | None = None,
    spin: float | None = None,
    idle: float = 1e-3,
) -> None:
    """Wait until ``done()`` is true, yielding to the event loop between tests.

    MPI makes progress inside ``Test`` (there is no progress thread by
    default): a collective of a few MB moves in dozens of steps, one per
    test, so for the first ``SPIN`` seconds the tests come back to back (a
    yield to the loop between them), as MPI's own blocking wait spins; after
    that a millisecond apart (the event loop's timer resolution), so that a
    long wait (a slow or dead rank) does not spin a core that the other
    ranks on a shared node need. ``spin`` and ``idle`` (seconds) say
    otherwise: ranks that are threads of one process (`run_local`) share its
    interpreter, and a rank testing back to back holds the lock the rank it
    waits for needs to compute (two ranks 5.7x slower a step, four 10x):
    they wait ``idle`` between tests from the start.
    """
    spin = SPIN if spin is None else spin
    await anyio.lowlevel.checkpoint_if_cancelled()  # (a cancelled wait is that, even where a peer is gone)
    started = anyio.current_time()
    while True:
        try:
            if done():
                return
        except Exception as error:  # a peer's process or link failed under the library's eyes
            if errors is None or not isinstance(error, errors):
                raise
            raise RankFailure({}, f"rank {rank}: error in {what}: {error}", in_step=False) from error
        waited = anyio.current_time() - started
        if waited > patience:
            raise RankFailure(
                {},
                f"rank {rank}: no answer from the other ranks in {what} within {seconds(patience)} s (a rank died or "
                "hangs, or ended without this exchange: a rank with fewer batches, which DataParallel.finish() "
                "reports at once; or this rank was the late one, and the others had given up on an earlier "
                "exchange before it came)",
                in_step=False,
            )
        await anyio.sleep(0.0 if waited < spin else idle)


def seconds(duration: float) -> str:
    """A duration in seconds as a message writes it: three digits under 100
    (``0.5``, ``2.5``, ``20.3``), whole seconds from there (``1232``, where
    ``:g`` wrote ``1.23e+03``: a lateness past the default 300 s timeout).

    >>> [seconds(t) for t in (0.5, 2.5, 20.25, 300.0, 1232.4)]
    ['0.5', '2.5', '20.2', '300', '1232']
    """
    return f"{duration:.3g}" if abs(duration) < 100 else f"{duration:.0f}"


SPIN: Final = 5e-2
"""Seconds of back-to-back tests: a healthy exchange of a few MB finishes within them. (With 2 ms, a
3.25 MB all-reduce between 2 ranks on the loaded 2-core development machine took 25-31 ms, tested
every millisecond; with 50 ms, 7.6-8.7 ms.)"""


def mpi_world(timeout: float = DEFAULT_TIMEOUT) -> MpiCommunicator:
    """``MPI.COMM_WORLD`` as a `Communicator` (needs the ``mpi`` extra).

    >>> mpi_world().size  # doctest: +SKIP
    2
    """
    return MpiCommunicator(None, timeout)


async def agree(
    comm: Communicator,
    problem: str,
    cause: Exception | None,
    status: npt.NDArray[np.int64] | None = None,
    parted: Callable[[npt.NDArray[np.int64]], str] | None = None,
    late: Callable[[npt.NDArray[np.int64]], str] | None = None,
    in_flight: Callable[[], Awaitable[object]] | None = None,
) -> npt.NDArray[np.int64]:
    """All-gather each rank's status (element 0: the length of its failure
    message, 0 if none); if any rank failed, all-gather the messages and raise
    the same `RankFailure` everywhere. ``parted`` reads the gathered statuses
    (the same on every rank) and says how the ranks have parted, if they have
    (at different steps, or some done): then that `RankFailure` is out of step.
    ``late`` says, before any further exchange, whether this rank came after
    the others had given up on it (their statuses came from the exchange they
    left): then it alone raises, out of step, with its own failure, if any.
    ``in_flight`` awaits the collectives every rank started before this round
    (the overlap's buckets): before the `RankFailure` that every rank raises
    alike, which they all take part in, not before a late rank's own (the
    others left theirs)."""
    message = problem.encode()
    if status is None:
        status = np.zeros(1, np.int64)
    status[0] = len(message)
    statuses = (await comm.allgather(status[None], [1] * comm.size)).reshape(comm.size, -1)
    gone = "" if late is None else late(statuses)
    if gone:
        raise RankFailure({comm.rank: problem} if problem else {}, gone, in_step=False) from cause
    lengths = statuses[:, 0]
    failures: dict[int, str] = {}
    if lengths.any():
        text = await comm.allgather(np.frombuffer(message, np.uint8).copy(), [int(n) for n in lengths])
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        failures = {r: text[bounds[r] : bounds[r + 1]].tobytes().decode() for r in range(comm.size) if lengths[r]}
    reason = "" if parted is None else parted(statuses)
    if failures or reason:
        if in_flight is not None:
            await in_flight()
        raise RankFailure(failures, reason, in_step=not reason) from cause
    return statuses
