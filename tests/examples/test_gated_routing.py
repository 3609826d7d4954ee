"""The gated routing benchmark: each example routed by its own gate, batched
across its choices, equal to one by one and to the model by hand."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import monadl as ml
from benchmarks import _gated_routing_numpy as by_hand
from benchmarks import gated_routing as gr
from monadl.runtime import entry


def test_examples_take_different_routes_and_match_one_by_one(merged: list[int]) -> None:
    assert gr.check(hidden=16, batch=8) < 1e-12  # on vs off, direct, cells, and the mean of one by one
    assert max(merged) == 8  # all eight examples' graphs ran as one

    routes: list[list[int]] = []
    entry.gradients_sync(gr.Router(16).loss(*gr.digits(8, 1, np.float64), routes))
    assert all(len(r) == gr.LAYERS for r in routes)
    for counts in gr.histogram(routes):
        assert sum(c > 0 for c in counts) >= 2  # no layer sends every example to one expert


def test_float32_agrees_with_batching_off() -> None:
    router = gr.Router(32, seed=2, dtype=np.float32)
    x, labels = gr.digits(8, 5)
    results = []
    for batching in (False, None):
        with ml.settings(batching=batching):
            value, grads = entry.gradients_sync(router.loss(x, labels))
        results.append((float(value), [grads.get(w) for w in router.weights()]))
    assert gr.difference(results[1], results[0]) <= 1e-5


def test_the_model_by_hand_has_monadls_loss_and_gradients() -> None:
    """The limit (the routing batched by hand in NumPy) computes the batch's
    loss and gradients, its choices included, in float64 and float32; its
    plain one-example form computes a batch of one's."""
    assert by_hand.check(gr.Router(16, seed=1), *gr.digits(8, 4, np.float64)) < 1e-12
    assert by_hand.check(gr.Router(16, seed=1, dtype=np.float32), *gr.digits(8, 4)) < 1e-5
    model = by_hand.Model(by_hand.weights_of(gr.Router(16, seed=1)))
    x, labels = gr.digits(3, 4, np.float64)
    for i in range(3):
        one, one_grads = model.example(x[i], int(labels[i]))
        batch_of_one, grads = model.loss_and_gradients(x[i : i + 1], labels[i : i + 1])
        assert one == pytest.approx(batch_of_one, rel=1e-12)
        assert one_grads.keys() == grads.keys()
        for k, g in grads.items():
            np.testing.assert_allclose(one_grads[k], g, rtol=1e-10, atol=1e-14)


def test_the_model_by_hand_steps_like_monadl() -> None:
    """Its Adam takes monadl's steps, an expert that no example chose left as it is."""
    router = gr.Router(16, seed=1, learning_rate=0.05)
    model = by_hand.Model(by_hand.weights_of(router), learning_rate=0.05)
    before = by_hand.weights_of(router)
    for k in range(3):
        x, labels = gr.digits(3, 100 + k, np.float64)  # three examples a batch: some experts idle
        anyio.run(router.loss(x, labels).train)
        model.train(x, labels)
    after = by_hand.weights_of(router)
    assert any(np.array_equal(after[k], before[k]) for k in after if k.startswith("expert"))
    for name, weight in after.items():
        np.testing.assert_allclose(model.w[name], weight, rtol=1e-9, atol=1e-12)
