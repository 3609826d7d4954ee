"""``ml.roll``: NumPy's ``roll`` along one axis, its delta rolled back, and
a Neural Turing Machine's circular shift of its weighting batched."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml


@pytest.mark.parametrize(("shift", "axis"), [(1, -1), (-2, 0), (7, 1), (0, -1)])
def test_values_as_numpy_and_gradients_by_finite_differences(shift: int, axis: int) -> None:
    x = np.random.default_rng(0).normal(size=(3, 4))
    np.testing.assert_array_equal(anyio.run(ml.roll(x, shift, axis).predict), np.roll(x, shift, axis=axis))
    ml.check_grads(lambda a: ml.sum(ml.roll(a, shift, axis) * np.arange(12.0).reshape(3, 4)), x)


def test_an_axis_out_of_range_is_refused_at_the_users_line() -> None:
    with pytest.raises(ml.ShapeError, match=r"roll.*axis 2 is out of bounds.*test_roll.py"):
        anyio.run(ml.roll(np.zeros((2, 3)), 1, axis=2).predict)


def test_numpy_integers_shift_and_a_bool_or_an_array_is_refused() -> None:
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(anyio.run(ml.roll(x, np.int64(1), axis=np.intp(0)).predict), np.roll(x, 1, axis=0))
    with pytest.raises(ml.OperandError, match=r"^roll: shift must be an integer, got True$"):
        ml.roll(x, True)  # type: ignore[arg-type]  # (mypy refuses it too: the typing corpus)
    with pytest.raises(ml.OperandError, match=r"^roll: shift must be an integer, got array\(\[1, 2\]\)$"):
        ml.roll(x, np.array([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ml.OperandError, match=r"^roll: axis must be an integer, got False$"):
        ml.roll(x, 1, axis=False)  # type: ignore[arg-type]


def test_a_cells_circular_shift_batches_as_torch_rolls_it() -> None:
    """An NTM's shift: the weighting rolled by -1, 0 and 1, mixed by the
    shift weights; 16 calls of the marked cell, batched, against PyTorch."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    w = ml.Weight(rng.normal(size=(6, 3)) / 2)

    @ml.operation
    def shifted(h: ml.ArrayOperand, weighting: ml.ArrayOperand) -> ml.ArrayLayer:
        s = ml.softmax(h @ w, axis=-1)
        return s[:, :1] * ml.roll(weighting, -1) + s[:, 1:2] * weighting + s[:, 2:] * ml.roll(weighting, 1)

    hs, ws = rng.normal(size=(16, 1, 6)), rng.random(size=(16, 1, 8))
    loss = ml.sum(ml.stack([shifted(ml.as_layer(h), ml.as_layer(v)) ** 2.0 for h, v in zip(hs, ws)]))
    with ml.settings(batching=True):
        value, grads = anyio.run(ml.value_and_gradients, loss)
    tw = torch.tensor(w.data, requires_grad=True)
    total: Any = 0
    for h, v in zip(torch.tensor(hs), torch.tensor(ws)):
        s = torch.softmax(h @ tw, dim=-1)
        total = total + ((s[:, :1] * v.roll(-1, -1) + s[:, 1:2] * v + s[:, 2:] * v.roll(1, -1)) ** 2).sum()
    total.backward()
    assert float(value) == pytest.approx(float(total.detach()), rel=1e-13)
    np.testing.assert_allclose(grads[w], tw.grad.numpy(), rtol=1e-12)
