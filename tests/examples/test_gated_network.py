"""The paper's gated network four ways: identical results, different work."""

from __future__ import annotations

import numpy as np
import pytest

from examples import gated_network as gn

pytestmark = pytest.mark.anyio


async def test_four_ways_give_identical_losses_and_updates() -> None:
    results = {way: await gn.train(way, steps=30) for way in gn.WAYS}
    eager_losses, eager_net = results["eager"]
    assert eager_losses[-1] < eager_losses[0]
    for way in gn.WAYS[1:]:
        losses, net = results[way]
        assert losses == eager_losses, way
        for w, w_eager in zip(net.weights(), eager_net.weights()):
            assert w.data.tobytes() == w_eager.data.tobytes(), way


async def test_both_subnets_get_chosen_so_the_comparison_means_something() -> None:
    net = gn.GatedNetwork(0)
    rng = np.random.default_rng(1)
    choices = set()
    for _ in range(30):
        features = net.input(rng.standard_normal(gn.FEATURES))
        left, right = net.gate(features)
        choices.add(bool(await left.predict() > await right.predict()))
    assert choices == {True, False}


@pytest.mark.parametrize("way", ["monadic", "applicative", "direct"])
async def test_dynamic_ways_evaluate_gate_and_input_once(way: str) -> None:
    _, net = await gn.train(way, steps=5)
    assert net.gate_count.count == 5
    assert net.input_count.count == 5


async def test_eager_evaluates_gate_and_input_again() -> None:
    _, net = await gn.train("eager", steps=5)
    # Each step: one predict per score (each its own evaluation), then train.
    assert net.gate_count.count == 15
    assert net.input_count.count == 15
