"""The joins' dtypes: a Python number stacked beside arrays takes their dtype,
as it does beside an array in a binary operation."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_python_float_stacked_beside_an_array_keeps_its_dtype(dtype: type[np.floating[Any]]) -> None:
    # np.stack made 1.0 a float64 array: a float32 model's bias feature was float64, and so its deltas.
    w = ml.Weight(np.array(2.0, dtype))
    features = ml.stack([1.0, w])
    value = anyio.run(features.predict)
    assert value.dtype == anyio.run((w * 1.0).predict).dtype == dtype
    np.testing.assert_array_equal(value, [1.0, 2.0])
    projection = ml.Weight(np.ones((2, 3), dtype))
    loss = ml.sum(features @ projection)  # (float64 features: a DTypeError mixing them)
    [delta] = anyio.run(ml.gradients, loss, [w])
    assert delta.dtype == dtype and delta == 3.0


def test_a_python_float_beside_integer_data_promotes_as_numpy_does() -> None:
    value = anyio.run(ml.stack([np.array(1), 0.5]).predict)  # (not cast to the integers: 0)
    assert value.dtype == np.stack([np.array(1), 0.5]).dtype == np.float64
    np.testing.assert_array_equal(value, [1.0, 0.5])
