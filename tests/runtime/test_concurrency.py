"""Evaluations are independent: concurrent trains and predicts on shared layers."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

pytestmark = pytest.mark.anyio


async def test_concurrent_trains_each_take_their_step() -> None:
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    started = anyio.Event()

    async def slow_one() -> float:
        started.set()
        await anyio.sleep(0.01)
        return 1.0

    slow: ml.ScalarLayer = ml.Layer(ml.Do.from_async(slow_one).map(lambda v: ml.Tape(v)))
    fast_loss = ml.sum(w * np.array([1.0, 0.0]))
    slow_loss = ml.sum(w * np.array([0.0, 1.0])) * slow
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_loss.train)
        await started.wait()
        await fast_loss.train()  # completes while the slow one waits
        np.testing.assert_allclose(w.data, [0.9, 2.0])
    np.testing.assert_allclose(w.data, [0.9, 1.9])


async def test_one_layer_evaluated_by_concurrent_predicts() -> None:
    calls = 0

    async def value() -> float:
        nonlocal calls
        calls += 1
        await anyio.sleep(0.005)
        return 2.0

    x: ml.ScalarLayer = ml.Layer(ml.Do.from_async(value).map(lambda v: ml.Tape(v)))
    y = x * x + x
    results = []

    async def run() -> None:
        results.append(await y.predict())

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(run)
    assert results == [6.0, 6.0, 6.0]
    assert calls == 3  # once per evaluation, not once per use


async def test_shared_resource_in_two_layers_opens_once_per_evaluation() -> None:
    log: list[str] = []

    async def open_() -> float:
        log.append("open")
        return 3.0

    async def close(v: float) -> None:
        log.append("close")

    resource = ml.Do.resource(open_, close).shared()
    a: ml.ScalarLayer = ml.Layer(resource.map(lambda v: ml.Tape(v)))
    b: ml.ScalarLayer = ml.Layer(resource.map(lambda v: ml.Tape(v * 2)))
    w = ml.Weight(1.0, optimizer=ml.optim.sgd(0.1))
    assert await (w * a + w * b).train() == 9.0
    assert log == ["open", "close"]
    assert w.data == pytest.approx(1.0 - 0.1 * 9.0)


# ---- an evaluation reads the model as it was when it began --------------------------------------
# A direct-style function reaches weights after an await: a step (or a load, or an
# assignment) landing in between gave it one weight's old value and another's new.
A_WEIGHT_CHANGES = ["a step", "an assignment", "a checkpoint's load"]


@pytest.mark.parametrize("change", A_WEIGHT_CHANGES)
async def test_a_prediction_across_a_commit_sees_the_model_it_began_with(change: str, tmp_path: Any) -> None:
    a = ml.Weight(np.array([1.0]), optimizer=ml.optim.sgd(0.5))
    b = ml.Weight(np.array([10.0]), optimizer=ml.optim.sgd(0.5))
    read_a, changed = anyio.Event(), anyio.Event()
    ml.save(tmp_path / "later.safetensors", {"a": ml.Weight(np.array([0.5])), "b": ml.Weight(np.array([9.5]))})

    @ml.direct
    async def model(x: ml.ArrayLayer) -> ml.ArrayLayer:
        await ml.values(x * a)  # a is read here ...
        read_a.set()
        await changed.wait()
        return ml.concatenate([x * a, x * b])  # ... and b first here

    async def change_the_model() -> None:
        await read_a.wait()
        if change == "a step":
            await ml.sum((a + b) * 1.0).train()  # each steps by -0.5
        elif change == "an assignment":
            a.data, b.data = np.array([0.5]), np.array([9.5])
        else:
            ml.load(tmp_path / "later.safetensors", {"a": a, "b": b})
        changed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(change_the_model)
        seen = await model(ml.as_layer(np.array([1.0]))).predict()
    assert seen.tolist() == [1.0, 10.0]  # (it read [1.0, 9.5])
    assert (float(a.data[0]), float(b.data[0])) == (0.5, 9.5)
    assert (await model(ml.as_layer(np.array([1.0]))).predict()).tolist() == [0.5, 9.5]


async def test_a_training_step_across_anothers_commit_steps_from_the_newer_data() -> None:
    # Its gradient is the model's it began with; its step lands on the data as
    # it is then (no update lost), and nothing it kept stays behind it.
    from monadl.layers._commits import READERS

    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    read, stepped = anyio.Event(), anyio.Event()

    @ml.direct
    async def loss() -> ml.ScalarLayer:
        await ml.values(w * 1.0)
        read.set()
        await stepped.wait()
        return ml.sum(w * w)  # gradient 2w at w = [1, 2]

    async def other() -> None:
        await read.wait()
        await ml.sum(w * np.array([10.0, 0.0])).train()  # w -> [0, 2]
        stepped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        assert await loss().train() == 5.0
    np.testing.assert_allclose(w.data, [0.0 - 0.2, 2.0 - 0.4])
    assert READERS == {}


async def test_a_prediction_awaited_inside_a_model_reads_the_outer_evaluations_model() -> None:
    # The eager way (a predict() awaited in an @ml.direct model) began an evaluation of
    # its own after the commit: it read b's new value beside the outer's old a.
    a = ml.Weight(np.array([1.0]), optimizer=ml.optim.sgd(0.5))
    b = ml.Weight(np.array([10.0]), optimizer=ml.optim.sgd(0.5))
    read_a, changed = anyio.Event(), anyio.Event()

    @ml.direct
    async def model(x: ml.ArrayLayer) -> ml.ArrayLayer:
        await ml.values(x * a)
        read_a.set()
        await changed.wait()
        gate = await (x * b).predict()
        return ml.concatenate([x * a, ml.as_layer(gate)])

    async def change_the_model() -> None:
        await read_a.wait()
        await ml.sum((a + b) * 1.0).train()
        changed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(change_the_model)
        seen = await model(ml.as_layer(np.array([1.0]))).predict()
    assert seen.tolist() == [1.0, 10.0]
    assert (await (ml.as_layer(np.array([1.0])) * b).predict()).tolist() == [9.5]  # (a new one: the new model)
