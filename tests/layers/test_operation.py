"""`ml.operation`: a cell as one node, with the values and gradients of the unmarked cell."""

from __future__ import annotations

import copy
import functools
import re
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.deltas import Outer
from monadl.layers import _batching_rules, _dataclasses
from monadl.layers._products import product
from monadl.layers._program import Program
from monadl.layers._structures import flatten


@dataclass(frozen=True, slots=True)
class State:
    h: ml.ArrayLayer
    c: ml.ArrayLayer


def _weights(dtype: Any, seed: int = 0) -> tuple[ml.ArrayWeight, ml.ArrayWeight, ml.ArrayWeight]:
    rng = np.random.default_rng(seed)
    return (
        ml.Weight(rng.normal(size=(6, 12)).astype(dtype)),
        ml.Weight(rng.normal(size=(3, 12)).astype(dtype)),
        ml.Weight(rng.normal(size=(12,)).astype(dtype)),
    )


def _model(cell: Any, weights: tuple[Any, ...], dtype: Any, trees: int = 6, depth: int = 4) -> ml.ScalarLayer:
    """A batch of small balanced trees over the cell: the natural recursion."""
    rng = np.random.default_rng(1)
    roots = []
    for _ in range(trees):
        level = [
            State(
                ml.Weight(np.zeros((1, 3), dtype)) * 1.0,
                ml.tanh(rng.normal(size=(1, 3)).astype(dtype) * weights[2][:3]),
            )
            for _ in range(2**depth)
        ]
        while len(level) > 1:
            level = [
                cell(weights, rng.normal(size=(1, 3)).astype(dtype), level[i], level[i + 1])
                for i in range(0, len(level), 2)
            ]
        roots.append(level[0].h)
    return ml.sum(ml.concatenate(roots, axis=0) ** 2)


def plain_cell(weights: tuple[Any, ...], x: ml.Array, left: State, right: State) -> State:
    w, u, b = weights
    gates = ml.dense(ml.concatenate([left.h, right.h], axis=1), w, b) + x @ u
    i, f, o, g = gates[:, :3], gates[:, 3:6], gates[:, 6:9], gates[:, 9:]
    c = ml.sigmoid(i) * ml.tanh(g) + ml.sigmoid(f) * (left.c + right.c) * 0.5
    return State(ml.sigmoid(o) * ml.tanh(c), c)


marked_cell = ml.operation(plain_cell)


def _run(loss: ml.ScalarLayer, weights: tuple[Any, ...], batching: bool) -> tuple[Any, list[Any]]:
    with ml.settings(batching=batching):
        value = anyio.run(loss.predict)
        grads = anyio.run(ml.gradients, loss, list(weights))
    return value, grads


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_same_values_and_gradients_as_the_unmarked_cell(batching: bool, dtype: Any, rtol: float) -> None:
    weights = _weights(dtype)
    value, grads = _run(_model(plain_cell, weights, dtype), weights, False)
    marked_value, marked_grads = _run(_model(marked_cell, weights, dtype), weights, batching)
    assert abs(marked_value - value) <= rtol * abs(value)
    for g, m in zip(grads, marked_grads):
        assert m.dtype == g.dtype
        assert np.max(np.abs(m - g)) <= rtol * np.max(np.abs(g))


def test_one_node_per_call_and_one_trace_per_signature() -> None:
    weights = _weights(np.float64)
    op = ml.operation(plain_cell)
    leaf = State(ml.Weight(np.zeros((1, 3))) * 1.0, ml.Weight(np.zeros((1, 3))) * 1.0)
    state = op(weights, np.ones((1, 3)), leaf, leaf)
    node = state.h._inputs[0]
    assert state.c._inputs[0] is node and type(node._op.rule) is Program
    assert node._inputs[:3] == weights  # weights passed in are operands of the node, as layers are
    op(weights, np.ones((1, 3)), leaf, leaf)
    assert len(op._traces) == 1
    op(_weights(np.float64, seed=1), np.ones((1, 3)), leaf, leaf)  # weights passed in are operands: the same trace
    assert len(op._traces) == 1


def test_static_arguments_choose_the_trace() -> None:
    @ml.operation
    def scaled(x: ml.ArrayOperand, twice: bool) -> ml.ArrayLayer:
        return ml.tanh(x) * (2.0 if twice else 1.0)

    x = ml.Weight(np.array([0.5]))
    once, twice = anyio.run(scaled(x, False).predict), anyio.run(scaled(x, True).predict)
    assert twice[0] == pytest.approx(2 * once[0]) and len(scaled._traces) == 2


def _batch_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the groups that programs are asked to batch, as they come."""
    calls: list[int] = []
    original = Program.batch

    def counting(self: Program, args: tuple[Any, ...], batched: tuple[bool, ...], n: int, **options: Any) -> Any:
        calls.append(n)
        return original(self, args, batched, n, **options)

    monkeypatch.setattr(Program, "batch", counting)
    return calls


def test_a_group_of_one_trace_runs_as_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _batch_calls(monkeypatch)
    weights = _weights(np.float64)
    _run(_model(marked_cell, weights, np.float64, trees=4, depth=3), weights, True)
    assert calls == [16, 8, 4] * 2  # one call per level of the four trees, in predict and in gradients


def test_a_step_without_a_batching_rule_runs_member_by_member() -> None:
    w = ml.Weight(np.arange(6.0).reshape(1, 6) / 6)

    def halves(x: ml.ArrayOperand) -> ml.ArrayLayer:
        pooled = ml.max_pool2d(ml.reshape(w * x, (1, 1, 2, 3)), 1)  # max_pool2d has no batching rule
        return ml.reshape(pooled, (1, 6)) * x

    marked = ml.operation(halves)
    xs = [np.full((1, 6), float(i)) for i in range(12)]
    plain = ml.sum(ml.concatenate([halves(x) for x in xs], axis=0))
    loss = ml.sum(ml.concatenate([marked(x) for x in xs], axis=0))
    assert _run(loss, (w,), True)[0] == pytest.approx(_run(plain, (w,), False)[0])
    np.testing.assert_allclose(_run(loss, (w,), True)[1][0], _run(plain, (w,), False)[1][0])


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_numbers_that_differ_per_call_batch_with_the_values_of_each_call(
    dtype: Any, rtol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A number per call (a scale, a step size, a mask of 0 and 1) once made a
    # signature per value: every call ran alone. Now the group's numbers are a
    # column of the other operands' float dtype, and the cell runs once.
    rng = np.random.default_rng(0)
    w: ml.ArrayWeight = ml.Weight(rng.normal(size=(4, 4)).astype(dtype))

    def scaled(x: ml.Array, s: float, k: float) -> ml.ArrayLayer:
        return ml.tanh(ml.matmul(x, w)) * s + k  # (an int argument would be static: a trace per value)

    xs = [rng.normal(size=(1, 4)).astype(dtype) for _ in range(12)]
    scales = [0.5 * i - 2.0 for i in range(10)] + [0.0, -0.0]
    products: list[int] = []

    def counting(x: Any, y: Any) -> Any:
        products.append(len(x))
        return product(x, y)

    monkeypatch.setattr(_batching_rules, "product", counting)
    for f in (scaled, ml.operation(scaled)):
        rows = ml.concatenate([f(x, s, float(i)) for i, (x, s) in enumerate(zip(xs, scales))], axis=0)
        loss = ml.sum(rows**2)
        products.clear()
        with ml.settings(batching=True):
            got = anyio.run(rows.predict)
        assert products == [12]  # one product for the twelve calls, unmarked or marked
        with ml.settings(batching=False):
            want = anyio.run(rows.predict)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=rtol)
        assert np.array_equal(np.signbit(got[-2:]), np.signbit(want[-2:]))  # 0.0 and -0.0 kept apart
        value, grads = _run(loss, (w,), True)
        want_value, want_grads = _run(loss, (w,), False)
        assert abs(value - want_value) <= rtol * abs(want_value) and grads[0].dtype == dtype
        np.testing.assert_allclose(grads[0], want_grads[0], rtol=rtol * 10)


def _scale_cases() -> list[tuple[str, Callable[..., Any]]]:
    w = ml.Weight(np.random.default_rng(2).normal(size=(4, 4)).astype(np.float32))
    w0 = ml.Weight(np.float64(1.0) / 3)  # a 0-d float64 weight
    idx = np.arange(4)
    return [
        # a float meets only integer data: float64, as one call's
        ("integers", lambda x, f: (ml.tanh(ml.matmul(x, w)), ml.as_layer(idx) * f)),
        # ... and then a float32 layer: the DTypeError one call raises
        ("mixed", lambda x, f: ml.tanh(ml.matmul(x, w)) + ml.as_layer(idx) * f),
        # only a 0-d float64 weight: float64
        ("0-d weight", lambda x, f: (ml.tanh(ml.matmul(x, w)), w0 * f)),
        # numbers alone: exp(f) in float64, and t - t0 without rounding to float32 first
        ("alone", lambda x, f: (ml.tanh(ml.matmul(x, w)) * ((f + 1e4) - 1e4), ml.exp(f))),
        # two numbers compared (maximum's mask of a Python bool)
        ("compared", lambda x, f: ml.matmul(x, w) * ml.maximum(f, 0.0) + ml.minimum(f, 1.0)),
    ]


@pytest.mark.parametrize("case", range(5))
def test_a_cells_numbers_compute_in_the_dtype_each_call_gives_them(case: int) -> None:
    # Batched, a float per call is a column whose dtype each step decides as
    # the float's own would be decided beside that step's other operands.
    rng = np.random.default_rng(0)
    name, f = _scale_cases()[case]
    cell = ml.operation(f)
    xs = [rng.normal(size=(1, 4)).astype(np.float32) for _ in range(12)]
    results: list[Any] = []
    for batching in (False, True):
        outs = [cell(x, 0.1 * i + 0.05) for i, x in enumerate(xs)]
        rows = ml.stack([ml.sum(o[1]) if type(o) is tuple else ml.sum(o) for o in outs])
        firsts = ml.stack([o[0] if type(o) is tuple else o for o in outs])
        with ml.settings(batching=batching):
            try:
                results.append((anyio.run(rows.predict), anyio.run(firsts.predict)))
            except ml.DTypeError as exc:
                results.append(str(exc))
    alone, batched = results
    if name == "mixed":
        assert isinstance(alone, str) and alone == batched and "mix float32 and float64" in alone
        return
    for a, b in zip(alone, batched):
        assert a.dtype == b.dtype
        assert np.max(np.abs(b - a)) <= 1e-6 * np.max(np.abs(a))  # (float32 products of 1 and 12 rows)
    if name != "compared":
        assert alone[0].dtype == np.float64


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (lambda x, f: x * (1.0 / f), ZeroDivisionError),  # Python's division, not NumPy's inf
        (lambda x, f: x * 10.0 ** (f * 1000.0), OverflowError),
        (lambda x, f: x * f**0.5, ml.OperandError),  # a negative float's root: a complex, refused
        (lambda x, f: (x * f, f * 2.0), None),  # a number among the results
    ],
)
def test_a_cells_steps_of_numbers_only_compute_as_python_does(body: Any, error: Any) -> None:
    # A step of the call's floats alone is Python arithmetic in one call; batched, it is
    # too (member by member), with its errors, or the calls group by value.
    cell = ml.operation(body)
    xs = [np.full((1, 3), 1.0 + i, np.float32) for i in range(10)]
    floats = [0.5 * i - 1.0 for i in range(10)]
    results = []
    for batching in (False, True):
        outs = [cell(x, f) for x, f in zip(xs, floats)]
        loss = ml.stack([ml.sum(o[0]) + o[1] if type(o) is tuple else ml.sum(o) for o in outs])
        # (NumPy's warnings as warnings, as a user has them: no error would stop a NumPy inf)
        with ml.settings(batching=batching), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if error is not None:
                with pytest.raises(error):
                    anyio.run(loss.predict)
                continue
            results.append(anyio.run(loss.predict))
    if error is None:
        assert results[0].dtype == results[1].dtype
        np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


def test_numbers_a_step_cannot_stack_group_the_calls_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _batch_calls(monkeypatch)
    w = ml.Weight(np.random.default_rng(0).normal(size=(4, 4)))
    cell = ml.operation(lambda x, m: ml.tanh(ml.matmul(x, w)) * ml.sum(ml.stack([m, m])))  # stack: no numbers
    xs = [np.full((1, 4), 0.1 * i) for i in range(20)]
    rows = ml.stack([cell(x, float(i % 2)) for i, x in enumerate(xs)])
    with ml.settings(batching=True):
        got = anyio.run(rows.predict)
    assert calls == [20, 10, 10]  # stacked, refused by the stack step; then a group per value
    with ml.settings(batching=False):
        np.testing.assert_allclose(got, anyio.run(rows.predict), rtol=1e-12)


def test_a_result_without_computation_is_its_arguments() -> None:
    swap = ml.operation(lambda pair: (pair[1], pair[0]))
    a, b = ml.Weight(1.0) * 1.0, ml.Weight(2.0) * 1.0
    assert swap((a, b)) == (b, a)


def test_a_shape_error_names_the_call_and_the_line_in_the_cell() -> None:
    @ml.operation
    def bad(x: ml.Expr[ml.Array, ml.Array]) -> ml.ArrayLayer:
        return x @ np.ones((4, 2))  # the line inside the cell

    w = ml.Weight(np.ones((1, 3)))
    y = bad(w)  # the line of the call
    with pytest.raises(ml.ShapeError) as info:
        anyio.run(ml.sum(y).train)
    message = str(info.value)
    here = test_a_shape_error_names_the_call_and_the_line_in_the_cell.__code__.co_firstlineno
    assert f"test_operation.py:{here + 3}" in message and f"test_operation.py:{here + 6}" in message
    np.testing.assert_array_equal(w.data, np.ones((1, 3)))  # nothing changed


def test_training_steps_each_weight_once() -> None:
    weights = _weights(np.float64)
    before = [w.data.copy() for w in weights]
    plain = _weights(np.float64)
    anyio.run(_model(marked_cell, weights, np.float64).train)
    anyio.run(_model(plain_cell, plain, np.float64).train)
    for w, p, b in zip(weights, plain, before):
        assert not np.array_equal(w.data, b)
        np.testing.assert_allclose(w.data, p.data, rtol=1e-12)


def test_layers_from_outside_and_values_are_refused() -> None:
    outside = ml.Weight(np.ones(2)) * 2.0

    @ml.operation
    def uses_outside(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return x + outside

    with pytest.raises(ml.OperandError, match="built outside the call; pass it as an argument"):
        uses_outside(np.ones(2))

    @ml.direct
    async def reads(x: ml.ArrayLayer) -> ml.ArrayLayer:
        return x * float(np.sum(await x))

    v = ml.Weight(np.ones(2))  # (made outside: a weight made in a cell is refused on its own)
    with pytest.raises(ml.OperandError, match="whose structure may depend on values, so it cannot be traced"):
        ml.operation(lambda x: reads(v * x))(np.ones(2))

    async def awaits(x: ml.ArrayLayer) -> ml.ArrayLayer:
        return x

    with pytest.raises(ml.OperandError, match="is async"):
        ml.operation(awaits)


def test_an_object_with_a_forward_of_its_own_is_built_outside_the_cell_and_passed_in() -> None:
    """ml.as_layer(obj) inside a cell was refused as 'its structure depends on
    values', of an object whose forward() is a plain product: the reason is
    that a trace cannot see inside its Do, and the fix is to pass it in."""

    class Scaled:
        def __init__(self, w: ml.ArrayWeight, k: float) -> None:
            self.w, self.k = w, k

        def forward(self) -> ml.Do[ml.Tape[ml.Array, ml.Array]]:
            return (self.w * self.k).forward()

    w: ml.ArrayWeight = ml.Weight(np.array([1.0, 2.0]))
    module = Scaled(w, 3.0)

    @ml.operation
    def inside(x: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(x * ml.as_layer(module))

    line = sys._getframe().f_lineno - 2
    with pytest.raises(ml.OperandError) as caught:
        inside(ml.as_layer(np.ones(2)))
    assert str(caught.value) == (
        f"operation {sys._getframe().f_code.co_name}.<locals>.inside: the layer built at {__file__}:{line} "
        "comes from a Do (bind, await, ml.direct, ml.as_layer of an object with a forward() of its own, or a Tape "
        "with a backward of your own): a trace cannot see inside a Do, whose structure may depend on values, so it "
        "cannot be traced; build that layer outside the operation and pass it in as an argument"
    )

    @ml.operation
    def passed(x: ml.ArrayLayer, scale: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(x * scale)

    xs = np.random.default_rng(0).standard_normal((20, 2))
    scale = ml.as_layer(module)
    cells = ml.sum(ml.stack([passed(ml.as_layer(x), scale) for x in xs]))
    value, grads = anyio.run(ml.value_and_gradients, cells)
    assert value == pytest.approx(np.tanh(xs * [3.0, 6.0]).sum(), rel=1e-12)
    np.testing.assert_allclose(grads[w], (3.0 * xs / np.cosh(xs * [3.0, 6.0]) ** 2).sum(axis=0), rtol=1e-12)


def test_data_arguments_are_parameters_and_not_numpy_inputs() -> None:
    table = ml.Weight(np.arange(8.0).reshape(4, 2))
    lookup = ml.operation(lambda indices: ml.embedding(table, indices) * 2.0)
    rows = [lookup(np.array([i])) for i in (3, 0, 2)]  # the first call's indices are not kept
    assert anyio.run(ml.concatenate(rows, axis=0).predict).tolist() == [[12.0, 14.0], [0.0, 2.0], [8.0, 10.0]]
    with pytest.raises(ml.OperandError, match="went into a NumPy computation inside it"):
        ml.operation(lambda x: table * np.exp(x))(np.ones(2))


@pytest.mark.parametrize(
    "read",
    [
        lambda x, d: x * 10.0 if d[0] > 5 else x,  # a branch on an item
        lambda x, d: x * float(int(d[0])),
        lambda x, d: x * float(d.item()),
        lambda x, d: x * float(sum(d.tolist())),
        lambda x, d: x * float(next(iter(d))),
        lambda x, d: x * float(d.reshape(())),
        lambda x, d: x if bool(d.reshape(())) else -x,
    ],
)
def test_a_data_arguments_values_read_in_python_are_refused(read: Callable[[Any, Any], Any]) -> None:
    # The trace would keep the first call's values for every later call: refused, not wrong.
    w = ml.Weight(np.array([[1.0, 2.0]]))
    said = "read the values of a data argument in Python|indexed or sliced a data argument"  # (d[0]: indexed)
    with pytest.raises(ml.OperandError, match=said):
        ml.operation(read)(w, np.array([1.0]))
    assert anyio.run(ml.sum(read(w, np.array([8.0]))).predict) != 0.0  # (unmarked, the same function runs)


def test_a_data_argument_sliced_inside_a_cell_is_refused_with_what_to_do() -> None:
    # A mask sliced for ml.where inside the cell was told the cell read values "in Python (an item, int(),
    # ...)", which it did not, and to compute with monadl functions, which where's condition cannot be.
    h = ml.Weight(np.ones((3, 2)))
    cell = ml.operation(lambda h, m: ml.where(m[:, None], h, 0.0))
    with pytest.raises(
        ml.OperandError, match=r"^operation \S*<lambda>: the cell indexed or sliced a data argument \(x\[0\]"
    ):
        cell(h, np.array([True, False, True]))
    shaped = ml.operation(lambda h, m: ml.where(m, h, 0.0))(h, np.array([[True], [False], [True]]))  # (as advised)
    np.testing.assert_array_equal(anyio.run(shaped.predict), [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])


@pytest.mark.parametrize(
    ("read", "message"),
    [
        (lambda x, d: x * np.asarray(d), "taken inside it as a plain array"),
        (lambda x, d: x * d.view(np.ndarray), "read the values"),
        (lambda x, d: x[:, np.asarray(d)], "taken inside it as a plain array"),
        (lambda x, d: x * float(d.flat[0]), "read the values"),
        (lambda x, d: x * d.dot(d), "NumPy computation"),
        (lambda x, d: x[:, d.argmax()], "NumPy computation"),
        (lambda x, d: x[:, d.argmin()], "NumPy computation"),
        (lambda x, d: x[:, d.nonzero()[0]], "NumPy computation"),
    ],
)
def test_a_data_argument_escaping_as_a_plain_array_or_by_a_method_is_refused(
    read: Callable[[Any, Any], Any], message: str
) -> None:
    w = ml.Weight(np.arange(1.0, 5.0).reshape(1, 4))
    with pytest.raises(ml.OperandError, match=message):
        ml.operation(read)(w, np.array([0, 3]))

    def reads(x: Any, d: Any) -> Any:
        return read(x, d)

    with pytest.raises(ml.OperandError, match=rf"^operation {reads.__qualname__}: .*{message}"):  # (its cell named)
        ml.operation(reads)(w, np.array([0, 3]))


def test_a_data_arguments_shape_and_dtype_choose_the_trace() -> None:
    w = ml.Weight(np.array([[1.0, 2.0]]))
    counted = ml.operation(lambda x, d: x * float(len(d)) if d.dtype.kind == "f" else x * -1.0)
    values = [anyio.run(ml.sum(counted(w, d)).predict) for d in (np.ones(1), np.ones(3), np.ones(3, int), np.ones(1))]
    assert values == [3.0, 9.0, -3.0, 3.0]
    assert len(counted._traces) == 3


@pytest.mark.parametrize("batching", [False, True])
def test_a_data_index_inside_an_index_tuple_is_each_calls(batching: bool) -> None:
    w = ml.Weight(np.array([[1.0, 2.0, 3.0]]))
    pick = ml.operation(lambda x, d: x[:, d] * 1.0)
    picked = [pick(w, np.array([i])) for i in (0, 2, 1, 2)]
    with ml.settings(batching=batching):
        got = anyio.run(ml.concatenate(picked, axis=1).predict)
        grads = anyio.run(ml.gradients, ml.sum(ml.concatenate(picked, axis=1) * np.arange(1.0, 5.0)), [w])
    assert got.tolist() == [[1.0, 3.0, 2.0, 3.0]]
    assert grads[0].tolist() == [[1.0, 3.0, 6.0]]


def test_an_inner_operation_holding_an_array_takes_its_callers_data_argument() -> None:
    # Its data argument is the caller's placeholder, which refuses NumPy's functions: the check for
    # a kept argument compared the constant with it through np.may_share_memory and was refused.
    h = ml.Weight(np.arange(12.0).reshape(3, 4))
    inner = ml.operation(lambda h, idx: h[idx] * np.full(4, 2.0))
    outer = ml.operation(lambda h, idx: ml.tanh(inner(h, idx)))
    got = [anyio.run(outer(h, np.array(idx)).predict) for idx in ([0, 1], [2, 0])]
    for value, idx in zip(got, ([0, 1], [2, 0])):
        np.testing.assert_allclose(value, np.tanh(np.arange(12.0).reshape(3, 4)[idx] * 2.0), rtol=1e-15)


def test_a_data_argument_nested_deeper_in_a_parameter_is_refused() -> None:
    w = ml.Weight(np.array([[1.0, 2.0, 3.0]]))
    with pytest.raises(ml.OperandError, match="nested inside a parameter"):
        ml.operation(lambda x, d: x[:, (d,)] * 1.0)(w, np.array([0]))


def test_an_operation_reads_another_operations_outputs_from_its_node() -> None:
    weights = _weights(np.float64)
    leaf = State(ml.Weight(np.zeros((1, 3))) * 1.0, ml.Weight(np.zeros((1, 3))) * 1.0)
    child = marked_cell(weights, np.ones((1, 3)), leaf, leaf)
    parent = marked_cell(weights, np.ones((1, 3)), child, child)
    node, child_node = parent.h._inputs[0], child.h._inputs[0]
    # h and c of the child are one operand, its node: no view node between the two cells.
    assert [x for x in node._inputs if isinstance(x, ml.Layer)] == [child_node]
    plain = plain_cell(weights, np.ones((1, 3)), *(2 * [plain_cell(weights, np.ones((1, 3)), leaf, leaf)]))
    assert anyio.run(ml.sum(parent.c).predict) == pytest.approx(anyio.run(ml.sum(plain.c).predict), rel=1e-12)


def test_the_finite_check_covers_every_output() -> None:
    w = ml.Weight(np.ones((2, 2)))
    both = ml.operation(lambda x: (ml.tanh(x @ w), ml.sqrt(x @ w)))
    a, b = both(np.array([[1.0, -2.0]]))
    with (
        ml.settings(check_finite=True),
        np.errstate(invalid="ignore"),
        pytest.raises(ml.NonFiniteError, match="<lambda>"),
    ):
        anyio.run((a + b).sum().train)
    np.testing.assert_array_equal(w.data, np.ones((2, 2)))


def test_a_partials_arguments_are_held_like_a_closure() -> None:
    import functools

    def scaled(w: ml.ArrayWeight, x: ml.Array) -> ml.ArrayLayer:
        return w * x

    first, second = ml.Weight(np.ones(2)), ml.Weight(np.full(2, 3.0))
    op_first, op_second = (
        ml.operation(functools.partial(scaled, first)),
        ml.operation(functools.partial(scaled, second)),
    )
    assert op_first.__name__ == "test_a_partials_arguments_are_held_like_a_closure.<locals>.scaled"
    assert anyio.run(op_second(np.ones(2)).predict).tolist() == [3.0, 3.0]
    assert anyio.run(op_first(np.ones(2)).predict).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("batching", [False, True])
def test_slices_and_whole_uses_of_one_array_add_up(batching: bool) -> None:
    w = ml.Weight(np.random.default_rng(3).normal(size=(3, 4)))

    def cut(x: ml.ArrayOperand) -> ml.ArrayLayer:
        g = x @ w
        # overlapping slices, an int index, and the whole array again
        return ml.tanh(g[:, :3]) * g[:, 1:] + g[:, 2:3] * 2.0 + ml.sigmoid(g).sum(axis=1, keepdims=True) + g[0, 1]

    xs = [np.full((2, 3), 0.1 * i) for i in range(10)]
    plain = _run(ml.sum(ml.concatenate([cut(x) for x in xs], axis=0)), (w,), False)
    marked_cut = ml.operation(cut)
    marked = _run(ml.sum(ml.concatenate([marked_cut(x) for x in xs], axis=0)), (w,), batching)
    assert marked[0] == pytest.approx(plain[0], rel=1e-12)
    np.testing.assert_allclose(marked[1][0], plain[1][0], rtol=1e-12)


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("cuts", ["tiling", "disjoint", "tiling, one unused"])
def test_slices_that_tile_or_not_assign_their_deltas_exactly(batching: bool, cuts: str) -> None:
    """Slices that never overlap write their deltas in place (into an empty
    buffer where they tile the array); an unused slice's place stays zero."""
    w = ml.Weight(np.random.default_rng(4).normal(size=(3, 6)))

    def cut(x: ml.ArrayOperand) -> ml.ArrayLayer:
        g = x @ w
        a, b, c = g[:, :2], g[:, 2:4], g[:, 4:]
        if cuts == "disjoint":
            return ml.tanh(a) * ml.sigmoid(c)
        if cuts == "tiling, one unused":  # b's delta stops: its place in the buffer is never written
            return ml.tanh(a) * ml.sigmoid(c) + ml.stop_gradient(b) * 3.0
        return ml.tanh(a) * ml.sigmoid(c) + b * 3.0

    xs = [np.full((2, 3), 0.1 * i - 0.4) for i in range(10)]
    plain = _run(ml.sum(ml.concatenate([cut(x) for x in xs], axis=0)), (w,), False)
    marked_cut = ml.operation(cut)
    marked = _run(ml.sum(ml.concatenate([marked_cut(x) for x in xs], axis=0)), (w,), batching)
    assert marked[0] == pytest.approx(plain[0], rel=1e-12)
    np.testing.assert_allclose(marked[1][0], plain[1][0], rtol=1e-12)
    program = next(iter(marked_cut._traces.values())).op.rule  # type: ignore[union-attr]
    assert isinstance(program, Program)
    tilings = set(program.tilings.values())
    assert tilings == {cuts != "disjoint"}


@pytest.mark.parametrize("check_finite", [False, True])
def test_a_node_alone_keeps_a_large_weights_delta_as_factors(check_finite: bool, outers: list[Outer]) -> None:
    """Run alone (batching off), a marked cell's product by a large weight sends
    that weight's delta as factors (`Outer`), as an unmarked product's does: one
    product per weight at the step, not a weight-sized one per node."""
    rng = np.random.default_rng(0)
    data = rng.normal(size=(512, 256)) / 16
    xs = [rng.normal(size=(2, 512)) for _ in range(3)]

    def loss(w: ml.ArrayWeight, cell: Any) -> ml.ScalarLayer:
        return ml.sum(ml.concatenate([cell(x) for x in xs], axis=0) ** 2)

    plain_w, marked_w = ml.Weight(data.copy()), ml.Weight(data.copy())
    with ml.settings(batching=False, check_finite=check_finite):
        (plain,) = anyio.run(ml.gradients, loss(plain_w, lambda x: ml.tanh(x @ plain_w)), [plain_w])
        outers.clear()
        (marked,) = anyio.run(ml.gradients, loss(marked_w, ml.operation(lambda x: ml.tanh(x @ marked_w))), [marked_w])
        assert len(outers) == 3  # one per node
        np.testing.assert_allclose(marked, plain, rtol=1e-12, atol=1e-15)
        anyio.run(loss(plain_w, lambda x: ml.tanh(x @ plain_w)).train)
        anyio.run(loss(marked_w, ml.operation(lambda x: ml.tanh(x @ marked_w))).train)
    np.testing.assert_allclose(marked_w.data, plain_w.data, rtol=1e-12)
    assert not np.array_equal(marked_w.data, data)


def test_a_small_group_of_operation_nodes_sends_a_large_weights_delta_as_factors(
    outers: list[Outer],
) -> None:
    """Batched, a group of few rows sends its weight's delta as one `Outer` (the
    rows and their deltas), which the step multiplies once, as for one node."""
    rng = np.random.default_rng(1)
    w = ml.Weight(rng.normal(size=(512, 256)) / 16)
    cell = ml.operation(lambda x: ml.tanh(x @ w))
    xs = [rng.normal(size=(2, 512)) for _ in range(3)]
    grads = []
    for batching in (False, True):
        loss = ml.sum(ml.concatenate([cell(x) for x in xs], axis=0) ** 2)
        outers.clear()
        with ml.settings(batching=batching):
            (g,) = anyio.run(ml.gradients, loss, [w])
        grads.append(g)
        assert len(outers) == (1 if batching else 3)  # one group, or one per node
    assert np.max(np.abs(grads[1] - grads[0])) <= 1e-12 * np.max(np.abs(grads[0]))


def test_a_weight_passed_as_an_argument_sends_its_delta_as_factors(outers: list[Outer]) -> None:
    """A weight passed to a cell as an argument gets its product's delta as
    factors, as a weight the cell closes over does: an RNN cell taking its
    weights as arguments ran 3.2x slower (512 units, 20 steps: a 512 x 512
    outer product per node, added up), where it now steps as the closed one."""
    rng = np.random.default_rng(2)
    data = rng.normal(size=(512, 256)) / 16
    xs = [rng.normal(size=(2, 512)) for _ in range(3)]
    closed_w, argument_w = ml.Weight(data.copy()), ml.Weight(data.copy())
    closed = ml.operation(lambda x: ml.tanh(x @ closed_w))
    argument = ml.operation(lambda w, x: ml.tanh(x @ w))
    for batching, made in ((False, 3), (True, 1)):  # one per node, or one for the group
        with ml.settings(batching=batching):
            loss = ml.sum(ml.concatenate([closed(x) for x in xs], axis=0) ** 2)
            (want,) = anyio.run(ml.gradients, loss, [closed_w])
            outers.clear()
            loss = ml.sum(ml.concatenate([argument(argument_w, x) for x in xs], axis=0) ** 2)
            (got,) = anyio.run(ml.gradients, loss, [argument_w])
        assert len(outers) == made
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("batching", [False, True])
def test_a_layer_where_a_weight_was_passed_gets_its_delta_as_an_array(batching: bool) -> None:
    """The same cell called with a weight and with layers in that argument (the
    weight scaled, `ml.as_layer` of it, another weight's rows): a weight's call
    is its own signature, so only it gets factors; every layer's delta is an
    array its rules can read, and every gradient is the unmarked cell's."""
    rng = np.random.default_rng(3)
    data = rng.normal(size=(512, 256)) / 16
    xs = [rng.normal(size=(2, 512)) for _ in range(6)]

    def cell(w: Any, x: Any) -> Any:
        return ml.tanh(x @ w)

    def loss(f: Callable[..., Any], w: ml.ArrayWeight, v: ml.ArrayWeight) -> ml.ScalarLayer:
        given = [w, w * 0.5, ml.as_layer(w), v[0:512], w, v]
        return ml.sum(ml.concatenate([f(g, x) for g, x in zip(given, xs)], axis=0) ** 2)

    w, v = ml.Weight(data.copy()), ml.Weight(data[::-1].copy())
    marked_w, marked_v = ml.Weight(data.copy()), ml.Weight(data[::-1].copy())
    _, plain = _run(loss(cell, w, v), (w, v), False)
    _, marked = _run(loss(ml.operation(cell), marked_w, marked_v), (marked_w, marked_v), batching)
    for g, m in zip(plain, marked):
        assert type(m) is np.ndarray
        np.testing.assert_allclose(m, g, rtol=1e-12, atol=1e-15)


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each call that takes the signature's walk."""
    from monadl.layers import _operation, _operation_traces
    from monadl.layers._operation import Operation

    walks: list[int] = []
    original = _operation_traces.walked

    def walked(op: Operation[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any], kinds: Any) -> Any:
        walks.append(1)
        return original(op, args, kwargs, kinds)

    monkeypatch.setattr(_operation, "walked", walked)  # (the name `Operation.found` calls)
    return walks


def test_calls_by_argument_types_find_the_trace_of_their_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls whose arguments are leaves and dataclasses of leaves find their
    trace without the signature's walk: by their types, and by which leaves
    are outputs of which earlier nodes. Each way of passing states gets its
    own trace, and each computes what the unmarked cell does."""
    import functools

    weights = _weights(np.float64)
    op = ml.operation(functools.partial(plain_cell, weights))
    x = np.ones((1, 3))
    leaf = State(ml.Weight(np.zeros((1, 3))) * 1.0, ml.Weight(np.full((1, 3), 0.5)) * 1.0)
    # Weights where the state holds layers (a cell takes either; the dataclass's annotation says layers).
    weight_leaf = State(*cast(list[ml.ArrayLayer], [ml.Weight(np.zeros((1, 3))), ml.Weight(np.full((1, 3), 0.5))]))
    a, b = op(x, leaf, leaf), op(x, weight_leaf, leaf)
    calls: dict[str, Callable[[], State]] = {
        "two nodes' outputs": lambda: op(x, a, b),
        "one node's outputs twice": lambda: op(x, a, a),
        "crossed outputs": lambda: op(x, State(a.c, a.h), b),
        "a view and a plain layer": lambda: op(x, State(a.h, leaf.c), b),
        "weights": lambda: op(x, weight_leaf, weight_leaf),
    }
    plain: dict[str, Callable[[], State]] = {  # (the unmarked cell: the views are layers like any other)
        "two nodes' outputs": lambda: plain_cell(weights, x, a, b),
        "one node's outputs twice": lambda: plain_cell(weights, x, a, a),
        "crossed outputs": lambda: plain_cell(weights, x, State(a.c, a.h), b),
        "a view and a plain layer": lambda: plain_cell(weights, x, State(a.h, leaf.c), b),
        "weights": lambda: plain_cell(weights, x, weight_leaf, weight_leaf),
    }
    walks = _walks(monkeypatch)
    for round in range(2):
        for name, call in calls.items():
            got = anyio.run(ml.sum(call().h * 2.0 + call().c).predict)
            want = anyio.run(ml.sum(plain[name]().h * 2.0 + plain[name]().c).predict)
            assert got == pytest.approx(want, rel=1e-12), name
        if round == 0:
            first = len(walks)
    assert first > 0 and len(walks) == first  # the second time round, every call is found by its types
    # No outputs of other nodes: layers; weights then layers; weights (a weight is its own signature: its
    # product's delta comes as factors), and the four arrangements of outputs.
    assert len(op._traces) == 7
    # One plan, with an entry per tuple of its leaves' types: layers; weights then layers; weights.
    (plan,) = op._plans.values()
    assert plan is not None and len(plan.entries) == 3


def test_a_plan_finds_a_trace_without_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    weights = _weights(np.float64)
    op = ml.operation(functools.partial(plain_cell, weights))
    x = np.ones((1, 3))
    leaf = State(ml.Weight(np.zeros((1, 3))) * 1.0, ml.Weight(np.full((1, 3), 0.5)) * 1.0)
    a = op(x, leaf, leaf)
    op(x, a, a)
    walks = _walks(monkeypatch)
    state = op(x, a, a)
    assert not walks and state.h._inputs[0]._inputs[1] is a.h._inputs[0]
    op(x, a, State(a.h, leaf.c))  # a new arrangement of outputs: a new trace, by the walk
    assert walks == [1]


def test_a_recurrence_from_arrays_finds_its_traces_by_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recurrence whose first state is arrays (zeros) and whose later states
    are the cell's outputs: both kinds of call are read by types."""
    import functools

    def step(w: ml.ArrayWeight, x: ml.Array, s: State) -> State:
        h = ml.tanh(ml.matmul(s.h, w) + ml.tanh(s.c) + x)
        return State(h, h * 0.5)

    w = ml.Weight(np.random.default_rng(6).normal(size=(3, 3)))
    op = ml.operation(functools.partial(step, w))
    x = np.ones((1, 3))
    zeros = State(*cast(list[ml.ArrayLayer], [np.zeros((1, 3)), np.zeros((1, 3))]))
    state = op(x, op(x, zeros))
    walks = _walks(monkeypatch)
    plain = step(w, x, step(w, x, zeros))
    for _ in range(5):
        state, plain = op(x, op(x, zeros)), step(w, x, step(w, x, zeros))
    assert not walks
    assert len(op._traces) == 2  # from arrays, and from a node's outputs
    assert anyio.run(ml.sum(state.c).predict) == pytest.approx(anyio.run(ml.sum(plain.c).predict), rel=1e-12)


@dataclass
class _Box:
    a: Any


def test_a_dataclass_whose_fields_are_not_leaves_takes_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A field holding a structure (here a layer and an int) is read by the
    walk, not by the dataclass's fields: the types of the arguments do not
    say where its leaves are, and a later call with a layer in the field must
    not find the first call's trace."""

    def scaled(box: _Box) -> ml.ArrayLayer:
        out: ml.ArrayLayer = box.a[0] * float(box.a[1]) if isinstance(box.a, tuple) else box.a * 1.0
        return out

    op = ml.operation(scaled)
    x = ml.Weight(np.ones(3)) * 1.0
    assert anyio.run(ml.sum(op(_Box((x, 3)))).predict) == pytest.approx(9.0)
    assert anyio.run(ml.sum(op(_Box(x))).predict) == pytest.approx(3.0)
    assert anyio.run(ml.sum(op(_Box((x, 3)))).predict) == pytest.approx(9.0)
    assert len(op._traces) == 2 and list(op._plans.values()) == [None]


def test_arguments_the_types_do_not_describe_take_the_walk() -> None:
    @ml.operation
    def cell(x: ml.ArrayOperand, scale: float) -> ml.ArrayLayer:
        return ml.tanh(x) * scale

    w = ml.Weight(np.array([0.5]))
    # An int is static (a trace per value): the types of the arguments do not say the signature.
    assert anyio.run(cell(w, 2).predict) == pytest.approx(anyio.run(cell(w, 3).predict) * 2 / 3)
    assert len(cell._traces) == 2 and list(cell._plans.values()) == [None]
    assert anyio.run(cell(w, 2.0).predict) == pytest.approx(anyio.run(cell(w, 4.0).predict) / 2)
    assert len(cell._traces) == 3  # a float is data: one trace for every value
    assert [plan is not None for plan in cell._plans.values()] == [False, True]


def test_a_tuple_or_list_argument_is_read_by_its_items_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Fold block's cell takes one tuple (its children's states and its
    input): the plan reads it by its items' types, and a tuple of other
    items, length or kind of sequence takes the walk to a trace of its own."""
    op = ml.operation(_total)  # (a module's function, with no closure: plans apply)
    rng = np.random.default_rng(5)
    state = State(ml.Weight(rng.normal(size=(1, 3))) * 1.0, ml.Weight(rng.normal(size=(1, 3))) * 1.0)
    x = rng.normal(size=(1, 3))
    inputs = [(state, state, x), (state, x), (x, state, state), [state, state, x], (state, (state, x))]
    walks = _walks(monkeypatch)
    ops: list[list[Any]] = [[], []]
    for round in range(2):
        for xs in inputs:
            node = op(xs)
            ops[round].append(node._op)
            got = anyio.run(ml.sum(node).predict)
            assert got == pytest.approx(anyio.run(ml.sum(_total(xs)).predict), rel=1e-12), (round, xs)
        if round == 0:
            first = len(walks)
    assert ops[0] == ops[1] and len(set(ops[0])) == len(inputs)  # each arrangement its own trace, both times
    # The second round: the tuple of three in its first order and the list are found by
    # their plans; the other tuples, whose items' types differ from the tuple plan's first
    # call's, take the walk every time (the nested one too, whose leaves' types are the same).
    assert first == len(inputs) and len(walks) - first == 3


def test_a_closure_is_planned_while_its_cells_hold_the_same_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A function with a closure is found by its plan while its cells hold
    the objects they held when the plan was learned; a cell rebound takes
    the walk, which keys each call by what the cells hold now, and the plan
    is learned again under the new objects (a model rebuilt), up to a few
    times: past them (a loop's variable, rebound every call) every call walks."""
    from monadl.layers._operation import _REBINDS

    scale = 2.0

    def scaled(x: ml.ArrayWeight) -> ml.ArrayLayer:
        return x * scale

    op = ml.operation(scaled)
    w = ml.Weight(np.ones(2))
    walks = _walks(monkeypatch)
    for _ in range(3):
        assert anyio.run(ml.sum(op(w)).predict) == pytest.approx(4.0)
    assert len(walks) == 2 and op._plans  # traced, then learned: the third call found by its plan
    for k in range(1, _REBINDS + 1):  # rebound: traced, learned again, then found by the plan
        scale = 2.0 + k
        before = len(walks)
        for _ in range(3):
            assert anyio.run(ml.sum(op(w)).predict) == pytest.approx(2 * scale)
        assert len(walks) - before == 2 and op._planned
    scale = 10.0
    for _ in range(3):
        assert anyio.run(ml.sum(op(w)).predict) == pytest.approx(20.0)
    assert not op._plans and not op._planned
    scale = 2.0  # (its first trace, found by the walk)
    before = len(walks)
    assert anyio.run(ml.sum(op(w)).predict) == pytest.approx(4.0)
    assert len(walks) == before + 1 and len(op._traces) == _REBINDS + 2


def _loss_and_gradients(cells: list[Any], weights: list[ml.ArrayWeight]) -> list[tuple[float, list[Any]]]:
    """Each cell's loss and gradients (None: not reached)."""
    x = np.full((1, 2), 0.5)
    out = []
    for f in cells:
        for _ in range(3):  # (learned, then found by its plan)
            f(x)
        loss = ml.sum(f(x))
        value, grads = anyio.run(ml.value_and_gradients, loss)
        out.append((float(value), [grads.get(w) for w in weights]))
    return out


def test_a_plan_is_never_learned_under_contents_another_thread_has_rebound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread A learns a plan under the old weight; the cell is rebound and
    thread B walks (clearing the plans) before A stores it: the stale plan
    made later calls read the old weight. Learning is one step now."""
    import threading

    from monadl.layers import _operation_traces, _plans

    w1, w2 = ml.Weight(np.ones(2)), ml.Weight(np.full(2, 2.0))
    w = w1

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return x * w

    op = ml.operation(cell)
    x = np.full(2, 0.5)
    op(x)  # (traced under w1; the next call learns its plan)
    learning, go = threading.Event(), threading.Event()
    real = _plans.learn

    def slow(*args: Any) -> None:
        if threading.current_thread().name == "A":
            learning.set()
            go.wait(timeout=10)  # (a thread switch here)
        real(*args)

    monkeypatch.setattr(_operation_traces, "learn", slow)
    a = threading.Thread(target=op, args=(x,), name="A")
    a.start()
    assert learning.wait(timeout=10)
    w = w2
    b = threading.Thread(target=op, args=(x,), name="B")  # (its walk waits for A's learning to end)
    b.start()
    b.join(timeout=0.2)
    go.set()
    a.join(timeout=10)
    b.join(timeout=10)
    assert not a.is_alive() and not b.is_alive()
    for _ in range(3):
        assert anyio.run(ml.sum(op(x)).predict) == pytest.approx(2.0)  # (0.5 * w2, not 0.5 * w1)


def test_a_closure_over_a_proxy_that_makes_a_wrapped_per_read_is_marked_at_once() -> None:
    """`reach` followed any callable's ``__wrapped__``: a proxy or a mock
    that answers it with a new object each read walked for ever."""
    from unittest import mock

    stub = mock.MagicMock()
    w = ml.Weight(np.ones(2))

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        _ = stub  # (held, never called)
        return x * w

    op = ml.operation(cell)
    assert anyio.run(ml.sum(op(np.ones(2))).predict) == pytest.approx(2.0)


def test_a_closure_over_a_helper_closure_reads_the_helpers_variables() -> None:
    """A cell whose closure holds a function that closes over a weight (a
    helper, a decorator's wrapper, another operation): the helper's
    variable rebound is the cell's own rebound (a new trace, the new weight
    trained), as for the same cell unmarked."""
    w1, w2 = ml.Weight(np.ones((2, 2))), ml.Weight(np.full((2, 2), 2.0))
    current = w1

    def helper(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(x @ current)

    def decorated(f: Callable[[ml.ArrayOperand], ml.ArrayLayer]) -> Callable[[ml.ArrayOperand], ml.ArrayLayer]:
        @functools.wraps(f)
        def wrapper(x: ml.ArrayOperand) -> ml.ArrayLayer:
            return f(x) * 2.0

        return wrapper

    inner_op = ml.operation(helper)
    cells = [lambda x: helper(x) + 1.0, decorated(helper), lambda x: inner_op(x) + 1.0]
    for cell in cells:
        current = w1
        marked = ml.operation(cell)
        for _ in range(3):
            marked(np.ones((1, 2)))
        current = w2
        want, got = _loss_and_gradients([cell, marked], [w1, w2])
        assert got[0] == pytest.approx(want[0], rel=1e-12)
        assert got[1][0] is None and want[1][0] is None
        np.testing.assert_allclose(got[1][1], want[1][1], rtol=1e-12)


def test_a_closure_over_a_weight_rebound_reads_the_new_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case that matters for training: a cell closing over a weight
    variable that is later rebound to another weight (a model rebuilt)
    trains the new weight, also once the plan was learned on the old."""
    weight = ml.Weight(np.ones(2))

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(x * weight)

    op = ml.operation(cell)
    x = np.full(2, 0.5)
    for _ in range(3):
        anyio.run(ml.sum(op(x)).predict)
    old, weight = weight, ml.Weight(np.full(2, 2.0))
    (grad,) = anyio.run(ml.gradients, ml.sum(op(x)), [weight])
    np.testing.assert_allclose(grad, 0.5 * (1 - np.tanh(1.0) ** 2), rtol=1e-12)
    np.testing.assert_array_equal(old.data, np.ones(2))


def test_a_weights_data_read_in_a_cell_is_refused_and_the_weight_itself_reads_each_call() -> None:
    """An eval-mode batch norm closing over its running mean read
    ``running_mean.data`` (the way to take no gradient into a buffer): the
    trace kept that array, and a later ``.data`` assignment changed nothing,
    silently (a new user's model: 1.0 where -4.0 was due). Now refused while
    the cell is traced, naming the cell, the weight, the line and what to do."""
    running_mean = ml.Weight(np.zeros(2), optimizer=ml.optim.sgd(0.0))
    line = sys._getframe().f_lineno - 1

    @ml.operation
    def eval_bn(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h - running_mean.data

    x = ml.as_layer(np.ones((2, 2)))
    with pytest.raises(ml.OperandError) as raised:
        eval_bn(x)
    message = str(raised.value)
    assert message.startswith(
        f"operation {eval_bn.__name__}: the cell read .data of the weight float64[2] built at {__file__}:{line} "
        f"(at {__file__}:{line + 5}) while it was traced; the trace would keep that value for every later call"
    )
    assert eval_bn.__name__.endswith("<locals>.eval_bn")
    assert "use the weight itself in the cell (h - w, read at each call" in message
    assert "or pass the value as an argument (cell(h, w.data)" in message
    np.testing.assert_array_equal(running_mean.data, np.zeros(2))  # (outside a trace, read as before)

    @ml.operation
    def by_weight(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h - ml.stop_gradient(running_mean)

    @ml.operation
    def by_argument(h: ml.ArrayLayer, mean: ml.Array) -> ml.ArrayLayer:
        return h - mean

    for value in (0.0, 5.0):
        running_mean.data = np.full(2, value)
        np.testing.assert_array_equal(anyio.run(by_weight(x).predict), np.full((2, 2), 1.0 - value))
        np.testing.assert_array_equal(
            anyio.run(by_argument(x, running_mean.data).predict), np.full((2, 2), 1.0 - value)
        )


def test_a_weights_state_or_assignment_in_a_cell_is_refused_and_nested_cells_are_named() -> None:
    """A trace runs once per signature: an assignment there would not
    happen at later calls, and a state read would be kept. The innermost
    cell being traced is named; once traces end, the weight reads and
    assigns as before, on this thread and on others while one traces."""
    w = ml.Weight(np.ones(2), optimizer=ml.optim.adam(1e-3))

    @ml.operation
    def assigns(h: ml.ArrayLayer) -> ml.ArrayLayer:
        w.data = np.zeros(2)
        return h * w

    @ml.operation
    def reads_state(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h * float(w.state[0].step)

    @ml.operation
    def inner(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h * w.data

    @ml.operation
    def outer(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(inner(h))

    x = ml.as_layer(np.ones(2))
    with pytest.raises(
        ml.OperandError, match=r"^operation \S*<locals>\.assigns: the cell assigned .data of the weight float64\[2\] "
    ):
        assigns(x)
    with pytest.raises(ml.OperandError, match=r"later calls would not assign it: assign it outside the cell"):
        assigns(x)
    with pytest.raises(
        ml.OperandError, match=r"^operation \S*<locals>\.reads_state: the cell read .state of the weight "
    ):
        reads_state(x)
    with pytest.raises(ml.OperandError, match=r"^operation \S*<locals>\.inner: the cell read .data of the weight "):
        outer(x)
    np.testing.assert_array_equal(w.data, np.ones(2))
    assert w.state[0].step == 0
    read: list[Any] = []

    @ml.operation
    def waits(h: ml.ArrayLayer) -> ml.ArrayLayer:
        thread = threading.Thread(target=lambda: read.append(w.data))
        thread.start()
        thread.join()
        return h * w

    np.testing.assert_array_equal(anyio.run(waits(x).predict), np.ones(2))
    np.testing.assert_array_equal(read[0], np.ones(2))  # (another thread's read, during the trace)


def test_a_weight_copied_or_its_optimizer_assigned_in_a_cell_is_refused_as_its_data_is() -> None:
    """``copy.copy(w)`` in a cell kept the copy in the trace, so a later
    ``w.data`` assignment changed nothing, silently (the bug that refusing
    ``.data`` fixed, by another way); ``w.optimizer = ...`` reset the state
    once, at the trace, where ``w.state = ...`` was refused. Outside a trace
    both work as before."""
    w = ml.Weight(np.ones(3))
    line = sys._getframe().f_lineno - 1
    model = {"w": w}

    @ml.operation
    def shallow(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h * copy.copy(w)

    @ml.operation
    def deep(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h * copy.deepcopy(model)["w"]

    @ml.operation
    def reoptimized(h: ml.ArrayLayer) -> ml.ArrayLayer:
        w.optimizer = ml.optim.sgd(0.1)
        return h * w

    x = ml.as_layer(np.arange(3.0))
    for cell, at in [(shallow, line + 6), (deep, line + 10)]:
        with pytest.raises(ml.OperandError) as copied:
            cell(x)
        assert str(copied.value).startswith(
            f"operation {cell.__name__}: the cell copied the weight float64[3] built at {__file__}:{line} "
            f"(at {__file__}:{at}) while it was traced; the trace would keep that value for every later call"
        )
    with pytest.raises(ml.OperandError) as assigned:
        reoptimized(x)
    assert str(assigned.value).startswith(
        f"operation {reoptimized.__name__}: the cell assigned .optimizer of the weight float64[3] built at "
        f"{__file__}:{line} (at {__file__}:{line + 14}) while it was traced; a trace runs once per signature"
    )
    optimizer = w.optimizer
    assert w.optimizer is optimizer  # (unchanged by the refused cell)
    twin = copy.deepcopy(w)
    w.optimizer = ml.optim.sgd(0.1)
    w.data = np.full(3, 5.0)
    np.testing.assert_array_equal(twin.data, np.ones(3))
    np.testing.assert_array_equal(copy.copy(w).data, np.full(3, 5.0))


def test_a_weight_read_by_the_library_in_a_cell_is_not_blamed_on_the_cell() -> None:
    """A Dyna goal built in a cell over a weight was refused as "the cell
    read .data of the weight": the library read it, for its shape, and the
    real reason (the goal comes from a Do, which a trace cannot see into)
    was lost. apply_gradients in a cell is refused for what it is (a step,
    which a trace would take once), not as a read of the weight's data."""
    from monadl.dyna.scalar import Program
    from monadl.dyna.syntax import Rule

    program = Program([Rule(("y",), [("w", "I"), ("x", "I")])])
    w = ml.Weight(np.array([1.0, 2.0]))

    @ml.operation
    def with_goal(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h * program.goal(("y",), axioms={("x", 0): 3.0, ("x", 1): 4.0}, weights={"w": w})

    line = sys._getframe().f_lineno - 2
    with pytest.raises(ml.OperandError) as caught:
        with_goal(ml.as_layer(np.ones(2)))
    assert str(caught.value).startswith(
        f"operation {with_goal.__name__}: the layer built at {__file__}:{line} comes from a Do (bind, await, "
    )

    @ml.operation
    def steps(h: ml.ArrayLayer) -> ml.ArrayLayer:
        ml.optim.apply_gradients({w: np.ones(3)})
        return h * w

    with pytest.raises(ml.OperandError, match=r": the cell called apply_gradients while it was traced; "):
        steps(ml.as_layer(np.ones(2)))


def test_a_cell_that_evaluates_a_layer_while_traced_is_told_why_at_its_line() -> None:
    """A debug print of a value inside a marked cell evaluated its
    placeholder: "placeholder was evaluated", with a note naming an empty
    "argument of ;" at the call's line (a new user's). Now the evaluation is
    refused as it starts, saying what to do, the cell's line in the
    traceback; a placeholder the cell kept and evaluated later says so."""
    w = ml.Weight(np.eye(2))
    kept: list[ml.ArrayLayer] = []

    @ml.operation
    def peeks(h: ml.ArrayLayer) -> ml.ArrayLayer:
        z = h @ w
        anyio.run(z.predict)
        return ml.tanh(z)

    line = sys._getframe().f_lineno - 3
    with pytest.raises(
        ml.OperandError, match=r"operation \S*peeks: the cell evaluates a layer .* while it is traced; "
    ) as info:
        peeks(ml.as_layer(np.ones((1, 2))))
    assert any(f.lineno == line for f in traceback.extract_tb(info.value.__traceback__))
    assert "call the function unmarked" in str(info.value)

    @ml.operation
    def keeps(h: ml.ArrayLayer) -> ml.ArrayLayer:
        kept.append(h)
        return ml.tanh(h @ w)

    keeps(ml.as_layer(np.ones((1, 2))))
    with pytest.raises(ml.OperandError, match=r"return it from the cell instead") as info:
        anyio.run(ml.sum(kept[0] * 2.0).predict)
    assert [n for n in info.value.__notes__ if n.startswith("monadl: in argument;")]


def test_a_weight_made_in_a_cell_is_refused_at_its_line() -> None:
    """A "lazy init" in a marked cell (a new user's, as some PyTorch code
    does): each trace kept one hidden weight that trained and that no model
    held (``ml.save`` missed it), where the unmarked function made a fresh
    one per call. Refused while traced, with what to do; unmarked it runs."""

    def scaled(h: ml.ArrayLayer, k: int) -> ml.ArrayLayer:
        w = ml.Weight(np.ones((2, 2)))
        return h @ w * float(k)

    line = sys._getframe().f_lineno - 3
    with pytest.raises(
        ml.OperandError, match=r"operation \S*scaled: the cell made an ml\.Weight while it was traced"
    ) as info:
        ml.operation(scaled)(ml.as_layer(np.ones((1, 2))), 1)
    assert any(f.lineno == line for f in traceback.extract_tb(info.value.__traceback__))
    assert "make the weight outside the cell" in str(info.value)
    assert anyio.run(ml.sum(scaled(ml.as_layer(np.ones((1, 2))), 2)).predict) == 8.0


def _parts(xs: Any) -> list[Any]:
    return [y for x in xs for y in (_parts(x) if isinstance(x, (tuple, list)) else [x])]


def _total(xs: Any) -> ml.ArrayLayer:
    first, *rest = _parts(xs)
    out = ml.tanh(first.h if isinstance(first, State) else first)
    for x in rest:
        out = out + (x.h * x.c if isinstance(x, State) else x)
    return out


class _Scaled:
    """A model whose cell is a method marked as an operation: refused, with what to do."""

    def __init__(self, scale: float) -> None:
        self.w = ml.Weight(np.full((2, 2), scale))
        self.bound = ml.operation(self._cell)

    @ml.operation
    def cell(self, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(x @ self.w)

    def _cell(self, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(x @ self.w)


def test_a_method_marked_in_its_class_is_refused_with_what_to_do() -> None:
    one, two = _Scaled(1.0), _Scaled(2.0)
    with pytest.raises(ml.OperandError, match=r"self.cell = ml.operation\(self._cell\)"):
        _ = one.cell
    assert isinstance(_Scaled.cell, ml.Operation)  # (read from the class: the operation itself)
    x = np.ones((1, 2))  # the bound method marked per object: each its own weights
    values = [anyio.run(ml.sum(m.bound(x)).predict) for m in (one, two)]
    np.testing.assert_allclose(values, [2 * np.tanh(2.0), 2 * np.tanh(4.0)], rtol=1e-12)


def test_a_function_as_a_class_attribute_binds_no_object() -> None:
    import functools

    w = ml.Weight(np.ones(2))

    def scaled(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return w * x

    class Holder:
        partial = ml.operation(functools.partial(lambda w, x: w * x, w))
        function = ml.operation(scaled)
        anonymous = ml.operation(lambda x: w * x)

    holder = Holder()
    for f in (holder.partial, holder.function, holder.anonymous):
        assert anyio.run(f(np.full(2, 3.0)).predict).tolist() == [3.0, 3.0]


def test_a_deep_copy_of_a_traced_model_trains_its_own_weights() -> None:
    """A target network or a "best model" snapshot made by deepcopy after
    the cell was traced read and stepped the original's weight: the copied
    operation kept the original's traces, keyed by the original's id."""
    import copy

    model = _Scaled(1.0)
    model.w.optimizer = ml.optim.sgd(0.5)
    x = np.ones((1, 2))
    anyio.run(ml.sum(model.bound(x)).train)  # (traced: its trace holds model.w)
    before = model.w.data.copy()
    snapshot = copy.deepcopy(model)
    assert snapshot.bound is not model.bound
    anyio.run(ml.sum(snapshot.bound(x)).train)
    np.testing.assert_array_equal(model.w.data, before)
    np.testing.assert_allclose(snapshot.w.data, before - 0.5 * (1 - np.tanh(2 * before) ** 2), rtol=1e-12)
    snapshot.w.data = np.zeros((2, 2))
    assert anyio.run(ml.sum(snapshot.bound(x)).predict) == 0.0
    assert anyio.run(ml.sum(model.bound(x)).predict) == pytest.approx(2 * np.tanh(2 * before[0, 0]), rel=1e-12)


def test_a_copied_partials_operation_reads_the_copied_arguments() -> None:
    import copy
    import functools

    def scaled(w: ml.ArrayWeight, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return w * x

    w = ml.Weight(np.ones(2))
    op = ml.operation(functools.partial(scaled, w))
    assert anyio.run(op(np.ones(2)).predict).tolist() == [1.0, 1.0]
    (copied_w, copied) = copy.deepcopy((w, op))
    copied_w.data = np.full(2, 5.0)
    assert anyio.run(copied(np.ones(2)).predict).tolist() == [5.0, 5.0]
    assert anyio.run(op(np.ones(2)).predict).tolist() == [1.0, 1.0]
    shallow = copy.copy(op)  # (the same arguments: the same values, its own traces)
    assert shallow is not op and shallow.__name__ == op.__name__
    assert anyio.run(shallow(np.ones(2)).predict).tolist() == [1.0, 1.0]


def test_a_copied_closures_operation_reads_copies_and_a_plain_functions_is_itself() -> None:
    """A closure's operation copies with copies of what its closure holds: a
    new user's model marking ``def cell(h, x)`` over ``self`` (or a lambda
    over its weights) in ``__init__`` copied as itself, so an ensemble of
    deep copies trained the original's cell weights, silently, and the
    copies' never moved. A function without a closure copies as itself
    (Python copies no function), traces and all."""
    import copy

    class Model:
        def __init__(self) -> None:
            self.w = ml.Weight(np.ones((2, 2)), optimizer=ml.optim.sgd(0.5))
            w = self.w

            def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
                return ml.tanh(x @ self.w)

            self.cell = ml.operation(cell)
            self.local = ml.operation(lambda x: ml.tanh(x @ w))

    class Helper:  # (a helper closure the cell calls, a default argument: copied too)
        def __init__(self) -> None:
            self.w = ml.Weight(np.ones((2, 2)), optimizer=ml.optim.sgd(0.5))
            lock = threading.Lock()  # (what does not copy is held as it is: deepcopy still works)
            xp = np  # (a module: held as it is)

            def project(h: ml.ArrayOperand) -> ml.ArrayLayer:
                with lock:
                    assert xp is np
                    return h @ self.w

            self.cell = ml.operation(lambda x: ml.tanh(project(x) * 0.5) * 2.0 + 0.0 * ml.sum(x @ self.w))
            self.local = ml.operation(lambda x, w=self.w: ml.tanh(x @ w))

    x = np.ones((1, 2))
    for name in ("cell", "local"):
        helped = Helper()
        anyio.run(ml.sum(getattr(helped, name)(x)).train)
        before = helped.w.data.copy()
        helped_copy = copy.deepcopy(helped)
        anyio.run(ml.sum(getattr(helped_copy, name)(x)).train)
        np.testing.assert_array_equal(helped.w.data, before)
        assert not np.array_equal(helped_copy.w.data, before)
    for name in ("cell", "local"):
        model = Model()
        anyio.run(ml.sum(getattr(model, name)(x)).train)  # (traced: its trace holds model.w)
        before = model.w.data.copy()
        copied = copy.deepcopy(model)
        assert getattr(copied, name) is not getattr(model, name)
        anyio.run(ml.sum(getattr(copied, name)(x)).train)
        np.testing.assert_array_equal(model.w.data, before)  # the original's weight did not move
        np.testing.assert_allclose(copied.w.data, before - 0.5 * (1 - np.tanh(2 * before) ** 2), rtol=1e-12)
    state = {"w": ml.Weight(np.ones(2))}
    nested = ml.operation(lambda x: state["w"] * x)  # (a dict the closure holds: copied with it)
    copied_nested = copy.deepcopy(nested)
    copied_nested.__wrapped__.__closure__[0].cell_contents["w"].data = np.full(2, 3.0)  # type: ignore[index]
    assert anyio.run(copied_nested(np.ones(2)).predict).tolist() == [3.0, 3.0]
    assert anyio.run(nested(np.ones(2)).predict).tolist() == [1.0, 1.0]

    scale = 1.0  # (one variable two functions share: one in the copy too)

    def set_scale(value: float) -> None:
        nonlocal scale
        scale = value

    pair = copy.deepcopy((ml.operation(lambda x: ml.as_layer(x) * scale), ml.operation(set_scale)))
    pair[1].__wrapped__(3.0)  # (the copy's setter: the copy's variable)
    assert anyio.run(pair[0](np.ones(2)).predict).tolist() == [3.0, 3.0]
    assert scale == 1.0

    def plain(x: ml.ArrayOperand) -> ml.ArrayLayer:  # (no closure: the module's names only)
        return ml.tanh(x)

    op = ml.operation(plain)
    assert copy.deepcopy(op) is op
    assert copy.deepcopy({"cell": op})["cell"] is op


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize(
    "reads",
    [
        lambda v: ml.softmax(v, axis=0),
        lambda v: ml.log_softmax(v, axis=0),
        lambda v: ml.concatenate([v, v], axis=0),
        lambda v: ml.sum(v, axis=0),
        lambda v: ml.transpose(v),
        lambda v: v[:1],
    ],
)
def test_an_output_no_stacked_argument_reaches_sums_its_members_deltas(
    batching: bool, reads: Callable[[Any], Any]
) -> None:
    # Such an output is one value broadcast to the group's members; its steps ran once, unstacked.
    v = ml.Weight(np.random.default_rng(4).normal(size=(2, 3)))

    def cell(x: ml.ArrayOperand) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        return ml.tanh(x), reads(v)

    def loss(f: Callable[[ml.ArrayOperand], tuple[ml.ArrayLayer, ml.ArrayLayer]]) -> ml.ScalarLayer:
        outs = [f(np.full((1, 3), float(i))) for i in range(4)]
        return ml.sum(ml.stack([ml.sum(a) + ml.sum(b * float(i + 1)) for i, (a, b) in enumerate(outs)]))

    with ml.settings(batching=False):
        expected = anyio.run(ml.gradients, loss(cell), [v])
    with ml.settings(batching=batching):
        got = anyio.run(ml.gradients, loss(ml.operation(cell)), [v])
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batching", [False, True])
def test_a_weight_only_an_unused_output_reads_is_not_reached(batching: bool) -> None:
    # As the unmarked function's unused layers: no gradient, no step (Adam's momentum would move it).
    from monadl.runtime import entry

    w = ml.Weight(np.array([[1.0, 2.0]]), optimizer=ml.optim.adam(0.1))
    u = ml.Weight(np.array([[0.5, 0.5]]), optimizer=ml.optim.adam(0.1))
    cell = ml.operation(lambda a, b: (ml.tanh(a) * 2.0, ml.tanh(b)))
    with ml.settings(batching=batching):
        anyio.run(ml.sum(w * w).train)  # (a step before: w has momentum)
        before = w.data.copy()
        loss = ml.sum(ml.stack([ml.sum(cell(u * float(i), w * 1.0)[0]) for i in range(3)]))
        _, grads = anyio.run(entry.gradients, loss)
        anyio.run(loss.train)
    assert u in grads and w not in grads
    np.testing.assert_array_equal(w.data, before)


def test_the_finite_check_reads_an_operations_outputs_deltas() -> None:
    # The deltas of a node with two outputs reach the check as one OutputsDelta.
    w = ml.Weight(np.ones((2, 2)))
    pair = ml.operation(lambda x: (ml.tanh(x @ w), x * 2.0))
    a, b = pair(ml.Weight(np.ones((1, 2))) * 1.0)
    with ml.settings(check_finite=True):
        grads = anyio.run(ml.gradients, ml.sum(a) + ml.sum(b), [w])
    np.testing.assert_allclose(grads[0], np.full((2, 2), 1.0 - np.tanh(2.0) ** 2), rtol=1e-12)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:invalid value encountered in log")
async def test_check_finite_names_the_line_inside_the_cell_that_made_the_nan() -> None:
    w = ml.Weight(np.array([1.0, -1.0]))

    @ml.operation
    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        y = ml.log(x * w)  # the NaN
        return y * 2.0

    inner = sys._getframe().f_lineno - 3
    out = cell(np.ones(2))
    called = sys._getframe().f_lineno - 1
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as raised:
        await ml.sum(out).predict()
    assert re.search(
        rf"^log produced a NaN or an infinity from float64\[2\]; layer built at .*test_operation.py:{inner},"
        rf" inside the operation .*cell called at .*test_operation.py:{called}$",
        str(raised.value),
    )


@dataclass(frozen=True)
class _Held:
    x: ml.ArrayLayer


@dataclass
class _WithHidden:
    h: ml.ArrayLayer
    aux: ml.ArrayLayer | None = field(default=None, init=False)


@pytest.mark.anyio
async def test_a_dataclass_nested_in_a_result_keeps_its_own_outputs() -> None:
    w = ml.Weight(np.array([1.0, 2.0]))

    def cell(x: ml.ArrayOperand) -> tuple[_Held, ml.ArrayLayer]:
        return _Held(ml.tanh(x * w)), x * w  # (the dataclass got both outputs: a TypeError at every call)

    (box, other), (plain_box, plain_other) = ml.operation(cell)(np.ones(2)), cell(np.ones(2))
    np.testing.assert_allclose(await box.x.predict(), await plain_box.x.predict())
    np.testing.assert_allclose(await other.predict(), await plain_other.predict())


@dataclass(frozen=True)
class _Derived:
    h: ml.ArrayLayer
    twice: ml.ArrayLayer = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "twice", self.h * 2.0)


@pytest.mark.anyio
async def test_a_dataclass_keeps_the_fields_its_constructor_does_not_take() -> None:
    # Rebuilt through its constructor, a field set after it came back as its default: a wrong value, silently.
    w, v = ml.Weight(np.ones(2)), ml.Weight(np.full(2, 3.0))
    state = _WithHidden(ml.tanh(w))
    state.aux = v * 5.0

    def cell(s: _WithHidden) -> _WithHidden:
        assert s.aux is not None
        out = _WithHidden(s.h + s.aux)
        out.aux = s.aux * 2.0
        return out

    marked, plain = ml.operation(cell)(state), cell(state)
    assert marked.aux is not None and plain.aux is not None
    for a, b in ((marked.h, plain.h), (marked.aux, plain.aux)):
        np.testing.assert_allclose(await a.predict(), await b.predict())
    got = await ml.gradients(ml.sum(marked.h) + ml.sum(marked.aux), [w, v])
    want = await ml.gradients(ml.sum(plain.h) + ml.sum(plain.aux), [w, v])
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h)
    derived = ml.operation(lambda d: d.twice + 1.0)(_Derived(ml.tanh(w)))  # (one derived in __post_init__)
    np.testing.assert_allclose(await derived.predict(), 2.0 * np.tanh(1.0) + 1.0)


@pytest.mark.anyio
async def test_equal_dict_keys_of_other_types_are_other_signatures() -> None:
    @ml.operation
    def keyed(d: dict[Any, ml.Weight[ml.Array, ml.Array]]) -> ml.ArrayLayer:
        (key,) = d
        return d[key] * (2.0 if type(key) is bool else 3.0)

    x = ml.Weight(np.ones(1))
    assert [float((await keyed({k: x}).predict())[0]) for k in (True, 1, 1.0)] == [2.0, 3.0, 3.0]

    @ml.operation
    def flagged(x: ml.Weight[ml.Array, ml.Array], flags: frozenset[Any]) -> ml.ArrayLayer:
        return x * (2.0 if any(type(f) is bool for f in flags) else 3.0)

    sets = [frozenset({1}), frozenset({True}), frozenset({(1, frozenset({1.0}))}), frozenset({(1, frozenset({1}))})]
    assert [float((await flagged(x, s).predict())[0]) for s in sets[:2]] == [3.0, 2.0]  # (a static frozenset too)
    shapes = {flatten(s, [], [], []) for s in sets}  # (an operation's signature of each)
    assert len(shapes) == 4  # nested members keep their types


def test_layers_in_a_dict_subclass_are_refused_with_what_to_pass() -> None:
    from collections import OrderedDict

    x = ml.Weight(np.ones(1))
    with pytest.raises(ml.OperandError, match="layers in a OrderedDict are not read as arguments; pass a plain dict"):
        ml.operation(lambda d: d["a"] * 2.0)(OrderedDict(a=x))  # (it said 'built outside the call')


@pytest.mark.anyio
async def test_a_numpy_integer_scalar_keeps_a_float32_model_float32() -> None:
    w = ml.Weight(np.ones(2, np.float32))
    two: Any = np.int64(2)  # (typed operands take no NumPy integer scalar; NumPy code makes them all the same)

    def cell(v: ml.ArrayOperand) -> ml.ArrayLayer:
        scale: Any = np.int32(2)  # (as a user's NumPy code makes them)
        shift: Any = np.bool_(True)
        out: ml.ArrayLayer = ml.as_layer(v) * scale + shift
        return out

    for out in (w * two, ml.operation(cell)(w)):
        assert (await out.predict()).dtype == np.float32  # (NumPy's promotion: float64)
        [g] = await ml.gradients(ml.sum(out + np.ones(2, np.float32)), [w])  # (a DTypeError, before)
        assert g.dtype == np.float32


def test_numpy_integers_and_bools_are_static_arguments_as_pythons_are() -> None:
    # A node count read from a NumPy record was a layer inside the cell: 'segment_sum: num_segments
    # must be an integer, got Layer(argument, ...)'.
    w = ml.Weight(np.eye(2))

    def mp(h: Any, src: Any, dst: Any, n: Any, relu: Any) -> Any:
        out = ml.segment_sum(h[src] @ w, dst, n)
        return ml.relu(out) if relu else out

    marked = ml.operation(mp)
    h = ml.as_layer(np.arange(6.0).reshape(3, 2) - 2.0)
    src, dst = np.array([0, 1]), np.array([1, 2])
    for n, relu in ((np.int64(3), np.bool_(False)), (np.int32(4), np.bool_(True)), (np.int64(3), np.bool_(False))):
        got = anyio.run(marked(h, src, dst, n, relu).predict)
        np.testing.assert_array_equal(got, anyio.run(mp(h, src, dst, n, relu).predict))
        assert got.shape == (int(n), 2)
    assert len(marked._traces) == 2  # (by value, as 3 and False)
    with pytest.raises(ml.OperandError, match="a float argument is data"):
        ml.operation(lambda x, t: x * 2.0 if t else x)(h, np.float64(0.5))  # (NumPy's floats stay data)


def test_a_cell_that_returns_no_layer_is_refused() -> None:
    w = ml.Weight(np.ones(3))
    for returns, message in [
        (lambda a: 1.0, r"returns no layer \(float\)"),  # (the trace's own object at every call, before)
        (lambda a: {"n": 3}, r"returns no layer \(int\)"),
        (lambda a: None, r"returns no layer \(NoneType\)"),
        (lambda a: (a * 2.0).forward(), "returns a Do, a computation and not a layer"),
    ]:
        with pytest.raises(ml.OperandError, match=message):
            ml.operation(returns)(ml.as_layer(w))
    assert ml.operation(lambda a: a)(w) is w  # (an argument returned as it is: fine)
    assert ml.operation(lambda a: (a, w))(ml.as_layer(w))[1] is w  # (a weight: fine)


def test_past_its_limit_an_operation_forgets_one_trace_not_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cache was cleared when full: a cell called with 257 shapes in turn retraced
    # on almost every call (82 -> 186 us a call in a user's attention cell).
    from monadl.layers import _operation_traces, _tracing

    made: list[int] = []
    traced = _tracing.traced

    def counted(*args: Any) -> Any:
        made.append(1)
        return traced(*args)

    monkeypatch.setattr(_operation_traces, "traced", counted)
    w = ml.Weight(np.ones((2, 2)))

    @ml.operation
    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(x @ w)

    shapes = range(1, _operation_traces._TRACES_LIMIT + 2)  # (one more than it keeps, in turn, round after round)
    for _ in range(3):
        for n in shapes:
            cell(np.ones((n, 2)))
    again = len(made) - len(shapes)
    assert again < len(shapes) // 4  # (clearing all: about 2 x 257)
    assert len(cell._traces) == _operation_traces._TRACES_LIMIT
    anyio.run(ml.sum(cell(np.ones((3, 2)))).predict)


def test_a_cell_given_a_list_of_numbers_is_told_to_pass_an_array_not_to_join_layers() -> None:
    """Inside a trace the numbers are placeholder layers: the hint for a
    list of layers (join them) would mislead; a real list of layers keeps it."""
    w = ml.Weight(np.ones((2, 2)))

    @ml.operation
    def cell(x: Any) -> ml.ArrayLayer:
        return ml.tanh(x @ w)

    with pytest.raises(ml.OperandError) as info:
        cell([1.0, 2.0])
    assert type(info.value) is ml.OperandError
    assert str(info.value) == (
        "matmul: operand of type list is not a Layer, a Weight, an array or a number (inside the cell, a list of "
        "the numbers it was given: pass them as one array, np.asarray(xs); in monadl.fold, put Vector(n) before "
        "the Function)"
    )
    rows = [ml.as_layer(np.ones((1, 2))), ml.as_layer(np.ones((1, 2)))]
    with pytest.raises(ml.OperandError, match=r"\(join its layers with ml\.stack or ml\.concatenate\)$"):
        cell(rows)
    with pytest.raises(ml.OperandError, match=r"\(join its layers with ml\.stack or ml\.concatenate\)$"):
        cell([1.0, rows[0]])  # (a layer among the numbers: a join still)
    assert np.allclose(anyio.run(cell(np.array([1.0, 2.0])).predict), np.tanh([3.0, 3.0]))


def test_a_dtype_refused_inside_a_cell_names_the_call_as_a_shape_does() -> None:
    # A float64 state into a float32 cell named the line inside the cell alone: with 64
    # sequences' calls, not which call got it.
    w = ml.Weight(np.ones((4, 4), np.float32))
    cell = ml.operation(lambda h, c: ml.tanh(h @ w) * c)
    out = cell(np.ones((2, 4), np.float32), np.ones((2, 4)))  # the call
    call = f"{__file__}:{sys._getframe().f_lineno - 1}"
    with pytest.raises(ml.DTypeError) as caught:
        anyio.run(ml.sum(out).predict)
    assert str(caught.value).endswith(f", inside the operation {cell.__name__} called at {call}")


@dataclass(frozen=True, slots=True)
class _Pair:
    h: ml.ArrayLayer
    c: ml.ArrayLayer


@dataclass(frozen=True, slots=True)
class _Counted:
    h: ml.ArrayLayer

    def __post_init__(self) -> None:
        _made.append("counted")


@dataclass(slots=True)
class _Watched:
    h: ml.ArrayLayer

    def __setattr__(self, name: str, value: object) -> None:
        _made.append(name)
        object.__setattr__(self, name, value)


@dataclass(frozen=True)
class _Unslotted:
    h: ml.ArrayLayer


@dataclass(frozen=True, kw_only=True)
class _Named:
    h: ml.ArrayLayer
    c: ml.ArrayLayer


class _Positional(_Named):
    def __init__(self, h_in: ml.ArrayLayer, c_in: ml.ArrayLayer) -> None:  # (its own: takes them by position)
        super().__init__(h=h_in, c=c_in)


class _Counting(type):
    def __call__(cls, *args: object, **kwargs: object) -> object:
        _made.append("metaclass")
        return super().__call__(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class _Metered(metaclass=_Counting):
    h: ml.ArrayLayer


_made: list[str] = []


@pytest.mark.anyio
async def test_a_dataclass_result_is_made_as_its_constructor_makes_it() -> None:
    # A frozen slotted dataclass (a cell's state) is made per call by its slots' stores, not its
    # constructor (half the time); one whose constructor does more than store its fields is made by it,
    # every call; a keyword-only one by name (positionally it was a TypeError at every call).
    w = ml.Weight(np.array([1.0, 2.0]))
    pair = ml.operation(lambda x: _Pair(ml.tanh(x * w), x * w))
    for _ in range(2):  # (the first call traces, the second is made from the trace)
        made = pair(np.ones(2))
        assert type(made) is _Pair
        np.testing.assert_allclose(await made.h.predict(), np.tanh([1.0, 2.0]))
        np.testing.assert_allclose(await made.c.predict(), [1.0, 2.0])
    assert _dataclasses.maker(_Pair) is not _Pair
    got = await ml.gradients(ml.sum(made.h) + ml.sum(made.c), [w])
    np.testing.assert_allclose(got[0], 1.0 - np.tanh([1.0, 2.0]) ** 2 + 1.0)
    stores: dict[type[_Counted | _Watched | _Unslotted | _Metered], list[str]] = {
        _Metered: ["metaclass"],
        _Counted: ["counted"],
        _Watched: ["h"],
        _Unslotted: [],
    }
    for kind, stored in stores.items():
        op = ml.operation(lambda x, kind=kind: kind(ml.tanh(x * w)))
        op(np.ones(2))
        _made.clear()
        out = op(np.ones(2))
        assert type(out) is kind
        assert _made == stored
        np.testing.assert_allclose(await out.h.predict(), np.tanh([1.0, 2.0]))
        assert _dataclasses.maker(kind) is kind
    named = ml.operation(lambda s: _Named(h=s.c * 2.0, c=s.h))
    for _ in range(2):
        swapped = named(_Named(h=ml.tanh(w), c=w * 3.0))
        np.testing.assert_allclose(await swapped.h.predict(), [6.0, 12.0])
        np.testing.assert_allclose(await swapped.c.predict(), np.tanh([1.0, 2.0]))
    # A subclass of a keyword-only dataclass with a constructor of its own is made by it, positionally.
    positional = ml.operation(lambda s: _Positional(s.c * 2.0, s.h))
    for _ in range(2):
        swapped = positional(_Positional(ml.tanh(w), w * 3.0))
        assert type(swapped) is _Positional
        np.testing.assert_allclose(await swapped.h.predict(), [6.0, 12.0])
    assert _dataclasses.maker(_Positional) is _Positional


_SCALE = np.ones((1, 3))


def test_an_array_a_cell_reads_from_elsewhere_is_kept_not_copied() -> None:
    """As documented (a new user asked): an array the cell reads from a
    global is read at its trace and kept, so a change in place reaches later
    calls, as a layer's data are read when it runs; a rebinding does not."""
    global _SCALE

    @ml.operation
    def scaled(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return h * _SCALE

    x = ml.as_layer(np.ones((1, 3)))
    assert anyio.run(scaled(x).predict).tolist() == [[1.0, 1.0, 1.0]]
    _SCALE[:] = 2.0
    assert anyio.run(scaled(x).predict).tolist() == [[2.0, 2.0, 2.0]]
    _SCALE = np.full((1, 3), 3.0)
    assert anyio.run(scaled(x).predict).tolist() == [[2.0, 2.0, 2.0]]
