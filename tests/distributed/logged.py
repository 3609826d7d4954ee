"""`Logged`: a communicator that records the exchanges its rank entered, for
the tests that show a rank raised before an exchange it would have waited in
(test_data_parallel.py, and mpi_ranks.py across processes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import numpy.typing as npt

from monadl.distributed import Communicator, LocalCommunicator, MpiCommunicator, Pending


@final
class Logged(Communicator):
    """A communicator that logs each collective as this rank enters it, an
    overlap's bucket when it starts and when it is awaited; its ``timeout``
    is its inner one's, which the test may shorten after the first step."""

    def __init__(self, inner: LocalCommunicator | MpiCommunicator) -> None:
        self.inner = inner
        self.log: list[str] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def timeout(self) -> float:
        return self.inner.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.inner.timeout = seconds

    async def allgather(self, send: npt.NDArray[Any], counts: Sequence[int]) -> npt.NDArray[Any]:
        self.log.append("all-gather")
        return await self.inner.allgather(send, counts)

    async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        self.log.append("all-reduce")
        return await self.inner.allreduce(send)

    async def allreduce_many(self, sends: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        self.log.append("all-reduce")
        return await self.inner.allreduce_many(sends)

    async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
        self.log.append("broadcast")
        return await self.inner.broadcast(buffer, root)

    def start_allreduce(self, send: npt.NDArray[Any]) -> Pending:
        self.log.append("start bucket")
        return LoggedPending(self.inner.start_allreduce(send), self.log)


@final
class LoggedPending(Pending):
    def __init__(self, inner: Pending, log: list[str]) -> None:
        self.inner, self.log = inner, log

    def test(self) -> bool:
        return self.inner.test()

    async def wait(self) -> npt.NDArray[Any]:
        self.log.append("wait bucket")
        return await self.inner.wait()
