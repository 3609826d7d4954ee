"""The data-parallel protocol with ranks as threads (`run_local`): no MPI needed.

The same protocol runs across processes in test_mpi.py.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

import monadl as ml
import monadl.distributed._data_parallel
from monadl.distributed import (
    Communicator,
    DataParallel,
    LocalCommunicator,
    RankFailure,
    find_weights,
    run_local,
    shard,
)
from monadl.distributed._rank_status import _came, _late, _status
from tests.distributed.logged import Logged

BACKENDS = ["asyncio", "trio"]
Arrays = dict[str, npt.NDArray[Any]]


class Net:
    """A two-layer network with a second head that only some batches reach (a dynamic network)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = ml.Weight(rng.standard_normal((4, 8)), optimizer=ml.optim.momentum(0.1))
        self.b1 = ml.Weight(np.zeros(8), optimizer=ml.optim.momentum(0.1))
        self.heads = [ml.Weight(rng.standard_normal((8, 3)), optimizer=ml.optim.adam(0.01)) for _ in range(2)]
        self.scale = ml.Weight(1.0, optimizer=ml.optim.sgd(0.1))

    def loss(self, x: npt.NDArray[Any], y: npt.NDArray[Any], head: int) -> ml.ScalarLayer:
        hidden = ml.relu(ml.dense(x, self.w1, self.b1))
        return ml.cross_entropy(ml.matmul(hidden, self.heads[head]) * self.scale, y)

    def weights(self) -> Arrays:
        return {f"{i}": np.asarray(w.data) for i, w in enumerate(find_weights(self))}


def batches(steps: int) -> list[tuple[npt.NDArray[Any], npt.NDArray[Any], int]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((6, 4)), rng.integers(0, 3, 6), step % 2) for step in range(steps)]


def single_process(steps: int) -> Arrays:
    net = Net(0)
    for x, y, head in batches(steps):
        anyio.run(net.loss(x, y, head).train)
    return net.weights()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_step_as_one_process_on_the_full_batch(backend: str) -> None:
    async def rank(comm: Communicator) -> Arrays:
        net = Net(comm.rank)  # different initial weights: broadcast makes them rank 0's
        dp = DataParallel(net, comm)
        await dp.broadcast()
        for x, y, head in batches(5):
            await dp.train(net.loss(shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size), head))
        return net.weights()

    zero, one = run_local(2, rank, backend=backend)
    expected = single_process(5)
    for name in expected:
        np.testing.assert_array_equal(zero[name], one[name])  # identical bits on every rank
        np.testing.assert_allclose(zero[name], expected[name], rtol=1e-12, atol=1e-14)


def test_a_weight_that_only_one_rank_reaches_takes_the_full_batch_step() -> None:
    x, y, _ = batches(1)[0]

    async def rank(comm: Communicator) -> Arrays:
        net = Net(0)
        dp = DataParallel(net, comm)
        # Rank 0's half goes through head 0 and rank 1's through head 1: each head's
        # full-batch gradient is half its rank's.
        half = slice(3 * comm.rank, 3 * comm.rank + 3)
        await dp.train(net.loss(x[half], y[half], comm.rank))
        return net.weights()

    async def whole() -> Arrays:
        net = Net(0)
        await (net.loss(x[:3], y[:3], 0) * 0.5 + net.loss(x[3:], y[3:], 1) * 0.5).train()
        return net.weights()

    got, expected = run_local(2, rank)[0], anyio.run(whole)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12)


def run_failing(fail: str, backend: str = "asyncio") -> list[Any]:
    """Two ranks train one step; rank 1 fails as ``fail`` says. Each returns
    its error and whether its weights stayed as they were."""
    x, y, head = batches(1)[0]

    async def rank(comm: Communicator) -> tuple[RankFailure | None, bool]:
        net = Net(0)
        before = net.weights()
        dp = DataParallel(net, comm)
        xs = shard(x, comm.rank, 2)
        loss = net.loss(xs, shard(y, comm.rank, 2), head)
        if comm.rank == 1 and fail == "raise":
            loss = net.loss(xs[:, :3], shard(y, 1, 2), head)  # a shape error in its forward
        if comm.rank == 1 and fail == "nan":
            loss = net.loss(xs * np.nan, shard(y, 1, 2), head)
        error = None
        try:
            await dp.train(loss)
        except RankFailure as e:
            error = e
        after = net.weights()
        return error, all(np.array_equal(before[k], after[k]) for k in before)

    return run_local(2, rank, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_raises_in_its_forward_stops_every_rank(backend: str) -> None:
    for error, unchanged in run_failing("raise", backend):
        assert unchanged
        assert isinstance(error, RankFailure)
        assert list(error.failures) == [1]
        assert "ShapeError" in error.failures[1] and "rank 1 failed" in str(error)


def test_a_rank_with_a_non_finite_gradient_stops_every_rank() -> None:
    for error, unchanged in run_failing("nan"):
        assert unchanged
        assert isinstance(error, RankFailure)
        assert list(error.failures) == [1]
        assert error.failures[1] == "non-finite gradient of weight 'w1' (shape (4, 8))"  # (it said 'weight 0')


def test_a_rank_that_never_joins_is_reported_after_the_timeout() -> None:
    async def rank(comm: Communicator) -> str:
        net = Net(0)
        before = net.weights()["0"]
        if comm.rank == 1:
            await anyio.sleep(1.0)  # hangs past the others' timeout (a dead process, to MPI)
            return "gone"
        x, y, head = batches(1)[0]
        with pytest.raises(RankFailure, match="no answer from the other ranks") as caught:
            await DataParallel(net, comm).train(net.loss(x, y, head))
        assert np.array_equal(before, net.weights()["0"])
        return str(caught.value)

    message, gone = run_local(2, rank, timeout=0.2)
    assert gone == "gone" and "rank 0" in message


def test_a_rank_whose_thread_ended_is_reported_at_once_and_its_own_error_surfaces() -> None:
    # run_local waited the whole timeout for a rank whose thread had ended, then raised
    # rank 0's RankFailure: the rank's own error appeared nowhere (a user's trial).
    async def rank(comm: Communicator) -> str:
        net = Net(0)
        if comm.rank == 1:
            raise KeyError("rank 1's data loader broke")
        x, y, head = batches(1)[0]
        await DataParallel(net, comm).train(net.loss(x, y, head))  # (raises RankFailure: rank 1 is gone)
        return "stepped"

    with pytest.raises(KeyError, match="rank 1's data loader broke") as caught:
        run_local(2, rank, timeout=300.0)  # (at once: no timeout waited for)
    (note,) = caught.value.__notes__
    assert note.startswith("run_local: rank 0 raised RankFailure: no rank stepped: rank 1 ended (it raised KeyError")


def test_after_a_timeout_the_ranks_refuse_to_step_again() -> None:
    # A slow rank (not a dead one) answers after the others gave up: its messages then
    # met the next step's exchange, the ranks waited in different collectives, and
    # one read the other's data as a size (a user's trial: MemoryError, 3.97 EiB).
    async def rank(comm: Communicator) -> list[tuple[bool, str]]:
        net = Net(0)
        dp = DataParallel(net, comm)
        x, y, head = batches(1)[0]
        if comm.rank == 1:
            await anyio.sleep(1.0)  # slower than the timeout
        seen = []
        for _ in range(2):
            with pytest.raises(RankFailure) as caught:
                await dp.train(net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head))
            seen.append((caught.value.in_step, str(caught.value)))
        return seen

    for (first_in_step, _), (second_in_step, second) in run_local(2, rank, timeout=0.2):
        assert not first_in_step and not second_in_step
        assert "out of step after an earlier step" in second and ("no answer" in second or "ended" in second)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_rank_that_came_after_the_others_gave_up_says_it_was_late_and_waits_no_more(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    # Rank 1 paused past the timeout before its second step: its status all-gather met the
    # one rank 0 had left, then it waited a second full timeout in the all-reduce and said
    # "no answer from the other ranks", though it was the late one (a new user's trial, MPI).
    # No test of real time: rank 1 starts its step once rank 0 has given up, its pause is
    # a 100 s jump of the clock the protocol reads (each rank's own, still otherwise), and
    # its log shows the exchanges it entered.
    now = {"rank 0": 0.0, "rank 1": 0.0}
    clock = types.SimpleNamespace(perf_counter=lambda: now[threading.current_thread().name])
    monkeypatch.setattr(monadl.distributed._data_parallel, "time", clock)
    gave_up, told = threading.Event(), threading.Event()

    async def rank(comm: Communicator) -> tuple[bool, str, list[str], bool]:
        assert isinstance(comm, LocalCommunicator)
        logged = Logged(comm)
        net = Net(0)
        dp = DataParallel(net, logged, overlap=overlap, bucket_bytes=1)
        x, y, head = batches(1)[0]
        xs, ys = shard(x, comm.rank, 2), shard(y, comm.rank, 2)
        await dp.train(net.loss(xs, ys, head))
        before = net.weights()
        logged.timeout = 0.5  # (not before: the first step waits for a loaded machine)
        if comm.rank == 1:
            await anyio.to_thread.run_sync(gave_up.wait, 60.0)  # (60 s: a guard against a hang, not a bound)
            now["rank 1"] += 100.0
        del logged.log[:]
        try:
            with pytest.raises(RankFailure) as caught:
                await dp.train(net.loss(xs, ys, head))
        finally:
            (told if comm.rank else gave_up).set()
        if comm.rank == 0:
            told.wait(60.0)  # (alive meanwhile, as an MPI process: its thread's end would tell rank 1 at once)
        unchanged = all(np.array_equal(before[k], v) for k, v in net.weights().items())
        return caught.value.in_step, str(caught.value), logged.log, unchanged

    (in_step0, waited, _, unchanged0), (in_step1, late, log, unchanged1) = run_local(2, rank, timeout=60.0)
    assert not in_step0 and not in_step1 and unchanged0 and unchanged1
    assert waited == (
        "no rank stepped: rank 0: no answer from the other ranks in all-gather within 0.5 s (a rank died or hangs, "
        "or ended without this exchange: a rank with fewer batches, which DataParallel.finish() reports at once; "
        "or this rank was the late one, and the others had given up on an earlier exchange before it came)"
    )
    assert late == (
        "no rank stepped: rank 1 was the late one: it came to this exchange 100 s after rank 0, past its timeout "
        "of 0.5 s, so it had given up waiting for it (this rank spent that long since the ranks' last exchange: "
        "in its loader, forward and backward, or paused); where a rank may be that slow, give the communicator "
        "a longer timeout"
    )
    # No second wait: the status all-gather was its last exchange (its buckets, rank 0 had left).
    assert log == ["start bucket"] * (4 if overlap else 0) + ["all-gather"]  # (w1, b1, the head, scale)


def test_the_late_verdict_writes_a_lateness_past_the_default_timeout_in_whole_seconds() -> None:
    # With timeout=300 a verdict needs more than 301 s, and '.3g' wrote 1232.5 s as '1.23e+03 s'.
    def statuses(came: list[float], patience: float) -> npt.NDArray[np.int64]:
        rows = []
        for seconds in came:
            status = _status(1, 5, finished=False)
            _came(status, 0.0, seconds, patience)
            rows.append(status)
        return np.stack(rows)

    assert _late(statuses([2.0, 1234.5], 300.0), 1).startswith(
        "rank 1 was the late one: it came to this exchange 1232 s after rank 0, past its timeout of 300 s, "
    )
    assert _late(statuses([2.0, 3.0, 999.7], 300.0), 2).startswith(
        "rank 2 was the late one: it came to this exchange 997 s after ranks 0, 1, past their timeout of 300 s, "
    )
    assert _late(statuses([1.0, 9.25], 2.0), 1).startswith(
        "rank 1 was the late one: it came to this exchange 8.25 s after rank 0, past its timeout of 2 s, "
    )
    assert _late(statuses([2.0, 302.9], 300.0), 1) == ""  # (300.9 s: within the margin of a second)


def test_after_a_cancelled_step_the_rank_refuses_to_step_again() -> None:
    # Cancelled part way, maybe inside a collective: the others wait for it, or read its stale messages.
    async def rank(comm: Communicator) -> str:
        net = Net(0)
        dp = DataParallel(net, comm)
        x, y, head = batches(1)[0]
        loss = net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head)
        with anyio.move_on_after(0.0):
            await dp.train(loss)
        with pytest.raises(RankFailure, match="stopped part way") as caught:
            await dp.train(loss)
        assert not caught.value.in_step
        with pytest.raises(RankFailure, match="stopped part way"):  # (a new one over the same communicator too)
            await DataParallel(net, comm).broadcast()
        return "refused"

    assert run_local(2, rank, timeout=0.5) == ["refused", "refused"]


def test_a_communicator_of_ones_own_need_not_hash() -> None:
    # A dataclass (equality on, so no hash): the record of communicators out of step
    # was keyed by the communicator, and every step raised 'unhashable type'.
    @dataclasses.dataclass
    class Solo(Communicator):
        name: str = "solo"

        @property
        def rank(self) -> int:
            return 0

        @property
        def size(self) -> int:
            return 1

        async def allgather(self, send: npt.NDArray[Any], counts: Sequence[int]) -> npt.NDArray[Any]:
            return send.copy()

        async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return send.copy()

        async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
            return buffer

    w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
    assert anyio.run(DataParallel(w, Solo()).train, ml.sum(w * w)) == 3.0
    assert w.data.tolist() == pytest.approx([0.8, 0.8, 0.8])


class Counting(Communicator):
    """A communicator that counts the elements each collective sends."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.reduced = 0
        self.gathered = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    async def allgather(self, send: npt.NDArray[Any], counts: Any) -> npt.NDArray[Any]:
        self.gathered += send.size
        return await self.inner.allgather(send, counts)

    async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        self.reduced += send.size
        return await self.inner.allreduce(send)

    async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
        return await self.inner.broadcast(buffer, root)


def test_sparse_embedding_deltas_travel_as_rows() -> None:
    table = np.random.default_rng(0).standard_normal((10_000, 4))
    ids = np.array([[3, 7, 3], [9_999, 7, 0]])

    async def rank(comm: Communicator) -> tuple[npt.NDArray[Any], int, int]:
        weight = ml.Weight(table, optimizer=ml.optim.sgd(0.5))
        counting = Counting(comm)
        await DataParallel(weight, counting).train(ml.sum(ml.embedding(weight, ids[comm.rank])))
        return weight.data, counting.reduced, counting.gathered

    async def whole() -> npt.NDArray[Any]:
        weight = ml.Weight(table, optimizer=ml.optim.sgd(0.5))
        await (ml.sum(ml.embedding(weight, ids.reshape(-1))) * 0.5).train()
        return weight.data

    (zero, reduced, gathered), (one, _, _) = run_local(2, rank)
    np.testing.assert_array_equal(zero, one)
    np.testing.assert_allclose(zero, anyio.run(whole), rtol=1e-15)
    assert reduced == 0  # no dense table went over the wire
    assert gathered < 100  # statuses, 6 indices and 6 rows of 4


def test_broadcast_gives_every_rank_the_roots_weights_and_optimizer_state() -> None:
    async def rank(comm: Communicator) -> Any:
        net = Net(comm.rank)
        if comm.rank == 0:
            await net.loss(*batches(1)[0]).train()  # momentum and Adam state that is not the initial one
        await DataParallel(net, comm).broadcast()
        return net.weights(), [w._state for w in find_weights(net)]

    (w0, s0), (w1, s1) = run_local(2, rank)
    for name in w0:
        np.testing.assert_array_equal(w0[name], w1[name])
    assert repr(s0) == repr(s1)


NOT_BROADCAST = "no rank took the root's weights: the ranks hold different models: "


def test_broadcast_refuses_a_model_of_another_shape_on_every_rank() -> None:
    async def rank(comm: Communicator) -> str:
        weight = ml.Weight(np.zeros(2 + comm.rank))
        with pytest.raises(RankFailure) as caught:
            await DataParallel(weight, comm).broadcast()
        return str(caught.value)

    expected = NOT_BROADCAST + "weight 0 is float64[2] on rank 0, float64[3] on rank 1" + SAME_MODEL
    assert run_local(2, rank) == [expected] * 2


def test_broadcast_names_the_weights_that_differ_and_says_what_it_did() -> None:
    # It named weights by number ('weight 1 is float32[3] here, float64[3] on the root', 'the
    # model has 3 weights here and 2 on the root'), and began 'no rank stepped' though no rank
    # had tried to step.
    def build(rank: int) -> dict[str, ml.ArrayWeight]:
        model = {
            "embed": ml.Weight(np.zeros(3)),
            "head": ml.Weight(np.zeros(3, np.float64 if rank == 0 else np.float32)),
        }
        if rank == 2:
            model["extra"] = ml.Weight(np.zeros(1))
        return model

    async def rank(comm: Communicator) -> str:
        with pytest.raises(RankFailure) as caught:
            await DataParallel(build(comm.rank), comm).broadcast()
        assert caught.value.failures == {}
        return str(caught.value)

    expected = (
        NOT_BROADCAST
        + "weight 1 is 'head' float64[3] on rank 0, 'head' float32[3] on ranks 1, 2 "
        + "(2 weights on rank 0, 2 weights on rank 1, 3 weights on rank 2)"
        + SAME_MODEL
    )
    assert run_local(3, rank) == [expected] * 3


def test_ranks_whose_weights_have_other_optimizers_stop_before_any_step() -> None:
    # Rank 1's weight with Adam, rank 0's with SGD: broadcast copied rank 0's empty
    # state into the Adam weight, and the step then failed on rank 1 only, after every
    # rank had agreed to step (rank 0 stepped; rank 1 raised a bare TypeError).
    def build(rank: int) -> ml.ArrayWeight:
        return ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1) if rank == 0 else ml.optim.adam(0.1))

    # (broadcast said only 'expected tuple of 2, got None'; it now describes both optimizers as train does)
    shown = r"weight 0 is float64\[3\], optimizer scale\(-0.1\) on rank 0, float64\[3\], optimizer chain\(scale_by_adam"

    async def broadcast_then_train(comm: Communicator) -> list[float]:
        weight = build(comm.rank)
        dp = DataParallel(weight, comm)
        with pytest.raises(RankFailure, match="^no rank took the root's weights: .*" + shown):
            await dp.broadcast()
        return list(map(float, weight.data))

    async def train(comm: Communicator) -> list[float]:
        weight = build(comm.rank)
        with pytest.raises(RankFailure, match="^no rank stepped: .*" + shown):
            await DataParallel(weight, comm).train(ml.sum(weight * 2.0))
        return list(map(float, weight.data))

    for rank in (broadcast_then_train, train):
        assert run_local(2, rank) == [[1.0, 1.0, 1.0]] * 2  # (no rank stepped)


@pytest.mark.parametrize(
    ("optimizers", "shown"),
    [
        ((ml.optim.adam(0.1), ml.optim.adam(0.01)), r"scale\(-0.1\)\) on rank 0, .*scale\(-0.01\)\) on rank 1"),
        ((ml.optim.momentum(0.1, 0.9), ml.optim.momentum(0.1, 0.8)), r"trace\(decay=0.9, .* on rank 0, .*decay=0.8"),
        (
            (ml.optim.sgd(ml.optim.exponential_decay(0.1, 0.5)), ml.optim.sgd(ml.optim.exponential_decay(0.1, 0.6))),
            r"decay_rate=0.5, .* on rank 0, .*decay_rate=0.6",
        ),
        (  # (a new user's: the two ranks read alike and ended at -0.525 and -1.05)
            (
                ml.optim.sgd(ml.optim.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)),
                ml.optim.sgd(ml.optim.warmup_cosine_decay_schedule(0.0, 0.2, 2, 10)),
            ),
            r"peak_value=0.1, warmup_steps=2\)\) on rank 0, .*peak_value=0.2, warmup_steps=2\)\) on rank 1",
        ),
        (
            (
                ml.optim.sgd(ml.optim.join_schedules([ml.optim.constant_schedule(0.1)] * 2, [5])),
                ml.optim.sgd(ml.optim.join_schedules([ml.optim.constant_schedule(0.1)] * 2, [50])),
            ),
            r"boundaries=\[5\], .* on rank 0, .*boundaries=\[50\], .* on rank 1",
        ),
    ],
    ids=["learning rate", "momentum", "a schedule's parameter", "a warmup's peak", "a joined schedule's boundary"],
)
def test_ranks_whose_optimizers_have_other_hyperparameters_stop_before_any_step(
    optimizers: tuple[ml.optim.GradientTransformation, ...], shown: str
) -> None:
    """The same optimizer with another learning rate has a state of the same
    structure: the ranks stepped, each by its own rate, and their copies of
    the weights parted silently."""

    async def train(comm: Communicator) -> list[float]:
        weight = ml.Weight(np.ones(3), optimizer=optimizers[comm.rank])
        with pytest.raises(RankFailure, match=shown):
            await DataParallel(weight, comm).train(ml.sum(weight * 2.0))
        return list(map(float, weight.data))

    assert run_local(2, train) == [[1.0, 1.0, 1.0]] * 2  # (no rank stepped)


def test_uneven_shards_step_as_the_full_batch_with_each_loss_scaled_by_its_share_and_no_average() -> None:
    # Batches of 7 on 3 ranks (shards of 3, 2, 2): the default average of the ranks' means
    # weighs each shard alike, not each example; the documented recipe weighs each example.
    rng = np.random.default_rng(2)
    steps = [(rng.standard_normal((7, 4)), rng.integers(0, 3, 7), step % 2) for step in range(5)]

    def trained(average: bool) -> list[Arrays]:
        async def rank(comm: Communicator) -> Arrays:
            net = Net(0)
            dp = DataParallel(net, comm, average=average)
            for x, y, head in steps:
                xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
                loss = net.loss(xs, ys, head)
                await dp.train(loss if average else loss * (len(xs) / len(x)))
            return net.weights()

        return run_local(3, rank)

    net = Net(0)
    for x, y, head in steps:
        anyio.run(net.loss(x, y, head).train)
    expected = net.weights()
    exact, averaged = trained(average=False), trained(average=True)
    for name in expected:
        for weights in exact:
            np.testing.assert_allclose(weights[name], expected[name], rtol=1e-12, atol=1e-14)
    assert max(float(np.max(np.abs(averaged[0][k] - expected[k]))) for k in expected) > 1e-4


def test_shard_splits_a_batch_into_disjoint_parts_that_cover_it() -> None:
    x = np.arange(10)
    parts = [shard(x, r, 3) for r in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert [len(shard(x, r, 3, drop_last=True)) for r in range(3)] == [3, 3, 3]
    with pytest.raises(ValueError, match=r"rank 3 is not in 0\.\.2"):
        shard(x, 3, 3)
    with pytest.raises(ValueError, match="size is the number of ranks, at least 1, got 0"):
        shard(x, 0, 0)  # (it said 'rank 0 is not in 0..-1')


# (NumPy warns of the empty mean: layers/_reductions.py)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_a_step_where_a_rank_has_no_examples_is_refused_on_every_rank() -> None:
    # A batch of 1 on 2 ranks: rank 1's shard was empty, its loss NaN and its gradient
    # zeros, which the average still counted: the step was half the batch's, silently.
    x, y = np.array([[1.0, 2.0], [3.0, 1.0]]), np.array([1, 0])

    async def rank(comm: Communicator) -> tuple[str, list[list[float]]]:
        w = ml.Weight(np.zeros((2, 2)), optimizer=ml.optim.sgd(1.0))
        dp = DataParallel(w, comm)
        with pytest.raises(RankFailure) as caught:
            await dp.train(ml.cross_entropy(ml.matmul(shard(x[:1], comm.rank, 2), w), shard(y[:1], comm.rank, 2)))
        assert list(caught.value.failures) == [1] and caught.value.in_step
        unchanged = w.data.tolist()
        await dp.train(ml.cross_entropy(ml.matmul(shard(x, comm.rank, 2), w), shard(y, comm.rank, 2)))  # (goes on)
        return caught.value.failures[1], unchanged

    (message, unchanged), _ = run_local(2, rank)
    assert message.startswith("the loss is NaN and its gradients finite, as a mean over an empty shard makes them")
    assert "give every rank at least one example" in message
    assert unchanged == [[0.0, 0.0], [0.0, 0.0]]


def test_mpi_without_mpi4py_says_how_to_get_it_or_do_without(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from monadl.distributed import MpiCommunicator

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # (import mpi4py: ModuleNotFoundError, as where it is absent)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'monadl\[mpi\]'.*run_local runs ranks as threads"):
        MpiCommunicator()


def test_a_sum_that_overflows_stops_every_rank() -> None:
    async def rank(comm: Communicator) -> str:
        weight = ml.Weight(np.zeros(2))
        with pytest.raises(RankFailure, match=r"the averaged gradient is not finite \(an overflow in the sum\)"):
            await DataParallel(weight, comm).train(ml.sum(weight * 1e308))  # finite on each rank, not summed
        assert np.array_equal(weight.data, np.zeros(2))
        return "raised"

    assert run_local(2, rank) == ["raised", "raised"]


class Slotted:
    """A model whose weights live in ``__slots__``, as `ml.save` finds them."""

    __slots__ = ("b", "w")

    def __init__(self) -> None:
        self.w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
        self.b = ml.Weight(0.5, optimizer=ml.optim.sgd(0.1))


class Subclassed(Slotted):
    """Slots and, through the subclass, a ``__dict__``: its attributes come first, as in `ml.save`."""

    def __init__(self) -> None:
        super().__init__()
        self.head = ml.Weight(np.zeros(2), optimizer=ml.optim.sgd(0.1))


def test_weights_held_in_slots_are_found_in_the_checkpoints_order_and_trained() -> None:
    model = Subclassed()
    assert find_weights(model) == tuple(ml.checkpoint.named_weights(model).values()) == (model.head, model.b, model.w)
    x = np.array([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])

    async def rank(comm: Communicator) -> tuple[int, npt.NDArray[Any], Any]:
        model = Slotted()
        dp = DataParallel(model, comm)
        await dp.train(ml.sum(model.w * x[comm.rank]) + model.b * (comm.rank + 1.0))
        return len(dp.weights), model.w.data, model.b.data

    # The gradients averaged: [2, 3, 4] for w, 1.5 for b; sgd(0.1) steps by a tenth of them.
    for found, w, b in run_local(2, rank):
        assert found == 2
        np.testing.assert_allclose(w, [0.8, 0.7, 0.6], rtol=1e-15)
        assert b == pytest.approx(0.35, rel=1e-15)


def run_different(models: list[Any], overlap: bool = False) -> list[tuple[str, bool]]:
    """Each rank builds ``models[rank]``, trains it twice; what it raised each time and whether it stayed as it was."""

    async def rank(comm: Communicator) -> tuple[str, bool]:
        model = models[comm.rank]
        weights = find_weights(model)
        before = [np.array(w.data) for w in weights]
        dp = DataParallel(model, comm, overlap=overlap)
        messages = []
        for _ in range(2):  # a refused first step is refused again: no rank stepped, nothing was agreed
            with pytest.raises(RankFailure) as caught:
                await dp.train(ml.sum(weights[0]))  # refused before the forward
            assert caught.value.failures == {}
            messages.append(str(caught.value))
        assert messages[0] == messages[1]
        return messages[0], all(np.array_equal(b, w.data) for b, w in zip(before, weights))

    return run_local(len(models), rank)


SAME_MODEL = "; every rank must build the same model (the same weights, shapes and dtypes, in the same containers, with the same optimizers and hyperparameters)"


@pytest.mark.parametrize("overlap", [False, True])
def test_ranks_whose_weights_differ_in_shape_stop_before_any_step(overlap: bool) -> None:
    sgd = ml.optim.sgd(1.0)
    models = [{"w": ml.Weight(np.ones(3), optimizer=sgd)}, {"w": ml.Weight(np.ones(1), optimizer=sgd)}]
    expected = "no rank stepped: the ranks hold different models: weight 0 is 'w' float64[3] on rank 0, 'w' float64[1] on rank 1"
    assert run_different(models, overlap) == [(expected + SAME_MODEL, True)] * 2


def test_ranks_whose_weights_differ_in_dtype_name_or_number_stop_before_any_step() -> None:
    def weight(dtype: Any = np.float64) -> ml.ArrayWeight:
        return ml.Weight(np.ones(2, dtype), optimizer=ml.optim.sgd(1.0))

    dtype = run_different([[weight(), weight()], [weight(), weight(np.float32)], [weight(), weight()]])
    assert {message for message, _ in dtype} == {
        "no rank stepped: the ranks hold different models: weight 1 is '1' float64[2] on ranks 0, 2, "
        "'1' float32[2] on rank 1" + SAME_MODEL
    }
    # Dicts filled in another order pair "a" with "b": as wrong as another shape.
    a, b = weight(), weight()
    name = run_different([{"a": a, "b": b}, {"b": weight(), "a": weight()}])
    assert name[0][0] == (
        "no rank stepped: the ranks hold different models: weight 0 is 'a' float64[2] on rank 0, "
        "'b' float64[2] on rank 1" + SAME_MODEL
    )
    number = run_different([[weight()], [weight(), weight()]])
    assert number[0][0] == (
        "no rank stepped: the ranks hold different models: weight 1 is absent on rank 0, '1' float64[2] on rank 1 "
        "(1 weight on rank 0, 2 weights on rank 1)" + SAME_MODEL
    )
    assert all(unchanged for _, unchanged in dtype + name + number)


def test_ranks_whose_weights_hold_different_values_stop_before_any_step() -> None:
    # Ranks built from different seeds without dp.broadcast() (a new user's trial): the
    # models matched in names, shapes, dtypes and optimizers, every rank stepped alike
    # from its own starting point, and the copies trained apart for good, silently.
    models = [Net(seed) for seed in (0, 1, 0)]
    expected = (
        "no rank stepped: the ranks hold different values of weights 'w1', 'heads.0', 'heads.1' (ranks 0, 2 hold "
        "one set of values, rank 1 another); call dp.broadcast() before the first step, to give every rank the "
        "root's weights and optimizer state (or load the same checkpoint on every rank)"
    )
    assert run_different(models) == [(expected, True)] * 3


def test_ranks_whose_optimizer_states_differ_stop_before_any_step() -> None:
    # Only rank 0 loaded a checkpoint's optimizer state (momentum that is not the initial one).
    def build(rank: int) -> dict[str, ml.ArrayWeight]:
        weight = ml.Weight(np.ones(3), optimizer=ml.optim.momentum(0.1))
        if rank == 0:
            weight.state = (np.full(3, 0.5), None)
        return {"w": weight}

    (message, unchanged), _ = run_different([build(0), build(1)])
    assert unchanged
    assert message.startswith(
        "no rank stepped: the ranks hold different values of weight 'w' (its optimizer state) (rank 0 holds one "
        "set of values, rank 1 another); call dp.broadcast()"
    )


def test_ranks_that_build_the_same_values_need_no_broadcast() -> None:
    async def rank(comm: Communicator) -> list[float]:
        weight = ml.Weight(np.arange(6.0).reshape(2, 3).T, optimizer=ml.optim.adam(0.1))  # (a strided view)
        number = ml.Weight(np.float32(0.5), optimizer=ml.optim.sgd(1.0))
        await DataParallel([weight, number], comm).train(ml.sum(weight) + number)
        return [float(number.data), *map(float, weight.data.reshape(-1))]

    zero, one = run_local(2, rank)
    assert zero == one and zero[0] == -0.5


def test_a_dict_keyed_by_objects_of_the_default_repr_is_the_same_model_on_every_rank() -> None:
    class Key:  # (its repr holds its address: each rank's differs, as in separate processes)
        pass

    async def rank(comm: Communicator) -> list[float]:
        w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.5))
        dp = DataParallel({Key(): w}, comm)
        await dp.train(ml.sum(w * float(comm.rank + 1)))  # (it raised 'the ranks hold different models')
        return list(w.data)

    assert run_local(2, rank) == [[0.25, 0.25], [0.25, 0.25]]  # (the mean gradient of 1 and 2, times 0.5)


def test_the_ranks_compare_their_models_once_in_three_numbers() -> None:
    async def rank(comm: Communicator) -> list[int]:
        net = Net(0)
        counting = Counting(comm)
        dp = DataParallel(net, counting)
        gathered = []
        for x, y, head in batches(3):
            await dp.train(net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head))
            gathered.append(counting.gathered)
        return gathered

    status = 1 + 3 * 5 + 4  # a failure's length; per weight of Net: kind, rows, position; came, timeout, step, finished
    assert run_local(2, rank) == [[3 + status, 3 + 2 * status, 3 + 3 * status]] * 2


def test_a_rank_whose_update_took_longer_is_not_taken_for_late_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 1's optimizer update took 10 s more than rank 0's (a large model on a loaded
    # node) and rank 0's loader 10 s more than rank 1's: both came to the next exchange
    # at once. The ranks' common reference was taken after the update, so rank 0 seemed
    # 10 s late, past the 5 s timeout: it raised 'rank 0 was the late one' and rank 1
    # waited for it in vain. Each rank's clock is its own and moves only as said here.
    now = {"rank 0": 0.0, "rank 1": 0.0}
    clock = types.SimpleNamespace(perf_counter=lambda: now[threading.current_thread().name])
    monkeypatch.setattr(monadl.distributed._data_parallel, "time", clock)
    update = monadl.distributed._data_parallel._commit

    def slow_update(grads: dict[ml.Weight[Any, Any], Any]) -> None:
        update(grads)
        if threading.current_thread().name == "rank 1":
            now["rank 1"] += 10.0

    monkeypatch.setattr(monadl.distributed._data_parallel, "_commit", slow_update)

    async def rank(comm: Communicator) -> list[float]:
        w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm)
        await dp.train(ml.sum(w * (comm.rank + 1.0)))
        if comm.rank == 0:
            now["rank 0"] += 10.0  # its loader
        await dp.train(ml.sum(w * (comm.rank + 1.0)))
        return list(map(float, w.data))

    assert run_local(2, rank, timeout=5.0) == [pytest.approx([0.7, 0.7])] * 2  # (two steps of 0.1 * 1.5)


def test_the_first_steps_wait_for_a_late_rank_is_in_its_agree_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank 2 s late for the first step: train took 2 s and last_step_seconds summed to
    # milliseconds (the wait fell in the same-model check, before the step's clock started).
    # The lateness is a clock's jump, at the first exchange: no test of real time.
    late = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + late[0])
    monkeypatch.setattr(monadl.distributed._data_parallel, "time", clock)

    class Late(Counting):
        async def allgather(self, send: npt.NDArray[Any], counts: Any) -> npt.NDArray[Any]:
            if not self.gathered:
                late[0] += 100.0  # the other ranks arrive 100 s after this one
            return await super().allgather(send, counts)

    async def rank(comm: Communicator) -> dict[str, float]:
        weight = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(weight, Late(comm))
        await dp.train(ml.sum(weight * 2.0))
        return dp.last_step_seconds

    (seconds,) = run_local(1, rank)
    assert seconds["agree"] >= 100.0 and seconds["backward"] < 100.0


def test_a_data_parallel_step_inside_a_direct_function_is_refused_on_every_rank() -> None:
    async def rank(comm: Communicator) -> list[float]:
        weight = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(weight, comm)

        @ml.direct
        async def model(h: ml.ArrayLayer) -> ml.ScalarLayer:
            await dp.train(ml.sum(weight * 3.0))
            return ml.sum(h * 2.0)

        with pytest.raises(ml.OperandError, match=r"DataParallel.train\(\) inside an @ml.direct function"):
            await model(ml.as_layer(weight)).train()
        await dp.train(ml.sum(weight * 0.0))  # (the communicator is still in step)
        return list(map(float, weight.data))

    assert run_local(2, rank) == [[1.0, 2.0]] * 2


def test_a_second_step_over_a_communicator_while_one_runs_is_refused_and_the_first_steps() -> None:
    # Two tasks' train() at once: their collectives interleaved and paired differently
    # on each rank, one step averaged one task's gradient with the other's, and every
    # later step was refused as out of step.
    async def rank(comm: Communicator) -> tuple[str, list[float]]:
        w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm)
        await dp.broadcast()
        first_in = anyio.Event()
        refused = ""

        async def first() -> None:
            first_in.set()
            await dp.train(ml.sum(w * 1.0))

        async def second() -> None:
            nonlocal refused
            await first_in.wait()
            with pytest.raises(ml.OperandError, match="already running on this rank") as caught:
                await DataParallel(w, comm).train(ml.sum(w * 2.0))  # (another over the same communicator too)
            refused = str(caught.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(second)
        await dp.train(ml.sum(w * 1.0))  # (still in step)
        return refused[:20], w.data.tolist()

    assert run_local(2, rank) == [("a step or a broadcas", [0.8, 0.8])] * 2


UNEVEN = [np.array([1.0, 2.0]), np.array([10.0, 20.0]), np.array([100.0, 200.0])]  # rank r's example: [r]


def test_a_rank_that_skipped_a_numbered_batch_is_refused_at_that_step_on_every_rank() -> None:
    # Rank 1's loader skipped batch 1: its batch 2 met rank 0's batch 1, both ranks stepped
    # by their mean (to w = -10.65) and no one was told (a user's trial).
    async def rank(comm: Communicator) -> tuple[list[str], float]:
        w = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm)
        seen = []
        for step, x in enumerate(UNEVEN):
            if comm.rank == 1 and step == 1:
                continue
            try:
                await dp.train(ml.mean(w * x[comm.rank]), step=step)
                seen.append("stepped")
            except RankFailure as error:
                seen.append(f"{error.in_step}: {error}")
        return seen, float(w.data[0])

    parted = (
        "the ranks are at different steps: rank 0 at step 1; rank 1 at step 2; each rank's train() meets the "
        "others' in call order, so a rank that skipped or repeated a batch, or made a call the others did not, "
        "pairs its batches with the others' next ones"
    )
    (first, w0), (second, w1) = run_local(2, rank)
    assert first[:2] == ["stepped", f"False: no rank stepped: {parted}"] and second[:2] == first[:2]
    assert first[2].startswith(f"False: no rank stepped: the ranks may be out of step after an earlier step ({parted})")
    assert len(second) == 2 and w0 == w1 == pytest.approx(-0.15)  # (the first step's alone: (1 + 2) / 2 * 0.1)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_rank_with_fewer_batches_that_finishes_is_named_by_every_rank(overlap: bool) -> None:
    # Its peer waited in the next step's exchange until the timeout, told under MPI
    # that "a rank died or hangs", though the rank had returned normally.
    async def rank(comm: Communicator) -> tuple[list[str], float]:
        w = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm, overlap=overlap)  # (overlapped, the third step's buckets are in flight)
        seen = []
        for x in UNEVEN[: 3 - comm.rank]:
            try:
                await dp.train(ml.mean(w * x[comm.rank]))
                seen.append("stepped")
            except RankFailure as error:
                seen.append(str(error))
        try:
            await dp.finish()
            seen.append("finished")
        except RankFailure as error:
            seen.append(str(error))
        return seen, float(w.data[0])

    ended = (
        "no rank stepped: rank 1 finished after 2 train() calls, while rank 0 at step 2 still trained: the ranks "
        "had different numbers of batches; give every rank as many (shard each global batch, with drop_last=True "
        "where it does not divide, or stop every rank where the shortest data ends)"
    )
    (first, w0), (second, w1) = run_local(2, rank, timeout=300.0)  # (at once: no timeout waited for)
    assert first[:3] == ["stepped", "stepped", ended] and f"earlier step ({ended[17:]}); end the job" in first[3]
    assert second == ["stepped", "stepped", ended]
    assert w0 == w1 == pytest.approx(-1.65)  # the first two steps: -0.1 * (1.5 + 15)


def test_ranks_that_finish_together_return_and_name_uneven_counts() -> None:
    async def rank(comm: Communicator) -> str:
        w = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm, overlap=True)
        for x in UNEVEN:
            await dp.train(ml.mean(w * x[comm.rank]))
        await dp.finish()
        alone = DataParallel(w, comm)
        if comm.rank == 1:  # a call on this rank alone, refused here (the counter still counts it)
            with pytest.raises(ml.OperandError, match=r"inside an @ml\.direct function"):
                await direct_step(alone, w)
        with pytest.raises(RankFailure) as caught:
            await alone.finish()
        return str(caught.value)

    uneven = (
        "no rank stepped: the ranks are at different steps: rank 0 finished after 0 train() calls; rank 1 "
        "finished after 1 train() call; each rank's train() meets the others' in call order, so a rank that "
        "skipped or repeated a batch, or made a call the others did not, pairs its batches with the others' "
        "next ones"
    )
    assert run_local(2, rank) == [uneven] * 2


def test_a_train_or_a_finish_after_finish_is_refused_on_the_rank_that_makes_it() -> None:
    # A loop that called finish() inside it stepped on after it, every rank alike, silently.
    async def rank(comm: Communicator) -> list[str]:
        w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.001))
        dp = DataParallel(w, comm)
        await dp.train(ml.sum(w * w), step=0)
        await dp.finish()
        said = []
        for late in (dp.finish(), dp.train(ml.sum(w * w), step=1)):
            with pytest.raises(RuntimeError) as caught:
                await late
            said.append(str(caught.value))
        np.testing.assert_allclose(w.data, 0.998)  # (the one step before finish())
        return said

    assert (
        run_local(2, rank)
        == [
            [
                "DataParallel.finish() called twice: call it once, after the last batch",
                "DataParallel.train() after finish(): this rank said its training was over; call finish() once, "
                "after the last batch (a new DataParallel over the same weights trains again)",
            ]
        ]
        * 2
    )


def test_a_loss_that_is_no_layer_is_refused_with_what_to_pass() -> None:
    # (a float reached the runtime: AttributeError: 'float' object has no attribute '_inputs')
    async def rank(comm: Communicator) -> str:
        w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.001))
        dp = DataParallel(w, comm)
        with pytest.raises(TypeError) as caught:
            await dp.train(3.0)  # type: ignore[call-overload]  # the mistake under test
        return str(caught.value)

    assert (
        run_local(2, rank)
        == [
            "DataParallel.train() takes the loss as a layer (what loss.train() would train), "
            "got float: pass the layer, not its value"
        ]
        * 2
    )


async def direct_step(dp: DataParallel, w: ml.Weight[Any, Any]) -> None:
    @ml.direct
    async def model(h: ml.ArrayLayer) -> ml.ScalarLayer:
        await dp.train(ml.sum(w * 3.0))
        return ml.sum(h * 2.0)

    await model(ml.as_layer(w)).train()


def test_a_rank_that_returned_without_finish_is_said_to_have_returned() -> None:
    async def rank(comm: Communicator) -> str:
        w = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm)
        for x in UNEVEN[: 3 - comm.rank]:
            await dp.train(ml.mean(w * x[comm.rank]))
        return "returned"

    with pytest.raises(RankFailure) as caught:
        run_local(2, rank, timeout=300.0)
    assert str(caught.value) == (
        "no rank stepped: rank 1 ended (it returned) before this collective (a rank that returned made fewer "
        "exchanges: fewer batches, say; DataParallel.finish() at the end of every rank's data names each rank's step)"
    )


def test_a_checkpoint_that_named_the_wrappers_fields_says_how_to_load_it(tmp_path: Any) -> None:
    # ml.save(path, dp) once wrote '_weights.0' ... (the walk saw DataParallel's own tuple of
    # weights); loaded since, into dp or the plain model, it was refused with no hint why.
    class Two:
        def __init__(self, value: float) -> None:
            self.a, self.b = ml.Weight(np.full(2, value)), ml.Weight(np.full(3, value))

    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    ml.save(old, {"_weights": find_weights(Two(1.0))})  # (the names and order the wrapper wrote)

    async def rank(comm: Communicator) -> tuple[str, list[float], list[float]]:
        dp = DataParallel(Two(2.0), comm)
        with pytest.raises(ml.CheckpointError) as refused:
            ml.load(old, dp)
        ml.load(old, {"_weights": dp.weights})  # (what it says)
        ml.save(new, dp)
        plain = Two(3.0)
        ml.load(new, plain)
        return str(refused.value), [float(w.data[0]) for w in dp.weights], plain.b.data.tolist()

    ((refused, loaded, plain),) = run_local(1, rank)
    assert refused == (
        f"{old} does not fit the model: no weight of the model is in the checkpoint, so nothing would load (the "
        "checkpoint holds '_weights.0', '_weights.1'; the model 'a', 'b'); those are a DataParallel's own fields, "
        "as ml.save(path, dp) named them before it saved the model's names ('_weights.0' is dp.weights[0]); with "
        "the model built as when saved, load it by that order once, ml.load(path, {'_weights': dp.weights}) (into "
        "the plain model: {'_weights': monadl.distributed.find_weights(model)}), then ml.save(path, dp) writes the "
        "model's names; nothing was loaded"
    )
    assert loaded == [1.0, 1.0] and plain == [1.0] * 3
    two = Two(4.0)
    ml.load(old, {"_weights": find_weights(two)})  # (into the plain model)
    assert two.a.data.tolist() == [1.0] * 2


def test_a_data_parallel_saves_and_loads_under_its_models_own_names(tmp_path: Any) -> None:
    # ml.save(path, dp) wrote the wrapper's fields ('_weights.0' ...), which the plain model
    # could not load (a new user's trial); DDP's state_dict prefixes 'module.' instead.
    async def rank(comm: Communicator) -> tuple[list[str], Arrays, Arrays, list[float]]:
        net = Net(0)
        dp = DataParallel(net, comm)
        x, y, head = batches(1)[0]
        await dp.train(net.loss(x, y, head))
        ml.save(tmp_path / "dp.safetensors", dp)
        plain = Net(1)
        ml.load(tmp_path / "dp.safetensors", plain)  # the wrapped model's checkpoint, into the plain model
        ml.save(tmp_path / "plain.safetensors", plain)
        wrapped = DataParallel(Net(2), comm)
        ml.load(tmp_path / "plain.safetensors", wrapped)  # and the plain model's, into a wrapped one
        moments = [float(np.sum(w.state[0].mu)) for w in (net.heads[0], plain.heads[0], wrapped.weights[2])]
        names = list(ml.checkpoint.named_weights({"dp": dp}))
        return names, net.weights(), {f"{i}": np.asarray(w.data) for i, w in enumerate(wrapped.weights)}, moments

    ((names, trained, loaded, moments),) = run_local(1, rank)
    assert names == ["dp.w1", "dp.b1", "dp.heads.0", "dp.heads.1", "dp.scale"]
    assert trained.keys() == loaded.keys()
    for name in trained:
        np.testing.assert_array_equal(loaded[name], trained[name])
    assert moments[0] != 0.0 and moments == [moments[0]] * 3  # (Adam's first moment came through both ways)


def test_data_parallel_steps_by_the_others_where_one_rank_reaches_no_weight_and_raises_where_none_does() -> None:
    async def main(comm: Any) -> tuple[str, float, list[float], float]:
        w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.5))
        dp = DataParallel([w], comm)
        line = sys._getframe().f_lineno + 2
        with pytest.raises(ml.NoGradientError) as raised:
            await dp.train(ml.sum(ml.as_layer(np.full(2, float(comm.rank)))))
        # The ranks are in step after it: rank 1's empty shard adds nothing, rank 0's gradient is averaged.
        x = np.array([1.0, 3.0]) if comm.rank == 0 else np.zeros(0)
        loss = ml.sum(w * x) if comm.rank == 0 else ml.sum(ml.as_layer(x))
        value = float(await dp.train(loss))
        await dp.finish()
        assert f"DataParallel.train() of the loss built at {__file__}:{line}: no rank's loss" in str(raised.value)
        return str(raised.value), float(raised.value.value), w.data.tolist(), value

    (m0, v0, w0, l0), (m1, v1, w1, l1) = run_local(2, main)
    assert "(this rank's is 0.0), so no rank stepped" in m0 and "(this rank's is 2.0), so no rank stepped" in m1
    assert (v0, v1) == (0.0, 2.0) and (l0, l1) == (4.0, 0.0)
    assert w0 == w1 == [1.0 - 0.5 * 0.5, 1.0 - 0.5 * 1.5]
