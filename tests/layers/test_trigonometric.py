"""``sin`` and ``cos``: values and deltas as NumPy's, float32 kept, and a
damped pendulum's RK4 step marked with ``ml.operation`` and batched.

A new user's pendulum (a learned ``g / L`` and damping) needed
``sin(theta)``; monadl had no ``ml.sin``, and one written as a `Tape` with
a backward of its own cannot be traced, so the step could not be marked and
lost batching. As primitives, the step is marked, batched, and its
gradients are those of finite differences.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from tests._batched_groups import groups_run

POINTS = np.array([-1e4, -800.0, -np.pi, -1.0, -1e-3, 0.0, 1e-3, 1.0, np.pi / 2, 3.0, 800.0, 1e4])
DT = 0.05
N = 6  # pendulums in a batch
STEPS = 8


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize(
    ("function", "value", "delta"),
    [(ml.sin, np.sin, np.cos), (ml.cos, np.cos, lambda x: -np.sin(x))],
    ids=["sin", "cos"],
)
def test_values_and_deltas_are_numpys_in_the_operands_dtype(
    function: Callable[[Any], Any], value: Any, delta: Any, dtype: Any
) -> None:
    x = POINTS.astype(dtype)
    w = ml.Weight(x.copy())
    got = anyio.run(function(w).predict)
    (grad,) = anyio.run(ml.gradients, ml.sum(function(w)), [w])
    assert got.dtype == grad.dtype == dtype
    np.testing.assert_array_equal(got, value(x))
    np.testing.assert_array_equal(grad, delta(x))
    scalar = ml.Weight(np.float32(0.5))
    assert anyio.run(function(scalar).predict) == value(np.float32(0.5))
    assert anyio.run(function(scalar).predict).dtype == np.float32
    assert anyio.run(function(np.pi / 3).predict) == pytest.approx(value(np.pi / 3), rel=1e-15)


def test_compositions_match_finite_differences() -> None:
    ml.check_grads(lambda a, b: ml.sin(a * b) * ml.cos(a) + ml.cos(ml.sin(b)), np.array([0.3, -2.0, 5.0]), 1.7)


def _pendulum_step(y: ml.ArrayOperand, g_over_l: ml.ScalarOperand, damping: ml.ScalarOperand) -> ml.ArrayLayer:
    """One RK4 step of ``theta'' = -g / L * sin(theta) - damping * theta'``, the state ``[theta, omega]``."""

    def f(s: Any) -> ml.ArrayLayer:
        theta, omega = s[:, 0:1], s[:, 1:2]
        return ml.concatenate([omega, -g_over_l * ml.sin(theta) - damping * omega], axis=1)

    k1 = f(y)
    k2 = f(y + (DT / 2) * k1)
    k3 = f(y + (DT / 2) * k2)
    k4 = f(y + DT * k3)
    return y + (DT / 6) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)


def _numpy_step(y: Any, g_over_l: float, damping: float) -> Any:
    def f(s: Any) -> Any:
        return np.concatenate([s[:, 1:2], -g_over_l * np.sin(s[:, 0:1]) - damping * s[:, 1:2]], axis=1)

    k1 = f(y)
    k2 = f(y + DT / 2 * k1)
    k3 = f(y + DT / 2 * k2)
    k4 = f(y + DT * k3)
    return y + DT / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def test_the_marked_pendulum_step_matches_finite_differences() -> None:
    y = np.array([[1.0, 0.0], [2.0, 0.5]])
    ml.check_grads(_pendulum_step, y, 5.0, 0.1)
    ml.check_grads(ml.operation(_pendulum_step), y, 5.0, 0.1)  # (it was refused: a Tape cannot be traced)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=lambda d: d.__name__)
def test_a_batch_of_pendulums_runs_the_marked_step_as_one_group(dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    starts = [rng.uniform(-2.0, 2.0, size=(1, 2)).astype(dtype) for _ in range(N)]
    g_over_l, damping = ml.Weight(dtype(5.0)), ml.Weight(dtype(0.1))
    step = ml.operation(_pendulum_step)

    def rollouts() -> ml.ArrayLayer:
        ends = []
        for y0 in starts:
            y: Any = ml.as_layer(y0)  # (a data argument is whole inside a cell: the step slices it)
            for _ in range(STEPS):
                y = step(y, g_over_l, damping)
            ends.append(y)
        return ml.concatenate(ends, axis=0)

    ran = groups_run(monkeypatch)
    results = {}
    for batching in (True, False):
        ran.clear()
        with ml.settings(batching=batching):
            ends = anyio.run(rollouts().predict)
            grads = anyio.run(ml.gradients, ml.sum(rollouts() ** 2.0), [g_over_l, damping])
        results[batching] = ends, grads, list(ran)
    (ends, grads, groups), (want, want_grads, _) = results[True], results[False]
    steps = [n for name, n in groups if name.partition("#")[0].endswith("_pendulum_step")]
    assert steps == [N] * (2 * STEPS)  # each step's calls one group, in predict and in gradients
    assert ends.dtype == want.dtype == dtype and all(g.dtype == dtype for g in [*grads, *want_grads])
    assert np.array_equal(ends, want)  # (elementwise: the same roundings, member by member)
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    for got, expected in zip(grads, want_grads):  # (the weights' deltas: the members' summed in another order)
        np.testing.assert_allclose(got, expected, rtol=rtol)
    reference = np.concatenate(starts).astype(np.float64)
    for _ in range(STEPS):
        reference = _numpy_step(reference, 5.0, 0.1)
    np.testing.assert_allclose(ends, reference, rtol=rtol)


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "_line_of" not in text)


@pytest.mark.parametrize("marked", [False, True], ids=["plain", "operation"])
def test_check_finite_names_the_infinity_before_sin_not_numpys_warning(marked: bool) -> None:
    w = ml.Weight(np.array([1e308, 1.0]))

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.sin(w * x * 10.0)  # OVERFLOW: sin(inf) would be NumPy's 'invalid value' warning

    f = ml.operation(cell) if marked else cell
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as error:
        anyio.run(ml.sum(f(np.ones(2))).train)  # CALL
    made = f"multiply produced a NaN or an infinity from float64[2], float 10.0; layer built at {__file__}:"
    made += str(_line_of("# OVERFLOW"))
    inside = rf", inside the operation .*cell called at {re.escape(__file__)}:{_line_of('# CALL')}" if marked else ""
    assert re.fullmatch(re.escape(made) + inside, str(error.value))
    np.testing.assert_array_equal(w.data, [1e308, 1.0])
