"""Ranks as threads: the collectives refuse what MPI cannot do, where NumPy would do it silently."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import numpy as np
import pytest

from monadl.distributed import Communicator, run_local


def test_an_all_reduce_of_arrays_that_differ_between_ranks_is_refused_on_every_rank() -> None:
    async def rank(comm: Communicator) -> str:
        send = np.ones(3) if comm.rank == 0 else np.ones(1)  # NumPy would broadcast (1,) into (3,)
        with pytest.raises(ValueError) as caught:
            await comm.allreduce(send)
        return str(caught.value)

    assert (
        run_local(2, rank)
        == [
            "all-reduce of arrays that differ between ranks: float64[3] on rank 0, float64[1] on rank 1 "
            "(every rank must send the same shape and dtype)"
        ]
        * 2
    )


def test_an_all_gather_refuses_rows_of_another_shape_or_dtype_and_takes_rows_of_any_count() -> None:
    async def rank(comm: Communicator) -> tuple[list[float], str]:
        rows = await comm.allgather(np.full((comm.rank + 1, 2), comm.rank, np.float64), [1, 2])
        with pytest.raises(ValueError) as caught:
            await comm.allgather(np.zeros(2, np.float32 if comm.rank else np.float64), [2, 2])  # NumPy would promote
        return rows.ravel().tolist(), str(caught.value)

    assert (
        run_local(2, rank)
        == [
            (
                [0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
                "all-gather of arrays that differ between ranks: float64[2] on rank 0, float32[2] on rank 1 "
                "(every rank must send rows of the same shape and dtype)",
            )
        ]
        * 2
    )


def test_a_collective_in_a_cancelled_scope_is_cancelled_even_where_a_peer_has_ended() -> None:
    # Under load, a rank can reach its collective after its peer's thread is done: the
    # collective's first test found the peer gone and raised RankFailure, past the
    # cancellation the caller asked for (a flaky test of data parallelism's, on a busy VM).
    rank_0_done = threading.Event()

    async def rank(comm: Communicator) -> str:
        if comm.rank == 0:
            rank_0_done.set()
            return "returned"
        await anyio.to_thread.run_sync(rank_0_done.wait)
        await anyio.sleep(0.05)  # (rank 0's thread is done: its end is on the board)
        with anyio.move_on_after(0.0) as scope:
            await comm.allreduce(np.ones(1))
        return "cancelled" if scope.cancelled_caught else "not cancelled"

    assert run_local(2, rank) == ["returned", "cancelled"]


def test_thread_ranks_wait_for_an_exchange_without_testing_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that are threads of one process share its interpreter: a rank
    testing an exchange back to back (``anyio.sleep(0)``, MPI's way) held
    the lock the rank it waited for needed to compute (two ranks 5.7x slower
    a step, four 10x, a new user's trial); they wait between tests now."""
    zero: list[float] = []
    sleep = anyio.sleep

    async def counted(delay: float) -> None:
        if delay == 0:
            zero.append(delay)
        await sleep(delay)

    monkeypatch.setattr(anyio, "sleep", counted)  # (the poll's module reads it from anyio at each call)

    async def rank(comm: Communicator) -> float:
        total = 0.0
        for _ in range(20):
            if comm.rank == 1:
                await anyio.to_thread.run_sync(lambda: sum(range(20_000)))  # (a rank that computes a while)
            total += float((await comm.allreduce(np.ones(3)))[0])
        return total

    assert run_local(2, rank, timeout=60) == [40.0, 40.0]
    assert not zero
