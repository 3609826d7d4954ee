"""`ml.operation`: NumPy reading a data argument past its placeholder is refused.

A constant indexed by a data argument, a constant's method taking it and a
copy of it read its buffer in C, where the placeholder's hooks are not asked;
the trace kept the first call's values for every later call (a graph cell
gathering rows by ``np.eye(n)[src] @ h`` trained on its first graph's edges).
"""

from __future__ import annotations

import inspect
import operator
import re
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

TABLE = np.arange(30.0).reshape(3, 10)
M = np.arange(9.0).reshape(3, 3)


@pytest.mark.parametrize(
    ("read", "argument"),
    [
        (lambda h, idx, x: np.eye(3)[idx] @ h, "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * TABLE[idx], "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * TABLE[:, idx], "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * TABLE.take(idx, axis=0), "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * TABLE[:2].repeat(idx, axis=0), "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * M.dot(x), "x (float64[3])"),
        (lambda h, idx, x: ml.sum(h) * np.array(idx), "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * np.array([idx]), "idx (int64[2])"),
        (lambda h, idx, x: ml.sum(h) * np.asarray(x, dtype=np.float32), "x (float64[3])"),
        (lambda h, idx, x: ml.sum(h) * np.frombuffer(x.tobytes()), "x (float64[3])"),
        (lambda h, idx, x: h[(TABLE[idx, 0] // 10).astype(int)], "idx (int64[2])"),
    ],
)
def test_numpy_reading_a_data_argument_past_its_placeholder_is_refused(
    read: Callable[[Any, Any, Any], Any], argument: str
) -> None:
    h = ml.Weight(np.arange(12.0).reshape(3, 4))

    def cell(h: Any, idx: Any, x: Any) -> Any:
        return read(h, idx, x)

    first, second = (np.array([0, 1]), np.array([1.0, 2.0, 3.0])), (np.array([2, 2]), np.array([5.0, -1.0, 0.5]))
    unmarked = [anyio.run(ml.as_layer(cell(h, *a)).predict) for a in (first, second)]
    assert not np.allclose(unmarked[0], unmarked[1])  # (the marked cell gave the first call's for both)
    with pytest.raises(ml.OperandError) as caught:
        ml.operation(cell)(h, *first)
    message = str(caught.value)
    assert message.startswith(f"operation {cell.__qualname__}: NumPy read the values of its data argument {argument}")
    assert message.endswith(
        "compute it before the call and pass the result, or compute it with monadl functions on the argument "
        "(ml.as_layer(TABLE)[idx], ml.embedding(TABLE, idx), ml.as_layer(M) @ x)"
    )


def test_the_refusal_names_the_layer_that_takes_what_was_read() -> None:
    h = ml.Weight(np.arange(12.0).reshape(3, 4))

    def cell(h: Any, src: Any) -> Any:
        gather = np.eye(3)[src]
        return gather @ h

    line = inspect.getsourcelines(cell)[1] + 2
    with pytest.raises(ml.OperandError, match=re.escape(f"built the layer at {__file__}:{line} from another constant")):
        ml.operation(cell)(h, np.array([0, 1]))


def test_a_read_that_fails_on_other_values_is_refused_with_its_error() -> None:
    h = ml.Weight(np.arange(12.0).reshape(3, 4))
    with pytest.raises(ml.OperandError, match=r"the cell raised IndexError \(index 3 is out of bounds") as caught:
        ml.operation(lambda h, src: np.eye(3)[src] @ h)(h, np.array([1, 2]))  # (2 + 1 is no row)
    assert isinstance(caught.value.__cause__, IndexError)


def test_an_inner_operation_is_named_where_it_reads_a_value() -> None:
    h = ml.Weight(np.arange(12.0).reshape(3, 4))

    @ml.operation
    def inner(h: Any, idx: Any) -> Any:
        return ml.sum(h) * TABLE[idx]

    @ml.operation
    def outer(h: Any, rows: Any) -> Any:
        return ml.tanh(inner(h, rows))

    with pytest.raises(
        ml.OperandError, match=rf"^operation {inner.__name__}: NumPy read the values of its data argument idx"
    ):
        outer(h, np.array([0, 1]))


@pytest.mark.parametrize("batching", [False, True])
def test_cells_that_read_no_values_keep_one_trace_and_each_calls_values(batching: bool) -> None:
    # The check runs the cell twice per signature, on other values: reading shapes, dtypes,
    # indices given to monadl, NaN and infinity among the data are no reads.
    h = ml.Weight(np.arange(12.0).reshape(3, 4) / 10)
    table = ml.Weight(np.arange(20.0).reshape(5, 4) / 10)
    runs: list[int] = []

    def cell(h: Any, idx: Any, x: Any, mask: Any) -> Any:
        runs.append(1)
        scale = float(idx.shape[0]) if idx.dtype.kind == "i" else 1.0
        rows = ml.embedding(table, idx) + h[idx] + ml.segment_sum(h[idx], idx, 3)[idx]
        return ml.sum(rows * scale) + ml.sum(ml.as_layer(x) * mask) + ml.cross_entropy(h[idx][:, :3], idx)

    marked = ml.operation(cell)
    calls = [
        (np.array([0, 2]), np.array([1.0, np.nan, 3.0, 4.0]), np.array([True, False, True, True])),
        (np.array([1, 1]), np.array([1e300, 2.0, np.inf, -4.0]), np.array([False, False, True, False])),
        (np.array([2, 0]), np.array([0.5, 2.0, 2.0, 4.0]), np.array([True, True, True, True])),
    ]
    with ml.settings(batching=batching):
        got = anyio.run(ml.stack([marked(h, *a) for a in calls]).predict)
        [grad] = anyio.run(ml.gradients, ml.sum(ml.stack([marked(h, *a) for a in calls[1:]])), [h])
    assert len(runs) == 2 and len(marked._traces) == 1  # (once, and once on other values)
    want = anyio.run(ml.stack([cell(h, *a) for a in calls]).predict)
    [want_grad] = anyio.run(ml.gradients, ml.sum(ml.stack([cell(h, *a) for a in calls[1:]])), [h])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12)


def test_a_cell_given_no_arrays_runs_once() -> None:
    runs: list[int] = []

    def cell(h: Any, t: float, n: int) -> Any:
        runs.append(1)
        return h * t * float(n)

    ml.operation(cell)(ml.Weight(np.ones(2)), 2.0, 3)
    assert runs == [1]


def test_a_cell_holding_a_random_constant_is_left_as_before() -> None:
    # It records another program on the same arguments: not a read of theirs (the docs: what the
    # cell reads from elsewhere is read once, at its trace).
    h = ml.Weight(np.arange(12.0).reshape(3, 4))
    rng = np.random.default_rng(0)
    marked = ml.operation(lambda h, idx: h[idx] * rng.normal(size=4))
    first = anyio.run(marked(h, np.array([0, 1])).predict)
    again = anyio.run(marked(h, np.array([0, 1])).predict)
    np.testing.assert_array_equal(first, again)


def test_the_other_values_differ_in_every_element_and_keep_shape_and_dtype() -> None:
    from monadl.layers._unread import perturbed

    xs = [
        np.array([np.nan, np.inf, -np.inf, 1e300, 0.5, -1.0]),
        np.array([np.nan, 3.0, 6e4], np.float16),
        np.array(2.0),
        np.array([0, 255], np.uint8),
        np.array([[True, False]]),
        np.array([complex(np.nan, 1.0), 2j]),
    ]
    kept = ["static", np.array(["x"]), np.zeros(0)]
    others = perturbed([*xs, *kept])
    assert others is not None
    for x, y in zip(xs, others):
        assert type(y) is np.ndarray and y.shape == x.shape and y.dtype == x.dtype
        assert not np.any((x == y) | (np.isnan(y) if y.dtype.kind in "fc" else False))
    assert all(map(operator.is_, others[len(xs) :], kept))
    assert perturbed([np.array(["x"]), np.zeros(0), 1.0]) is None  # (nothing to change: traced once)


def test_the_other_values_take_one_array_the_size_of_the_argument() -> None:
    # A 160 MB data argument took 340 MB more and 0.8 s at its first call: x + 1, three masks
    # and np.where's result, each of the argument's size.
    import tracemalloc

    from monadl.layers._unread import perturbed

    x = np.asfortranarray(np.arange(600_000.0).reshape(1000, 600))
    x[::7, ::5] = np.nan
    x[3::11, 1::3] = np.inf
    x[::13] = 2.0**60
    tracemalloc.start()
    try:
        others = perturbed([x, x[::2, ::3]])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert others is not None
    assert peak < (x.nbytes + x[::2, ::3].nbytes) * 1.05
    for a, y in zip([x, x[::2, ::3]], others):
        assert y.shape == a.shape and y.dtype == a.dtype
        assert not np.any((a == y) | np.isnan(y))
        np.testing.assert_array_equal(np.where(np.isfinite(a) & (a < 2.0**53), a + 1, 0.5), y)

    w = ml.Weight(np.ones(600))
    cell = ml.operation(lambda w, x: ml.sum(ml.as_layer(x) @ w))
    tracemalloc.start()
    try:
        cell(w, x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < x.nbytes * 1.05
