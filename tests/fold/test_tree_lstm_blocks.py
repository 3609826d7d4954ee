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


def test_a_batch_of_trees_is_one_loom_node_whose_schedule_groups_calls_by_depth() -> None:
    """The blocks' calls are recorded, not built as nodes: the batch's graph
    is one loom node (and a slot a root's state reads), whose schedule runs
    per depth one group of leaves' and one of internal nodes' calls."""
    from monadl.fold._loom import LOOM, SLOT
    from monadl.runtime.evaluation import Evaluation
    from monadl.runtime.node import collect

    model = FoldTreeLSTM(tl.init_weights(4, dtype=np.float64))
    trees = tl.make_trees(8, 4, 6, seed=0)
    order = collect(Evaluation(train=True), [model.loss(trees)])
    (loom,) = [x for x in order if x._op is LOOM]
    assert len([x for x in order if x._op is SLOT]) == len(trees)  # (the roots' h)
    assert len(order) < 20  # (and the head: the roots' concatenation, the dense layer, the loss)
    (schedule,) = loom._params
    calls = sum(len(t.symbol) for t in trees)
    assert sum(plan.n for plan in schedule.planned) == calls
    depths = [plan.group.depth for plan in schedule.planned]
    assert depths == sorted(depths)
    assert len(depths) == len({(plan.group.depth, plan.group.trace) for plan in schedule.planned}) < calls // 4
    assert {len(plan.group.trace.weights) for plan in schedule.planned} == {1, 2}  # (leaf: 1 table; internal: 2)
