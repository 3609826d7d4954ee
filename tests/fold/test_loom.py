"""A Fold batch's loom (`monadl.fold._loom`): its `Function` calls recorded
and run as one node, batched by depth, with the values, gradients, steps and
errors of the same calls built as nodes one input at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import AllOf, Block, Function, InputTransform, Map, Reduce, Vector
from monadl.fold._loom import LOOM, SLOT
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import collect

Pair = tuple[ml.ArrayLayer, ml.ArrayLayer]


def ops_of(root: ml.Layer[Any, Any]) -> list[str]:
    return [x._op.name for x in collect(Evaluation(train=True), [root])]


def loss_and_grads(
    loss: Callable[[], ml.ScalarLayer], weights: Sequence[ml.ArrayWeight], batching: bool | None = None
) -> tuple[float, list[Any]]:
    async def run() -> tuple[float, list[Any]]:
        with ml.settings(batching=batching):
            layer = loss()
            grads = await ml.gradients(layer, list(weights))
            return float(await layer.predict()), grads

    return anyio.run(run)


def sequence_model(w: ml.ArrayWeight, v: ml.ArrayWeight) -> Block[list[list[float]], ml.ArrayLayer]:
    """Each item a constant row through a cell, the items summed pairwise (a balanced reduction)."""
    cell = Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.tanh(x @ w))
    join = Function[Pair, ml.ArrayLayer](lambda ab: ml.sigmoid((ab[0] + ab[1]) @ v))
    return Map(Vector(3, "float64") >> cell) >> Reduce(join)


def weights(seed: int = 0) -> tuple[ml.ArrayWeight, ml.ArrayWeight]:
    rng = np.random.default_rng(seed)
    return ml.Weight(rng.normal(size=(3, 3))), ml.Weight(rng.normal(size=(3, 3)))


SEQUENCES = [[[0.1, 0.2, 0.3]] * n for n in (1, 2, 3, 5, 8)] + [[[0.5, -0.1, 0.2], [1.0, 0.0, -1.0]]]


def test_a_batch_builds_one_loom_node_whose_calls_equal_the_inputs_built_one_at_a_time() -> None:
    w, v = weights()
    model = sequence_model(w, v)

    def batched() -> ml.ScalarLayer:
        return ml.sum(ml.concatenate(model.batch(SEQUENCES), axis=0))

    def one_at_a_time() -> ml.ScalarLayer:  # (a call's one input: nodes built as they are, no loom)
        return ml.sum(ml.concatenate([model(s) for s in SEQUENCES], axis=0))

    names = ops_of(batched())
    assert names.count(LOOM.name) == 1 and names.count(SLOT.name) == len(SEQUENCES)
    assert LOOM.name not in ops_of(one_at_a_time())
    loss_1, grads_1 = loss_and_grads(one_at_a_time, [w, v], batching=False)
    for batching in (None, True, False):  # (batched by depth; False: the loom's calls one by one)
        loss_b, grads_b = loss_and_grads(batched, [w, v], batching)
        assert loss_b == pytest.approx(loss_1, rel=1e-14)
        for g_b, g_1 in zip(grads_b, grads_1):
            np.testing.assert_allclose(g_b, g_1, rtol=1e-13, atol=1e-15)


def test_the_same_batch_graph_predicts_then_trains() -> None:
    w, v = weights(1)
    loss = ml.sum(ml.concatenate(sequence_model(w, v).batch(SEQUENCES), axis=0))
    before = w.data.copy()
    first = anyio.run(loss.predict)
    anyio.run(loss.train)
    assert first == anyio.run(ml.sum(ml.concatenate([sequence_model(*weights(1))(s) for s in SEQUENCES])).predict)
    assert not np.array_equal(w.data, before)


def test_a_weight_that_only_unread_calls_use_takes_no_step() -> None:
    """As a member that got no delta sends none: a call whose outputs the loss
    never reads leaves its weight unreached (no step, not even Adam's)."""
    w, v = (ml.Weight(np.eye(3), optimizer=ml.optim.adam(0.1)) for _ in range(2))
    both = Vector(3, "float64") >> AllOf(
        Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.tanh(x @ w)),
        Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.tanh(x @ v)),
    )
    outs = both.batch([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]])
    loss = ml.sum(ml.concatenate([first for first, _ in outs], axis=0))
    _, grads = anyio.run(ml.value_and_gradients, loss)
    assert list(grads) == [w] and np.any(grads[w] != 0.0)  # (v: unreached, as one input at a time)
    _, alone = anyio.run(ml.value_and_gradients, ml.sum(ml.concatenate([both(x)[0] for x in ([0.1, 0.2, 0.3],)])))
    assert list(alone) == [w]
    anyio.run(loss.train)
    assert not np.array_equal(w.data, np.eye(3))
    np.testing.assert_array_equal(v.data, np.eye(3))


def test_calls_the_loom_cannot_record_build_nodes_as_outside_a_batch() -> None:
    """A float among a call's leaves (data the loom does not stack) makes that
    call a node; calls over its outputs are nodes too, over its views."""
    w, _ = weights(2)
    scaled = Function[tuple[ml.ArrayLayer, float], ml.ArrayLayer](lambda xs: ml.tanh(xs[0] @ w) * xs[1])
    block = (
        Vector(3, "float64")
        >> InputTransform[ml.ArrayLayer, tuple[ml.ArrayLayer, float]](lambda x: (x, 0.5))
        >> scaled
        >> Function[ml.ArrayLayer, ml.ArrayLayer](lambda h: h @ w)
    )
    xs = [[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]]
    loss = ml.sum(ml.concatenate(block.batch(xs), axis=0))
    names = ops_of(loss)
    assert SLOT.name not in names and len([n for n in names if "<lambda>" in n]) == 4
    expected = sum(np.sum(np.tanh(np.array([x]) @ w.data) * 0.5 @ w.data) for x in xs)
    assert anyio.run(loss.predict) == pytest.approx(expected, rel=1e-14)


def test_shapes_that_differ_within_an_arena_run_batched_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    """Lookups of 2 and of 3 ids are two traces, whose outputs one consumer
    reads: the rows of the second shape are held apart from the arena's
    first, and the consumer's group runs as one batched call per shape (said
    at DEBUG; before, every call of the loom ran one by one), with the same
    values and gradients as the inputs built one at a time."""
    table = ml.Weight(np.random.default_rng(3).normal(size=(10, 4)))
    block = (
        InputTransform[list[int], ml.Array](np.asarray)
        >> Function[ml.Array, ml.ArrayLayer](lambda ids: ml.embedding(table, ids))
        >> Function[ml.ArrayLayer, ml.ArrayLayer](lambda e: ml.tanh(ml.sum(e, axis=0, keepdims=True)))
    )
    ids = [[1, 2], [3, 4, 5], [6, 7], [8, 9, 0]]

    def batched() -> ml.ScalarLayer:
        return ml.sum(ml.concatenate(block.batch(ids), axis=0))

    def one_at_a_time() -> ml.ScalarLayer:
        return ml.sum(ml.concatenate([block(i) for i in ids], axis=0))

    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        loss_b, (g_b,) = loss_and_grads(batched, [table])
    said = [r.getMessage() for r in caplog.records]
    assert any("holds outputs of 1 more shapes apart" in m and "ran 1 groups as 2 batched calls" in m for m in said)
    assert not any("one by one" in m for m in said)
    loss_1, (g_1,) = loss_and_grads(one_at_a_time, [table], batching=False)
    assert loss_b == pytest.approx(loss_1, rel=1e-14)
    np.testing.assert_allclose(g_b, g_1, rtol=1e-13)


def test_a_nan_a_cell_makes_under_check_finite_names_its_line_and_the_batchs_input() -> None:
    w = ml.Weight(np.ones((3, 3)))
    block = Vector(3, "float64") >> Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.log(x @ w))  # the cell
    outs = block.batch([[1.0, 1.0, 1.0], [1.0, -5.0, 1.0], [2.0, 2.0, 2.0]])  # the batch
    loss = ml.sum(ml.concatenate(outs, axis=0))
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(loss.train)
    message = str(info.value)
    assert "log" in message and f"{__file__}:" in message
    assert message.endswith("built input 1 (from 0) of 3") or "built input 1 (from 0) of 3" in message
    np.testing.assert_array_equal(w.data, np.ones((3, 3)))  # nothing changed


def test_a_split_of_a_calls_output_sends_its_parts_deltas_back() -> None:
    """A call's output read by a split (whose parts get their deltas apart,
    some squared, some summed): the same gradients as one input at a time."""
    w, v = weights(4)
    model = sequence_model(w, v)

    def loss(outs: list[ml.ArrayLayer]) -> ml.ScalarLayer:
        parts = [ml.split(o, [1, 2], axis=1) for o in outs]
        return ml.sum(ml.stack([ml.sum(a * a) + ml.sum(b) for a, b in parts]))

    batched, (g_w, g_v) = loss_and_grads(lambda: loss(model.batch(SEQUENCES)), [w, v])
    alone, (a_w, a_v) = loss_and_grads(lambda: loss([model(s) for s in SEQUENCES]), [w, v], batching=False)
    assert batched == pytest.approx(alone, rel=1e-14)
    np.testing.assert_allclose(g_w, a_w, rtol=1e-13)
    np.testing.assert_allclose(g_v, a_v, rtol=1e-13)


def test_one_output_read_by_two_calls_at_one_position_sums_both_deltas() -> None:
    """Two calls of one cell read the same output at the same position (a
    group whose rows repeat: its deltas are scattered with ``add.at``), and
    calls whose index data are stacked per group: the same loss and
    gradients as one input at a time."""
    w, v = weights(6)
    cell = Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.tanh(x @ w))
    join = Function[Pair, ml.ArrayLayer](lambda ab: ml.sigmoid(ab[0] * ab[1] @ v))
    pick = Function[tuple[ml.ArrayLayer, ml.Array], ml.ArrayLayer](lambda s: s[0] * ml.embedding(v, s[1]))
    shared = Vector(3, "float64") >> cell >> AllOf(cell, cell) >> join
    model = AllOf(shared, InputTransform(lambda xs: np.array([int(xs[0] * 2)]))) >> pick
    inputs = [[0.1, 0.2, -0.3], [0.5, -0.1, 0.2], [1.0, 0.0, -1.0]]

    def loss(outs: list[ml.ArrayLayer]) -> ml.ScalarLayer:
        return ml.sum(ml.concatenate(outs, axis=1) ** 2)

    batched, grads_b = loss_and_grads(lambda: loss(model.batch(inputs)), [w, v])
    alone, grads_1 = loss_and_grads(lambda: loss([model(x) for x in inputs]), [w, v], batching=False)
    assert batched == pytest.approx(alone, rel=1e-14)
    for g_b, g_1 in zip(grads_b, grads_1):
        np.testing.assert_allclose(g_b, g_1, rtol=1e-13)


def test_an_unread_members_infinite_derivative_does_not_make_the_gradient_nan() -> None:
    """sqrt at 0 in an input the loss never reads: its zero delta times an
    infinite derivative is NaN in a group's backward, so the members that
    got a delta run again as a group of their own, as they would send alone."""
    w = ml.Weight(np.ones((3, 3)))
    block = Vector(3, "float64") >> Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.sqrt(x @ w))
    xs = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.5, 1.0]]
    _, (g_b,) = loss_and_grads(lambda: ml.sum(block.batch(xs)[0]) + ml.sum(block.batch(xs)[2]), [w])
    _, (g_1,) = loss_and_grads(lambda: ml.sum(block(xs[0])) + ml.sum(block(xs[2])), [w], batching=False)
    assert np.all(np.isfinite(g_b))
    np.testing.assert_allclose(g_b, g_1, rtol=1e-14)
    anyio.run(ml.sum(block.batch(xs)[0]).train)  # (trains: no step refused for a NaN)
    assert np.all(np.isfinite(w.data)) and not np.array_equal(w.data, np.ones((3, 3)))


def test_a_batch_of_one_input_builds_its_nodes_as_a_call_does() -> None:
    """One input's calls group only within it (a sequence's steps: a group
    each), which the runtime's own cost rule runs better: no loom."""
    w, v = weights(5)
    one = ml.sum(ml.concatenate(sequence_model(w, v).batch([SEQUENCES[3]]), axis=0))
    names = ops_of(one)
    assert LOOM.name not in names and SLOT.name not in names


def test_a_batch_leaves_no_reference_cycle() -> None:
    """The loom node holds its schedule, which holds none of the loom: a
    batch's graph is freed when its last layer goes, without a collection."""
    import gc
    import weakref

    w, v = weights(6)
    outs = sequence_model(w, v).batch(SEQUENCES)
    (loom,) = [x for x in collect(Evaluation(train=True), [outs[0]]) if x._op is LOOM]
    node = weakref.ref(loom)
    gc.disable()
    try:
        del outs, loom
        assert node() is None
    finally:
        gc.enable()


def test_a_calls_shape_error_keeps_numpys_error_as_its_cause_and_names_the_weights_line() -> None:
    w = ml.Weight(np.ones((3, 3)))  # the weight's line
    block = InputTransform[int, ml.Array](lambda n: np.zeros(n, np.int64)) >> Function[ml.Array, ml.ArrayLayer](
        lambda ids: ml.embedding(w, ids) @ ml.embedding(w, ids)
    )
    outs = block.batch([1, 2])
    with pytest.raises(ml.ShapeError) as info:
        anyio.run(ml.sum(ml.stack([ml.sum(o) for o in outs])).predict)
    assert isinstance(info.value.__cause__, ValueError)
    assert f"the weight float64[3, 3] built at {__file__}:" in str(info.value)
