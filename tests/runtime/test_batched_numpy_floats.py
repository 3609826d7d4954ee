"""A NumPy float that differs per call (a temperature from ``np.linspace``)
batches as a Python float does, each call's value and dtype kept.

A new user's cell ``softmax((x @ w) / temp)`` on float32 data with
``np.float64`` temperatures ran its 128 calls one by one (5.7x the same
numbers as Python floats): inside the operation, the stacked temperatures
were a float64 array beside float32 ones, which one call's rule refuses.
Unmarked, a stacked column of them beside a 0-d float32 weight made the
group float64 where each node alone is float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from tests._batched_groups import groups_run

N = 12
NUMBERS: list[Callable[[float], Any]] = [np.float64, np.float32, np.float16, float]
DATA = [np.float32, np.float64, np.float16]


def _bodies(dtype: Any) -> dict[str, tuple[Callable[[Any, Any], Any], ml.Weight[Any, Any]]]:
    """Where a call's float meets the call's other operands: its data, a 0-d
    weight alone, a scalar layer (a NumPy scalar, ``ml.sum``'s), a Python float."""
    w = ml.Weight(np.linspace(0.5, 1.5, 4, dtype=dtype).reshape(1, 4))
    w0 = ml.Weight(np.array(0.7, dtype))
    return {
        "data": (lambda x, t: ml.tanh(x * w) / t, w),
        "0-d weight": (lambda x, t: w0 * t + w0, w0),
        "scalar layer": (lambda x, t: ml.sum(x * w) * t, w),
        "Python float": (lambda x, t: x * w * (t * 2.0 + 1.0), w),
    }


def _calls(body: Callable[[Any, Any], Any], make: Callable[[float], Any], dtype: Any) -> ml.ArrayLayer:
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(1, 4)).astype(dtype) for _ in range(N)]
    return ml.stack([body(x, make(t)) for x, t in zip(xs, np.linspace(0.5, 2.0, N))])


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "operation"])
@pytest.mark.parametrize("dtype", DATA, ids=lambda d: d.__name__)
@pytest.mark.parametrize("make", NUMBERS, ids=lambda k: k.__name__)
def test_a_numpy_float_per_call_batches_with_each_calls_values_and_dtypes(
    make: Callable[[float], Any], dtype: Any, marked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = groups_run(monkeypatch)
    for name, (body, w) in _bodies(dtype).items():
        f = ml.operation(body) if marked else body
        results = {}
        for batching in (True, False):  # (batched first: no call of the operation has run yet)
            ran.clear()
            rows = _calls(f, make, dtype)
            with ml.settings(batching=batching):
                value = anyio.run(rows.predict)
                (grad,) = anyio.run(ml.gradients, ml.sum(rows), [w])
            results[batching] = value, grad, list(ran)
        (got, got_grad, groups), (want, want_grad, _) = results[True], results[False]
        assert got.dtype == want.dtype and grad.dtype == want_grad.dtype, name
        assert np.array_equal(got, want), name  # (elementwise: the same roundings, member by member)
        # (the weight's delta: the members' summed in another order)
        scale = (1e-2 if want_grad.dtype == np.float16 else 1e-6) * float(np.max(np.abs(want_grad)))
        np.testing.assert_allclose(got_grad, want_grad, rtol=0, atol=scale, err_msg=name)
        assert groups and all(n == N for _, n in groups), name  # each step's calls (or nodes) one group


def test_the_users_cell_runs_its_calls_as_one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    w = ml.Weight((rng.normal(size=(16, 16)) / 8).astype(np.float32))

    @ml.operation
    def cell(x: ml.ArrayOperand, temp: ml.ScalarOperand) -> ml.ArrayLayer:
        return ml.softmax((x @ w) / temp, axis=-1)

    xs = [rng.normal(size=(1, 16)).astype(np.float32) for _ in range(32)]
    temps = list(np.linspace(0.5, 2.0, 32))  # np.float64 items
    ran = groups_run(monkeypatch)
    values: dict[bool, tuple[Any, Any]] = {}
    for batching in (True, False):
        ran.clear()
        loss = ml.sum(ml.concatenate([cell(x, t) ** 2 for x, t in zip(xs, temps)], axis=0))
        with ml.settings(batching=batching):
            values[batching] = anyio.run(loss.predict), anyio.run(ml.gradients, loss, [w])[0]
        if batching:
            # The calls one group (and their squares), in predict and in gradients.
            cells = [n for name, n in ran if name.rsplit("#", 1)[0].endswith(".cell")]
            assert cells == [32, 32] and {n for _, n in ran} == {32}
    assert values[True][0].dtype == values[False][0].dtype == np.float32
    assert values[True][1].dtype == np.float32
    assert abs(values[True][0] - values[False][0]) <= 1e-6 * abs(values[False][0])
    np.testing.assert_allclose(values[True][1], values[False][1], rtol=1e-5, atol=1e-7)


WEIGHTS: list[Callable[[], Any]] = [
    lambda: ml.Weight(np.array(0.3, np.float16)),
    lambda: ml.Weight(np.array(0.3, np.float32)),
    lambda: ml.Weight(np.float32(0.3)),
    lambda: ml.Weight(np.full(3, 0.3, np.float32)),
]


@pytest.mark.parametrize("marked", [False, True])
@pytest.mark.parametrize("number", [np.float64, np.float16, float])
@pytest.mark.parametrize("weight", range(len(WEIGHTS)))
def test_where_of_a_weight_and_a_number_per_call_keeps_each_calls_dtype(marked: bool, number: Any, weight: int) -> None:
    # A new user's differential fuzzing: where(True, a 0-d float32 weight, np.float64(i)) was float64 batched
    # and float32 node by node (where casts its two sides as a binary op does; the group cast nothing).
    results = []
    for batching in (True, False):
        w = WEIGHTS[weight]()
        chosen = functools.partial(ml.where, True, w)  # (bound now: one weight a pass)
        cell: Callable[[Any], Any] = ml.operation(chosen) if marked else chosen
        ys = [cell(number(i / 10)) for i in range(N)]
        with ml.settings(batching=batching):
            values = anyio.run(ml.Layer(ml.Do.gather([y.forward() for y in ys]).map(lambda tapes: tapes[0])).predict)
            _, grads = anyio.run(ml.value_and_gradients, ml.stack(ys))
        results.append((type(values), np.asarray(values).dtype, type(grads[w]), np.asarray(grads[w]).dtype))
    assert results[0] == results[1]


def test_a_scalars_sigmoid_and_a_0d_weights_gradient_are_of_one_kind_batched_or_not() -> None:
    kinds = []
    for batching in (True, False):
        w = ml.Weight(np.array(0.5))
        with ml.settings(batching=batching):
            ys = [ml.sigmoid(w * float(i)) for i in range(N)]
            value = anyio.run(ys[1].predict)
            _, grads = anyio.run(ml.value_and_gradients, ml.sum(ml.stack(ys)))
        kinds.append((type(value), type(grads[w]), np.ndim(grads[w])))
    expected: Any = (np.float64, np.ndarray, 0)  # (a 0-d array weight's gradient: a 0-d array)
    assert kinds[0] == kinds[1] == expected


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "operation"])
def test_a_numpy_float_per_call_beside_a_scalar_layer_is_of_the_layers_dtype_in_one_group(
    marked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group's scalar layers are tensors, not numbers, wherever they come from: a row of an earlier group
    # (each call's ml.sum), one shared by all (ml.sum(w)), a stacked column of the members' own. Each member's
    # np.float64 then takes their float32, as it does node by node (both were float64 before).
    w = ml.Weight(np.linspace(0.5, 1.5, 4, dtype=np.float32).reshape(1, 4))
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(1, 4)).astype(np.float32) for _ in range(N)]
    temps = np.linspace(0.5, 2.0, N)
    shared = ml.sum(w)

    def body(x: Any, t: Any, s: Any) -> Any:
        return ml.sum(x * w) * t + s * t + ml.where(True, ml.mean(x * w), t)

    cell = ml.operation(body) if marked else body
    ran = groups_run(monkeypatch)
    results = {}
    for batching in (True, False):
        ran.clear()
        rows = ml.stack([cell(x, t, shared) for x, t in zip(xs, temps)])
        with ml.settings(batching=batching):
            results[batching] = anyio.run(rows.predict), anyio.run(ml.gradients, ml.sum(rows), [w])[0], list(ran)
    (got, got_grad, groups), (want, want_grad, _) = results[True], results[False]
    assert got.dtype == want.dtype == np.float32 and got_grad.dtype == want_grad.dtype == np.float32
    by_hand = [
        np.sum(x * w.data) * np.float32(t) + np.sum(w.data) * np.float32(t) + np.mean(x * w.data)
        for x, t in zip(xs, temps)
    ]
    np.testing.assert_allclose(want, by_hand, rtol=1e-6)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6)
    assert groups and all(n % N == 0 for _, n in groups)  # (all the calls' nodes of one kind: one group)


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "operation"])
@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("condition", ["True", "0-d", "mask"])
def test_where_between_two_weights_casts_its_sides_as_between_layers(
    marked: bool, batching: bool, condition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # where(c, a, b) of a 0-d float16 weight and Weight(np.float32(2.0)) was float16 unmarked and float32
    # marked: unmarked, a node whose two last operands are weights took the dense layer's branch, which
    # cast only same-dtype primitives' operands; where(c, a, b * 1.0) was float32 (two tensors promote).
    a, b = ml.Weight(np.array(0.7, np.float16)), ml.Weight(np.float32(2.0))
    masks: dict[str, Callable[[int], Any]] = {
        "True": lambda i: True,
        "0-d": lambda i: np.array(i % 2 == 0),
        "mask": lambda i: np.arange(3) < i % 4,
    }

    def cell(c: Any) -> Any:
        return ml.where(c, a, b)

    f: Callable[[Any], Any] = ml.operation(cell) if marked else cell
    ran = groups_run(monkeypatch)
    ys = [f(masks[condition](i)) for i in range(N)]
    with ml.settings(batching=batching):
        values = [anyio.run(y.predict) for y in ys[:2]]
        got = anyio.run(ml.stack(ys).predict)
        _, grads = anyio.run(ml.value_and_gradients, ml.sum(ml.stack(ys)))
    want = [np.where(masks[condition](i), np.float32(a.data), b.data) for i in range(N)]
    assert all(np.asarray(v).dtype == np.float32 for v in values) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.stack(want))
    ga, gb = grads[a], grads[b]
    assert (type(ga), np.asarray(ga).dtype.type, type(gb)) == (np.ndarray, np.float16, np.float32)  # (each its own)
    assert ran or not batching or condition == "True"  # (a call of no operands but its weights: one node)
