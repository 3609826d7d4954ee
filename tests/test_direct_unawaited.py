"""``ml.values(...)`` used without ``await``: refused where it is used as
values and inside an ``@ml.operation``, warned of where it is dropped, and
silent where it was awaited or given up by a failure or a cancellation."""

from __future__ import annotations

import gc
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

pytestmark = pytest.mark.anyio

_ADVICE = (
    "on ml.values(...), not awaited (a forgotten await?): ml.values(...) is an awaitable, not the values: "
    "write `(value,) = await ml.values(layer)` (or `value = await layer`) inside the @ml.direct function"
)
_NEVER_AWAITED = (
    "ml.values(...) was never awaited, so it read nothing: write `(value,) = await "
    "ml.values(layer)` (or `value = await layer`) inside the @ml.direct function"
)


@contextmanager
def never_awaited() -> Iterator[list[str]]:
    """The "never awaited" warnings of ``ml.values(...)`` dropped inside, as
    'file:line: message' (a collection at the end finds those that a
    traceback's cycle held)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        said: list[str] = []
        yield said
        gc.collect()
    said += [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "never awaited" in str(w.message)]


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

    with never_awaited() as said:
        assert await exit_early().predict() == pytest.approx(2.0)
    assert len(refused) == len(uses)
    assert said == []  # (awaited after: nothing to warn of)


async def test_an_operator_that_said_so_does_not_warn_again_when_it_is_dropped() -> None:
    w = ml.Weight(np.array([1.0, 2.0]))

    @ml.direct
    async def forgot() -> ml.ScalarLayer:
        p: Any = ml.values(ml.max(w))
        return ml.sum(w) if p > 0.5 else ml.sum(w * 2.0)

    with never_awaited() as said, pytest.raises(TypeError, match=re.escape(f"a comparison (>) {_ADVICE}")):
        await forgot().predict()
    assert said == []


async def test_values_never_awaited_warn_at_the_line_that_dropped_them() -> None:
    # `ml.values(h)` as a statement (a forgotten await) was dropped silently; a forgotten `await
    # layer.train()` gets Python's "coroutine ... was never awaited".
    w = ml.Weight(np.array([1.0, -2.0]))
    line: list[int] = []

    @ml.direct
    async def forgot() -> ml.ScalarLayer:
        h = ml.tanh(w)
        line.append(_line() + 1)
        ml.values(h)
        return ml.sum(h)

    with never_awaited() as said:
        assert await forgot().predict() == pytest.approx(math.tanh(1.0) + math.tanh(-2.0))
    assert said == [f"{__file__}:{line[0]}: {_NEVER_AWAITED}"]


async def test_values_never_awaited_and_held_to_the_end_warn_at_the_line_that_called_them() -> None:
    # Held in a local, it is dropped when the function's frame ends, in monadl's code: the warning named
    # monadl/runtime/stepping.py (a new user's), where the line that called ml.values is what to fix.
    w = ml.Weight(np.array([1.0, -2.0]))
    line: list[int] = []

    @ml.direct
    async def forgot() -> ml.ScalarLayer:
        line.append(_line() + 1)
        pending = ml.values(ml.sum(w))  # (lives to the frame's end)
        return ml.sum(w * w) if pending is not None else ml.sum(w)

    with never_awaited() as said:
        assert await forgot().predict() == pytest.approx(5.0)
    assert said == [f"{__file__}:{line[0]}: {_NEVER_AWAITED}"]


async def test_values_awaited_or_given_up_by_a_cancellation_or_a_failure_do_not_warn() -> None:
    w = ml.Weight(np.array([1.0, 2.0]))

    async def slow() -> float:
        await anyio.sleep(30)
        return 1.0

    service: ml.ScalarLayer = ml.Layer(ml.Do.from_async(slow).map(ml.Tape))

    @ml.direct
    async def cancelled_in_its_await() -> ml.ScalarLayer:
        (s, _) = await ml.values(service, w)
        return ml.sum(w * s)

    @ml.direct
    async def cancelled_before_its_await() -> ml.ScalarLayer:
        pending = ml.values(w)  # (made, then a foreign await, cancelled there)
        await anyio.sleep(30)
        (x,) = await pending
        return ml.sum(w * x)

    @ml.direct
    async def fails() -> ml.ScalarLayer:
        await w
        raise ValueError("example failed")

    @ml.direct
    async def beside_a_failure() -> ml.ScalarLayer:
        pending = ml.values(w)
        await anyio.sleep(30)
        (x,) = await pending
        return ml.sum(w * x)

    @ml.direct
    async def closed_by_a_failure() -> ml.ScalarLayer:
        pending = ml.values(w)
        (y,) = await ml.values(w * 3.0)  # (suspended here when its sibling fails: closed)
        (x,) = await pending
        return ml.sum(w * x * y)

    @ml.direct
    async def awaited() -> ml.ScalarLayer:
        (x,) = await ml.values(w)
        y = await (w * 2.0)
        return ml.sum(w * x) + ml.sum(y)

    with never_awaited() as said:
        for model in (cancelled_in_its_await, cancelled_before_its_await):
            with anyio.move_on_after(0.2) as scope:
                await ml.sum(model()).predict()
            assert scope.cancelled_caught
        with pytest.raises(ValueError, match=r"^example failed\n"):
            await (fails() + beside_a_failure()).predict()
        with pytest.raises(ValueError, match=r"^example failed\n"):
            await (fails() + closed_by_a_failure()).predict()
        assert await awaited().train() == pytest.approx(11.0)
    assert said == []


async def test_values_kept_in_a_list_and_given_up_by_a_failure_do_not_warn() -> None:
    """Reads kept in a list (or a dict), awaited one by one, the first of
    which fails: the others were given up by the failure, as locals are."""
    w = ml.Weight(np.array([1.0, 2.0]))

    @ml.direct
    async def broken() -> ml.ArrayLayer:
        raise ValueError("a read's own evaluation failed")

    @ml.direct
    async def reads_in_a_list() -> ml.ScalarLayer:
        reads = [ml.values(broken()), ml.values(w * 2.0)]
        got = [await r for r in reads]
        return ml.sum(w) * float(got[1][0].sum())

    @ml.direct
    async def reads_in_a_dict() -> ml.ScalarLayer:
        reads = {"first": ml.values(broken()), "second": ml.values(w * 2.0)}
        (x,) = await reads["first"]
        (y,) = await reads["second"]
        return ml.sum(w * x * y)

    with never_awaited() as said:
        for model in (reads_in_a_list, reads_in_a_dict):
            with pytest.raises(ValueError, match="a read's own evaluation failed"):
                await model().predict()
    assert said == []


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

    with never_awaited() as said, pytest.raises(TypeError) as raised:
        await returns_values().predict()
    assert re.fullmatch(
        r"the @ml.direct function .*returns_values \(defined at .*:\d+\) returned ml.values\(\.\.\.\), an "
        r"awaitable; it must return a Layer or a Weight \(return the layer; `await ml.values\(layer\)` reads its "
        r"value inside the function\)",
        str(raised.value),
    )
    assert said == []


def _line() -> int:
    """The caller's line."""
    return sys._getframe(1).f_lineno
