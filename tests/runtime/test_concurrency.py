"""Evaluations are independent: concurrent trains and predicts on shared layers."""

from __future__ import annotations

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
