"""Reductions at the edges of their axes: a 0-d operand reduced over axis 0
or -1, which NumPy's sum and max take (the array itself) and its mean
refuses."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

NUMPY_TAKES: dict[str, Any] = {
    "sum": np.sum,
    "max": np.max,
    "logsumexp": np.sum,
}  # (logsumexp of one value: that value)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("name", sorted(NUMPY_TAKES))
def test_a_0d_operand_over_axis_0_or_minus_1_is_itself_as_in_numpy(name: str, axis: int, keepdims: bool) -> None:
    # Its backward divided by the operand's number of axes (ZeroDivisionError in _expand).
    w = ml.Weight(np.array(0.4))
    layer: Any = getattr(ml, name)(w, axis=axis, keepdims=keepdims)
    value = anyio.run(layer.predict)
    expected = NUMPY_TAKES[name](np.array(0.4), axis=axis, keepdims=keepdims)
    assert np.shape(value) == np.shape(expected) == () and value == expected
    [delta] = anyio.run(ml.gradients, ml.sum(layer * 3.0), [w])
    assert np.shape(delta) == () and delta == 3.0  # (PyTorch's: sum, amax and logsumexp over dim 0 of a 0-d tensor)


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda w: ml.mean(w, axis=0), "mean: .*axis 0 is out of bounds for array of dimension 0"),
        (lambda w: ml.mean(w, axis=-1), "mean: .*axis -1 is out of bounds for array of dimension 0"),
        (lambda w: ml.sum(w, axis=1), "sum: .*axis 1 is out of bounds for array of dimension 0"),
        (lambda w: ml.max(w, axis=(0,)), "max: .*axis 0 is out of bounds for array of dimension 0"),
        (lambda w: ml.logsumexp(w, axis=-2), "logsumexp: .*axis -2 is out of bounds for array of dimension 0"),
    ],
)
def test_what_numpy_refuses_of_a_0d_operand_is_a_shape_error(build: Any, said: str) -> None:
    w = ml.Weight(np.array(0.4))
    with pytest.raises(ml.ShapeError, match=said):
        anyio.run(ml.gradients, ml.sum(build(w)), [w])
