"""The Tree-LSTM benchmark's implementations agree before anything is timed.

PyTorch is not installed for the tests: its variants then drop out of the
check (their builders return None), and the monadl model is checked against
the NumPy per-node reference alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import _treelstm_torch, treelstm
from examples.tree_lstm import init_weights, random_tree


@pytest.mark.parametrize("balanced", [False, True])
def test_every_available_variant_gives_the_same_loss_and_gradients(balanced: bool) -> None:
    worst = treelstm.check_equivalence(hidden=4, batch=3, leaves=9, balanced=balanced)
    expected = {"monadl"} | ({"torch per-node", "torch by depth"} if _treelstm_torch.available() else set())
    batched = {"monadl batching", "monadl cell", "monadl loom", "monadl cell off"}  # (loom: one ml.loom() block)
    expected |= batched if treelstm.batching_available() else set()
    expected |= {"monadl fold"}  # the Tree-LSTM as Fold blocks (examples/tree_lstm_fold.py)
    expected |= {"numpy by depth"}  # the limit: by depth in NumPy, the backward by hand
    assert set(worst) == expected
    assert max(worst.values()) < 1e-9


def test_the_check_catches_a_variant_that_computes_something_else() -> None:
    def off_by_a_little(weights: treelstm.Weights) -> treelstm.Variant:
        changed = dict(weights)
        changed["children"] = weights["children"] * (1 + 1e-6)
        return treelstm._monadl(changed)

    with pytest.raises(AssertionError, match="off by a little disagrees"):
        treelstm.check_equivalence(
            4, 2, leaves=5, variants={"monadl": treelstm._monadl, "off by a little": off_by_a_little}
        )


def test_batching_is_a_variant_only_where_the_runtime_has_the_setting() -> None:
    variant = treelstm._monadl_batching(init_weights(4))
    assert (variant is not None) == treelstm.batching_available()


def test_the_by_depth_schedule_puts_children_below_parents() -> None:
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, 16), random_tree(rng, 16, balanced=True), random_tree(rng, 1)]
    plan = _treelstm_torch.schedule(trees)
    nodes = np.concatenate(plan.levels)
    assert sorted(nodes.tolist()) == list(range(sum(len(t.symbol) for t in trees)))
    internal = np.flatnonzero(plan.left >= 0)
    parent = plan.height[internal]
    assert np.all(plan.height[plan.left[internal]] < parent) and np.all(plan.height[plan.right[internal]] < parent)
    assert np.all(np.maximum(plan.height[plan.left[internal]], plan.height[plan.right[internal]]) == parent - 1)
    assert plan.height[plan.roots].tolist() == [int(plan.height[plan.roots[0]]), 4, 0]
    for level in plan.levels:
        assert plan.row[level].tolist() == list(range(len(level)))


def test_the_build_cost_counts_every_layer_of_the_graph() -> None:
    trees = treelstm.make_batches(batch=2, count=1, balanced=False)[0]
    cost = treelstm.build_cost(init_weights(4), trees)
    # A leaf is 10 layers (lookup, 3 slices, 2 sigmoids, 2 tanh, 2 products), an
    # internal node 21, and the head 3 (concatenate, dense with its bias, cross-entropy).
    assert cost.layers == 2 * (128 * 10 + 127 * 21) + 3
    assert 0.0 <= cost.gc_seconds <= cost.seconds and cost.collections >= 0


def test_without_pytorch_only_the_monadl_variants_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_treelstm_torch, "available", lambda: False)
    assert _treelstm_torch.per_node(init_weights(4)) is None and _treelstm_torch.by_depth(init_weights(4)) is None
    assert "torch per-node" not in treelstm.check_equivalence(hidden=4, batch=2, leaves=5)


def test_the_numpy_limit_takes_adams_steps() -> None:
    """The hand-written limit trains (no PyTorch needed): Adam's first step
    moves each weight by ``rate * |g| / (|g| + eps)``, and the loss falls."""
    from benchmarks import _treelstm_numpy

    weights = init_weights(8, dtype=np.float64)
    trees = treelstm.make_batches(batch=4, count=1, balanced=False)[0]
    model = _treelstm_numpy._Model(weights, learning_rate=0.01)
    first, grads = model.loss_and_gradients(trees)
    model.step(grads)
    for k, g in grads.items():
        np.testing.assert_allclose(np.abs(model.w[k] - weights[k]), 0.01 * np.abs(g) / (np.abs(g) + 1e-8), atol=1e-15)
    for _ in range(20):
        model.step(model.loss_and_gradients(trees)[1])
    assert model.loss_and_gradients(trees)[0] < first - 0.1
