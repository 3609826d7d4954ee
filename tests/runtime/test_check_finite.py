"""``ml.settings(check_finite=True)`` stops at the first NaN or infinity, inside a marked cell too.

A marked cell (`ml.operation`) is one node of the graph; the check looks at
each of its steps, forward and backward, and names the line inside the cell
as it would unmarked, followed by the line that called it. Batching is off
under the check, whatever ``batching`` says: both settings are run. NumPy's
RuntimeWarnings are errors here (pyproject's filterwarnings): under the
check, the error is the check's, not NumPy's warning.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import anyio
import numpy as np
import pytest

import monadl as ml

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


def site(marker: str) -> str:
    return f"{HERE}:{line_of(marker)}"


def raised(run: Callable[[], object], batching: bool) -> str:
    """The message of the `NonFiniteError` that ``run`` raises under the check
    (with NumPy's RuntimeWarnings as errors, as this project's pytest has them)."""
    with ml.settings(check_finite=True, batching=batching), pytest.raises(ml.NonFiniteError) as error:
        run()
    return str(error.value)


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("mode", ["predict", "train"])
def test_an_infinity_made_inside_a_marked_cell_is_found_at_its_line(mode: str, batching: bool) -> None:
    w = ml.Weight(np.array([1e308, 1.0, 2.0]))

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        big = w * x * 10.0  # OVERFLOW: 1e308 * 10, the first infinity
        return ml.tanh(big)  # tanh(inf) = 1: the cell's value is finite

    x = np.ones(3)
    unmarked = raised(lambda: anyio.run(getattr(ml.sum(cell(x)), mode)), batching)
    marked = raised(lambda: anyio.run(getattr(ml.sum(ml.operation(cell)(x)), mode)), batching)  # CALL-1
    made = f"multiply produced a NaN or an infinity from float64[3], float 10.0; layer built at {site('OVERFLOW')}"
    assert unmarked == made
    assert re.fullmatch(
        rf"{re.escape(made)}, inside the operation .*cell called at {re.escape(site('CALL-1'))}", marked
    )
    np.testing.assert_array_equal(w.data, [1e308, 1.0, 2.0])


@pytest.mark.parametrize("batching", [False, True])
def test_the_backward_inside_a_marked_cell_is_found_at_its_line(batching: bool) -> None:
    v = ml.Weight(np.array([0.0, 1.0, 4.0]))

    def root(x: ml.ArrayOperand) -> ml.ArrayLayer:
        inner = v * x
        return ml.sqrt(inner)  # ROOT: its delta at 0 is infinite

    unmarked = raised(lambda: anyio.run(ml.sum(root(np.ones(3))).train), batching)
    marked = raised(lambda: anyio.run(ml.sum(ml.operation(root)(np.ones(3))).train), batching)  # CALL-2
    made = f"the backward of sqrt produced a NaN or an infinity; layer built at {site('ROOT')}"
    assert unmarked == made
    assert re.fullmatch(
        rf"{re.escape(made)}, inside the operation .*root called at {re.escape(site('CALL-2'))}", marked
    )
    np.testing.assert_array_equal(v.data, [0.0, 1.0, 4.0])


def test_a_nested_cell_names_each_line_from_the_innermost() -> None:
    w = ml.Weight(np.array([1e308, 1.0]))

    @ml.operation
    def inner(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(w * x * 10.0)  # NESTED-STEP

    @ml.operation
    def outer(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return inner(x) * 2.0  # NESTED-CALL

    message = raised(lambda: anyio.run(ml.sum(outer(np.ones(2))).train), False)  # OUTER-CALL
    assert re.fullmatch(
        rf"multiply produced .*; layer built at {re.escape(site('NESTED-STEP'))}, inside the operation .*inner"
        rf" called at {re.escape(site('NESTED-CALL'))}, inside the operation .*outer"
        rf" called at {re.escape(site('OUTER-CALL'))}",
        message,
    )


def test_data_that_holds_an_infinity_is_named_as_data() -> None:
    w = ml.Weight(np.ones(1))
    loss = ml.sum(ml.tanh(ml.as_layer(np.array([np.inf])) * w))  # AS-LAYER
    message = raised(lambda: anyio.run(loss.predict), False)
    assert message == f"the data given at {site('AS-LAYER')} already holds a NaN or an infinity (float64[1])"


@pytest.mark.parametrize("marked", [False, True])
def test_an_operand_that_already_holds_a_nan_is_named(marked: bool) -> None:
    w, b = ml.Weight(np.ones((3, 2))), ml.Weight(np.zeros(2))

    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.dense(x, w, b)  # DENSE

    f = ml.operation(cell) if marked else cell
    message = raised(lambda: anyio.run(ml.sum(f(np.array([[np.nan, 1.0, 1.0]]))).train), False)
    assert message.startswith(
        f"dense's operand 0 (float64[1, 3]) already holds a NaN or an infinity; layer built at {site('DENSE')}"
    )


@pytest.mark.parametrize("batching", [False, True])
def test_a_checked_cell_trains_as_an_unchecked_one(batching: bool) -> None:
    w = ml.Weight(np.arange(6.0).reshape(3, 2) / 10.0)

    @ml.operation
    def cell(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.tanh(x @ w) * 2.0

    def grads(check: bool) -> list[np.ndarray]:
        loss = ml.sum(ml.stack([ml.sum(cell(np.full((1, 3), float(i)))) for i in range(4)]))
        with ml.settings(check_finite=check, batching=batching):
            return anyio.run(ml.gradients, loss, [w])

    np.testing.assert_allclose(grads(True)[0], grads(False)[0], rtol=1e-12)


@pytest.mark.parametrize("batching", [False, True])
def test_an_infinity_in_one_examples_data_is_named_as_its_operand(batching: bool) -> None:
    w = ml.Weight(np.ones((4, 3)))
    xs = [np.ones((1, 4)) for _ in range(32)]
    xs[17] = np.array([[np.inf, 1.0, 1.0, 1.0]])
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(x @ w)) for x in xs]))  # EXAMPLES
    message = raised(lambda: anyio.run(loss.train), batching)
    assert message == (
        f"matmul's operand 0 (float64[1, 4]) already holds a NaN or an infinity; layer built at {site('EXAMPLES')}"
    )
    np.testing.assert_array_equal(w.data, np.ones((4, 3)))
