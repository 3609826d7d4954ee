"""The Tree-LSTM as Fold blocks (OneOf + ForwardDeclaration) against the
example's natural recursion: the same loss, gradients and step from the same
weights, with the runtime's dynamic batching on and off, and on deep trees."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from examples import tree_lstm as tl
from examples.tree_lstm_fold import FoldTreeLSTM

Model = tl.TreeLSTM | FoldTreeLSTM


def loss_and_gradients(model: Model, trees: list[tl.Tree]) -> tuple[float, dict[str, ml.Array]]:
    async def run() -> tuple[float, dict[str, ml.Array]]:
        loss = model.loss(trees)
        grads = await ml.gradients(loss, list(model.w.values()))
        return float(await loss.predict()), dict(zip(model.w, grads))

    return anyio.run(run)


def relative(a: ml.Array, b: ml.Array) -> float:
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-300))


@pytest.mark.parametrize("batching", [False, True])
def test_blocks_give_the_natural_recursions_loss_gradients_and_step(batching: bool) -> None:
    weights = tl.init_weights(6, seed=2, dtype=np.float64)
    trees = [*tl.make_trees(12, 1, 9, seed=7), tl.random_tree(np.random.default_rng(1), 16, balanced=True)]
    natural, blocks = tl.TreeLSTM(weights), FoldTreeLSTM(weights)
    with ml.settings(batching=batching):
        loss_n, grads_n = loss_and_gradients(natural, trees)
        loss_b, grads_b = loss_and_gradients(blocks, trees)
        assert abs(loss_b - loss_n) <= 1e-12 * abs(loss_n)
        assert grads_b.keys() == grads_n.keys()
        for name, g in grads_n.items():
            assert np.any(g != 0.0), name  # every weight is reached
            assert relative(grads_b[name], g) <= 1e-12, name
        anyio.run(natural.loss(trees).train)
        anyio.run(blocks.loss(trees).train)
    for name, w in natural.weights().items():
        assert not np.array_equal(w, weights[name])  # one Adam step moved it...
        assert relative(blocks.weights()[name], w) <= 1e-12, name  # ...the same way in both


def test_a_tree_deeper_than_pythons_stack_encodes_as_the_natural_recursion() -> None:
    # A left comb: ((((d0 op d1) op d2) op d3) ...), depth 2,500.
    leaves = 2_500
    rng = np.random.default_rng(3)
    symbol = list(rng.integers(0, tl.DIGITS, leaves)) + list(rng.integers(0, len(tl.OPERATORS), leaves - 1))
    left, right = [-1] * leaves, [-1] * leaves
    previous = 0
    for k in range(1, leaves):
        left.append(previous)
        right.append(k)
        previous = len(left) - 1
    tree = tl.Tree(np.array(symbol), np.array(left), np.array(right), 0)
    weights: dict[str, Any] = tl.init_weights(2, seed=1, dtype=np.float64)
    natural = anyio.run(tl.TreeLSTM(weights).logits([tree]).predict)
    blocks = anyio.run(FoldTreeLSTM(weights).logits([tree]).predict)
    np.testing.assert_allclose(blocks, natural, rtol=1e-12)


def test_the_block_graph_is_an_ordinary_graph_that_batching_groups() -> None:
    from monadl.runtime.evaluation import Evaluation, Record
    from monadl.runtime.node import collect
    from monadl.runtime.schedule import batched

    model = FoldTreeLSTM(tl.init_weights(4, dtype=np.float64))
    ev = Evaluation(train=True)
    order = collect(ev, [model.loss(tl.make_trees(8, 4, 6, seed=0))])
    with ml.settings(batching=True):
        assert batched.worth_batching(ev, order)
        assert batched.forward(ev, order) == []  # every node ran, in groups or alone
    groups = [key for key in ev.records if type(key) is Record]  # the stack and group records batching added
    cells = [g for g in groups if g.node._op.name != "output"]  # (the roots' views of h group too: 4 here)
    assert 10 < len(cells) < len(order) // 4
