"""Dynamic batching: the same values, gradients and errors as node by node."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import anyio
import numpy as np
import numpy.typing as npt
import pytest

import monadl as ml
from monadl.deltas import Outer, SparseRows, unbroadcast
from monadl.layers._batching_rules import BATCHING_RULES
from monadl.layers._operands import number_dtype
from monadl.layers._primitives import PRIMITIVES
from monadl.layers._split import SplitDelta
from monadl.runtime import entry
from monadl.runtime.evaluation import Evaluation, Record
from monadl.runtime.node import collect
from monadl.runtime.schedule import batched as _batching
from monadl.runtime.schedule import batched_marked, batched_rule, batched_run, batched_weights

HERE = __file__
Tree: TypeAlias = "int | tuple[Tree, Tree]"


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


# ---- a small Tree-LSTM ------------------------------------------------------------------
def random_tree(rng: np.random.Generator, leaves: int) -> Tree:
    if leaves == 1:
        return int(rng.integers(10))
    left = int(rng.integers(1, leaves))
    return (random_tree(rng, left), random_tree(rng, leaves - left))


class TreeLSTM:
    def __init__(self, hidden: int, dtype: type[np.floating[Any]], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.hidden = hidden
        self.w = ml.Weight((rng.standard_normal((2 * hidden, 5 * hidden)) * 0.3).astype(dtype))
        self.b = ml.Weight(np.zeros(5 * hidden, dtype))
        self.table = ml.Weight((rng.standard_normal((10, hidden)) * 0.5).astype(dtype))

    def cell(self, tree: Tree) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        h = self.hidden
        if isinstance(tree, int):
            leaf: ml.ArrayLayer = ml.tanh(ml.embedding(self.table, np.array([tree]))[0])
            return leaf, leaf * 0.5
        (hl, cl), (hr, cr) = self.cell(tree[0]), self.cell(tree[1])
        gates = ml.concatenate([hl, hr]) @ self.w + self.b
        i, fl, fr, o = (ml.sigmoid(gates[k * h : (k + 1) * h]) for k in range(4))
        c = i * ml.tanh(gates[4 * h :]) + fl * cl + fr * cr
        return o * ml.tanh(c), c

    def loss(self, trees: list[Tree]) -> ml.ScalarLayer:
        return ml.sum(ml.stack([ml.sum(self.cell(t)[0] * self.cell(t)[1]) for t in trees]))


def evaluate(model: TreeLSTM, trees: list[Tree], batching: bool) -> tuple[Any, Any]:
    with ml.settings(batching=batching):
        return entry.gradients_sync(model.loss(trees))


def dense(x: Any) -> npt.NDArray[Any]:
    return np.asarray(x.to_dense() if isinstance(x, SparseRows) else x)


def assert_same_gradients(got: dict[Any, Any], want: dict[Any, Any], rtol: float) -> None:
    assert list(got) == list(want)  # the same weights, in the same order
    for w in want:
        assert type(got[w]) is type(want[w])
        a, b = dense(got[w]), dense(want[w])
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.max(np.abs(a - b)) <= rtol * max(np.max(np.abs(b)), 1e-30)


@pytest.mark.parametrize("strategy", ["depth", "agenda"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_lstm_batched_equals_unbatched_float64(seed: int, strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_batching, "STRATEGY", strategy)
    rng = np.random.default_rng(seed)
    model = TreeLSTM(6, np.float64, seed)
    trees = [random_tree(rng, int(rng.integers(1, 12))) for _ in range(5)]
    want_value, want = evaluate(model, trees, batching=False)
    got_value, got = evaluate(model, trees, batching=True)
    assert got_value == pytest.approx(want_value, rel=1e-12)
    assert_same_gradients(got, want, 1e-12)


def test_tree_lstm_float32_within_1e_6() -> None:
    rng = np.random.default_rng(7)
    model = TreeLSTM(16, np.float32)
    trees = [random_tree(rng, 16) for _ in range(8)]
    want_value, want = evaluate(model, trees, batching=False)
    got_value, got = evaluate(model, trees, batching=True)
    assert type(got_value) is type(want_value) is np.float32
    assert abs(got_value - want_value) <= 1e-6 * abs(want_value)
    assert_same_gradients(got, want, 1e-6)


def test_groups_really_run_batched() -> None:
    model = TreeLSTM(4, np.float64)
    trees: list[Tree] = [((1, 2), (3, 4))] * 4
    ev = Evaluation(train=True)
    order = collect(ev, [model.loss(trees)])
    with ml.settings(batching=None):
        assert _batching.worth_batching(ev, order)
        assert _batching.forward(ev, order) == []
    added = [key for key in ev.records if type(key) is Record]  # stack, gather and group records
    assert 10 < len(added) < len(order) // 4  # 8 trees' cells (the loss builds each twice) in a few groups
    assert all(ev.records.computed(node) for node in order)
    # Members read only by index (gathers) have no records: only the ones read otherwise, and the 3 weights.
    lazy = [node for node in order if node not in ev.records]
    assert len(ev.records) - len(added) - 3 < len(order) // 2 < len(lazy)
    group, row, _ = ev.records.places[lazy[0]]
    rec = ev.records[lazy[0]]  # read: its record is made, a view of its row, holding its group
    assert rec.inputs == (group,) and np.shares_memory(rec.value, group.value)
    np.testing.assert_array_equal(rec.value, group.value[row])


def test_training_steps_each_weight_once_and_matches() -> None:
    import anyio

    rng = np.random.default_rng(3)
    trees = [random_tree(rng, 8) for _ in range(4)]
    models = [TreeLSTM(5, np.float64, seed=1) for _ in range(2)]

    async def train(model: TreeLSTM, batching: bool) -> list[float]:
        with ml.settings(batching=batching):
            return [float(await model.loss(trees).train()) for _ in range(3)]

    losses = [anyio.run(train, m, b) for m, b in zip(models, (False, True))]
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    assert losses[0][2] != losses[0][0]  # the weights moved
    for a, b in zip((models[0].w, models[0].b, models[0].table), (models[1].w, models[1].b, models[1].table)):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-12)


def test_chain_is_left_alone_cheaply() -> None:
    x = ml.Weight(np.ones(4))
    y: ml.ArrayLayer = x * 1.0
    for i in range(100):
        y = ml.tanh(y) if i % 2 else y + 0.5
    ev = Evaluation(train=True)
    with ml.settings(batching=None):
        assert not _batching.worth_batching(ev, collect(ev, [ml.sum(y)]))


@pytest.mark.parametrize(("batching", "extra"), [(None, 0), (True, 2)])
def test_small_groups_run_batched_only_when_forced(batching: bool | None, extra: int) -> None:
    """``extra``: a stack and a group record if batched, whose 2 members get records when read."""
    w = ml.Weight(np.ones(302))
    products = [w[i : i + 3] for i in range(300)]  # 300 signatures: all different slices
    nodes = [ml.tanh(products[0]), ml.tanh(products[1]), *products]  # one group of 2
    ev = Evaluation(train=False)
    order = collect(ev, nodes)
    with ml.settings(batching=batching):
        assert _batching.worth_batching(ev, order)
        _batching.forward(ev, order)
    assert (
        len(ev.records) == 303
    )  # the weight and 302 nodes; batched: 300 nodes, a stack and a group (its members: none yet)
    assert all(ev.records.computed(node) for node in nodes)
    assert (nodes[1] in ev.records) is (not extra)
    assert np.array_equal(ev.records[nodes[1]].value, np.tanh(np.ones(3)))


def test_numbers_that_differ_per_node_are_one_column_of_the_operands_dtype() -> None:
    w = ml.Weight(np.linspace(-1, 1, 3, dtype=np.float32))
    products = [w * i for i in range(40)]  # ints: one signature, their column float32
    assert len({_batching.signature({}, x) for x in products}) == 1
    assert _batching.signature({}, w[0:2]) != _batching.signature({}, w[1:3])  # parameters stay in it
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(x)) for x in products]))
    with ml.settings(batching=False):
        want, (want_grad,) = anyio.run(loss.predict), anyio.run(ml.gradients, loss, [w])
    with ml.settings(batching=True):
        got, (grad,) = anyio.run(loss.predict), anyio.run(ml.gradients, loss, [w])
    assert abs(got - want) <= 1e-6 * abs(want) and grad.dtype == np.float32
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)
    # The column takes the dtype each number computes in beside the node's other operands.
    f32, f64, i64 = np.dtype("float32"), np.dtype("float64"), np.dtype("int64")
    assert number_dtype([(f32, True)], [int]) == f32 and number_dtype([(i64, True)], [float]) == f64
    assert number_dtype([(i64, True), (f64, False)], [float]) == f64  # a 0-d float sets it for integers
    assert number_dtype([(f32, True), (f64, True)], [float]) is None  # one node raises: members group by value


def test_numbers_of_a_primitive_that_is_not_elementwise_are_never_stacked() -> None:
    # stack keeps a Python 0.0 beside a float32 0-d array in float32 (as a binary operation), one
    # node alone; zeros that are other objects once made one column of the group, losing -0.0's sign.
    x = ml.Weight(np.array(1.0, np.float32))
    stacks = [ml.stack([x * 1.0, float("0.0" if i % 2 else "-0.0")]) for i in range(20)]
    loss = ml.stack(stacks)
    values = []
    for batching in (False, True):
        with ml.settings(batching=batching):
            values.append(anyio.run(loss.predict))
    assert values[0].dtype == values[1].dtype == np.float32
    assert np.array_equal(np.signbit(values[0]), np.signbit(values[1]))


def test_a_number_no_column_holds_fails_as_its_node_alone() -> None:
    w = ml.Weight(np.ones(3, np.float32))
    loss = ml.sum(ml.stack([ml.sum(w * n) for n in (2, 3, 10**400, 5)]))  # (an int beyond any dtype)
    notes = []
    for batching in (False, True):
        with ml.settings(batching=batching), pytest.raises(OverflowError) as info:
            anyio.run(loss.predict)
        notes.append(info.value.__notes__)
    assert notes[0] == notes[1] and "layer built at" in notes[0][0]
    ints = [ml.as_layer(np.arange(4) + i) + i % 3 for i in range(40)]  # integer layers, integer numbers: int64
    with ml.settings(batching=True):
        got = anyio.run(ml.stack(ints).predict)
    assert got.dtype == np.int64 and np.array_equal(got, [np.arange(4) + i + i % 3 for i in range(40)])


def test_the_log_says_what_a_batched_run_grouped(caplog: pytest.LogCaptureFixture) -> None:
    """Examples of different lengths never group (a group's members have one
    shape): forced batching then ran them one by one, and the log was silent."""
    w = ml.Weight(np.ones((3, 3)))
    same = ml.sum(ml.stack([ml.sum(ml.tanh(np.ones((2, 3)) @ w)) for _ in range(8)]))
    lengths = ml.sum(ml.stack([ml.sum(ml.tanh(np.ones((n, 3)) @ w)) for n in range(1, 9)]))
    for loss, grouped in ((same, True), (lengths, False)):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=True):
            anyio.run(loss.predict)
        (line,) = [r.getMessage() for r in caplog.records if "ran " in r.getMessage()]
        if grouped:
            assert "ran batched: 24 nodes in 3 groups" in line, line
        else:  # (it said "ran batched: 0 nodes in 0 groups": a new user read a contradiction)
            assert "went through batching, and no two of its nodes were alike: all ran one by one" in line, line


def test_a_group_that_runs_one_by_one_says_why_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones((1, 1, 2, 2)))

    def pooled(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.max_pool2d(w * x, 1)  # (max_pool2d has no batching rule)

    cell = ml.operation(pooled)
    for f in (pooled, cell):
        loss = ml.sum(ml.stack([ml.sum(f(np.full((1, 1, 2, 2), float(i)))) for i in range(5)]))
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=True):
            anyio.run(loss.predict)
        (message,) = [r.getMessage() for r in caplog.records if "max_pool2d" in r.getMessage()]
        assert "5 nodes of" in message and "ran one by one" in message and "no batching rule" in message
        assert f"test_batched.py:{pooled.__code__.co_firstlineno + 1}" in message  # the cell's line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="monadl.batching"), ml.settings(batching=True):
        anyio.run(loss.predict)
    assert not caplog.records  # (only at DEBUG)


def test_the_log_says_what_else_runs_unbatched(caplog: pytest.LogCaptureFixture) -> None:
    # A new user's checks found the log silent where batching did nothing: a graph the
    # cost rule left alone, splits outside a cell, and calls of an operation that differ
    # by an int (a trace, and groups, per value).
    table = ml.Weight(np.linspace(-1, 1, 80).reshape(20, 4))
    cell = ml.operation(lambda token, h: ml.tanh(table[token] + h))

    def messages(loss: ml.ScalarLayer) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
            anyio.run(loss.predict)
        return [r.getMessage() for r in caplog.records]

    h: Any = np.zeros(4)
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        for token in range(9):
            h = cell(token, h)  # (traced at the call)
    (many,) = [r.getMessage() for r in caplog.records]
    assert "<lambda> has 8 traces" in many and "never batch together" in many
    (small,) = messages(ml.sum(h))
    assert "a graph of 10 nodes" in small and "fewer than 256 nodes" in small
    z = ml.as_layer(np.ones((1, 10)))
    parts = [ml.split(z * float(i), 2, axis=1) for i in range(300)]
    said = messages(ml.sum(ml.stack([ml.sum(a * b) for a, b in parts])))
    assert any("300 nodes of split built at" in m and "slices batch" in m for m in said)
    # A graph whose analysis batched nothing (branches of different shapes) was silent at its
    # first evaluation and then called 'a chain' (a new user's 150 independent branches).
    ws = [ml.Weight(np.ones(k + 1)) for k in range(150)]
    for turn in range(3):  # (analysed at the next evaluation again, then after two: `remember`)
        said = [m for m in messages(ml.sum(ml.stack([ml.sum(w * 2.0) for w in ws]))) if "runs unbatched" in m]
        assert len(said) == 1 and "its analysis batched nothing" in said[0] and "chain" not in said[0]
        assert ("as when it was last judged" in said[0]) == (turn == 2)


def test_the_outputs_of_a_marked_cell_read_outside_cells_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cell returning (h, a token's loss), the loss summed outside: each view of a loss
    # ran alone (690 a step of a user's language model, about a tenth of its time).
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(4, 4)) / 2)
    v = ml.Weight(rng.normal(size=(4, 3)))
    target = np.array([[0.0, 1.0, 0.0]])

    @ml.operation
    def cell(x: ml.ArrayOperand, h: ml.ArrayOperand) -> tuple[ml.ArrayLayer, ml.ScalarLayer]:
        h = ml.tanh(x @ w + h)
        return h, ml.sum(ml.log_softmax(h @ v) * target)

    inputs = [np.random.default_rng(s).normal(size=(8, 4)) for s in range(12)]

    def loss() -> ml.ScalarLayer:
        terms: list[ml.ScalarLayer] = []
        for s, xs in enumerate(inputs):
            h: Any = np.zeros((1, 4))
            for t in range(s % 5 + 3):
                h, token = cell(xs[t : t + 1], h)
                terms.append(token * float(t + 1))
            terms.append(ml.sum(h * h))
        return ml.sum(ml.stack(terms))

    views: list[int] = []
    group = batched_run.Run.group

    def counting(self: Any, members: list[Any], numbers_stack: bool = True) -> None:
        before = self.batches
        group(self, members, numbers_stack)
        if self.batches > before and members[0]._op.name == "output":
            views.append(len(members))

    monkeypatch.setattr(batched_run.Run, "group", counting)
    results = {}
    for batching in (False, True):
        with ml.settings(batching=batching):
            results[batching] = anyio.run(ml.gradients, loss(), [w, v])
    assert sum(views) >= 12 * 3  # (each step's views of the tokens' losses, one group)
    for a, b in zip(results[True], results[False]):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_the_settings_docs_state_the_cost_rule_as_it_is() -> None:
    from monadl.runtime.schedule.fibers import MIN_MERGED
    from monadl.runtime.settings import Settings

    doc = " ".join((Settings.__doc__ or "").split())
    assert f"fewer than {_batching.MIN_NODES} nodes" in doc and f"fewer than {MIN_MERGED} examples'" in doc
    assert (
        f"batches from 2 members where the weights a call reads hold {batched_marked.MARKED_WEIGHTS:,} elements or "
        f"more, from 3 where {batched_marked.MARKED_SOME:,} or more or its program has {batched_marked.MARKED_STEPS} "
        f"steps or more, else from {batched_weights.MIN_PACKED}; of another op from {_batching.MIN_GROUP} (from "
        f"{batched_weights.MIN_PACKED}," in doc
    )
    assert (
        f"weight of {batched_weights.PACKED_WEIGHT:,} elements or more, {batched_weights.PACKED_WORK:,} multiply-adds"
        in doc
    )
    assert f"unless {batched_rule.MIN_LARGE} of its nodes read a weight of {batched_weights.MIN_SHARED:,}" in doc
    assert f"over {_batching.MAX_MEMBER_SIZE:,} elements" in doc
    assert batched_rule.BATCHED_SHARE == 3 and "A graph whose groups hold under a third of its nodes" in doc
    assert f"at most {batched_rule.REPROBE} evaluations later" in doc


def test_small_graphs_and_coarse_members_are_left_alone() -> None:
    w = ml.Weight(np.ones(3))
    ev = Evaluation(train=False)
    assert not _batching.worth_batching(ev, collect(ev, [ml.tanh(w * float(i)) for i in range(20)]))
    with ml.settings(batching=True):  # forced: even a small graph
        assert _batching.worth_batching(ev, collect(ev, [ml.tanh(w * float(i)) for i in range(20)]))
    big = [np.full((200, 100), float(i)) for i in range(300)]
    nodes = [ml.tanh(x * w[0]) for x in big]  # 300 members of 20,000 elements each
    ev = Evaluation(train=False)
    order = collect(ev, nodes)
    assert _batching.worth_batching(ev, order)
    _batching.forward(ev, order)
    assert all(type(key) is not Record for key in ev.records)  # no stack, no group


def test_a_large_layer_scaled_by_many_numbers_runs_node_by_node() -> None:
    """An elementwise op whose shared operand is over `MAX_MEMBER_SIZE`
    elements is coarse, as each member's result is that large: a new user's
    256 x 256 layer read by 400 scalings, each summed, grouped the scalings
    into one 400 x 256 x 256 array (and its delta) and left the sums node by
    node: 46 ms and 3x the memory, against 26 ms with batching off. Forced,
    it still batches; the gradients are the same."""
    rng = np.random.default_rng(5)
    w = ml.Weight(rng.normal(size=(256, 256)) / 16)
    x = rng.normal(size=(256, 256)) / 16

    def loss() -> ml.ScalarLayer:
        s = ml.tanh(x @ w)
        return ml.sum(ml.stack([ml.sum(s * float(k + 1)) for k in range(300)]))

    for batching in (None, True):
        ev = Evaluation(train=False)
        order = collect(ev, [loss()])
        with ml.settings(batching=batching):
            assert _batching.worth_batching(ev, order)
            _batching.forward(ev, order)
        stacks = sum(type(key) is Record for key in ev.records)
        assert stacks > 0 if batching else stacks == 0  # (no stack, no group, unless forced)
    results = []
    for batching in (None, False, True):
        with ml.settings(batching=batching):
            results.append(entry.gradients_sync(loss()))
    for got in results[1:]:
        assert got[0] == pytest.approx(results[0][0], rel=1e-12)
        assert_same_gradients(got[1], results[0][1], 1e-12)


def test_a_small_graph_of_marked_cells_counts_their_ops() -> None:
    """32 calls of a 6-op cell are 32 nodes, and 192 ops: worth batching (an
    attention cell of 12 ops, 32 calls, ran 3.7x faster batched than the
    rule's node-by-node verdict), where 32 single ops alone are not."""
    w = ml.Weight(np.ones((3, 3)))

    @ml.operation
    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        h = ml.tanh(x @ w)
        return ml.sigmoid(h @ w) * h + 1.0

    xs = [np.full((2, 3), float(i)) for i in range(48)]
    ev = Evaluation(train=False)
    order = collect(ev, [cell(x) for x in xs])
    assert len(order) < _batching.MIN_NODES <= batched_rule.ops(order) == 48 * 6
    assert _batching.worth_batching(ev, order)
    order = collect(ev, [ml.tanh(x @ w) for x in xs])
    assert not _batching.worth_batching(ev, order)


def test_lookups_and_losses_per_example_batch_with_equal_gradients() -> None:
    rng = np.random.default_rng(4)
    table = ml.Weight(rng.standard_normal((9, 4)))
    w = ml.Weight(rng.standard_normal((4, 3)))
    examples = [(rng.integers(0, 9, 2), rng.integers(0, 3, 2)) for _ in range(12)]

    def loss() -> ml.ScalarLayer:
        return ml.sum(ml.stack([ml.cross_entropy(ml.embedding(table, i) @ w, labels) for i, labels in examples]))

    results = []
    for batching in (False, True):
        with ml.settings(batching=batching):
            results.append(entry.gradients_sync(loss()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-12)
    assert_same_gradients(results[1][1], results[0][1], 1e-12)
    ev = Evaluation(train=True)
    with ml.settings(batching=True):
        _batching.forward(ev, collect(ev, [loss()]))
    groups = {r.node._op.name for key, r in ev.records.items() if type(key) is Record}
    assert {"embedding", "matmul", "cross_entropy"} <= groups


# ---- errors and failures ----------------------------------------------------------------
def test_error_in_a_batched_group_names_the_failing_members_line() -> None:
    # (two indices a lookup: a single one into a weight is refused where it is built, `test_index_range`)
    table = ml.Weight(np.ones((5, 2)))
    good = [ml.embedding(table, np.array([i % 5, 0])) for i in range(6)]
    bad = ml.embedding(table, np.array([0, 99]))  # BAD-MEMBER
    more = [ml.embedding(table, np.array([1, 0])) for _ in range(3)]
    loss = ml.sum(ml.concatenate([*good, bad, *more]))
    for batching in (False, True):
        with ml.settings(batching=batching), pytest.raises(ml.ShapeError) as info:  # out-of-range indices are refused
            entry.gradients_sync(loss)
        assert f"{HERE}:{line_of('BAD-MEMBER')}" in str(info.value)
        assert str(info.value).startswith("embedding: index 99 at indices[1] out of range for a table of 5 rows")


@pytest.mark.parametrize("label", [-1, 4], ids=["negative", "too-large"])
def test_a_batched_cross_entropy_refuses_a_label_out_of_range_as_one_member_does(label: int) -> None:
    """A negative label would pick a class from the end (take_along_axis wraps):
    the group checks its members' labels as each member's rule does."""
    w = ml.Weight(np.ones((3, 4)))
    xs = [np.ones((2, 3)) * i for i in range(4)]
    labels = [np.array([0, label if i == 2 else 1]) for i in range(4)]
    loss = ml.sum(ml.stack([ml.cross_entropy(ml.as_layer(x) @ w, y) for x, y in zip(xs, labels)]))
    for batching in (False, True):
        with ml.settings(batching=batching), pytest.raises(ml.ShapeError, match="labels must lie in"):
            entry.gradients_sync(loss)


def test_shape_error_in_a_group_is_the_unbatched_error() -> None:
    w = ml.Weight(np.ones(4))
    xs = [np.ones(3) * i for i in range(8)]
    loss = ml.sum(ml.stack([ml.sum(x + w) for x in xs]))  # SHAPE-SITE
    messages = []
    for batching in (False, True):
        with ml.settings(batching=batching), pytest.raises(ml.ShapeError) as info:
            entry.gradients_sync(loss)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"{HERE}:{line_of('SHAPE-SITE')}" in messages[1]


def test_mixed_dtypes_in_a_group_raise_the_dtype_error() -> None:
    w = ml.Weight(np.ones(3, np.float32))
    loss = ml.sum(ml.stack([ml.sum(np.ones(3) * i * w) for i in range(8)]))
    with ml.settings(batching=True), pytest.raises(ml.DTypeError):
        entry.gradients_sync(loss)


@pytest.mark.anyio
async def test_weights_unchanged_after_a_failure_with_batching() -> None:
    model = TreeLSTM(4, np.float64)
    before = [w.data.copy() for w in (model.w, model.b, model.table)]
    rng = np.random.default_rng(0)
    loss = model.loss([random_tree(rng, 6) for _ in range(4)]) + ml.sum(model.b + np.ones(3))
    with ml.settings(batching=True), pytest.raises(ml.ShapeError):
        await loss.train()
    for old, w in zip(before, (model.w, model.b, model.table)):
        assert np.array_equal(old, w.data)


# ---- the counted release ----------------------------------------------------------------
@pytest.mark.anyio
async def test_counted_release_with_do_layers_and_shared_do() -> None:
    model = TreeLSTM(4, np.float64)
    rng = np.random.default_rng(5)
    trees = [random_tree(rng, 5) for _ in range(4)]
    calls: list[int] = []

    def counted(tape: ml.Tape[Any, Any]) -> ml.Tape[Any, Any]:
        calls.append(1)
        return tape

    def loss() -> ml.ScalarLayer:
        hs = [model.cell(t)[0] for t in trees]
        through_do = ml.Layer(hs[0].forward().map(counted))  # a Do-built layer inside the graph
        shared = ml.Layer(model.b.forward().map(counted).shared())
        more = [ml.sum(ml.tanh(through_do * h) + shared[:4]) for h in hs[1:]]
        return ml.sum(ml.stack(more)) + ml.sum(shared)

    results = []
    for batching in (False, True):
        calls.clear()
        with ml.settings(batching=batching):
            value, grads = await entry.gradients(loss())
        results.append((value, grads, len(calls)))
    assert results[0][2] == results[1][2] == 2
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-12)
    assert_same_gradients(results[1][1], results[0][1], 1e-12)


# ---- each rule against the unbatched rule ------------------------------------------------
Case: TypeAlias = "tuple[str, list[tuple[int, ...] | None], tuple[Any, ...]]"
# (primitive, per operand: the member's shape (batched) or None (shared, shape given in params' place), params)
SHARED_W = np.linspace(-1, 1, 12).reshape(4, 3)
SHARED_ROW = np.linspace(0.5, 1.5, 3)
CASES: list[tuple[str, list[Any], tuple[Any, ...]]] = [
    ("matmul", [(4,), SHARED_W], ()),
    ("matmul", [(2, 4), SHARED_W], ()),
    ("matmul", [SHARED_W.T, (4,)], ()),
    ("matmul", [(4,), (4,)], ()),
    ("matmul", [(2, 4), (4, 3)], ()),
    ("matmul", [(2, 4), SHARED_W[:, 0]], ()),  # rows times one vector
    ("matmul", [(4,), SHARED_W[:, 0]], ()),  # a vector . one vector
    ("matmul", [(3, 2, 4), SHARED_W[:, 0]], ()),
    ("matmul", [SHARED_W[:, 0], (4, 3)], ()),  # one vector times each member's matrix
    ("matmul", [SHARED_W[:, 0], (4,)], ()),  # one vector . each member's vector
    ("matmul", [SHARED_W.T, (4, 2)], ()),  # one matrix times each member's matrix
    ("matmul", [(2, 4), (4,)], ()),  # attention's scores: states @ query, both per member
    ("matmul", [(4,), (4, 3)], ()),  # attention's mix: weights @ states
    ("matmul", [(2, 2, 4), (2, 4, 3)], ()),  # stacks of matrices per member
    ("dense", [(2, 4), SHARED_W, SHARED_ROW], ()),
    ("dense", [(4,), SHARED_W, SHARED_ROW], ()),
    ("dense", [(2, 4), SHARED_W, (3,)], ()),
    ("add", [(3,), SHARED_ROW], ()),
    ("add", [(2, 3), (3,)], ()),
    ("add", [(3,), (2, 3)], ()),
    ("add", [(2, 1), SHARED_ROW], ()),
    ("subtract", [(3,), 0.5], ()),
    ("multiply", [(3,), (3,)], ()),
    ("multiply", [(2, 3), SHARED_ROW], ()),
    ("divide", [(3,), SHARED_ROW], ()),
    ("maximum", [(3,), SHARED_ROW], ()),
    ("minimum", [(3,), (3,)], ()),
    ("tanh", [(3,)], ()),
    ("sigmoid", [(2, 3)], ()),
    ("exp", [(3,)], ()),
    ("negative", [(3,)], ()),
    ("relu", [(3,)], ()),
    ("abs", [(3,)], ()),
    ("log", [(3,)], ()),
    ("sqrt", [(3,)], ()),
    ("sin", [(2, 3)], ()),
    ("cos", [(3,)], ()),
    ("getitem", [(6,)], (slice(1, 4),)),
    ("getitem", [(2, 6)], ((Ellipsis, slice(None, None, 2)),)),
    ("getitem", [(2, 6)], (0,)),
    ("getitem", [(3,)], ((None, slice(None)),)),
    ("concatenate", [(3,), (2,)], (0,)),
    ("concatenate", [(2, 3), SHARED_W[:2]], (-1,)),
    ("sum", [(2, 3)], (1, False)),
    ("sum", [(2, 3)], (None, False)),
    ("mean", [(2, 3)], (-1, True)),
    ("max", [(2, 3)], (0, False)),
    ("logsumexp", [(2, 3)], (1, False)),
    ("softmax", [(2, 3)], (-1,)),
    ("log_softmax", [(2, 3)], (0,)),
    ("power", [(3,), 3.0], ()),
    ("power", [2.0, (2, 3)], ()),
    ("power", [(3,), (3,)], ()),
    ("stop_gradient", [(3,)], ()),
    ("reshape", [(2, 3)], ((3, 2),)),
    ("reshape", [(2, 3)], ((-1,),)),
    ("transpose", [(2, 3)], (None,)),
    ("transpose", [(2, 3, 4)], ((2, 0, -2),)),
    ("roll", [(2, 5)], (2, -1)),
    ("roll", [(3, 4)], (-5, 0)),
    ("stack", [(3,), (3,)], (0,)),
    ("stack", [(2, 3), SHARED_W[:2]], (-1,)),
    ("split", [(2, 6)], (3, -1)),
    ("split_part", [(2, 6)], (3, -1, 1)),
    ("split_part", [(6,)], ((2, 4), 0, 1)),
]


def _whole(delta: Any) -> Any:
    """A split part's delta (a `SplitDelta`) as one array."""
    return delta.to_dense() if type(delta) is SplitDelta else delta


def _member_values(rng: np.random.Generator, shapes: list[Any], n: int) -> list[list[Any]]:
    """Per operand: the n members' values (one object when shared)."""
    columns = []
    for s in shapes:
        if type(s) is tuple:
            columns.append([rng.uniform(0.5, 2.0, s) * rng.choice([-1, 1], s) for _ in range(n)])
        else:
            columns.append([s] * n)
    return columns


@pytest.mark.parametrize(("name", "shapes", "params"), CASES, ids=lambda x: str(x)[:30])
def test_rule_matches_the_unbatched_rule(name: str, shapes: list[Any], params: tuple[Any, ...]) -> None:
    rng = np.random.default_rng(0)
    n = 5
    if name in ("log", "sqrt", "power"):
        columns = [[np.abs(v) for v in column] for column in _member_values(rng, shapes, n)]
    else:
        columns = _member_values(rng, shapes, n)
    batched = tuple(type(s) is tuple for s in shapes)
    args = [np.stack(c) if b else c[0] for c, b in zip(columns, batched)]
    result = BATCHING_RULES[name]((*args, *params), (*batched, *(False,) * len(params)), n)
    assert result is not None
    out, vjps = result
    singles = [PRIMITIVES[name].rule(*(c[i] for c in columns), *params) for i in range(n)]
    for i, (value, _) in enumerate(singles):
        np.testing.assert_allclose(out[i], value, rtol=1e-12)
    g = rng.standard_normal(out.shape)
    for k, vjp in enumerate(vjps):
        want = [unbroadcast(np.asarray(_whole(s[1][k](g[i]))), np.shape(columns[k][i])) for i, s in enumerate(singles)]
        got = _whole(vjp(g))
        if batched[k]:
            assert got.shape == args[k].shape
            for i in range(n):
                np.testing.assert_allclose(got[i], want[i], rtol=1e-12, atol=1e-12)
        else:
            np.testing.assert_allclose(unbroadcast(got, np.shape(args[k])), sum(want), rtol=1e-12, atol=1e-12)


def _halves(z: ml.ArrayLayer) -> ml.ArrayLayer:
    a, b = ml.split(z, 2, axis=-1)
    return ml.tanh(a) * ml.sigmoid(b)


CELL_BODIES: dict[str, Callable[[ml.ArrayLayer], ml.ArrayLayer]] = {
    "split": _halves,
    "power": lambda z: ml.tanh(z[:, :4]) ** 2.0 + 0.5 ** z[:, 4:],
    "stack": lambda z: ml.tanh(ml.sum(ml.stack([z[:, :4], z[:, 4:]]), axis=0)),
    "reshape": lambda z: ml.tanh(ml.reshape(z, (2, 4)))[1:],
    "transpose": lambda z: ml.transpose(ml.tanh(ml.reshape(z, (4, 2))))[:1],
    "roll": lambda z: ml.tanh(ml.roll(z, 3)[:, :4]) * ml.roll(z, -1, axis=0)[:, 4:],
    "stop_gradient": lambda z: ml.tanh(z[:, :4] + ml.stop_gradient(z[:, 4:])),
}


@pytest.mark.parametrize("marked", [False, True])
@pytest.mark.parametrize("name", list(CELL_BODIES))
def test_split_power_stack_reshape_transpose_and_stop_gradient_batch(
    name: str, marked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each once sent its group, or a marked cell's whole group, back to node by node.
    rng = np.random.default_rng(3)
    w = ml.Weight(rng.normal(size=(4, 8)) / 2)
    body = CELL_BODIES[name]

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return body(ml.matmul(x, w))

    step = ml.operation(cell) if marked else cell
    xs = [rng.normal(size=(1, 4)) for _ in range(16)]
    calls: list[bool] = []
    rule = BATCHING_RULES[name]

    def counting(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> Any:
        result = rule(args, batched, n)
        calls.append(result is not None)
        return result

    monkeypatch.setitem(BATCHING_RULES, name, counting)
    results = []
    for batching in (False, True):
        hs: list[Any] = list(xs)
        for _ in range(3):
            hs = [step(h) for h in hs]
        loss = ml.sum(ml.concatenate(hs, axis=0) ** 2)
        with ml.settings(batching=batching):
            results.append((anyio.run(loss.predict), anyio.run(ml.gradients, loss, [w])[0]))
    if name == "split" and not marked:  # (unmarked, splits run one by one: `_ALONE`)
        assert not calls
    else:
        assert calls and all(calls)  # batched, by the rule
    (value, grad), (batched_value, batched_grad) = results
    assert batched_value == pytest.approx(value, rel=1e-12)
    np.testing.assert_allclose(batched_grad, grad, rtol=1e-10, atol=1e-14)


def test_split_parts_read_alone_or_in_groups_and_scalars_of_another_dtype_batch_as_one_by_one() -> None:
    # A split's parts read by a node that runs alone, and by a group, once sent a part's delta
    # (a SplitDelta) into a group's delta of arrays; a float32 group with a 0-d float64
    # weight computed in float64, where each node alone casts the weight to float32.
    w = ml.Weight(np.ones((3, 4)))
    hs = [np.full((1, 3), float(i)) @ w for i in range(8)]
    parts = [ml.split(h, 2) for h in hs]
    shared = ml.split(hs[0] * 2.0, 2)
    terms = [ml.sum(a) for a, _ in parts] + [ml.sum(parts[0][1])] + [ml.sum(a * shared[1]) for a, _ in parts]
    s = ml.Weight(np.array(1.5))  # 0-d float64
    v = ml.Weight(np.ones((3, 4), np.float32))
    xs = [np.full((1, 3), float(i), np.float32) @ v for i in range(8)]
    scaled = ml.sum(ml.stack([ml.sum(x**s + s**x + x * s) for x in xs]))
    for loss, weights in ((ml.sum(ml.stack(terms)), [w]), (scaled, [s, v])):
        results = []
        for batching in (False, True):
            with ml.settings(batching=batching):
                results.append((anyio.run(loss.predict), anyio.run(ml.gradients, loss, weights)))
        (value, grads), (batched_value, batched_grads) = results
        assert np.asarray(batched_value).dtype == np.asarray(value).dtype
        assert batched_value == pytest.approx(value, rel=1e-6)
        for g, b in zip(grads, batched_grads):
            assert np.asarray(b).dtype == np.asarray(g).dtype
            np.testing.assert_allclose(b, g, rtol=1e-6)


def test_embedding_and_cross_entropy_rules() -> None:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((7, 3))
    indices = [rng.integers(0, 7, 2) for _ in range(4)]
    result = BATCHING_RULES["embedding"]((table, np.stack(indices)), (False, True), 4)
    assert result is not None
    out, (vjp,) = result
    for i, idx in enumerate(indices):
        np.testing.assert_array_equal(out[i], table[idx])
    g = rng.standard_normal(out.shape)
    want = sum(PRIMITIVES["embedding"].rule(table, idx)[1][0](g[i]).to_dense() for i, idx in enumerate(indices))
    np.testing.assert_allclose(vjp(g).to_dense(), want)

    logits = [rng.standard_normal((3, 4)) for _ in range(5)]
    labels = [rng.integers(0, 4, 3) for _ in range(5)]
    rows = np.arange(3)
    args = (np.stack(logits), rows, np.stack(labels))
    batched = BATCHING_RULES["cross_entropy"](args, (True, False, True), 5)
    assert batched is not None
    losses, (ce_vjp,) = batched
    g = rng.standard_normal(5)
    got = ce_vjp(g)
    for i in range(5):
        value, (single,) = PRIMITIVES["cross_entropy"].rule(logits[i], rows, labels[i])
        assert losses[i] == pytest.approx(value, rel=1e-12)
        np.testing.assert_allclose(got[i], single(g[i]), rtol=1e-12)


def test_unbatchable_combinations_say_so() -> None:
    rule: Callable[..., Any] = BATCHING_RULES["getitem"]
    # Fancy indices other than one integer array in the first place (`test_batched_lookups`).
    stack, ids = np.ones((3, 4, 2)), np.array([0, 1])
    assert rule((stack, (np.array([True, False, True, False]),)), (True, False), 3) is None  # a mask
    assert rule((stack, (slice(None), ids)), (True, False), 3) is None  # an array after a slice
    assert rule((stack, (ids, ids)), (True, False), 3) is None  # two arrays
    rows = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(rule((rows, (ids,)), (True, False), 3)[0], rows[:, ids])  # one array: batched now
    assert BATCHING_RULES["matmul"]((np.ones(3), np.ones(3)), (False, False), 1) is None
    # Stacks of matrices whose members broadcast ((1, 2, 3) @ (5, 3, 2)): the delta of the
    # first would be of the broadcast shape, not its own; members one by one.
    assert BATCHING_RULES["matmul"]((np.ones((4, 1, 2, 3)), np.ones((4, 5, 3, 2))), (True, True), 4) is None


@pytest.mark.parametrize("rows", [2, 600])
def test_a_small_groups_weight_delta_comes_as_factors(rows: int, outers: list[Outer]) -> None:
    """A group of few rows by a large weight sends the weight's delta as factors
    (`Outer`: one product for all groups when the weight is stepped), as one node
    would; a group with more rows than the weight pays for sends the product."""
    rng = np.random.default_rng(0)
    data = rng.normal(size=(512, 256)) / 16
    xs = [rng.normal(size=(rows, 512)) for _ in range(4)]
    grads = []
    for batching in (False, True):
        w = ml.Weight(data.copy())
        loss = ml.sum(ml.concatenate([ml.tanh(x @ w) for x in xs], axis=0) ** 2)
        outers.clear()
        with ml.settings(batching=batching):
            (g,) = anyio.run(ml.gradients, loss, [w])
        grads.append(g)
    assert len(outers) == (1 if rows == 2 else 0)  # batched: one group, its factors (rows 2: 4 x 2 x 768 < 512 x 256)
    assert np.max(np.abs(grads[1] - grads[0])) <= 1e-12 * np.max(np.abs(grads[0]))


@pytest.mark.parametrize("batching", [True, None])
def test_a_layer_and_an_array_in_one_operand_place_batch_together(batching: bool | None) -> None:
    # Equal signatures (one's operand a layer's value, the other's an array of its shape): stacked.
    w = ml.Weight(np.array([[0.5, -1.0]]))
    terms = []
    for i in range(150 if batching is None else 1):  # (the cost rule batches a graph this large)
        y = w * float(i + 1)
        terms += [ml.sum(ml.tanh(w) - y), ml.sum(np.array([[1.0, 2.0]]) - y)]
    loss = ml.sum(ml.stack(terms))
    with ml.settings(batching=False):
        expected = anyio.run(ml.gradients, loss, [w])
    with ml.settings(batching=batching):
        got = anyio.run(ml.gradients, loss, [w])
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12)


def test_a_weight_inside_an_index_is_no_data_to_a_signature() -> None:
    # A weight has a shape and a dtype now, but in an index it is no array of data: such a node is never batched.
    w, x = ml.Weight(np.zeros(2)), ml.Weight(np.ones((3, 4)))
    index: Any = (w, 0)  # (mypy rejects a weight in an index: it fails when it runs)
    assert _batching.signature({}, x[index]) is None
    assert _batching.signature({}, x[np.zeros(2, np.intp), 0]) is not None


def test_an_axis_out_of_range_inside_a_batched_cell_is_the_nodes_error() -> None:
    # Batched, the axis was wrapped (axis % ndim + 1) and another axis reduced: a value, silently.
    w = ml.Weight(np.random.default_rng(0).normal(size=(3, 4)))
    for reduce in (
        lambda h: ml.sum(h, axis=2),
        lambda h: ml.logsumexp(h, axis=-3),
        lambda h: ml.softmax(h, axis=2),
        lambda h: ml.concatenate([h, h], axis=2),
    ):
        cell = ml.operation(lambda x, reduce=reduce: ml.sum(reduce(ml.tanh(x @ w))))
        for batching in (True, False):
            with ml.settings(batching=batching), pytest.raises(ml.ShapeError, match="out of"):
                anyio.run(ml.sum(ml.stack([cell(np.ones((2, 3)) * i) for i in range(3)])).predict)


@pytest.mark.parametrize("lift", ["weight", "as_layer", "transpose"])
@pytest.mark.parametrize(("size", "members", "groups"), [(32, 2, 0), (32, 4, 0), (128, 4, 0), (128, 8, 48)])
def test_few_products_run_node_by_node_by_default(
    caplog: pytest.LogCaptureFixture, size: int, members: int, groups: int, lift: str
) -> None:
    # A new user's attention over examples of different lengths (groups of 2 or 3 of each product by a
    # 32 x 32 weight) ran 1.6x slower under the cost rule than node by node: such groups paid from 2.
    # Then products by a weight of MIN_SHARED elements or more paid from 4 (1.1-1.35x node by node's
    # time at 4 to 7 members, a weight's delta from one product kept as factors); now all from 8 (with the
    # tanh and the sum: 16 row counts, 3 groups each).
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((size, size)) / size)
    xs = [rng.standard_normal((rows, size)) for rows in range(1, 1 + 128 // members) for _ in range(members)]
    shared: Any = {"weight": w, "as_layer": ml.as_layer(w), "transpose": w.T.T}[lift]  # (the weight, seen as a layer)
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(x @ shared)) for x in xs]))
    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    batched_rule._verdicts.clear()  # (a verdict of an earlier test's graph of the same line and size)
    got = anyio.run(ml.gradients, loss, [w])
    with ml.settings(batching=False):
        want = anyio.run(ml.gradients, loss, [w])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9, atol=1e-12)  # (a product of more rows rounds otherwise)
    ran = [
        r.getMessage() for r in caplog.records if "ran batched" in r.getMessage() or "runs unbatched" in r.getMessage()
    ]
    assert len(ran) == 1
    assert (
        (f"ran batched: {groups * members} nodes in {groups} groups" in ran[0])
        if groups
        else ("batched nothing" in ran[0])
    )


def _rule_line(caplog: pytest.LogCaptureFixture, loss: ml.ScalarLayer, w: ml.ArrayWeight) -> str:
    """The cost rule's DEBUG line on ``loss``'s graph (no verdict kept from earlier tests), once the
    gradient to ``w`` under the default rule equals batching off's to float64 rounding."""
    batched_rule._verdicts.clear()
    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    got = anyio.run(ml.gradients, loss, [w])
    with ml.settings(batching=False):
        want = anyio.run(ml.gradients, loss, [w])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9, atol=1e-12)
    (line,) = [r.getMessage() for r in caplog.records if "batched" in r.getMessage()]
    return line


@pytest.mark.parametrize(("examples", "batched"), [(6, False), (8, True)])
def test_few_examples_through_a_large_weight_run_node_by_node_by_default(
    caplog: pytest.LogCaptureFixture, examples: int, batched: bool
) -> None:
    # A new user's trial: 4 to 6 examples, each 10 steps of tanh(h @ W) through one 256 x 256 weight, ran
    # 1.1-1.35x the time of batching off under the default rule (groups of 4 to 6 products paid). The graph
    # is analysed (MIN_LARGE of its nodes read a large weight); its groups of 6 do not pay, those of 8 do.
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((256, 256)) / 16)
    outs = []
    for _ in range(examples):
        h: Any = ml.as_layer(rng.standard_normal((1, 256)))
        for _ in range(10):
            h = ml.tanh(h @ w)
        outs.append(ml.sum(h))
    loss = ml.sum(ml.stack(outs))
    line = _rule_line(caplog, loss, w)
    if batched:
        assert f"ran batched: {examples * 22} nodes in 22 groups" in line, line  # (and the as_layer, the sum)
    else:
        assert "batched nothing" in line and f"{examples * 22} in groups too small to pay (MIN_GROUP" in line, line


@pytest.mark.parametrize(
    ("counts", "members", "lift", "groups"),
    [
        (range(4, 12), 4, "weight", 8),
        (range(4, 12), 4, "transpose", 8),
        ((2, 3), 4, "weight", 0),
        ((4, 5, 6), 3, "weight", 0),
    ],
)
def test_groups_of_four_products_of_several_rows_by_a_large_weight_pay(
    caplog: pytest.LogCaptureFixture, counts: Sequence[int], members: int, lift: str, groups: int
) -> None:
    # A product of 2 rows or more packs its weight: a group of 4 packs it once (MIN_PACKED), where each
    # member's product does PACKED_WORK multiply-adds or more (4 rows times 512 x 512); 2 rows do not,
    # nor groups of 3.
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((512, 512)) / 512)
    shared: Any = {"weight": w, "transpose": w.T}[lift]
    xs = [rng.standard_normal((rows, 512)) for rows in counts for _ in range(members)]
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(x @ shared)) for x in xs]))
    line = _rule_line(caplog, loss, w)
    if groups:
        assert f"ran batched: {groups * members} nodes in {groups} groups" in line, line  # (the products only)
    else:
        assert "batched nothing" in line, line


def test_products_of_an_earlier_group_s_members_pack_their_weight() -> None:
    # The rows of each product are members of an earlier group (8 tanh nodes, one group): their shape is
    # read from the group's place, not from a record per member. Four go through each of two weights.
    rng = np.random.default_rng(1)
    w1, w2 = (ml.Weight(rng.standard_normal((512, 512)) / 512) for _ in range(2))
    hs = [ml.tanh(rng.standard_normal((4, 512))) for _ in range(8)]
    loss = ml.sum(ml.stack([ml.sum(h @ (w1 if i < 4 else w2)) for i, h in enumerate(hs)]))
    packed: list[bool] = []
    packs = batched_weights.packs

    def seen(node: Any, records: Any, where: dict[Any, Any]) -> bool:
        got = packs(node, records, where)
        packed.append(got and node._inputs[0] in where)
        return got

    batched_rule._verdicts.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(batched_run, "packs", seen)
        got = anyio.run(ml.gradients, loss, [w1, w2])
    with ml.settings(batching=False):
        want = anyio.run(ml.gradients, loss, [w1, w2])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert packed == [True, True]  # (both groups of 4, their rows an earlier group's members)


@pytest.mark.parametrize(("size", "batched"), [(128, [6, 6]), (64, [])])
def test_merged_runs_batch_products_by_a_large_weight_from_four(
    monkeypatch: pytest.MonkeyPatch, size: int, batched: list[int]
) -> None:
    # Across control flow (fibers' graphs merged), a group's delta to a weight is kept as factors, where a
    # product alone makes a weight-sized one below 64K elements: groups of 4 to 7 products by a weight of
    # MIN_SHARED elements or more batch there, as they did before the single graphs' rule went to 8.
    rng = np.random.default_rng(0)
    wg, w1, w2 = (ml.Weight(rng.standard_normal((size, size)) / size) for _ in range(3))

    @ml.direct
    async def example(i: int, x: Any) -> Any:
        h = ml.tanh(x @ wg)
        await ml.values(h)  # (the examples park here, and their graphs merge)
        return ml.sum(ml.tanh(h @ (w1 if i % 2 else w2)))

    xs = [rng.standard_normal((1, size)) for _ in range(12)]
    seen: list[int] = []
    group = batched_run.Run.group

    def counting(self: Any, members: list[Any], numbers_stack: bool = True) -> None:
        before = self.batches
        group(self, members, numbers_stack)
        if self.batches > before and members[0]._op.name == "matmul" and members[0]._inputs[1] in (w1, w2):
            seen.append(len(members))

    monkeypatch.setattr(batched_run.Run, "group", counting)
    batched_rule._verdicts.clear()
    got = anyio.run(ml.gradients, ml.sum(ml.stack([example(i, x) for i, x in enumerate(xs)])), [wg, w1, w2])
    assert seen == batched
    with ml.settings(batching=False):
        want = anyio.run(ml.gradients, ml.sum(ml.stack([example(i, x) for i, x in enumerate(xs)])), [wg, w1, w2])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_a_stacks_getters_are_one_tuple_cut_to_each_size() -> None:
    # A tuple per group size held about n * n / 2 getters for groups of up to n members of varying
    # sizes (a soak test's finding); one grown tuple, cut, holds n.
    from monadl.runtime.schedule import batched_records

    for n in (5, 3, 9, 1, 9):
        getters = batched_records._getters(n)
        assert [g("abcdefghij") for g in getters] == list("abcdefghij"[:n])
    assert [len(t) for t in batched_records._GETTERS] == [max(9, len(batched_records._GETTERS[0]))]


def test_a_graph_that_batched_nothing_is_analysed_again_soon_then_less_often() -> None:
    # Known by its last line and node count, a model's ragged batch (nothing grouped) left its next batches,
    # of one length, unbatched for 31 evaluations: 2.1x slower (a new user's trial).
    key: Any = ("a site", 300)
    waits = [batched_rule.remember(key, False, batched_rule.NOTHING_PAID) for _ in range(8)]
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32]
    batched_rule.paid(key)  # (an analysis that batched something: the next that does not, analysed at once)
    assert batched_rule.remember(key, False, batched_rule.NOTHING_PAID) == 1
    assert batched_rule.remember(key, False, batched_rule.CHAIN) == batched_rule.REPROBE


def test_a_ragged_batch_leaves_the_next_batch_of_one_length_batched(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((16, 16)) / 4)

    def loss(lengths: list[int]) -> Any:
        return ml.sum(ml.stack([ml.sum(ml.tanh(rng.standard_normal((n, 16)) @ w)) for n in lengths]))

    batched_rule._verdicts.clear()
    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    anyio.run(loss(list(range(1, 91))).predict)  # (ninety lengths: nothing groups)
    caplog.clear()
    anyio.run(loss([4] * 90).predict)  # (the same line and node count: one length)
    assert any("ran batched" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(("size", "batches"), [(128, True), (64, False)])
def test_a_small_graph_of_products_by_large_weights_is_batched_by_default(
    caplog: pytest.LogCaptureFixture, size: int, batches: bool
) -> None:
    # 16 examples through a 2-layer MLP of 512 x 512 (82 nodes, fewer than MIN_NODES) ran node by node
    # by default, where batching them ran 1.5x faster (a new user's trial of the cost rule). Here 66 nodes.
    rng = np.random.default_rng(0)
    w1, w2 = (ml.Weight(rng.standard_normal((size, size)) / size) for _ in range(2))
    xs = [rng.standard_normal((10, size)) for _ in range(16)]
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(x @ w1) @ w2) for x in xs]))
    batched_rule._verdicts.clear()
    batched_rule._smalls.clear()
    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    got = anyio.run(ml.gradients, loss, [w1, w2])
    said = [r.getMessage() for r in caplog.records if "a graph of 66 nodes" in r.getMessage()]
    assert len(said) == 1
    assert ("ran batched: 64 nodes in 4 groups" in said[0]) == batches, said
    assert ("fewer than 256 nodes" in said[0]) == (not batches), said
    with ml.settings(batching=False):
        want = anyio.run(ml.gradients, loss, [w1, w2])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("hidden", "blocks", "sequences", "batched"),
    [
        (16, 1, 2, False),  # (a new user's: 1.22x the time of batching off when groups of 2 paid)
        (16, 1, 3, False),
        (16, 1, 4, True),
        (16, 3, 3, True),  # (9 steps: MARKED_STEPS)
        (64, 1, 3, False),
        (96, 1, 3, True),  # (9,216 elements: MARKED_SOME)
        (128, 1, 2, False),
        (256, 1, 2, True),  # (65,536 elements: MARKED_WEIGHTS)
    ],
)
def test_groups_of_a_marked_operations_calls_pay_from_two_to_four(
    caplog: pytest.LogCaptureFixture, hidden: int, blocks: int, sequences: int, batched: bool
) -> None:
    # Sequences of 30 calls of a marked cell of `blocks` steps tanh(h @ W + x): a group of 2 calls pays
    # where its weights hold MARKED_WEIGHTS elements or more, of 3 from MARKED_SOME or MARKED_STEPS steps.
    rng = np.random.default_rng(2)
    table = ml.Weight(rng.standard_normal((30, hidden)))
    ws = [ml.Weight(rng.standard_normal((hidden, hidden)) / hidden) for _ in range(blocks)]
    out = ml.Weight(rng.standard_normal((hidden, 30)) / hidden)

    @ml.operation
    def cell(h: ml.ArrayLayer, x: ml.ArrayLayer) -> ml.ArrayLayer:
        for w in ws:
            h = ml.tanh(h @ w + x)
        return h

    terms = []
    for _ in range(sequences):
        tokens = rng.integers(30, size=31)
        h: Any = ml.as_layer(np.zeros((1, hidden)))
        for a, b in itertools.pairwise(tokens):
            h = cell(h, ml.embedding(table, np.array([a])))
            terms.append(ml.cross_entropy(h @ out, np.array([b])))
    line = _rule_line(caplog, ml.mean(ml.stack(terms)), ws[0])
    calls = sequences * 30
    if batched:  # (the lookups, ready together, are one group; then each step's calls)
        assert f"ran batched: {2 * calls} nodes in 31 groups" in line, line
    else:
        # (the lookups only: under a third of the graph, BATCHED_SHARE, so the next evaluations run node by node)
        assert f"batched too little of it to pay (BATCHED_SHARE): {calls} of its" in line, line
        assert "in groups too small to pay (MIN_GROUP; a marked operation's group from 2 to 4" in line, line


def _rnn_with_input_products(size: int, rows: int, steps: int = 300) -> tuple[Callable[[], Any], list[Any]]:
    # Each step h = tanh(h @ U + b + xs[t] @ V): only the input products (one node in five) are ready together.
    rng = np.random.default_rng(0)
    u, v = (ml.Weight(rng.standard_normal((size, size)) / size) for _ in range(2))
    b = ml.Weight(np.zeros(size))
    xs = rng.standard_normal((steps, rows, size))

    def loss() -> Any:
        h: Any = ml.as_layer(np.zeros((rows, size)))
        for x in xs:
            h = ml.tanh(h @ u + b + x @ v)
        return ml.mean(h * h)

    return loss, [u, v, b]


@pytest.mark.parametrize(("size", "rows", "again"), [(16, 1, False), (64, 4, False), (128, 1, True), (512, 4, True)])
def test_a_graph_that_batched_too_little_of_itself_is_analysed_again_later(
    caplog: pytest.LogCaptureFixture, size: int, rows: int, again: bool
) -> None:
    # A new user's RNN of 3,000 steps ran 5-18% slower batched: its input products, one node in five, ran in one
    # group, and the analysis of the rest cost more than the group saved. Under a third of a graph batched, it
    # runs node by node until analysed again, as one that batched nothing; unless its group saves more than
    # dispatch: one-row products by a weight of 16K elements or more (gemv each, and a weight-sized outer product
    # for its delta), or products that pack a weight of 512 x 512.
    loss, weights = _rnn_with_input_products(size, rows, steps=60 if size == 512 else 300)
    batched_rule._verdicts.clear()
    batched_rule._unpaid.clear()
    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    said: list[str] = []
    runs = []
    for _ in range(3):  # (analysed, analysed again at the next evaluation, then one left out)
        runs.append(anyio.run(ml.gradients, loss(), weights))
        said.append(caplog.text)
        caplog.clear()
    if again:
        assert all("ran batched" in text for text in said), said
    else:
        steps = 60 if size == 512 else 300
        for text, later in zip(said, (1, 2)):
            assert f"batched too little of it to pay (BATCHED_SHARE): {steps} of its {5 * steps + 3:,} nodes" in text
            assert "in 1 group(s): " in text and f"; analysed again {later} evaluation(s) later" in text
        assert "ran batched" not in said[2] and "as when it was last judged" in said[2], said[2]
    with ml.settings(batching=False):
        want = anyio.run(ml.gradients, loss(), weights)
    for got in runs:
        for a, w in zip(got, want):
            np.testing.assert_allclose(a, w, rtol=1e-9, atol=1e-12)
