"""A loom's recorders (`monadl.fold._loom_recorders`): after one call is recorded,
calls like it are recorded by straight-line code, the same groups, operands,
slots and results as `Loom.record` makes, and calls unlike it (another trace,
another loom's output, a rebound closure, another thread) take that path."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest

import monadl as ml
from examples.tree_lstm import TreeLSTM, encode, init_weights, make_trees
from monadl.fold import Function, Map, Reduce, Vector
from monadl.fold._loom import Loom
from monadl.layers._primitives import AS_LAYER
from monadl.layers._recording import RECORDING


@contextlib.contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many calls took `Loom.record`'s path (each one's count, in a list)."""
    calls = [0]
    record = Loom.record

    def counting(self: Loom, *args: Any) -> Any:
        calls[0] += 1
        return record(self, *args)

    monkeypatch.setattr(Loom, "record", counting)
    yield calls


@contextlib.contextmanager
def unlearned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Looms that learn no recorder: every call by `Loom.record`."""
    monkeypatch.setattr("monadl.fold._loom.MOST", 0)
    yield


def groups_of(build: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """What a block records: per group its key, members, first slots and lines; and the block's result."""
    with ml.loom():
        loom = RECORDING.get()
        assert isinstance(loom, Loom)
        result = build()
    described = [
        (
            at,
            g.trace is not None,
            [g.member(row) for row in range(len(g.firsts))],
            [f - g.firsts[0] for f in g.firsts],
            g.sites,
        )
        for at, g in loom.groups.items()
    ]
    return described, result


def same_groups(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for (at_a, _, members_a, firsts_a, sites_a), (at_b, _, members_b, firsts_b, sites_b) in zip(a, b):
        assert at_a == at_b and firsts_a == firsts_b and sites_a == sites_b
        assert len(members_a) == len(members_b)
        for m_a, m_b in zip(members_a, members_b):
            assert len(m_a) == len(m_b)
            for x, y in zip(m_a, m_b):
                x, y = data_of(x), data_of(y)
                assert x is y or (type(x) is type(y) is np.ndarray and np.array_equal(x, y)) or x == y


def data_of(operand: Any) -> Any:
    """A member's operand, a row of data given as a layer by its data (each build makes its own layer)."""
    return operand._inputs[0] if type(operand) is ml.Layer and operand._op is AS_LAYER else operand


def value_and_grads(loss: ml.ScalarLayer, weights: list[ml.ArrayWeight]) -> tuple[float, list[Any]]:
    async def run() -> tuple[float, list[Any]]:
        grads = await ml.gradients(loss, weights)
        return float(await loss.predict()), grads

    return anyio.run(run)


def test_a_tree_recursion_takes_the_path_once_per_cell_and_records_as_it_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 trees: the leaf and internal cells each take `Loom.record` once, and
    the block's groups (members, slots, lines), values and gradients are those
    of every call recorded by that path."""
    trees = make_trees(32, 2, 9, seed=5)
    model = TreeLSTM(init_weights(6, seed=2), operation=True, loom=True)
    weights = list(model.w.values())
    cells = model.cells
    groups_of(lambda: [encode(cells, t) for t in trees])  # (the cells traced: their serials before the block's)
    with counted(monkeypatch) as calls:
        fast, roots = groups_of(lambda: [encode(cells, t) for t in trees])
        assert calls[0] == 2
    loss_fast = ml.sum(ml.concatenate(roots, axis=0))
    with unlearned(monkeypatch):
        slow, roots = groups_of(lambda: [encode(cells, t) for t in trees])
    loss_slow = ml.sum(ml.concatenate(roots, axis=0))
    same_groups(fast, slow)
    (v0, g0), (v1, g1) = value_and_grads(loss_slow, weights), value_and_grads(loss_fast, weights)
    assert v1 == v0
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_calls_of_another_index_shape_dtype_or_structure_take_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An index array of another shape or dtype, a tuple of another length or
    a list for a tuple is another trace or no recorder's: recorded by the
    path, with the values of the calls built as nodes."""
    table = ml.Weight(np.arange(12.0).reshape(4, 3))

    @ml.operation
    def cell(ids: Any, hs: Any) -> ml.ArrayLayer:
        total = ml.sum(ml.embedding(table, ids), axis=0, keepdims=True)
        for h in hs:
            total = total + h
        return ml.tanh(total * 0.1)

    def build() -> list[ml.ArrayLayer]:
        h = cell(np.array([1]), (ml.as_layer(np.ones((1, 3))),))  # (a row: its plan, no recorder)
        outs = [h]
        for ids, hs in [
            (np.array([2]), (h,)),
            (np.array([2, 3]), (h,)),  # (another shape)
            (np.array([2], np.int32), (h,)),  # (another dtype)
            (np.array([1]), (h, h)),  # (a longer tuple)
            (np.array([1]), [h]),  # (a list)
            (np.array([3]), (h,)),  # (like the second)
        ]:
            outs.append(cell(ids, hs))
        return outs

    with counted(monkeypatch) as calls:
        with ml.loom():
            outs = build()
        assert calls[0] == 6  # (all but the last: it is like the second, the first recorder's)
    woven = anyio.run(ml.concatenate(outs, axis=0).predict)
    plain = anyio.run(ml.concatenate(build(), axis=0).predict)
    np.testing.assert_allclose(woven, plain, rtol=1e-14)


def test_a_rebound_closure_is_traced_again_not_replayed() -> None:
    """A cell over a variable rebound between calls (a loop's): each call
    reads the weight its closure holds then, as its node would."""
    weights = [ml.Weight(np.full((2, 2), s)) for s in (0.1, 0.2, 0.3)]
    w = weights[0]
    cell = ml.operation(lambda h: ml.tanh(h @ w))
    x = ml.as_layer(np.ones((1, 2)))
    with ml.loom():
        h = cell(x)
        outs = []
        for w in weights:  # noqa: B007  (the closure reads it)
            outs.append(cell(h))
            outs.append(cell(h))
    got = anyio.run(ml.concatenate(outs, axis=0).predict)
    first = np.tanh(np.ones((1, 2)) @ weights[0].data)
    want = np.concatenate([np.tanh(first @ v.data) for v in weights for _ in (0, 1)], axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_another_looms_outputs_and_another_threads_calls_build_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorder records its own loom's slots, in its thread: an output of
    another block's call, or a call from a worker thread, builds its node."""
    w = ml.Weight(np.eye(2) * 0.5)
    cell = ml.operation(lambda h: ml.tanh(h @ w))
    x = ml.as_layer(np.ones((1, 2)))
    with ml.loom():
        other = cell(cell(x))
    with ml.loom():
        loom = RECORDING.get()
        assert isinstance(loom, Loom)
        mine = cell(cell(x))
        assert loom.recorders[cell]  # (learned from the second call)
        foreign = cell(other)  # (another loom's slot)
        built: list[Any] = []
        ctx = __import__("contextvars").copy_context()
        worker = threading.Thread(target=lambda: built.append(ctx.run(cell, mine)))
        worker.start()
        worker.join()
        again = cell(mine)
    assert foreign._op is not mine._op and built[0]._op is not mine._op and again._op is mine._op
    got = anyio.run(ml.concatenate([foreign, built[0], again], axis=0).predict)
    one = np.tanh(np.tanh(np.tanh(np.ones((1, 2)) * 0.5) * 0.5) * 0.5)
    np.testing.assert_allclose(got, np.concatenate([one] * 3), rtol=1e-14)


@dataclass(frozen=True)
class Pair:
    h: ml.ArrayLayer
    c: ml.ArrayLayer


class Named(NamedTuple):
    h: ml.ArrayLayer
    c: ml.ArrayLayer


@pytest.mark.parametrize("result", ["dataclass", "named tuple", "one output", "swapped", "with an argument"])
def test_results_of_every_form_are_made_as_their_nodes_would_be(result: str) -> None:
    """A recorder makes a call's result as its trace's template does: a
    dataclass or named tuple of the outputs, one output, the outputs in
    another order, a result holding one of the call's arguments."""
    w = ml.Weight(np.array([[0.5, -0.2], [0.1, 0.3]]))

    def step(s: Any) -> Any:
        h, c = (s, s) if isinstance(s, ml.Layer) else (s.h, s.c) if not isinstance(s, tuple) else s
        h2, c2 = ml.tanh(h @ w), ml.sigmoid(c @ w)
        if result == "dataclass":
            return Pair(h2, c2)
        if result == "named tuple":
            return Named(h2, c2)
        if result == "one output":
            return h2 + c2
        if result == "swapped":
            return (c2, h2)
        return (h2, c)  # (the argument's c, as it was)

    cell = ml.operation(step)

    def build() -> list[ml.ArrayLayer]:
        s: Any = ml.as_layer(np.array([[1.0, 2.0]]))
        outs = []
        for _ in range(4):
            s = cell(s)
            outs += [s] if isinstance(s, ml.Layer) else [s[0], s[1]] if isinstance(s, tuple) else [s.h, s.c]
        return outs

    with ml.loom():
        woven = build()
    assert type(woven[-1]) is ml.Layer
    got = anyio.run(ml.concatenate(woven, axis=0).predict)
    want = anyio.run(ml.concatenate(build(), axis=0).predict)
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_a_fold_batch_records_its_calls_by_recorders_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Fold batch's `Function` calls go through the loom's recorders, those
    on a `Vector`'s rows too (each took the path, 1.6x a trial's build)."""
    w = ml.Weight(np.random.default_rng(0).normal(size=(3, 3)))
    cell = Function[ml.ArrayLayer, ml.ArrayLayer](lambda x: ml.tanh(x @ w))
    join = Function[tuple[ml.ArrayLayer, ml.ArrayLayer], ml.ArrayLayer](lambda ab: ml.sigmoid(ab[0] + ab[1]))
    model = Map(Vector(3, "float64") >> cell) >> Reduce(join)
    inputs = [[[0.1 * i, 0.2, -0.3]] * n for i, n in enumerate((2, 3, 5, 8, 8, 4))]
    with counted(monkeypatch) as calls:
        outs = model.batch(inputs)
    assert calls[0] == 2 + 1  # (the cell's first two: a closure's plan is learned at its second call; the join's)
    got = anyio.run(ml.concatenate(outs, axis=0).predict)
    want = anyio.run(ml.concatenate([model(x) for x in inputs], axis=0).predict)
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_a_nan_names_the_line_of_its_call_among_calls_from_two_lines() -> None:
    """Under check_finite a call's error names the line that made it, where
    the recorder's calls come from two lines in turn."""
    w = ml.Weight(np.ones((1, 1)))
    cell = ml.operation(lambda h: ml.sqrt(h @ w))
    flip = ml.operation(lambda h: -(h @ w))
    with ml.loom():
        x = ml.as_layer(np.ones((1, 1)))
        good, bad = cell(x), flip(x)
        outs = []
        for k in range(3):
            outs.append(cell(good))  # the first line
            outs.append(cell(bad if k == 2 else good))  # the second line
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(ml.concatenate(outs, axis=0).predict)
    first = test_a_nan_names_the_line_of_its_call_among_calls_from_two_lines.__code__.co_firstlineno
    assert f"{__file__}:{first + 12}" in str(info.value), str(info.value)


def test_a_recorder_of_a_trace_the_operation_forgot_leaves_the_call_to_the_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its traces' limit an operation forgets one per new signature and
    traces the next call of it again (reading what the cell reads then): a
    recorder of a forgotten trace records nothing more (a reviewer's case:
    the last call's value was 0.322 where its node's is 0.903)."""
    monkeypatch.setattr("monadl.layers._operation_traces._TRACES_LIMIT", 8)
    table = ml.Weight(np.arange(40.0).reshape(20, 2) / 40)
    scale = [1.0]
    bag = ml.operation(lambda ids: ml.tanh(ml.sum(ml.embedding(table, ids), axis=0, keepdims=True) * scale[0]))

    def build() -> list[ml.ArrayLayer]:
        scale[0] = 1.0
        outs = [bag(np.array([1])), bag(np.array([2]))]  # (a recorder of ids of shape (1,))
        first = next(iter(bag._traces.values()))
        n = 2
        while first in bag._traces.values():  # (ids of more lengths, till that trace is forgotten)
            outs.append(bag(np.arange(n) % 20))
            n += 1
        scale[0] = 3.0  # (read by the call's new trace)
        outs.append(bag(np.array([3])))
        return outs

    got = []
    for loom in (True, False):
        bag._traces.clear()
        bag._plans.clear()
        with ml.loom() if loom else contextlib.nullcontext():
            outs = build()
        got.append(anyio.run(outs[-1].predict))
    np.testing.assert_allclose(got[0], got[1], rtol=1e-14)
    np.testing.assert_allclose(got[1], np.tanh(table.data[3:4] * 3.0), rtol=1e-14)


@pytest.mark.parametrize("case", ["no argument", "a field named by a keyword", "nested 40 deep"])
def test_calls_a_recorder_cannot_read_are_recorded_by_the_path(case: str) -> None:
    """An operation of no arguments, a dataclass field whose name is a
    keyword (``if``), a tuple nested past what a recorder reads: each call
    recorded as before (a reviewer's: a SyntaxError, a RecursionError)."""
    w = ml.Weight(np.array([[0.5, -0.2], [0.3, 0.1]]))
    x = ml.as_layer(np.array([[1.0, 2.0]]))

    def nest(h: Any, d: int) -> Any:
        for _ in range(d):
            h = (h,)
        return h

    def unnest(t: Any) -> Any:
        while type(t) is tuple:
            t = t[0]
        return t

    cell: Any
    if case == "no argument":
        cell = ml.operation(lambda: ml.tanh(w * 2.0))
        calls: list[Callable[[Any], Any]] = [lambda h: cell()] * 3
    elif case == "a field named by a keyword":
        kind: Any = dataclasses.dataclass(init=False, repr=False, eq=False)(  # (a field a class could not name)
            type("S", (), {"__annotations__": {"if": ml.Layer}, "if": dataclasses.field(init=False)})
        )

        def made(h: Any) -> Any:
            s = kind()
            setattr(s, "if", h)
            return s

        cell = ml.operation(lambda s: ml.tanh(getattr(s, "if") @ w))
        calls = [lambda h: cell(made(h))] * 3
    else:
        cell = ml.operation(lambda t: ml.tanh(unnest(t) @ w))
        calls = [lambda h: cell(nest(h, 40))] * 3

    def build() -> ml.ArrayLayer:
        h = x
        for call in calls:
            h = call(h)
        return h

    with ml.loom():
        woven = build()
    np.testing.assert_allclose(anyio.run(woven.predict), anyio.run(build().predict), rtol=1e-14)


def test_rows_of_data_given_as_layers_are_recorded_as_the_path_records_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of data given as a layer (``ml.as_layer``, a `Vector`'s) is read
    by a recorder as it reads an array, by its data's shape and dtype: the
    same groups (keyed by the rows' shapes and dtypes), slots and values as
    the path's. A row of another dtype or shape, or a slot in a row's place,
    takes the path."""
    rng = np.random.default_rng(3)
    w, v = ml.Weight(rng.normal(size=(3, 2))), ml.Weight(rng.normal(size=(2, 2)))

    @ml.operation
    def cell(x: ml.ArrayLayer, h: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(x @ w + h @ v)

    def row(k: int, rows: int = 1) -> ml.ArrayLayer:
        return ml.as_layer(np.full((rows, 3), 0.1 * k))

    def build() -> list[ml.ArrayLayer]:
        starts = [cell(row(k), ml.as_layer(np.zeros((1, 2)))) for k in range(4)]  # (rows both: a Fold's Zeros)
        outs = [cell(row(k), h) for k, h in enumerate(starts)]  # (a row and a slot)
        outs.append(cell(row(5, rows=2), outs[0]))  # (another shape: another group)
        outs.append(cell(ml.as_layer(np.ones((1, 3))), outs[1]))  # (like the second kind)
        outs.append(cell(outs[2] @ np.ones((2, 3)), outs[3]))  # (a layer built outside: a node)
        return outs

    build()  # (the cell traced: its plans learned)
    with counted(monkeypatch) as calls:
        fast, outs = groups_of(build)
        assert calls[0] == 4  # (the first of each kind: two rows, a row and a slot, two rows' data, a node's input)
    with unlearned(monkeypatch):
        slow, _ = groups_of(build)
    same_groups(fast, slow)
    f64 = np.dtype(np.float64)
    assert [(at[0], *at[2:]) for at, *_ in fast if len(at) > 2] == [  # (depth, which operands are rows, their data)
        (0, 0b11, (np.ndarray, (1, 3), f64), (np.ndarray, (1, 2), f64)),
        (1, 0b01, (np.ndarray, (1, 3), f64)),
        (2, 0b01, (np.ndarray, (2, 3), f64)),
        (2, 0b01, (np.ndarray, (1, 3), f64)),
    ]
    woven = anyio.run(ml.concatenate(outs, axis=0).predict)
    plain = anyio.run(ml.concatenate(build(), axis=0).predict)
    np.testing.assert_allclose(woven, plain, rtol=1e-14)
