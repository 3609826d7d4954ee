"""Forking: coarse independent branches run on the worker pool, fine ones never
do, results match one thread, and a branch's exception surfaces as itself."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import monadl as ml
from monadl.layers._layer import Layer
from monadl.layers._primitives import Primitive

pytestmark = pytest.mark.anyio


class Probe:
    """An identity primitive that notes the thread it ran on, and can fail."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.error: BaseException | None = None
        self.primitive = Primitive("probe", self._rule)

    def _rule(self, a: Any) -> tuple[Any, tuple[Any, ...]]:
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        return a, (lambda g: g,)

    def __call__(self, x: ml.ArrayLayer) -> ml.ArrayLayer:
        return Layer._make(self.primitive, (x,))


def columns(x: ml.Array, ws: list[ml.ArrayWeight], probe: Probe) -> ml.ScalarLayer:
    outs = [probe(ml.relu(ml.tanh(x @ w) @ w.T)) for w in ws]
    total = outs[0]
    for out in outs[1:]:
        total = total + out
    return ml.mean(total * total)


def make(seed: int = 0) -> tuple[ml.Array, list[ml.ArrayWeight]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((128, 512))
    return x, [ml.Weight(rng.standard_normal((512, 512)) * 0.05, optimizer=ml.optim.sgd(0.1)) for _ in range(4)]


async def gradients(workers: int, probe: Probe) -> tuple[float, list[Any]]:
    x, ws = make()
    with ml.settings(workers=workers, fork_threshold_s=1e-4):
        for _ in range(2):  # the first evaluation measures, the next may fork
            value = await columns(x, ws, probe).predict()
            grads = await ml.gradients(columns(x, ws, probe), ws)
    return float(value), grads


async def test_coarse_branches_fork_and_match_one_thread() -> None:
    one, two = Probe(), Probe()
    value1, grads1 = await gradients(1, one)
    value2, grads2 = await gradients(2, two)
    assert set(one.threads) == {"MainThread"}
    assert any(name.startswith("monadl-worker") for name in two.threads)
    assert value2 == pytest.approx(value1, rel=1e-12)
    for g1, g2 in zip(grads1, grads2):
        np.testing.assert_allclose(g2, g1, rtol=1e-10, atol=1e-14)


async def test_training_on_the_pool_steps_like_one_thread() -> None:
    results = []
    for workers in (1, 2):
        x, ws = make(1)
        with ml.settings(workers=workers, fork_threshold_s=1e-4):
            for _ in range(3):
                await columns(x, ws, Probe()).train()
        results.append([w.data for w in ws])
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-14)


async def test_fine_graphs_never_fork() -> None:
    probe = Probe()
    w = ml.Weight(np.ones((4, 4)))
    with ml.settings(workers=4):
        for _ in range(3):
            await ml.sum(probe(w * 2.0) + probe(w * 3.0)).train()
    assert set(probe.threads) == {"MainThread"}


class Boom(Exception):
    pass


async def test_exception_in_a_branch_surfaces_as_itself_and_changes_nothing() -> None:
    probe = Probe()
    x, ws = make(2)
    before = [w.data.copy() for w in ws]
    with ml.settings(workers=2, fork_threshold_s=1e-4):
        await columns(x, ws, probe).predict()  # measure: the next evaluation forks
        ws_after_predict = [w.data.copy() for w in ws]
        probe.error = Boom("in a branch")
        with pytest.raises(Boom) as info:
            await columns(x, ws, probe).train()
    assert info.value is probe.error
    assert not isinstance(info.value, BaseExceptionGroup)
    for b, a, w in zip(before, ws_after_predict, ws):
        assert w.data.tobytes() == b.tobytes() == a.tobytes()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="workers"):
        with ml.settings(workers=0):
            pass
