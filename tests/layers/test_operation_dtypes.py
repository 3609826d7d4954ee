"""A traced operation applies the runtime's operand rule to each of its
steps: one float dtype per step (else `DTypeError` naming the line inside the
cell), integers and booleans cast to the float's dtype. So marking a cell
changes no dtype and no error."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.errors import DTypeError
from monadl.layers._program import Program

H = 4


def _weights(dtype: Any) -> tuple[ml.ArrayWeight, ml.ArrayWeight, ml.ArrayWeight]:
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((2 * H, H)).astype(dtype), optimizer=ml.optim.sgd(0.1))
    b = ml.Weight(np.zeros(H, np.float32), optimizer=ml.optim.sgd(0.1))
    table = ml.Weight(rng.standard_normal((5, H)).astype(np.float32), optimizer=ml.optim.sgd(0.1))
    return w, b, table


@pytest.mark.parametrize("batching", [False, True])
def test_a_cell_mixing_float32_and_float64_raises_as_the_unmarked_one_does(batching: bool) -> None:
    w, b, table = _weights(np.float64)  # a float64 weight beside float32 leaves: the user forgot a cast

    def combine(left: ml.ArrayLayer, right: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(ml.dense(ml.concatenate([left, right], axis=-1), w, b))

    marked = ml.operation(combine)

    def leaf(i: int) -> ml.ArrayLayer:
        return ml.embedding(table, np.array([i]))

    before = [x.data.copy() for x in (w, b, table)]
    messages = []
    for cell in (combine, marked):
        loss = ml.sum(ml.concatenate([cell(leaf(1), leaf(2)), cell(leaf(3), leaf(4))], axis=0))
        with ml.settings(batching=batching), pytest.raises(DTypeError) as caught:
            anyio.run(loss.train)
        messages.append(str(caught.value))
    plain, traced = messages
    assert "dense: operands float32[1, 8], float64[8, 4], float32[4] mix float32 and float64" in traced
    assert traced.startswith(plain)  # the same message and line (the line of ml.dense in combine) ...
    assert ", inside the operation " in traced  # ... and the operation it is in, and the call's line
    assert re.search(rf"combine called at {re.escape(__file__)}:\d+$", traced), traced
    for x, old in zip((w, b, table), before):
        np.testing.assert_array_equal(x.data, old)  # nothing changed


@pytest.mark.parametrize("batching", [False, True])
def test_integer_data_inside_a_cell_takes_the_float_dtype_as_outside(batching: bool) -> None:
    _, b, table = _weights(np.float32)

    def scaled(x: ml.ArrayLayer, counts: ml.Array) -> ml.ArrayLayer:
        return x * counts + b

    marked = ml.operation(scaled)
    counts = np.arange(H)  # int64: NumPy alone would make float64 of float32 * int64
    values = []
    for cell in (scaled, marked):
        leaves = [ml.embedding(table, np.array([i])) for i in range(3)]
        with ml.settings(batching=batching):
            values.append(anyio.run(ml.concatenate([cell(x, counts) for x in leaves], axis=0).predict))
    plain, traced = values
    assert plain.dtype == traced.dtype == np.float32
    np.testing.assert_array_equal(plain, traced)


@pytest.mark.parametrize("batching", [False, True])
def test_a_numpy_float_beside_a_scalar_layer_inside_a_cell_takes_the_layers_dtype(batching: bool) -> None:
    # A new user's float32 VAE with a per-example marked ELBO and beta = np.linspace(...)[i] (np.float64):
    # its loss was float64, and batching on and off differed past float32's rounding.
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal(H).astype(np.float32))
    xs = [rng.standard_normal(H).astype(np.float32) for _ in range(6)]
    betas = np.linspace(0.1, 1.0, len(xs))

    def elbo(x: ml.Array, beta: ml.ScalarOperand) -> ml.ScalarLayer:
        kl = ml.sum(x * w)  # a scalar layer: a NumPy float32 as its value
        # (1.0 - beta): numbers only, float64 as outside; ml.sum(x): of data, a layer all the same
        return beta * kl + (1.0 - beta) * ml.mean(x * w) + ml.sum(x) * np.float64(0.5)

    def by_hand(x: Any, beta: np.float64) -> Any:
        kl = np.sum(x * w.data)
        return np.float32(beta) * kl + np.float32(1.0 - beta) * np.mean(x * w.data) + np.sum(x) * np.float32(0.5)

    want = np.array([by_hand(x, b) for x, b in zip(xs, betas)])
    assert want.dtype == np.float32
    for cell in (elbo, ml.operation(elbo)):
        parts = ml.stack([cell(x, b) for x, b in zip(xs, betas)])
        with ml.settings(batching=batching):
            got = anyio.run(parts.predict)
            (grad,) = anyio.run(ml.gradients, ml.sum(parts), [w])
        assert got.dtype == np.float32 and grad.dtype == np.float32, cell
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("batching", [False, True])
def test_an_ml_function_of_a_number_is_a_tensor_inside_a_cell_as_outside(batching: bool) -> None:
    # Unmarked, 1.0 - beta is NumPy's arithmetic, a number (float32 beside a float32 scalar layer), but
    # ml.exp(beta) is a layer of float64, which promotes one of float32 as NumPy does: the cell's steps too.
    w = ml.Weight(np.ones(H, np.float32))
    betas = np.linspace(0.1, 1.0, 5)

    def annealed(beta: ml.ScalarOperand) -> ml.ScalarLayer:
        return (1.0 - beta) * ml.sum(w)

    def exponential(beta: ml.ScalarOperand) -> ml.ScalarLayer:
        return ml.exp(-beta) * ml.sum(w)

    for f, dtype in [(annealed, np.float32), (exponential, np.float64)]:
        values = []
        for cell in (f, ml.operation(f)):
            with ml.settings(batching=batching):
                values.append(anyio.run(ml.stack([cell(b) for b in betas]).predict))
        plain, traced = values
        assert plain.dtype == traced.dtype == dtype, f
        np.testing.assert_array_equal(plain, traced)


N = 6
W16 = ml.Weight(np.linspace(0.5, 1.5, H).astype(np.float16))
W32 = ml.Weight(np.linspace(0.5, 1.5, H).astype(np.float32))
Z32 = ml.Weight(np.array(1.25, np.float32))  # (a 0-d array weight: a tensor of no dimensions)


def _shift(d: Any, p: float) -> Any:
    # Unmarked, d - p of a 0-d array d is NumPy's arithmetic: a NumPy scalar, a number beside Z32.
    return Z32 + (d - p)


def _chosen(d: Any, p: float) -> Any:
    return ml.where(True, Z32 * 2.0, d - p)


def _offset(t: Any) -> Any:
    # np.array(0.25) + t: a constant 0-d array and an np.float16 argument, a NumPy float64 unmarked.
    return (np.array(0.25) + t) - ml.sum(W16)


def _power(t: Any) -> Any:
    # t * np.int64(3) of an np.float16 t: NumPy's float64 unmarked (the rule would cast the int to float16).
    return ml.exp(t * np.int64(3)) + ml.sum(W32) * 0.0


DATA_STEPS: dict[str, tuple[Callable[..., Any], Callable[[int], tuple[Any, ...]], Any, Any]] = {
    "z32 + (d - p)": (_shift, lambda i: (np.array(0.2 + 0.1 * i), 0.5 + 0.25 * i), np.float32, Z32),
    "where(True, z32 * 2.0, d - p)": (_chosen, lambda i: (np.array(0.2 + 0.1 * i), 0.5), np.float32, Z32),
    "(np.array(0.25) + t16) - sum(w16)": (_offset, lambda i: (np.float16(0.5 + 0.25 * i),), np.float16, W16),
    "exp(t16 * np.int64(3)) + sum(w32) * 0.0": (_power, lambda i: (np.float16(0.1 * i),), np.float64, W32),
}


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("case", list(DATA_STEPS))
def test_an_operator_on_data_alone_is_numpys_arithmetic_inside_a_cell_as_outside(
    batching: bool, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new user's 0-d float64 array argument d: z32 + (d - p) was float32 unmarked (d - p: a NumPy
    # scalar, a number) and float64 marked, where the cell read the step d - p as a tensor; and the
    # step t * np.int64(3) went through the operand rule (float16) where NumPy gives float64.
    f, args, dtype, w = DATA_STEPS[case]
    batched: list[bool] = []  # (per group of the cell's calls, whether it ran batched)
    batch = Program.batch

    def counting(self: Program, *given: Any, **named: Any) -> Any:
        out = batch(self, *given, **named)
        batched.append(out is not None)
        return out

    monkeypatch.setattr(Program, "batch", counting)
    results = []
    for cell in (f, ml.operation(f)):
        parts = ml.stack([cell(*args(i)) for i in range(N)])
        with ml.settings(batching=batching):
            value = anyio.run(parts.predict)
            (grad,) = anyio.run(ml.gradients, ml.sum(parts), [w])
        results.append((value, grad))
    (plain, plain_grad), (traced, traced_grad) = results
    assert plain.dtype == traced.dtype == dtype, case
    assert np.asarray(plain_grad).dtype == np.asarray(traced_grad).dtype == np.asarray(w.data).dtype
    np.testing.assert_array_equal(plain, traced)
    np.testing.assert_array_equal(plain_grad, traced_grad)
    assert (batched and all(batched)) if batching else not batched  # (the calls: one group, forward and back)


@pytest.mark.parametrize("t", [0.3, np.float32(0.3), np.float64(0.3)], ids=type)
def test_a_float_argument_beside_a_layer_or_beside_data_computes_as_the_readme_says(t: Any) -> None:
    # A new user read "float32 beside a float32 array, an np.float64 too" as covering t * data:
    # beside a float32 layer an np.float64 is float32, beside plain data it is NumPy's float64.
    ones = np.ones((1, 1), np.float32)

    def beside_layer(y: ml.ArrayLayer, t: ml.ScalarOperand) -> ml.ArrayLayer:
        return y * t

    def beside_data(y: ml.ArrayLayer, t: ml.ScalarOperand) -> ml.ArrayLayer:
        return ml.concatenate([y, t * ones], axis=1)

    y = np.ones((1, 2), np.float32)
    for f in (beside_layer, ml.operation(beside_layer)):
        assert anyio.run(f(ml.as_layer(y), t).predict).dtype == np.float32
    for f in (beside_data, ml.operation(beside_data)):
        if type(t) is np.float64:
            with pytest.raises(DTypeError, match=r"concatenate: operands float32\[1, 2\], float64\[1, 1\] mix"):
                anyio.run(f(ml.as_layer(y), t).predict)
        else:
            assert anyio.run(f(ml.as_layer(y), t).predict).dtype == np.float32
