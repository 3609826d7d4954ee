"""A traced operation applies the operand rule to its steps once per
signature of its operands (their types, dtypes and dimensions), and after
that what the rule did: the same casts, the same values, the same errors,
without the rule's checks at each step of each call."""

from __future__ import annotations

import logging
import re
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.errors import DTypeError
from monadl.layers._program import Program

STEPS = 6


def _euler(a: ml.ScalarWeight, b: ml.ScalarWeight) -> Any:
    def cell(y: ml.ArrayLayer) -> ml.ArrayLayer:
        for _ in range(STEPS):
            y = y + 0.01 * (a * y - b * y * y)
        return y

    return cell


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Program]:
    """Each call of a program's rule ``name`` from now on, as the program it checked for."""
    seen: list[Program] = []
    rule = getattr(Program, name)

    def counting(self: Program, *args: Any) -> Any:
        seen.append(self)
        return rule(self, *args)

    monkeypatch.setattr(Program, name, counting)
    return seen


def _run(f: Any, a: ml.ScalarWeight, b: ml.ScalarWeight, starts: list[Any], calls: int, batching: bool) -> Any:
    """The values of chains of ``calls`` calls of ``f`` from ``starts``, and the gradients of
    their sum of squares, each evaluated twice: four evaluations (the later ones: the program traced)."""
    ends = []
    for y0 in starts:
        y: Any = ml.as_layer(y0)
        for _ in range(calls):
            y = f(y)
        ends.append(y)
    out = ml.concatenate(ends, axis=0)
    with ml.settings(batching=batching):
        for _ in range(2):
            value = anyio.run(out.predict)
            grads = anyio.run(ml.gradients, ml.sum(out * out), [a, b])
    return value, [np.asarray(g) for g in grads]


def _same(got: Any, want: Any, exact: bool = True) -> None:
    (value, grads), (want_value, want_grads) = got, want
    assert value.dtype == want_value.dtype == np.float32
    np.testing.assert_array_equal(value, want_value)
    for g, w in zip(grads, want_grads):
        assert g.dtype == w.dtype
        # (a weight used at each step: the marked cell sums its six uses first, unmarked adds them one by one)
        np.testing.assert_array_equal(g, w) if exact else np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("batching", [False, True])
def test_a_float64_weight_in_a_float32_cell_is_cast_by_the_rule_once_not_per_call(
    batching: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new user's float32 ODE cell with ml.Weight(1.0) (a float64) as its rate: each of its steps
    # cast the weight, and so went through the operand rule, and the text of the step's line, at
    # every call (173 ms for 200 calls where the float32 weight's took 28 ms, the unmarked 103 ms).
    # A group of such calls went through the group's rule (`_member_rule`) at every group.
    a, b = ml.Weight(1.0), ml.Weight(0.5)
    cell = _euler(a, b)
    # Four chains of three calls: each wave of their calls is one group where batching.
    starts = [np.linspace(0.5, 1.5, 8, dtype=np.float32).reshape(4, 2) * (i + 1) for i in range(4)]
    plain = _run(cell, a, b, starts, 3, batching)
    groups: list[bool] = []
    batch = Program.batch

    def grouped(self: Program, *given: Any, **named: Any) -> Any:
        out = batch(self, *given, **named)
        groups.append(out is not None)
        return out

    monkeypatch.setattr(Program, "batch", grouped)
    checked = _counted(monkeypatch, "_member_rule" if batching else "_operand_rule")
    traced = _run(ml.operation(cell), a, b, starts, 3, batching)
    (program,) = set(checked)  # the rule ran at the first call's (or group's) steps only, of 48 (or 12)
    assert len(checked) == len(program.steps) == 6 * STEPS  # (a * y, b * y, * y, -, 0.01 *, + per update)
    assert groups == ([True] * 12 if batching else [])  # (three waves, four evaluations: all batched)
    _same(traced, plain, exact=False)
    # What the rule did, applied, is what the rule does: as where each call (or group) is checked.
    checked.clear()
    monkeypatch.setattr("monadl.layers._program.signature", lambda args: object())
    _same(traced, _run(ml.operation(cell), a, b, starts, 3, batching))
    assert len(checked) == 6 * STEPS * (12 if batching else 48)


def test_what_the_rule_did_is_remembered_per_dimensions_too() -> None:
    # A 0-d float64 array beside a float32 tensor is cast; one of the same dtype with dimensions
    # raises, as unmarked: a call after the first one is not cast as the first one was.
    w = ml.Weight(np.ones(3, np.float32))

    def shifted(s: ml.Array) -> ml.ArrayLayer:
        return w * 2.0 + s

    marked = ml.operation(shifted)
    for f in (shifted, marked):
        assert anyio.run(f(np.array(0.5)).predict).dtype == np.float32
    messages = []
    for f in (shifted, marked):
        with pytest.raises(DTypeError) as caught:
            anyio.run(f(np.ones(3)).predict)
        messages.append(str(caught.value))
    plain, traced = messages
    assert "add: operands float32[3], float64[3] mix float32 and float64 arrays" in traced
    assert traced.startswith(plain)  # (the line of the addition, then the operation and its call's)
    assert re.search(r", inside the operation \S*shifted called at \S+:\d+$", traced), traced


def test_a_group_that_declined_declines_again_without_the_rule(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A float64 weight beside float32 rows (the user forgot a cast): each member would raise, so the
    # group runs member by member, which raises at the member's line; the next group of the same
    # operands does so at once, and its log names the same step.
    w = ml.Weight(np.ones((3, 3)))
    marked = ml.operation(lambda x: ml.tanh(x @ w))
    checked = _counted(monkeypatch, "_member_rule")
    messages = []
    for _ in range(2):
        rows = ml.concatenate([marked(np.full((1, 3), i, np.float32)) for i in range(4)], axis=0)
        debug = caplog.at_level(logging.DEBUG, "monadl.batching")
        with debug, ml.settings(batching=True), pytest.raises(DTypeError) as caught:
            anyio.run(rows.predict)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "matmul: operands float32[1, 3], float64[3, 3] mix float32 and float64 arrays" in messages[0]
    (program,) = set(checked)
    assert len(checked) == 1 and program.declined is not None  # (its first step: the product)
    logged = [r.getMessage() for r in caplog.records if "ran one by one" in r.getMessage()]
    assert len(logged) == 2 and logged[0] == logged[1]
    assert re.search(r"its step matmul at \S+:\d+ does not batch with these operands$", logged[0]), logged


@pytest.mark.parametrize("batching", [False, True])
def test_a_cast_to_float64_is_kept_in_the_plan(batching: bool) -> None:
    """A NumPy float32 base beside a float64 layer is cast to float64 at every
    call, as unmarked: the plan kept it as no cast (NumPy's float64 dtype
    compares equal to None), so later calls took log(base) in float32 for
    the exponent's delta (a new user's: 6e-8 relative in a float64 gradient)."""
    w = ml.Weight(np.array([[0.3]]))

    def f(x: ml.ArrayLayer, t: Any) -> ml.ArrayLayer:
        return t ** ml.tanh(x @ w)  # type: ignore[no-any-return]  # (t ** layer: NumPy's scalar's __pow__ is Any)

    marked = ml.operation(f)
    base = np.float64(np.float32(0.7))  # (the float32 base, in float64)
    exact = base ** np.tanh(0.3) * np.log(base) * (1 - np.tanh(0.3) ** 2)

    async def grad(g: Any, n: int) -> float:
        terms = [ml.sum(g(ml.as_layer(np.ones((1, 1))), np.float32(0.7))) for _ in range(n)]
        with ml.settings(batching=batching):
            (dw,) = await ml.gradients(ml.sum(ml.stack(terms)), [w])
        return float(np.asarray(dw)[0, 0]) / n

    for n in (1, 2, 1, 12):  # (the first call takes the rule; the later ones its plan)
        assert anyio.run(grad, marked, n) == pytest.approx(exact, rel=1e-13, abs=0)
        assert anyio.run(grad, f, n) == pytest.approx(exact, rel=1e-13, abs=0)
