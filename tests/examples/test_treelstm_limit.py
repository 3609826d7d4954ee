"""The Tree-LSTM's floor (`benchmarks.treelstm_limit`) measures what it says:
the bare build is the model op for op, and the grouping puts every layer in
one group, below its consumers."""

from __future__ import annotations

import math

import pytest

from benchmarks import treelstm_limit
from benchmarks.treelstm import make_batches
from examples.tree_lstm import TreeLSTM, init_weights
from monadl.layers._layer import Layer


@pytest.mark.parametrize("balanced", [False, True])
def test_the_bare_build_is_the_model_op_for_op(balanced: bool) -> None:
    trees = make_batches(3, 1, balanced)[0]
    model = TreeLSTM(init_weights(4), operation=False)
    cells = treelstm_limit.bare_cells(model.w, model.hidden)
    bare = treelstm_limit.bare_ops(treelstm_limit.bare_loss(cells, model.w, trees))
    layers = treelstm_limit.layer_ops(model.loss(trees))
    assert bare == layers
    assert sum(layers.values()) > 15 * 3 * 255  # about 15.5 layers a tree node, 255 nodes a tree


def test_the_grouping_puts_each_layer_in_one_group_above_its_operands() -> None:
    model = TreeLSTM(init_weights(4), operation=False)
    order = sorted(treelstm_limit.walk(model.loss(make_batches(2, 1, False)[0])), key=lambda layer: layer._serial)
    groups = treelstm_limit.group(order)
    depth = {layer: d for (d, _), members in groups.items() for layer in members}
    assert sorted(map(id, depth)) == sorted(map(id, order))
    assert all(layer._op is op for (_, op), members in groups.items() for layer in members)
    assert all(depth[x] < depth[layer] for layer in order for x in layer._inputs if type(x) is Layer)


@pytest.mark.parametrize("model", ["ops", "cell"])
def test_a_measurement_has_every_part(model: str) -> None:
    parts = treelstm_limit.measure(4, False, 2, 1, treelstm_limit.MODELS[model])
    assert {"monadl", "monadl build", "build", "walk", "group", "free", "numpy", "sched", "torch", "layers"} <= set(
        parts
    )
    assert all(parts[k] > 0 for k in parts if k != "torch") and (parts["torch"] > 0 or math.isnan(parts["torch"]))


def test_the_bare_marked_cells_are_one_node_a_tree_node() -> None:
    trees = make_batches(3, 1, False)[0]
    model = TreeLSTM(init_weights(4))
    ops = treelstm_limit.bare_ops(treelstm_limit.bare_loss(treelstm_limit.bare_marked_cells(), model.w, trees))
    leaves = sum(int((t.left < 0).sum()) for t in trees)
    assert ops == {
        "leaf cell": leaves,
        "internal cell": 3 * 255 - leaves,
        "concatenate": 1,
        "dense": 1,
        "cross_entropy": 1,
    }
