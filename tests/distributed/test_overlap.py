"""The all-reduce overlapped with the backward: the runtime's hook, and DataParallel's buckets.

The hook (`monadl.runtime.entry.gradients`' ``on_gradient``) must report each
weight once, with its final gradient, as soon as the backward has finished
with it; the buckets it fills must give the same steps as reducing after the
backward, on static and dynamic networks, with failing and dead ranks.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

import monadl as ml
from monadl.distributed import Communicator, DataParallel, LocalCommunicator, RankFailure, run_local, shard
from monadl.distributed._overlap import Overlap, plan_buckets
from monadl.runtime import entry
from tests.distributed.logged import Logged
from tests.distributed.test_data_parallel import Arrays, Net, batches

Reports = list[tuple[ml.Weight[Any, Any], Any]]


def chain(depth: int) -> tuple[list[ml.Weight[Any, Any]], ml.ScalarLayer]:
    """``depth`` tanh layers; the first weight is used again by the loss's last term (its
    first use is the earliest record, so it is final only at the very end)."""
    rng = np.random.default_rng(0)
    ws = [ml.Weight(rng.standard_normal((3, 3)) * 0.5) for _ in range(depth)]
    x = rng.standard_normal((2, 3))
    h: ml.ArrayLayer = ml.tanh(ml.matmul(x, ws[0]))
    for w in ws[1:]:
        h = ml.tanh(ml.matmul(h, w))
    return ws, ml.sum(h) + ml.sum(ml.matmul(x, ws[0]) * 0.5)


def reported(loss: ml.ScalarLayer) -> tuple[Reports, dict[ml.Weight[Any, Any], Any]]:
    reports: Reports = []
    _, grads = anyio.run(entry.gradients, loss, lambda w, g: reports.append((w, g)))
    return reports, grads


def test_the_hook_reports_each_weight_once_with_its_final_gradient_last_layer_first() -> None:
    ws, loss = chain(5)
    reports, grads = reported(loss)
    assert [ws.index(w) for w, _ in reports] == [4, 3, 2, 1, 0]
    assert all(g is grads[w] for w, g in reports)  # final: the very gradient the backward ended with
    twins, twin_loss = chain(5)
    _, plain = anyio.run(entry.gradients, twin_loss)  # the same graph with no listener
    for w, g in reports:
        np.testing.assert_array_equal(g, plain[twins[ws.index(w)]])


def test_the_hook_reports_final_gradients_when_the_runtime_batches_nodes() -> None:
    def branches() -> tuple[ml.Weight[Any, Any], list[ml.Weight[Any, Any]], ml.ScalarLayer]:
        rng = np.random.default_rng(1)
        shared = ml.Weight(rng.standard_normal((4, 4)))
        heads = [ml.Weight(rng.standard_normal((4, 2))) for _ in range(8)]
        terms = [ml.sum(ml.matmul(ml.tanh(ml.matmul(rng.standard_normal((3, 4)), shared)), v)) for v in heads]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return shared, heads, total

    shared, heads, loss = branches()
    with ml.settings(batching=True):  # the branches' matmuls and tanhs run as groups
        reports, grads = reported(loss)
    names = [w for w, _ in reports]
    assert sorted(map(id, names)) == sorted(map(id, [shared, *heads]))  # each weight once
    assert all(g is grads[w] for w, g in reports)
    assert names[-1] is shared  # used by every branch: final last
    twin, twin_heads, twin_loss = branches()
    with ml.settings(batching=False):
        _, plain = anyio.run(entry.gradients, twin_loss)
    for w, t in [(shared, twin), *zip(heads, twin_heads)]:
        np.testing.assert_allclose(grads[w], plain[t], rtol=1e-12, atol=1e-14)


def test_the_hook_reports_weights_of_a_direct_style_graph_at_their_last_release() -> None:
    ws, _ = chain(3)

    @ml.direct
    async def net(x: npt.NDArray[Any]) -> ml.ScalarLayer:
        h = ml.tanh(ml.matmul(x, ws[0]))
        (first,) = await ml.values(ml.sum(h))  # direct style: the counted release back-propagates
        h = ml.tanh(ml.matmul(h, ws[1] if first > 0 else ws[2]))
        return ml.sum(h)

    reports, grads = reported(net(np.ones((2, 3))))
    names = [w for w, _ in reports]
    assert len(names) == len(set(names)) == len(grads) == 2  # ws[0] and the branch's weight, once each
    assert all(g is grads[w] for w, g in reports)
    assert names.index(ws[0]) > max(names.index(w) for w in names if w in ws[1:])  # upstream after downstream


def test_buckets_start_while_the_backward_still_runs_and_sum_what_the_ranks_reported() -> None:
    async def rank(comm: Communicator) -> list[int]:
        ws, loss = chain(4)
        unreached = ml.Weight(np.ones(2))
        # A bucket per weight, the first one unreached by this graph: it starts before the backward.
        overlap = Overlap(comm, plan_buckets([unreached, ws[3], ws[2], ws[1], ws[0]], 1, 1))
        started = []

        def reached(weights: list[ml.Weight[Any, Any]]) -> None:
            overlap.reached(weights)
            started.append(overlap.started)

        def final(w: ml.Weight[Any, Any], g: Any) -> None:
            started.append(overlap.started)  # before this weight's report
            overlap.final(w, g)

        _, grads = await entry.gradients(loss, final, reached)
        overlap.finish(grads)
        started.append(overlap.started)
        await overlap.wait()
        np.testing.assert_array_equal(overlap.results[0], np.zeros(2))
        for k, w in enumerate([ws[3], ws[2], ws[1], ws[0]], 1):
            np.testing.assert_array_equal(overlap.results[k], 2 * grads[w].reshape(-1))  # two equal ranks
        return started

    # Each bucket starts the moment its weight is final, before the backward goes on to the next.
    assert run_local(2, rank) == [[1, 1, 2, 3, 4, 5]] * 2


def train_two_ranks(
    overlap: bool, heads: list[tuple[int, int]], bucket_bytes: int = 1 << 20
) -> tuple[Arrays, Arrays, list[dict[str, float]]]:
    """Two ranks train ``Net`` on batches(len(heads)); at step s rank r uses head heads[s][r]."""

    async def rank(comm: Communicator) -> tuple[Arrays, list[dict[str, float]]]:
        net = Net(0)
        dp = DataParallel(net, comm, overlap=overlap, bucket_bytes=bucket_bytes)
        times = []
        for (x, y, _), pair in zip(batches(len(heads)), heads):
            xs, ys = shard(x, comm.rank, 2), shard(y, comm.rank, 2)
            await dp.train(net.loss(xs, ys, pair[comm.rank]))
            times.append(dp.last_step_seconds)
        return net.weights(), times

    (zero, times), (one, _) = run_local(2, rank)
    return zero, one, times


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 20])  # a bucket per weight; one bucket
def test_overlapped_steps_equal_steps_reduced_after_the_backward(bucket_bytes: int) -> None:
    heads = [(s % 2, s % 2) for s in range(6)]
    zero, one, times = train_two_ranks(True, heads, bucket_bytes)
    plain, _, _ = train_two_ranks(False, heads, bucket_bytes)
    for name in plain:
        np.testing.assert_array_equal(zero[name], one[name])
        np.testing.assert_allclose(zero[name], plain[name], rtol=1e-12, atol=1e-15)
    assert set(times[-1]) == {"backward", "allreduce", "exposed", "agree"}
    assert all(t >= 0 for step in times for t in step.values())


def test_ranks_that_reach_different_weights_step_as_one_process() -> None:
    # Each step the two ranks take different heads (or the same): a weight a rank never
    # reached goes into its bucket as zeros, and a head no rank reached is not stepped.
    heads = [(0, 1), (1, 0), (0, 0), (1, 1), (0, 1), (1, 1)]
    zero, one, _ = train_two_ranks(True, heads, 1)
    net = Net(0)
    for (x, y, _), (h0, h1) in zip(batches(len(heads)), heads):
        loss0 = net.loss(shard(x, 0, 2), shard(y, 0, 2), h0)
        loss1 = net.loss(shard(x, 1, 2), shard(y, 1, 2), h1)
        anyio.run((loss0 * 0.5 + loss1 * 0.5).train)
    expected = net.weights()
    for name in expected:
        np.testing.assert_array_equal(zero[name], one[name])
        np.testing.assert_allclose(zero[name], expected[name], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("fail", ["raise", "nan"])
def test_a_rank_that_fails_during_an_overlapped_step_stops_every_rank_and_training_goes_on(fail: str) -> None:
    async def rank(comm: Communicator) -> tuple[str, bool, Arrays]:
        net = Net(0)
        dp = DataParallel(net, comm, bucket_bytes=1, overlap=True)
        data = batches(4)
        for x, y, head in data[:2]:  # the buckets are planned: step 3 overlaps
            await dp.train(net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head))
        before = net.weights()
        x, y, head = data[2]
        xs = shard(x, comm.rank, 2)
        if comm.rank == 1:
            xs = xs[:, :3] if fail == "raise" else xs * np.nan
        with pytest.raises(RankFailure) as caught:
            await dp.train(net.loss(xs, shard(y, comm.rank, 2), head))
        after = net.weights()
        x, y, head = data[3]  # every rank is still in step: the next step trains
        await dp.train(net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head))
        return str(caught.value), all(np.array_equal(before[k], after[k]) for k in before), net.weights()

    (message0, unchanged0, w0), (message1, unchanged1, w1) = run_local(2, rank)
    assert unchanged0 and unchanged1 and message0 == message1
    assert "rank 1 failed" in message0
    assert ("ShapeError" if fail == "raise" else "non-finite gradient of weight") in message0
    for name in w0:
        np.testing.assert_array_equal(w0[name], w1[name])


def test_a_rank_that_dies_before_an_overlapped_step_is_reported_after_the_timeout() -> None:
    async def rank(comm: Communicator) -> str:
        net = Net(0)
        dp = DataParallel(net, comm, bucket_bytes=1, overlap=True)
        data = batches(2)
        x, y, head = data[0]
        await dp.train(net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head))
        if comm.rank == 1:
            await anyio.sleep(1.5)  # hangs past the others' timeout (a dead process, to MPI)
            return "gone"
        before = net.weights()
        x, y, head = data[1]
        with pytest.raises(RankFailure, match="no answer from the other ranks in all-gather") as caught:
            await dp.train(net.loss(shard(x, 0, 2), shard(y, 0, 2), head))
        assert all(np.array_equal(before[k], net.weights()[k]) for k in before)
        return str(caught.value)

    message, gone = run_local(2, rank, timeout=0.5)
    assert gone == "gone" and "rank 0" in message


def test_plan_buckets_keep_order_dtype_runs_and_a_small_first_bucket() -> None:
    ws = [ml.Weight(np.zeros(n, dtype)) for n, dtype in [(10, "f8"), (10, "f8"), (10, "f4"), (1000, "f4"), (5, "f4")]]
    buckets = plan_buckets(ws, limit=8000, first=100)
    assert [[ws.index(w) for w in b] for b in buckets] == [[0], [1], [2, 3, 4]]


@pytest.mark.parametrize("optimizer", [ml.optim.sgd(0.1), ml.optim.adam(0.1)], ids=["sgd", "adam"])
def test_a_table_once_dense_steps_by_rows_when_every_rank_has_rows(optimizer: ml.optim.GradientTransformation) -> None:
    # Step 1 reaches the whole table densely; from then on it was planned into a dense bucket
    # and stepped by that bucket's total whatever the ranks' gradients were: at step 2 (rows
    # on both ranks) Adam moved the rows no rank looked up, on their momentum alone.
    ids = [[0, 1], [2, 3], [0, 2]]  # per step, rank 0 looks up ids[s][0] and rank 1 ids[s][1]

    def build() -> tuple[ml.ArrayWeight, ml.ArrayWeight]:
        rng = np.random.default_rng(0)
        return (
            ml.Weight(rng.standard_normal((6, 2)), optimizer=optimizer),
            ml.Weight(rng.standard_normal(2), optimizer=optimizer),
        )

    def loss(table: ml.ArrayWeight, v: ml.ArrayWeight, step: int, rows: list[int]) -> ml.ScalarLayer:
        out = ml.sum(ml.matmul(ml.embedding(table, np.array(rows)), v)) * (1.0 / len(rows))
        return out + ml.sum(table) if step == 1 else out

    def two_ranks(overlap: bool) -> list[npt.NDArray[Any]]:
        async def rank(comm: Communicator) -> npt.NDArray[Any]:
            table, v = build()
            dp = DataParallel([table, v], comm, overlap=overlap)
            for step, pair in enumerate(ids):
                await dp.train(loss(table, v, step, [pair[comm.rank]]))
            assert any(table in bucket for bucket in dp.buckets)  # (planned, as once dense)
            return table.data

        return run_local(2, rank)

    async def one_process() -> npt.NDArray[Any]:
        table, v = build()
        for step, pair in enumerate(ids):
            await loss(table, v, step, pair).train()  # the mean of the ranks' losses
        return table.data

    expected = anyio.run(one_process)
    for overlap in (False, True):
        zero, one = two_ranks(overlap)
        np.testing.assert_array_equal(zero, one)
        np.testing.assert_allclose(zero, expected, rtol=1e-12, atol=1e-15)


def test_an_overlapped_step_that_a_rank_failed_awaits_its_buckets_before_every_rank_raises() -> None:
    # The status round runs while the buckets are in flight (so that a late rank is told at
    # once); where a rank failed, the ranks stay in step, so every rank awaits its buckets
    # before it raises: none is left in flight into the next step.
    async def rank(comm: Communicator) -> tuple[list[str], str]:
        assert isinstance(comm, LocalCommunicator)
        logged = Logged(comm)
        net = Net(0)
        dp = DataParallel(net, logged, bucket_bytes=1, overlap=True)
        data = batches(3)
        for x, y, head in data[:2]:  # both heads reached: five buckets
            await dp.train(net.loss(shard(x, comm.rank, 2), shard(y, comm.rank, 2), head))
        del logged.log[:]
        x, y, head = data[2]
        xs = shard(x, comm.rank, 2)
        with pytest.raises(RankFailure) as caught:
            await dp.train(net.loss(xs[:, :3] if comm.rank else xs, shard(y, comm.rank, 2), head))
        return logged.log, str(caught.value)

    for log, message in run_local(2, rank):
        assert message.startswith("no rank stepped: rank 1 failed: ShapeError")
        # The statuses, then the failure's message, then the buckets.
        assert log == ["start bucket"] * 5 + ["all-gather"] * 2 + ["wait bucket"] * 5
