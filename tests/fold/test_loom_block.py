"""An ``ml.loom()`` block (`monadl.fold._loom_block.loom`): the calls of marked
operations made in it recorded and run by depth as one node, with the
values, gradients, steps and errors of the same calls built as nodes."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from examples.tree_lstm import TreeLSTM, init_weights, make_trees
from monadl.fold import Function, Vector
from monadl.fold._loom import LOOM, SLOT
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import collect


def ops_of(root: ml.Layer[Any, Any]) -> list[str]:
    return [x._op.name for x in collect(Evaluation(train=True), [root])]


def value_and_grads(loss: ml.ScalarLayer, weights: Sequence[ml.ArrayWeight]) -> tuple[float, list[Any]]:
    async def run() -> tuple[float, list[Any]]:
        grads = await ml.gradients(loss, list(weights))
        return float(await loss.predict()), grads

    return anyio.run(run)


def dense(g: Any) -> Any:
    return g.to_dense() if hasattr(g, "to_dense") else g


def rows(*xs: float) -> list[ml.ArrayLayer]:
    return [ml.as_layer(np.array([[x, 2 * x, -x]])) for x in xs]


def chain_cell(seed: int = 0) -> tuple[ml.ArrayWeight, Callable[[ml.ArrayLayer], ml.ArrayLayer]]:
    w = ml.Weight(np.random.default_rng(seed).normal(size=(3, 3)))
    return w, ml.operation(lambda h: ml.tanh(h @ w))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_tree_lstm_in_a_loom_is_one_node_with_the_values_gradients_and_steps_of_its_nodes(dtype: Any) -> None:
    """The natural recursion over a batch of trees, its cells marked: in a
    block, one loom node and a slot per read output; the loss, every
    weight's gradient and one Adam step as without the block."""
    trees = make_trees(8, 2, 9, seed=3)
    models = [TreeLSTM(init_weights(8, seed=1, dtype=dtype), loom=loom) for loom in (False, True)]
    losses = [m.loss(trees) for m in models]
    plain, woven = (ops_of(loss) for loss in losses)
    assert LOOM.name not in plain and woven.count(LOOM.name) == 1 and SLOT.name in woven
    assert woven.count(SLOT.name) == len(trees) and len(woven) < len(trees) + 6  # (a root's h each; the head)
    (v0, g0), (v1, g1) = (value_and_grads(loss, list(m.w.values())) for loss, m in zip(losses, models))
    tolerance = 1e-12 if dtype is np.float64 else 1e-6
    assert v1 == pytest.approx(v0, rel=tolerance)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(dense(b), dense(a), rtol=tolerance, atol=tolerance * 1e-2)
    for loss in losses:
        anyio.run(loss.train)
    for name in models[0].w:
        np.testing.assert_allclose(models[1].w[name].data, models[0].w[name].data, rtol=tolerance, atol=1e-7)


@pytest.mark.parametrize("settings", [{"batching": False}, {"check_finite": True}])
def test_calls_run_one_by_one_with_batching_off_or_checked_alike(settings: dict[str, Any]) -> None:
    w, cell = chain_cell(1)
    with ml.loom():
        ends = [cell(cell(x)) for x in rows(0.1, 0.2, 0.3)]
    loss = ml.sum(ml.concatenate(ends, axis=0))
    expected = sum(
        float(np.sum(np.tanh(np.tanh(np.array([[x, 2 * x, -x]]) @ w.data) @ w.data))) for x in (0.1, 0.2, 0.3)
    )
    with ml.settings(**settings):
        assert anyio.run(loss.predict) == pytest.approx(expected, rel=1e-14)
    assert anyio.run(loss.predict) == pytest.approx(expected, rel=1e-14)


def test_a_nan_a_call_makes_under_check_finite_names_the_operations_line_and_nothing_steps() -> None:
    w = ml.Weight(np.ones((3, 3)))
    cell = ml.operation(lambda x: ml.log(x @ w))  # the cell's line
    with ml.loom():
        outs = [cell(x) for x in rows(1.0, -5.0, 2.0)]
    loss = ml.sum(ml.concatenate(outs, axis=0))
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(loss.train)
    assert "log" in str(info.value) and f"{__file__}:" in str(info.value)
    np.testing.assert_array_equal(w.data, np.ones((3, 3)))


def test_a_graph_run_inside_the_block_that_reads_a_recorded_call_is_refused() -> None:
    _, cell = chain_cell(2)
    with ml.loom():
        h = cell(rows(0.5)[0])
        assert ops_of(h).count(LOOM.name) == 1
        with pytest.raises(ml.OperandError, match=rf"block at {__file__}:\d+ was read while the block was open"):
            anyio.run(h.predict)
    assert anyio.run(h.predict).shape == (1, 3)  # (after it: the block's loom is complete)


def test_an_error_in_the_block_keeps_the_calls_recorded_so_far_runnable() -> None:
    w, cell = chain_cell(3)
    kept: list[ml.ArrayLayer] = []
    with pytest.raises(ZeroDivisionError), ml.loom():
        kept.append(cell(rows(0.5)[0]))
        _ = 1 / 0
    expected = np.tanh(np.array([[0.5, 1.0, -0.5]]) @ w.data)
    np.testing.assert_allclose(anyio.run(kept[0].predict), expected, rtol=1e-14)
    assert anyio.run(cell(rows(0.5)[0]).predict).shape == (1, 3)  # (no block left open)
    assert LOOM.name not in ops_of(cell(rows(0.5)[0]))


def test_calls_of_another_thread_or_after_the_block_build_their_own_nodes() -> None:
    """A worker thread that copied the block's context, and a call made after
    the block (a task it started may go on), build nodes as outside one:
    over the block's slots where they read its calls' outputs."""
    w, cell = chain_cell(4)
    made: list[ml.ArrayLayer] = []
    with ml.loom():
        first = cell(rows(0.3)[0])
        context = contextvars.copy_context()
        worker = threading.Thread(target=lambda: made.append(context.run(cell, first)))
        worker.start()
        worker.join()
    after = cell(first)
    for layer in (made[0], after):
        names = ops_of(layer)
        assert names.count(LOOM.name) == 1 and len([n for n in names if "<lambda>" in n]) == 1
        expected = np.tanh(np.tanh(np.array([[0.3, 0.6, -0.3]]) @ w.data) @ w.data)
        np.testing.assert_allclose(anyio.run(layer.predict), expected, rtol=1e-14)


def test_calls_the_block_cannot_record_build_nodes_and_an_operation_traced_in_it_records_nothing() -> None:
    """A float argument, a weight passed in, a layer built outside the
    block's calls: nodes, as outside a block. An operation called inside
    another's body while that one is traced in the block is a step of its
    trace, not a call of the block's."""
    w, cell = chain_cell(5)
    scaled = ml.operation(lambda h, s: cell(h) * s)  # (``cell`` inside: traced into ``scaled``)
    times = ml.operation(lambda h, v: h @ v)
    with ml.loom():
        x = rows(0.2)[0]
        a = scaled(x, 0.5)  # a float: a node
        b = times(cell(x), w)  # a weight passed in: a node over the slot
        c = cell(ml.tanh(x))  # a layer built otherwise: a node
    loss = ml.sum(a) + ml.sum(b) + ml.sum(c)
    names = ops_of(loss)
    assert names.count(LOOM.name) == 1 and len([n for n in names if "<lambda>" in n]) == 3
    data = np.array([[0.2, 0.4, -0.2]])
    expected = (
        np.sum(np.tanh(data @ w.data) * 0.5)
        + np.sum(np.tanh(data @ w.data) @ w.data)
        + np.sum(np.tanh(np.tanh(data) @ w.data))
    )
    assert anyio.run(loss.predict) == pytest.approx(expected, rel=1e-14)


def test_nested_blocks_and_a_fold_batch_inside_one_give_the_values_of_no_block() -> None:
    w, cell = chain_cell(6)
    block = Vector(3, "float64") >> Function[ml.ArrayLayer, ml.ArrayLayer](cell)

    def build() -> ml.ScalarLayer:
        outer = [cell(x) for x in rows(0.1, 0.4)]
        with ml.loom():
            inner = [cell(h) for h in outer] + [cell(cell(x)) for x in rows(0.7, 0.9)]
        batch = block.batch([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]])
        return ml.sum(ml.concatenate([*outer, *inner, *batch], axis=0))

    plain = build()
    with ml.loom():
        woven = build()
    (v0, g0), (v1, g1) = (value_and_grads(loss, [w]) for loss in (plain, woven))
    assert v1 == pytest.approx(v0, rel=1e-14)
    np.testing.assert_allclose(g1[0], g0[0], rtol=1e-13)
    assert ops_of(woven).count(LOOM.name) == 3  # (outer block, inner block, the Fold batch)


def test_a_weight_only_unread_calls_use_takes_no_step_and_a_block_is_entered_once() -> None:
    w, cell = chain_cell(7)
    v = ml.Weight(np.eye(3), optimizer=ml.optim.adam(0.1))
    other = ml.operation(lambda h: ml.tanh(h @ v))
    block = ml.loom()
    with block:
        read = cell(rows(0.3)[0])
        other(rows(0.6)[0])  # never read
    _, grads = anyio.run(ml.value_and_gradients, ml.sum(read))
    assert list(grads) == [w]
    anyio.run(ml.sum(read).train)
    np.testing.assert_array_equal(v.data, np.eye(3))
    with pytest.raises(RuntimeError, match="entered once"), block:
        pass


def test_keyword_arguments_and_several_outputs_are_recorded() -> None:
    w, _ = chain_cell(8)
    pair = ml.operation(lambda h, *, scale: (ml.tanh(h @ w), ml.sigmoid(h) * scale))
    with ml.loom():
        outs = [pair(pair(x, scale=2)[0], scale=2) for x in rows(0.1, 0.5)]
    loss = ml.sum(ml.concatenate([a + b for a, b in outs], axis=0))
    assert ops_of(loss).count(LOOM.name) == 1
    expected = 0.0
    for x in (0.1, 0.5):
        h = np.tanh(np.array([[x, 2 * x, -x]]) @ w.data)
        expected += float(np.sum(np.tanh(h @ w.data) + 2.0 / (1 + np.exp(-h))))
    assert anyio.run(loss.predict) == pytest.approx(expected, rel=1e-14)


def test_a_calls_error_names_the_line_that_called_it_as_its_node_would() -> None:
    """A call's error names the user's line that made the call, the line in
    the cell and the weight's line: the same text as the call built as a node."""
    w = ml.Weight(np.ones((3, 3)))  # the weight's line
    cell = ml.operation(lambda ids: ml.embedding(w, ids) @ ml.embedding(w, ids))

    def build() -> ml.ScalarLayer:
        outs = [cell(np.zeros(n, np.int64)) for n in (1, 2)]  # the calls' line
        return ml.sum(ml.stack([ml.sum(o) for o in outs]))

    messages = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            loss = build()
        with pytest.raises(ml.ShapeError) as info:
            anyio.run(loss.predict)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    line = build.__code__.co_firstlineno + 1
    assert f"layer built at {__file__}:{line};" in messages[1]


def test_an_output_some_calls_leave_unread_sends_them_no_delta_through_an_infinite_derivative() -> None:
    """A cell of two outputs, the second a sqrt at 0 in one call: read in one
    call, unread in the other, and unread in a call alone. The unread one
    sends no delta (a zero delta times sqrt's infinite derivative would be
    NaN), as the calls built as nodes one by one."""
    grads = []
    for loom in (False, True):
        w = ml.Weight(np.eye(2))
        two = ml.operation(lambda h: (ml.tanh(h @ w), ml.sqrt(h @ w)))  # noqa: B023
        with ml.loom() if loom else contextlib.nullcontext():
            t1, _ = two(ml.as_layer(np.array([[0.0, 1.0]])))  # (its sqrt: 0 at the first entry)
            t2, s2 = two(ml.as_layer(np.array([[1.0, 1.0]])))
            t3, _ = two(two(ml.as_layer(np.array([[0.0, 2.0]])))[0])
        with ml.settings(batching=False if not loom else None):
            _, g = anyio.run(ml.value_and_gradients, ml.sum(t1) + ml.sum(t2 * s2) + ml.sum(t3))
        grads.append(g[w])
    assert np.isfinite(grads[1]).all()
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-14)


def test_constant_rows_of_different_shapes_given_to_one_cell_group_apart() -> None:
    rng = np.random.default_rng(9)
    w = ml.Weight(rng.normal(size=(3, 4)))
    pool = ml.operation(lambda x: ml.tanh(ml.mean(x @ w, axis=0, keepdims=True)))  # (n, 3) -> (1, 4)
    sentences = [rng.normal(size=(n, 3)) for n in (2, 5, 3, 5)]
    losses = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [pool(ml.as_layer(s)) for s in sentences]
        losses.append(value_and_grads(ml.sum(ml.concatenate(outs, axis=0)), [w]))
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-14)
    np.testing.assert_allclose(losses[1][1][0], losses[0][1][0], rtol=1e-13)


def test_the_block_says_at_debug_which_calls_it_built_as_nodes_and_why(caplog: pytest.LogCaptureFixture) -> None:
    _, cell = chain_cell(10)
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.loom():
        a, b = (cell(x) for x in rows(0.1, 0.2))
        cell(ml.concatenate([a[:, :1], b[:, 1:]], axis=1))  # the joining line
        cell(a)
    (said,) = [r.getMessage() for r in caplog.records if "ml.loom() block" in r.getMessage()]
    assert "recorded 3 calls and built 1 as nodes" in said
    assert f"an operand built outside the loom's calls (concatenate at {__file__}:" in said


def test_a_graph_run_inside_an_open_block_records_none_of_its_own_calls() -> None:
    """An ``@ml.direct`` body calls a marked cell while the run reads it:
    inside a block that reads none of the block's calls, it is a node."""
    w, cell = chain_cell(11)

    @ml.direct
    async def plain(h: ml.ArrayLayer) -> ml.ScalarLayer:
        v = await h
        return ml.sum(cell(ml.as_layer(v)))

    x = ml.as_layer(np.ones((1, 3)))
    expected = anyio.run(plain(x).predict)
    with ml.loom():
        kept = cell(x)
        assert anyio.run(plain(x).predict) == expected
    np.testing.assert_allclose(anyio.run(kept.predict), np.tanh(np.ones((1, 3)) @ w.data), rtol=1e-14)


def test_rows_of_two_float_dtypes_given_to_one_cell_are_refused_as_their_nodes_are() -> None:
    w = ml.Weight(np.eye(3))
    cell = ml.operation(lambda x: ml.tanh(x @ w))
    messages = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [cell(ml.as_layer(np.ones((1, 3), dtype))) for dtype in (np.float64, np.float32)]
        with pytest.raises(ml.DTypeError) as info:
            anyio.run(ml.sum(ml.concatenate(outs, axis=0)).predict)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_rows_of_data_given_as_arrays_are_recorded_and_larger_arrays_say_why_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``cell(X[i:i + 1])``: a float row is stacked per group, as
    ``ml.as_layer(row)`` is (before: nothing was recorded, and the block cost
    1.7-3x its nodes); an array of several rows, which every call may share,
    builds its node, and the DEBUG line says what to pass."""
    w, _ = chain_cell(11)
    cell = ml.operation(lambda h: ml.tanh(h @ w))  # (given arrays)
    scaled = ml.operation(lambda h, m: ml.tanh(h @ w) * m)
    xs = np.random.default_rng(0).normal(size=(6, 3))
    losses = []
    for loom in (False, True):
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.loom() if loom else contextlib.nullcontext():
            ends = [cell(cell(xs[i : i + 1])) for i in range(len(xs))]
            masked = scaled(ends[0], np.ones((2, 3)))
        losses.append(ml.sum(ml.concatenate(ends, axis=0)) + ml.sum(masked))
    names = ops_of(losses[1])
    assert names.count(LOOM.name) == 1
    assert len([n for n in names if "<lambda>" in n]) == 1  # (the masked call alone: a node)
    (v0, g0), (v1, g1) = (value_and_grads(loss, [w]) for loss in losses)
    assert v1 == pytest.approx(v0, rel=1e-14)
    np.testing.assert_allclose(g1[0], g0[0], rtol=1e-13)
    (said,) = [r.getMessage() for r in caplog.records if "ml.loom() block" in r.getMessage()]
    assert "recorded 12 calls and built 1 as nodes" in said
    assert "a data argument of shape (2, 3), neither indices nor a row (X[i:i + 1])" in said
    assert "ml.as_layer(x)" in said


def test_calls_a_block_builds_as_nodes_write_no_reasons_while_debug_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reasons are said in words at the block's end, at DEBUG only (each
    call's text made the block cost twice its nodes' build)."""
    from monadl.fold import _loom

    written: list[Any] = []

    def site_text(site: Any) -> str:
        written.append(site)
        return "here"

    monkeypatch.setattr(_loom, "site_text", site_text)
    _, cell = chain_cell(12)
    with ml.loom():
        for x in rows(0.1, 0.2, 0.3):
            cell(ml.tanh(x))  # (an operand built outside the block's calls: a node)
    assert written == []


def test_calls_on_outputs_of_calls_built_as_nodes_are_said_to_be_so(caplog: pytest.LogCaptureFixture) -> None:
    """A call whose operand is an output of a call built as a node (before
    the block here), and the calls that read its outputs in turn: the
    DEBUG line names the node they read and what to do (before: 'a weight
    passed in, or weights not NumPy's', neither true)."""
    _, cell = chain_cell(13)
    two = ml.operation(lambda h: (cell(h), ml.sum(h)))
    before, _ = two(rows(0.1)[0])
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.loom():
        h = before
        for _ in range(3):
            h, _ = two(h)
    (said,) = [r.getMessage() for r in caplog.records if "ml.loom() block" in r.getMessage()]
    assert "recorded 0 calls and built 3 as nodes" in said
    assert "with an output of a call of test_calls_on_outputs_of" in said
    assert "built as a node (at" in said and "made before the block, or not recorded, for its own reason" in said
    assert "weight" not in said and "compute it in a marked cell" not in said


def test_a_calls_data_is_read_when_the_graph_runs_as_a_nodes_is() -> None:
    """A batch buffer refilled after the block, before the graph runs: its
    rows (arrays, or ``ml.as_layer`` of them) are read as refilled, as the
    same calls' nodes read them (a new user's: the first version of rows as
    arrays read them at the block's end)."""
    w, _ = chain_cell(14)
    cell = ml.operation(lambda h, x: ml.tanh(h @ w) + x)
    values = []
    for loom in (False, True):
        for lift in (False, True):
            buf = np.ones((4, 3))
            with ml.loom() if loom else contextlib.nullcontext():
                h: Any = ml.as_layer(np.zeros((1, 3)))
                for i in range(4):
                    h = cell(h, ml.as_layer(buf[i : i + 1]) if lift else buf[i : i + 1])
            buf[:] = 0.0
            values.append(anyio.run(ml.sum(h).predict))
    assert values == [0.0] * 4


def test_blocks_in_examples_evaluated_together_are_said_not_to_batch_across(caplog: pytest.LogCaptureFixture) -> None:
    """A block in each of 8 ``@ml.direct`` examples: each a node, which the
    runtime does not batch with the others' (a new user's 3.7x); the DEBUG
    line says so (before: 'no signature (a plain number or another
    library's array among operands)'), and a second block's call on the
    first's output is said to read another loom's calls (before: 'slot',
    and 'compute it in a marked cell')."""
    w, cell = chain_cell(15)
    xs = np.random.default_rng(0).normal(size=(8, 3))

    @ml.direct
    async def example(i: int) -> ml.ScalarLayer:
        with ml.loom():
            h = cell(cell(ml.as_layer(xs[i : i + 1])))
        await ml.values(ml.sum(h))
        with ml.loom():
            h = cell(h)
        return ml.sum(h)

    async def run() -> float:
        with ml.settings(batching=True):
            return float(await ml.sum(ml.stack([example(i) for i in range(8)])).predict())

    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        got = anyio.run(run)
    expected = sum(float(np.sum(np.tanh(np.tanh(np.tanh(x[None] @ w.data) @ w.data) @ w.data))) for x in xs)
    assert got == pytest.approx(expected, rel=1e-13)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "the nodes of 8 ml.loom() blocks and 8 reads of their calls' outputs: each block runs its own calls, by "
        "depth, not with another block's (a block in each of many examples" in m
        for m in said
    )
    assert not any("with no signature" in m for m in said)
    assert any("1 with an output of another loom's calls (another ml.loom() block's" in m for m in said)


def test_one_blocks_node_is_said_to_run_its_calls_itself(caplog: pytest.LogCaptureFixture) -> None:
    """A graph over one block's outputs whose other nodes have no partner: the
    log said its 21 nodes and reads were "of ml.loom() blocks, whose calls
    batch within their block, not across blocks", with advice for a block in
    each of many examples (a new user's single block, whose calls ran batched)."""
    _, cell = chain_cell(2)
    with ml.loom():
        ends = [cell(cell(ml.as_layer(np.full((1, 3), x)))) for x in np.linspace(0, 1, 20)]
    loss = ml.sum(ml.concatenate(ends, axis=0)) + ml.sum(ml.concatenate(ends[:3], axis=0))
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=True):
        anyio.run(loss.predict)
    (said,) = [r.getMessage() for r in caplog.records if "ml.loom() block" in r.getMessage()]
    assert (
        "; the node of an ml.loom() block (its calls run inside it, by depth) and 20 reads of its calls' outputs"
        in said
    )
    assert "many examples" not in said and "blocks" not in said


def test_an_output_read_by_two_groups_and_at_two_positions_gets_every_delta() -> None:
    """A call's output read by two operations (two groups) and twice by one
    call: each reader's delta adds to the others' (the first written, the
    rest added), as the same calls built as nodes get them."""
    w, cell = chain_cell(4)
    v = ml.Weight(np.random.default_rng(5).normal(size=(3, 3)))
    mix = ml.operation(lambda a, b: ml.tanh(a @ v) * b)

    def loss(loom: bool) -> ml.ScalarLayer:
        with ml.loom() if loom else contextlib.nullcontext():
            hs = [cell(x) for x in rows(0.1, -0.2, 0.3)]
            ends = [mix(h, h) + cell(h) for h in hs]  # (each column's slots distinct: scattered, not add.at)
        return ml.sum(ml.concatenate(ends, axis=0) ** 2)

    (v0, g0), (v1, g1) = (value_and_grads(loss(loom), [w, v]) for loom in (False, True))
    assert v1 == pytest.approx(v0, rel=1e-12)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(dense(b), dense(a), rtol=1e-12, atol=1e-14)


def test_calls_from_equal_functions_in_two_files_keep_their_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code objects of equal text at equal lines compare equal across files:
    a block's calls from two such helpers were all given the first one's
    file (by the block's path, and by a recorder's), in its errors too."""
    for name in ("loom_site_a", "loom_site_b"):
        (tmp_path / f"{name}.py").write_text("def call(op, x):\n    return op(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = (importlib.import_module(name) for name in ("loom_site_a", "loom_site_b"))
    _, cell = chain_cell(6)
    x, y = rows(0.1, 0.2)
    with ml.loom():
        made = [a.call(cell, x), b.call(cell, y), a.call(cell, y), b.call(cell, x)]
    assert [Path(layer._site[0].co_filename).name for layer in made] == [
        "loom_site_a.py",
        "loom_site_b.py",
        "loom_site_a.py",
        "loom_site_b.py",
    ]
