"""Reductions at the edges of their axes: a 0-d operand reduced over axis 0
or -1, which NumPy's sum and max take (the array itself) and its mean
refuses."""

from __future__ import annotations

from typing import Any, cast

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


# ---- from a new user's fuzzing of batching: plain numbers, and NumPy's scalars -----------------
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("reduce", "want"),
    [
        (ml.sum, 1.5),
        (lambda x: ml.sum(x > 1.0), 1),
        (ml.mean, 1.5),
        (ml.max, 1.5),
        (ml.logsumexp, 1.5),
        (lambda x: ml.reshape(x, (1,)), [1.5]),
        (lambda x: ml.softmax(ml.reshape(x, (1,))), [1.0]),
    ],
)
async def test_a_plain_number_reduces_and_reshapes_as_numpys_would(reduce: Any, want: Any) -> None:
    # (a bare AttributeError, 'float' object has no attribute 'shape', where mypy accepted the call)
    got = await reduce(1.5).predict()
    np.testing.assert_array_equal(got, want)

    @ml.operation
    def cell(h: ml.Expr[ml.Array, ml.Array], t: Any) -> ml.ScalarLayer:  # (a float argument: a layer in the cell)
        return ml.sum(h * ml.reshape(t, (1,)))

    assert await cell(ml.Weight(np.ones(2)), 0.5).predict() == 1.0


@pytest.mark.anyio
@pytest.mark.parametrize("batching", [False, True])
async def test_a_scalar_result_is_numpys_scalar_whether_batched_or_not(batching: bool) -> None:
    # Unbatched, logsumexp over every axis, where of scalars and a reshape to () gave 0-d arrays, and a
    # float64 number beside them took their float32 (the batched ones, scalars, made float64).
    w = ml.Weight(np.array([[0.3, 0.2], [0.5, -0.1]], np.float32))
    s = ml.Weight(np.float32(-0.5))
    xs = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([[1.0, 0.5], [-3.0, 4.0]], np.float32)]
    terms: list[Any] = [
        *[ml.logsumexp(x @ w) for x in xs],
        *[ml.where(np.array(True), ml.tanh(s) + 1.5, c) for c in (0.73, -0.86)],
        *[ml.reshape(ml.sum(x @ w, axis=0, keepdims=True)[:, :1], ()) for x in xs],
    ]
    with ml.settings(batching=batching):
        values = await ml.stack(terms).predict()
        for term in terms:
            assert type(await term.predict()) is np.float32
        loss = await (ml.sum(ml.Weight(np.array([0.1, 0.2])) ** 2.0) + terms[0] + terms[2]).predict()
        _, grads = await ml.value_and_gradients(terms[2] * terms[3])
    assert values.dtype == np.float32
    assert type(loss) is np.float64  # (float64 beside float32 scalars: float64, as NumPy's)
    assert type(grads[s]) is np.float32  # (a scalar weight's gradient: a scalar, as ml.gradients says)
    for through in (ml.sum, ml.mean, lambda x: ml.reshape(x, (1,))):  # (their deltas are 0-d arrays)
        with ml.settings(batching=batching):
            _, grads = await ml.value_and_gradients(ml.sum(through(s)))
            (g,) = await ml.gradients(ml.sum(through(s)), [cast(Any, s)])
        assert type(grads[s]) is np.float32 and type(g) is np.float32
