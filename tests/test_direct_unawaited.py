"""``ml.values(...)`` used without ``await``: refused where it is used as
values, and inside an ``@ml.operation``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import monadl as ml

pytestmark = pytest.mark.anyio

_ADVICE = (
    "on ml.values(...), not awaited (a forgotten await?): ml.values(...) is an awaitable, not the values: "
    "write `(value,) = await ml.values(layer)` (or `value = await layer`) inside the @ml.direct function"
)


async def test_operators_on_values_not_awaited_say_await_was_forgotten() -> None:
    # `p = ml.values(ml.max(h)); if p > 0.5:` raised Python's bare "'>' not supported between instances
    # of 'AwaitLayers' and 'float'", where indexing the same object said what to do.
    uses: list[tuple[Callable[[Any], object], type[Exception], str]] = [
        (lambda p: p > 0.5, TypeError, "a comparison (>)"),
        (lambda p: 0.5 < p, TypeError, "a comparison (>)"),  # noqa: SIM300 (the reflected one: p.__gt__)
        (lambda p: p <= 0.5, TypeError, "a comparison (<=)"),
        (lambda p: p == 1.0, TypeError, "a comparison (==)"),
        (lambda p: p != 1.0, TypeError, "a comparison (!=)"),
        (lambda p: p * 2.0, TypeError, "arithmetic (*)"),
        (lambda p: 1.0 - p, TypeError, "arithmetic (-)"),
        (lambda p: p / 2, TypeError, "arithmetic (/)"),
        (lambda p: -p, TypeError, "a negation (-)"),
        (lambda p: p @ np.ones(2), TypeError, "a matrix product (@)"),
        (lambda p: np.ones(2) * p, TypeError, "NumPy's conversion (np.asarray, np.argmax, ...)"),
        (lambda p: abs(p), TypeError, "abs()"),
        (lambda p: round(p, 2), TypeError, "round()"),
        (lambda p: math.floor(p), TypeError, "rounding (math.trunc, math.floor, math.ceil)"),
        (lambda p: 1.0 in p, TypeError, "iteration (for, unpacking, list(), in)"),
        (lambda p: f"{p:.3f}", TypeError, "formatting (f-string, format())"),
        (lambda p: p.max(), AttributeError, "`.max`"),
        (lambda p: p.shape, AttributeError, "`.shape`"),
    ]
    w = ml.Weight(np.array([0.25, 0.75]))
    refused: list[str] = []

    @ml.direct
    async def exit_early() -> ml.ScalarLayer:
        probs = ml.softmax(w * 4.0)
        pending: Any = ml.values(ml.max(probs))  # (Any: the mistakes under test, which mypy rejects)
        for use, kind, what in uses:
            with pytest.raises(kind) as raised:
                use(pending)
            refused.append(str(raised.value))
            assert str(raised.value) == f"{what} {_ADVICE}"
        assert repr(pending) == "<ml.values(...): an awaitable; await it for the values>"
        (p,) = await pending
        return ml.sum(probs) * 2.0 if p > 0.5 else ml.sum(probs)

    assert await exit_early().predict() == pytest.approx(2.0)
    assert len(refused) == len(uses)


async def test_values_inside_an_operation_are_refused_naming_the_cell() -> None:
    # Inside an @ml.operation (a synchronous function, traced once per signature) `v = ml.values(h)`
    # was dropped silently: nothing could await it, and a trace has no values to read.
    w = ml.Weight(np.array([[1.0, 0.0], [0.0, 1.0]]))

    @ml.operation
    def cell(x: ml.ArrayLayer) -> ml.ArrayLayer:
        h = ml.tanh(x @ w)
        ml.values(h)
        return h

    with pytest.raises(ml.OperandError) as raised:
        await ml.sum(cell(ml.as_layer(np.ones((1, 2))))).predict()
    assert str(raised.value) == (
        "operation test_values_inside_an_operation_are_refused_naming_the_cell.<locals>.cell: the cell calls "
        "ml.values(...), which reads layers' values, while it is traced (once per signature, with no values, and a cell is no async def: nothing could await it): read "
        "values in an @ml.direct function outside the cell and pass what the cell branches on as an int or a "
        "string argument (each value its own trace), or leave the cell unmarked"
    )


async def test_a_direct_function_that_returns_values_not_awaited_is_told_so() -> None:
    w = ml.Weight(np.array([1.0, 2.0]))

    @ml.direct
    async def returns_values() -> Any:
        return ml.values(w)

    with pytest.raises(TypeError) as raised:
        await returns_values().predict()
    assert re.fullmatch(
        r"the @ml.direct function .*returns_values \(defined at .*:\d+\) returned ml.values\(\.\.\.\), an "
        r"awaitable; it must return a Layer or a Weight \(return the layer; `await ml.values\(layer\)` reads its "
        r"value inside the function\)",
        str(raised.value),
    )
