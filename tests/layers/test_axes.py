"""Axes, sizes and counts given as NumPy integers (``x.ndim - 1``, an
``np.argmax``, a shape from NumPy arithmetic) build the layers Python ints
build, and whatever is no integer is refused at the user's line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

Build = Callable[[ml.Weight[ml.Array, ml.Array], Any], ml.ArrayLayer]

MINUS = np.int32(-1)

# Each case: the layer built with NumPy integers, and with Python ints.
CASES: list[tuple[str, Build, Build]] = [
    ("sum", lambda w, i: ml.sum(w, axis=i(1)), lambda w, i: ml.sum(w, axis=1)),
    ("sum of axes", lambda w, i: ml.sum(w, axis=(i(0), i(-1))), lambda w, i: ml.sum(w, axis=(0, -1))),
    ("sum of a list", lambda w, i: ml.sum(w, axis=[i(0), i(1)]), lambda w, i: ml.sum(w, axis=(0, 1))),
    ("method sum", lambda w, i: w.sum(axis=i(1)), lambda w, i: w.sum(axis=1)),
    (
        "mean",
        lambda w, i: ml.mean(w, axis=i(1), keepdims=np.True_),  # type: ignore[call-overload]  # (no bool to mypy; it runs)
        lambda w, i: ml.mean(w, axis=1, keepdims=True),
    ),
    ("max", lambda w, i: ml.max(w, axis=i(-1)), lambda w, i: ml.max(w, axis=-1)),
    ("method max", lambda w, i: w.max(i(-1)), lambda w, i: w.max(-1)),
    ("logsumexp", lambda w, i: ml.logsumexp(w, axis=i(2)), lambda w, i: ml.logsumexp(w, axis=2)),
    ("softmax", lambda w, i: ml.softmax(w, axis=i(1)), lambda w, i: ml.softmax(w, axis=1)),
    ("log_softmax", lambda w, i: ml.log_softmax(w, axis=i(1)), lambda w, i: ml.log_softmax(w, axis=1)),
    ("concatenate", lambda w, i: ml.concatenate([w, w], axis=i(1)), lambda w, i: ml.concatenate([w, w], axis=1)),
    ("stack", lambda w, i: ml.stack([w, w], axis=i(-1)), lambda w, i: ml.stack([w, w], axis=-1)),
    ("split", lambda w, i: ml.split(w, i(2), axis=i(-1))[1], lambda w, i: ml.split(w, 2, axis=-1)[1]),
    ("split sizes", lambda w, i: ml.split(w, np.array([1, 3]))[1], lambda w, i: ml.split(w, [1, 3])[1]),
    ("reshape", lambda w, i: ml.reshape(w, np.array([6, 4])), lambda w, i: ml.reshape(w, (6, 4))),
    ("method reshape", lambda w, i: w.reshape(i(6), i(-1)), lambda w, i: w.reshape(6, -1)),
    ("transpose", lambda w, i: ml.transpose(w, np.array([2, 0, 1])), lambda w, i: ml.transpose(w, (2, 0, 1))),
    ("method transpose", lambda w, i: w.transpose(i(2), i(0), i(1)), lambda w, i: w.transpose(2, 0, 1)),
    ("max_pool2d", lambda w, i: ml.max_pool2d(w[None], i(2), i(1)), lambda w, i: ml.max_pool2d(w[None], 2, 1)),
]


def _python_ints(params: Any) -> bool:
    """Whether every integer in a layer's parameters is a Python int (a signature keys on them)."""
    if isinstance(params, tuple):
        return all(_python_ints(p) for p in params)
    return params is None or type(params) in (int, bool)


@pytest.mark.parametrize(("name", "numpy_ints", "python_ints"), CASES, ids=[c[0] for c in CASES])
def test_numpy_integers_build_the_layer_python_ints_build(name: str, numpy_ints: Build, python_ints: Build) -> None:
    w = ml.Weight(np.arange(24.0).reshape(2, 3, 4) / 10)
    built, expected = numpy_ints(w, np.int64), python_ints(w, int)
    assert _python_ints(built._params) and built._params == expected._params
    np.testing.assert_array_equal(anyio.run(built.predict), anyio.run(expected.predict))
    # The backward (sum's, max's and logsumexp's expanded their delta by `isinstance(axis, int)`).
    [delta], [expected_delta] = (anyio.run(ml.gradients, ml.sum(layer * layer), [w]) for layer in (built, expected))
    np.testing.assert_array_equal(delta, expected_delta)


def test_an_int32_axis_trains() -> None:
    w = ml.Weight(np.arange(6.0).reshape(2, 3), optimizer=ml.optim.sgd(1.0))
    anyio.run(ml.sum(ml.max(w, axis=MINUS)).train)
    np.testing.assert_array_equal(w.data, [[0.0, 1.0, 1.0], [3.0, 4.0, 4.0]])


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda w: ml.sum(w, axis=1.0), "sum: axis must be an integer, got 1.0"),  # type: ignore[call-overload]  # the mistake under test
        (lambda w: ml.softmax(w, axis=np.float64(1)), "softmax: axis must be an integer"),  # type: ignore[arg-type]  # the mistake under test
        (lambda w: w.mean(True), "mean: axis must be an integer, got True"),  # (keepdims, meant)
        (lambda w: ml.reshape(w, (2.0, 3)), "reshape: shape must be an integer, got 2.0"),  # type: ignore[arg-type]  # the mistake under test
        (lambda w: ml.reshape(w, 6), "reshape: shape must be a sequence of integers, got 6"),  # type: ignore[arg-type]  # the mistake under test
        (lambda w: ml.split(w, np.int64(2).astype(float)), "split: sections must be a count or a sequence"),
        (lambda w: ml.concatenate([w, w], axis="0"), "concatenate: axis must be an integer"),  # type: ignore[arg-type]  # the mistake under test
    ],
)
def test_what_is_no_integer_is_refused_where_it_is_given(build: Any, said: str) -> None:
    with pytest.raises(ml.OperandError, match=said):
        build(ml.Weight(np.ones((2, 3))))


METHODS: list[tuple[str, Callable[[Any], Any]]] = [
    ("reshape((3, 2))", lambda x: x.reshape((3, 2))),
    ("reshape([6])", lambda x: x.reshape([6])),
    ("reshape(np.array([3, -1]))", lambda x: x.reshape(np.array([3, -1]))),
    ("reshape(3, 2)", lambda x: x.reshape(3, 2)),
    ("transpose((1, 0))", lambda x: x.transpose((1, 0))),
    ("transpose([1, 0])", lambda x: x.transpose([1, 0])),
    ("transpose(None)", lambda x: x.transpose(None)),
    ("transpose()", lambda x: x.transpose()),
]


@pytest.mark.parametrize(("name", "method"), METHODS, ids=[m[0] for m in METHODS])
def test_reshape_and_transpose_methods_take_numpys_forms(name: str, method: Callable[[Any], Any]) -> None:
    # A tuple built a layer that failed when run ("'tuple' object cannot be interpreted as an integer").
    data = np.arange(6.0).reshape(2, 3)
    w = ml.Weight(data.copy())
    for layer in (method(w), method(w * 1.0)):
        value = anyio.run(layer.predict)
        np.testing.assert_array_equal(value, method(data))
        [delta] = anyio.run(ml.gradients, ml.sum(layer * np.arange(6.0).reshape(value.shape)), [w])
        np.testing.assert_array_equal(delta, method(np.arange(6.0).reshape(value.shape)).reshape(2, 3))


def test_a_shape_given_both_ways_at_once_is_refused_where_it_is_given() -> None:
    w = ml.Weight(np.ones((2, 3)))
    with pytest.raises(ml.OperandError, match=r"reshape: shape must be an integer, got \(3, 2\)"):
        w.reshape((3, 2), 1)  # type: ignore[call-overload]  # the mistake under test
    with pytest.raises(ml.ShapeError, match="transpose"):  # (NumPy's: axes don't match array)
        anyio.run(w.transpose(()).predict)
