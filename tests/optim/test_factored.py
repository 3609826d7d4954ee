"""A large weight's gradient from a few rows, kept as factors (`monadl.deltas.Outer`):
the same gradients and steps as the multiplied-out product, arrays wherever a user
looks, and a finite check that still refuses every non-finite step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import monadl as ml
import monadl.layers._products as products
import monadl.optim._sgd as sgd
from monadl._blas import can_add_product
from monadl.deltas import Outer
from monadl.runtime import entry

pytestmark = pytest.mark.anyio

ROWS, FEATURES, HIDDEN = 4, 512, 256  # a 131,072-element weight, factors of 3,072 elements


@pytest.fixture
def unfactored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every product's delta multiplied out in the backward, as before factors."""
    monkeypatch.setattr(products, "_FACTORED", 1 << 62)


def model(dtype: Any = np.float32, rate: float = 0.1) -> tuple[ml.Weight[Any, Any], ml.Weight[Any, Any], Any]:
    rng = np.random.default_rng(0)
    w = ml.Weight((rng.standard_normal((FEATURES, HIDDEN)) * 0.05).astype(dtype), optimizer=ml.optim.sgd(rate))
    b = ml.Weight(np.zeros(HIDDEN, dtype), optimizer=ml.optim.sgd(rate))
    x = rng.standard_normal((ROWS, FEATURES)).astype(dtype)
    return w, b, x


def loss(w: ml.Weight[Any, Any], b: ml.Weight[Any, Any], x: Any) -> ml.ScalarLayer:
    h = ml.relu(ml.dense(x, w, b))
    return ml.sum(h * h) + ml.sum(ml.relu(x[:2] @ w))  # w used twice: two products' factors, summed


def test_a_large_weights_rule_is_marked_and_a_small_ones_is_not() -> None:
    assert type(products.outer_rule(np.ones((16, 512)), np.ones((512, 256)))) is products.OuterRule
    assert type(products.outer_rule(np.ones((16, 64)), np.ones((64, 64)))) is not products.OuterRule
    # factors larger than the product: the product, multiplied in the backward
    assert type(products.outer_rule(np.ones((1024, 512)), np.ones((512, 256)))) is not products.OuterRule


async def test_gradients_are_arrays_equal_to_the_multiplied_out_ones(request: pytest.FixtureRequest) -> None:
    w, b, x = model()
    value, grads = await entry.gradients(loss(w, b, x))
    heard: dict[Any, Any] = {}
    await entry.gradients(loss(w, b, x), on_gradient=heard.__setitem__)
    (listed,) = await ml.gradients(loss(w, b, x), [w])
    request.getfixturevalue("unfactored")
    expected_value, expected = await entry.gradients(loss(w, b, x))
    assert type(grads[w]) is np.ndarray and type(heard[w]) is np.ndarray and type(listed) is np.ndarray
    assert float(value) == float(expected_value)
    for got in (grads[w], heard[w], listed):
        np.testing.assert_allclose(got, expected[w], rtol=1e-5, atol=1e-6)


async def test_plain_sgd_from_factors_steps_as_the_multiplied_out_gradient(request: pytest.FixtureRequest) -> None:
    w, b, x = model(rate=0.01)
    for _ in range(3):
        await loss(w, b, x).train()
    factored = w.data.copy()
    assert w._bound is not None and w._bound[0] is w.data  # later steps are proven finite from factors
    request.getfixturevalue("unfactored")
    w2, b2, _ = model(rate=0.01)
    for _ in range(3):
        await loss(w2, b2, x).train()
    # The rate scales the rows' deltas before the product, not the product: float32 rounding apart.
    np.testing.assert_allclose(factored, w2.data, rtol=0, atol=1e-6 * float(np.abs(w2.data).max()))


async def test_adam_steps_from_the_multiplied_out_gradient(request: pytest.FixtureRequest) -> None:
    w, b, x = model()
    w.optimizer = ml.optim.adam(1e-3)
    await loss(w, b, x).train()
    request.getfixturevalue("unfactored")
    w2, b2, _ = model()
    w2.optimizer = ml.optim.adam(1e-3)
    await loss(w2, b2, x).train()
    np.testing.assert_allclose(w.data, w2.data, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("known", [False, True], ids=["first step", "bound carried"])
async def test_a_non_finite_factor_is_refused_and_changes_nothing(known: bool) -> None:
    w, b, x = model()
    if known:
        await loss(w, b, x).train()
        assert w._bound is not None
    before = w.data.copy()
    bad = x.copy()
    bad[1, 7] = np.nan
    with pytest.raises(ml.NonFiniteError):
        await loss(w, b, bad).train()
    np.testing.assert_array_equal(w.data, before)


@pytest.mark.parametrize("known", [False, True], ids=["first step", "bound carried"])
async def test_an_overflowing_step_from_finite_factors_is_refused(known: bool) -> None:
    w, b, x = model(rate=1e36)
    if known:
        w.optimizer = ml.optim.sgd(1e-3)
        await loss(w, b, x).train()
        assert w._bound is not None
        w.optimizer = ml.optim.sgd(1e36)
    before = w.data.copy()
    with np.errstate(over="ignore"), pytest.raises(ml.NonFiniteError):
        await loss(w, b, x * 1e3).train()  # finite factors; their product times the rate is past float32
    np.testing.assert_array_equal(w.data, before)


async def test_data_assigned_by_the_user_is_read_again() -> None:
    # One nonzero entry in each factor: the gradient has one entry, and a bound carried
    # from the data before the assignment (about 10) would prove this step finite.
    w, b, x = model()
    await loss(w, b, x).train()
    assert w._bound is not None
    w.optimizer = ml.optim.sgd(5e37)
    w.data = np.full((FEATURES, HIDDEN), 3e38, np.float32)
    one = np.zeros((ROWS, FEATURES), np.float32)
    one[0, 0] = 1.0
    pick = np.zeros((ROWS, HIDDEN), np.float32)
    pick[0, 0] = -1.0
    with np.errstate(over="ignore"), pytest.raises(ml.NonFiniteError):
        await ml.sum((one @ w) * pick).train()  # 3e38 + 5e37 overflows float32
    assert float(w.data[0, 0]) == float(np.float32(3e38))


def test_factors_add_up_with_arrays_and_each_other() -> None:
    rng = np.random.default_rng(1)
    a, g = rng.standard_normal((3, 5)), rng.standard_normal((3, 4))
    dense = rng.standard_normal((5, 4))
    kept = dense.copy()
    total = dense + Outer(a, g) + Outer(a[:2], g[:2]) + dense
    np.testing.assert_allclose(total.dense(), 2 * dense + a.T @ g + a[:2].T @ g[:2])
    np.testing.assert_array_equal(dense, kept)  # (summed into the product, not into an array it was sent)
    mixed = Outer(a.astype(np.float32), g.astype(np.float32)) + dense  # (float32 factors, a float64 array)
    assert mixed.dense().dtype == np.float64
    np.testing.assert_allclose(mixed.dense(), dense + a.T @ g, rtol=1e-6, atol=1e-6)


@pytest.fixture
def fresh_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every factored step into a fresh array, none into the weight's own."""
    monkeypatch.setattr(sgd, "can_add_product", lambda *args: False)


async def test_a_proven_step_writes_into_data_nobody_holds(request: pytest.FixtureRequest) -> None:
    w, b, x = model(rate=0.01)
    await loss(w, b, x).train()  # the first step takes a bound
    first = id(w.data)
    await loss(w, b, x).train()
    await loss(w, b, x).train()
    assert id(w.data) == first  # written in place: no fresh array
    in_place = w.data.copy()
    request.getfixturevalue("fresh_arrays")
    w2, b2, _ = model(rate=0.01)
    for _ in range(3):
        await loss(w2, b2, x).train()
    np.testing.assert_allclose(in_place, w2.data, rtol=0, atol=1e-6 * float(np.abs(w2.data).max()))


async def test_data_a_user_holds_is_never_written() -> None:
    w, b, x = model(rate=0.01)
    await loss(w, b, x).train()
    held = w.data
    snapshot = held.copy()
    for _ in range(3):
        await loss(w, b, x).train()
    np.testing.assert_array_equal(held, snapshot)
    assert w.data is not held


async def test_a_refused_commit_leaves_data_that_would_be_written_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b, x = model(rate=0.01)
    await loss(w, b, x).train()
    before = w.data.copy()
    queued: list[Any] = []

    def can(*args: Any) -> bool:
        queued.append(args[0])
        return can_add_product(*args)

    monkeypatch.setattr(sgd, "can_add_product", can)
    other = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.sgd(0.1))
    with pytest.raises(ml.NonFiniteError):
        await (loss(w, b, x) + ml.sum(other * np.array([np.nan, 1.0], np.float32))).train()
    assert queued  # w's step was to be written in place, after the checks
    np.testing.assert_array_equal(w.data, before)
