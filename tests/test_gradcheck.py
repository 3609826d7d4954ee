"""`check_grads` on a marked cell (`ml.operation`): it called the function on plain arrays first, and a
cell refuses data that its operators would compute on, so a user's correct cell was refused."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml


def cell(a: Any, b: Any) -> Any:
    return ml.tanh(a @ b) * ml.sigmoid(b[0])


marked = ml.operation(cell)
rng = np.random.default_rng(0)
A, B = rng.random((2, 3)), rng.random((3, 4))


def test_check_grads_checks_a_marked_cell_as_the_unmarked_function() -> None:
    ml.check_grads(marked, A, B)  # (OperandError: a data argument of the cell went into a NumPy computation)
    ml.check_grads(cell, A, B)
    weights = [ml.Weight(A), ml.Weight(B)]
    by_cell = anyio.run(ml.gradients, ml.sum(marked(*weights)), weights)
    by_function = anyio.run(ml.gradients, ml.sum(cell(*weights)), weights)
    for got, expected in zip(by_cell, by_function, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_check_grads_still_finds_a_wrong_gradient_in_a_marked_cell() -> None:
    half: Any = ml.operation(lambda a: a * ml.stop_gradient(a))  # (its backward misses one of the two factors)
    with pytest.raises(AssertionError, match="gradient of argument 0"):
        ml.check_grads(half, np.array([0.5, -1.5]))


def test_check_grads_checks_a_marked_cell_behind_a_wrapper() -> None:
    # A lambda or a partial over the cell is no Operation: it was called on plain arrays, and refused.
    ml.check_grads(lambda a, b: marked(a, b) * 2.0, A, B)
    ml.check_grads(functools.partial(marked, A), B)
