"""Elementwise deltas where the formula breaks down (a zero base, a NaN
operand): PyTorch's values, written out, and checked against PyTorch itself
where it is installed."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

BASES = np.zeros(5)
EXPONENTS = np.array([-1.0, -0.5, 0.0, 0.5, 2.0])
# d(a**b)/da and d(a**b)/db at a == 0, for the exponents above (PyTorch's pow backward).
AT_ZERO_D_BASE = [-np.inf, -np.inf, 0.0, np.inf, 0.0]
AT_ZERO_D_EXPONENT = [-np.inf, -np.inf, 0.0, 0.0, 0.0]  # (a**b * log(a): -inf for b < 0; 0 for b >= 0)


def _torch_pow_deltas(a: Any, b: Any) -> tuple[Any, Any]:
    torch = pytest.importorskip("torch")
    ta = torch.tensor(a, dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    (ta**tb).sum().backward()
    return ta.grad.numpy(), tb.grad.numpy()


@pytest.mark.filterwarnings("ignore:divide by zero encountered")  # (the value 0 ** -1: inf, NumPy warns of it)
def test_the_power_of_a_zero_base_has_pytorchs_deltas() -> None:
    # d/db was NaN for b < 0 (a**b times a log(a) masked to log(1): inf * 0).
    a, b = ml.Weight(BASES.copy()), ml.Weight(EXPONENTS.copy())
    d_base, d_exponent = anyio.run(ml.gradients, ml.sum(a**b), [a, b])
    np.testing.assert_array_equal(d_base, AT_ZERO_D_BASE)
    np.testing.assert_array_equal(d_exponent, AT_ZERO_D_EXPONENT)
    [d_of_a_number_base] = anyio.run(ml.gradients, ml.sum(0.0**b), [b])
    np.testing.assert_array_equal(d_of_a_number_base, AT_ZERO_D_EXPONENT)
    torch_base, torch_exponent = _torch_pow_deltas(BASES, EXPONENTS)
    np.testing.assert_array_equal(torch_base, AT_ZERO_D_BASE)
    np.testing.assert_array_equal(torch_exponent, AT_ZERO_D_EXPONENT)


def test_the_power_of_a_positive_base_by_its_exponent_is_unchanged() -> None:
    a, b = ml.Weight(np.array([0.5, 2.0, 3.0], np.float32)), ml.Weight(np.array([-1.0, 0.0, 2.0], np.float32))
    [d_exponent] = anyio.run(ml.gradients, ml.sum(a**b), [b])
    assert d_exponent.dtype == np.float32
    np.testing.assert_allclose(d_exponent, a.data**b.data * np.log(a.data), rtol=1e-6)


NAN = np.nan
# Each case: a function of two weights, and the deltas of sum(3 * f(a, b)) that PyTorch gives them.
CHOICES: list[tuple[str, Any, list[float], list[float]]] = [
    ("relu", lambda a, b: ml.relu(a) + 0.0 * b, [3.0, 3.0, 0.0, 0.0, 0.0], [0.0] * 5),
    ("maximum", ml.maximum, [3.0, 3.0, 0.0, 1.5, 3.0], [3.0, 0.0, 3.0, 1.5, 3.0]),
    ("minimum", ml.minimum, [3.0, 0.0, 3.0, 1.5, 3.0], [3.0, 3.0, 0.0, 1.5, 3.0]),
]
A, B = [NAN, 1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, NAN]


def _torch_choice_deltas(name: str) -> tuple[Any, Any]:
    torch = pytest.importorskip("torch")
    ta = torch.tensor(A, dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(B, dtype=torch.float64, requires_grad=True)
    out = torch.relu(ta) + 0.0 * tb if name == "relu" else getattr(torch, name)(ta, tb)
    (out * 3.0).sum().backward()
    return ta.grad.numpy(), tb.grad.numpy()


@pytest.mark.parametrize(("name", "choose", "d_a", "d_b"), CHOICES, ids=[c[0] for c in CHOICES])
def test_a_nan_operand_of_a_choice_gets_the_delta_as_in_pytorch(
    name: str, choose: Any, d_a: list[float], d_b: list[float]
) -> None:
    # A NaN lost no comparison in PyTorch and got no delta here (a > b is False for a NaN).
    a, b = ml.Weight(np.array(A)), ml.Weight(np.array(B))
    got_a, got_b = anyio.run(ml.gradients, ml.sum(choose(a, b) * 3.0), [a, b])
    np.testing.assert_array_equal(got_a, d_a)
    np.testing.assert_array_equal(got_b, d_b)
    torch_a, torch_b = _torch_choice_deltas(name)
    np.testing.assert_array_equal(torch_a, d_a)
    np.testing.assert_array_equal(torch_b, d_b)


def test_relu_of_a_large_array_passes_a_nan_s_delta() -> None:
    # A NaN among thousands passes its delta; -0.0 and 0.0 get none, as PyTorch's (relu's value is 0 there).
    w = ml.Weight(np.concatenate([[NAN, -0.0, 0.0], np.linspace(-1.0, 1.0, 5000)]))
    [delta] = anyio.run(ml.gradients, ml.sum(ml.relu(w) * 3.0), [w])
    np.testing.assert_array_equal(delta, np.where(np.isnan(w.data) | (w.data > 0), 3.0, 0.0))
