"""A weight's shape, dtype, ndim and size: read-only views of its current data."""

from __future__ import annotations

from typing import Any

import anyio
import array_api_strict as xs
import numpy as np
import pytest

import monadl as ml
from monadl._namespace import is_array


def test_an_array_weight_has_the_shape_dtype_ndim_and_size_of_its_data() -> None:
    w = ml.Weight(np.zeros((2, 3), np.float32))
    assert (w.shape, w.dtype, w.ndim, w.size) == ((2, 3), np.dtype(np.float32), 2, 6)
    assert type(w.size) is int and type(w.ndim) is int


@pytest.mark.parametrize("data", [1.5, np.float32(1.5), np.array(1.5)], ids=["float", "float32", "0-d"])
def test_a_scalar_weight_has_no_axes_and_one_element(data: float) -> None:
    w = ml.Weight(data)
    assert (w.shape, w.ndim, w.size) == ((), 0, 1)
    assert w.dtype == np.asarray(data).dtype


def test_they_follow_the_data_through_a_step_and_an_assignment() -> None:
    w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
    anyio.run(ml.sum(w * w).train)
    w.data = np.full(3, 2.0)
    assert (w.shape, w.dtype, w.size) == ((3,), np.dtype(np.float64), 3)


def test_a_weight_of_another_array_library_gives_that_librarys_dtype() -> None:
    w = ml.Weight(xs.zeros((4, 2), dtype=xs.float32))
    assert (w.shape, w.ndim, w.size) == ((4, 2), 2, 8)
    assert w.dtype == xs.float32


@pytest.mark.parametrize("name", ["shape", "dtype", "ndim", "size"])
def test_they_are_read_only(name: str) -> None:
    w = ml.Weight(np.zeros(2))
    with pytest.raises(AttributeError):
        setattr(w, name, None)


def test_a_weight_is_still_no_array() -> None:
    # The runtime tells arrays from weights by type, never by a ``shape``.
    w = ml.Weight(np.zeros(2))
    assert not is_array(w)
    x = ml.Weight(np.ones((2, 3)))
    index: Any = (w, 0)  # (mypy rejects a weight in an index: it fails when it runs)
    assert "[Weight(array([0., 0.])), 0]" in ml.to_dot(x[index])  # an index that fails: shown as it is


def test_a_large_weights_repr_is_its_dtype_shape_and_line() -> None:
    big = ml.Weight(np.zeros((512, 512), np.float32))  # (its values filled a screen)
    here = test_a_large_weights_repr_is_its_dtype_shape_and_line.__code__.co_firstlineno + 1
    assert repr(big) == f"Weight(float32[512, 512], built at {__file__}:{here})"
    assert repr(ml.Weight(np.zeros(2))) == "Weight(array([0., 0.]))"  # (a small one's values, as before)


def test_a_weight_deep_copies_with_its_own_state_and_does_not_pickle() -> None:
    """As README's "Save and resume" says: a deep copy is independent, and
    pickling (between processes) is not the way: ml.save and ml.load are."""
    import copy
    import pickle

    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.adam(0.1))
    anyio.run(ml.sum(w * w).train)
    copied = copy.deepcopy(w)
    anyio.run(ml.sum(copied * copied).train)
    np.testing.assert_allclose(w.data, [0.9, 1.9])  # (Adam's first step: the rate, per element)
    anyio.run(ml.sum(w * w).train)
    assert copied.data.tobytes() == w.data.tobytes()  # (its second step: the state went with the copy)
    assert copied.data is not w.data
    with pytest.raises(AttributeError, match=r"Can't pickle local object 'chain.<locals>.init'"):
        pickle.dumps(w)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", ">f8", "<f4"])
def test_a_weights_dtype_is_numpys_own_so_the_runtime_need_not_check_its_operands(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the weight's data had an equal copy of the dtype object, made to put it in native byte order: the
    # runtime's check that a node's operands share one dtype, by identity first, then cost a tiny model's
    # prediction a third of its time, until the weight's first step)
    from monadl.runtime import node

    w = ml.Weight(np.ones(3, dtype))
    assert w.data.dtype is np.dtype(np.dtype(dtype).char) and w.data.dtype.isnative
    checked: list[str] = []
    check = node._check_dtypes

    def spy(n: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        checked.append(n._op.name)
        return check(n, args)

    monkeypatch.setattr(node, "_check_dtypes", spy)
    x = np.ones(3, w.dtype)
    assert anyio.run((x * w + w).predict).tolist() == [2.0] * 3
    assert checked == []
    w.data = np.full(3, 2.0, dtype)  # (an assignment keeps it)
    assert w.data.dtype is np.dtype(np.dtype(dtype).char)
