"""A loom whose calls give outputs of different shapes to one arena (each
example's own width: a CTC recursion's alpha) (`monadl.fold._loom_arenas`):
rows of another shape held apart, a group whose members read them run as
one batched call per pattern of shapes, with the values, gradients, errors
and non-finite checks of the same calls built as nodes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import _loom_looped, _loom_run
from tests.fold.test_loom_block import value_and_grads

WIDTHS = (2, 3, 2, 5, 3, 2)  # (each example's rows: 3 of 2, 2 of 3, 1 of 5)


def sizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (depth, members) of each batched call the loom's groups make, as they run."""
    made: list[tuple[int, int]] = []
    call = _loom_looped.group_call

    def counted(plan: Any, operands: Any, arenas: Any, weights: Any, n: int) -> Any:
        made.append((plan.group.depth, n))
        return call(plan, operands, arenas, weights, n)

    monkeypatch.setattr(_loom_run, "group_call", counted)
    return made


def chains(seed: int = 0) -> tuple[ml.ArrayWeight, Callable[[bool], ml.ScalarLayer]]:
    """Per example a chain of a start and three steps over its own rows (k, 3):
    the steps' groups read outputs of three shapes from one arena."""
    rng = np.random.default_rng(seed)
    w = ml.Weight(rng.normal(size=(3, 3)) / 2)
    start = ml.operation(lambda x: ml.tanh(x @ w))
    step = ml.operation(lambda h: ml.tanh(h @ w) + h * 0.5)
    xs = [rng.normal(size=(k, 3)) for k in WIDTHS]

    def build(loom: bool) -> ml.ScalarLayer:
        with ml.loom() if loom else contextlib.nullcontext():
            ends = [step(step(step(start(ml.as_layer(x))))) for x in xs]
        return ml.sum(ml.stack([ml.sum(e * e) for e in ends]))

    return w, build


def test_steps_that_read_outputs_of_several_shapes_run_batched_per_shape(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: every call of the block ran one by one (a new user's CTC: 8x
    the block's time). Now one batched call per shape and depth, and the
    loss and gradient of the calls as nodes. (The starts' outputs and the
    steps' are two arenas, no group reading both: 2 shapes apart in each.)"""
    w, build = chains()
    v0, (g0,) = value_and_grads(build(False), [w])
    made = sizes(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        v1, (g1,) = value_and_grads(build(True), [w])
    assert v1 == pytest.approx(v0, rel=1e-13)
    np.testing.assert_allclose(g1, g0, rtol=1e-12, atol=1e-14)
    per_run = made[: len(made) // 2]  # (gradients, then predict: the same calls twice)
    assert sorted(per_run) == sorted((depth, n) for depth in range(4) for n in (3, 2, 1))
    said = [r.getMessage() for r in caplog.records]
    assert any("holds outputs of 4 more shapes apart" in m and "ran 3 groups as 9 batched calls" in m for m in said)
    assert not any("one by one" in m for m in said)


def test_a_call_of_two_operands_each_of_several_shapes_runs_per_pair_of_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A join's two operands read rows of different arenas independently:
    its group splits by the pair of shapes (4 pairs of 6 calls)."""
    rng = np.random.default_rng(1)
    w = ml.Weight(rng.normal(size=(3, 3)) / 2)
    cell = ml.operation(lambda x: ml.tanh(x @ w))
    join = ml.operation(lambda a, b: ml.tanh(ml.sum(a @ w, axis=0, keepdims=True) + ml.sum(b, axis=0, keepdims=True)))
    pairs = [(2, 3), (3, 2), (2, 3), (2, 2), (3, 3), (3, 2)]
    xs = [(rng.normal(size=(i, 3)), rng.normal(size=(j, 3))) for i, j in pairs]
    losses = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [join(cell(ml.as_layer(a)), cell(ml.as_layer(b))) for a, b in xs]
        losses.append(ml.sum(ml.concatenate(outs, axis=0) ** 2.0))
    v0, (g0,) = value_and_grads(losses[0], [w])
    made = sizes(monkeypatch)
    v1, (g1,) = value_and_grads(losses[1], [w])
    assert v1 == pytest.approx(v0, rel=1e-13)
    np.testing.assert_allclose(g1, g0, rtol=1e-12, atol=1e-14)
    assert sorted(n for depth, n in made[: len(made) // 2] if depth == 1) == [1, 1, 2, 2]


def test_an_output_unread_in_some_calls_of_a_split_group_sends_no_delta_through_sqrt_at_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cell of two outputs, the second a sqrt at 0 in the calls that do
    not read it, read in the others, in a group split by shape (each shape's
    part holds both): the unread ones send no delta (a zero delta times
    sqrt's infinite derivative is NaN), as the calls built as nodes."""
    grads = []
    for loom in (False, True):
        w = ml.Weight(np.eye(2))
        two = ml.operation(lambda h: (ml.tanh(h @ w), ml.sqrt(h @ w)))  # noqa: B023
        terms = []
        with ml.loom() if loom else contextlib.nullcontext():
            for k, n in enumerate((1, 1, 2, 2, 3, 3)):
                x = np.full((n, 2), 1.0 + k)
                x[:, 0] = 0.5 * (k % 2)  # (unread: the first column 0, tanh's 0, then sqrt's 0 a level up)
                t, s = two(two(ml.as_layer(x))[0])
                terms.append(ml.sum(t * s) if k % 2 else ml.sum(t))
        with ml.settings(batching=False if not loom else None), caplog.at_level(logging.DEBUG, "monadl.batching"):
            _, g = anyio.run(ml.value_and_gradients, ml.sum(ml.stack(terms)))
        grads.append(g[w])
    assert any("ran 1 groups as 3 batched calls" in r.getMessage() for r in caplog.records)
    assert np.isfinite(grads[1]).all()
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-14)


def test_a_shape_error_in_one_call_of_a_split_group_names_its_line_as_its_node_would() -> None:
    w = ml.Weight(np.ones((3, 3)))  # the weight's line
    widen = ml.operation(lambda x: x * 2.0)
    cell = ml.operation(lambda h: ml.tanh(h @ w))

    def build() -> ml.ScalarLayer:
        outs = [cell(widen(ml.as_layer(np.ones((1, n))))) for n in (3, 3, 4)]  # the calls' line
        return ml.sum(ml.stack([ml.sum(o) for o in outs]))

    messages = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            loss = build()
        with pytest.raises(ml.ShapeError) as info:
            anyio.run(loss.predict)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert f"layer built at {__file__}:{build.__code__.co_firstlineno + 1};" in messages[1]


def test_a_nan_in_a_split_group_under_check_finite_names_its_line_and_nothing_steps() -> None:
    w = ml.Weight(np.ones((3, 3)))
    start = ml.operation(lambda x: x * 1.0)
    cell = ml.operation(lambda h: ml.log(h @ w))  # the cell's line
    with ml.loom():
        outs = [cell(start(ml.as_layer(np.full((n, 3), v)))) for n, v in ((1, 1.0), (2, 1.0), (2, -5.0))]
    loss = ml.sum(ml.stack([ml.sum(o) for o in outs]))
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(loss.train)
    line = test_a_nan_in_a_split_group_under_check_finite_names_its_line_and_nothing_steps.__code__.co_firstlineno + 3
    assert "log" in str(info.value) and f"{__file__}:{line}" in str(info.value)
    np.testing.assert_array_equal(w.data, np.ones((3, 3)))


def test_a_group_that_fails_batched_but_not_alone_runs_one_by_one_and_says_so_as_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback that remains (a batching rule's fault): the values of the
    calls alone, and a WARNING, not only a DEBUG line."""
    w, build = chains(2)
    v0, (g0,) = value_and_grads(build(False), [w])
    call = _loom_looped.group_call

    def failing(plan: Any, operands: Any, arenas: Any, weights: Any, n: int) -> Any:
        if plan.group.depth == 2:
            raise ValueError("a batching rule's fault")
        return call(plan, operands, arenas, weights, n)

    monkeypatch.setattr(_loom_run, "group_call", failing)
    with caplog.at_level(logging.WARNING, logger="monadl.batching"):
        v1, (g1,) = value_and_grads(build(True), [w])
    assert v1 == pytest.approx(v0, rel=1e-13)
    np.testing.assert_allclose(g1, g0, rtol=1e-12, atol=1e-14)
    (said, *_) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "runs its calls one by one" in said.getMessage()
    assert (
        "calls of " in said.getMessage()
        and "raised ValueError, where each of its calls alone did not" in said.getMessage()
    )


def test_calls_whose_data_set_their_outputs_shapes_are_parted_by_shape(caplog: pytest.LogCaptureFixture) -> None:
    """A boolean mask's count sets each call's output's rows: the group's
    calls run one by one (the masked read does not batch), then are held
    per shape, and the calls that read them batch per shape. Before, the
    calls' outputs could not be stacked and every call of the block ran
    one by one."""
    results = []
    masks = [np.array(m) for m in ([1, 0, 1], [1, 0, 0], [1, 1, 1], [0, 1, 1])]
    for loom in (False, True):
        w = ml.Weight(np.random.default_rng(4).normal(size=(3, 3)))
        pick = ml.operation(lambda x, m: ml.tanh(x @ w)[m])  # noqa: B023
        total = ml.operation(lambda h: ml.sum(h * h, axis=0, keepdims=True))
        with ml.loom() if loom else contextlib.nullcontext():
            outs = [
                total(pick(ml.as_layer(np.full((3, 3), 0.1 * (i + 1))), m.astype(bool))) for i, m in enumerate(masks)
            ]
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
            results.append(value_and_grads(ml.sum(ml.concatenate(outs, axis=0)), [w]))
    (v0, (g0,)), (v1, (g1,)) = results
    assert v1 == pytest.approx(v0, rel=1e-14)
    np.testing.assert_allclose(g1, g0, rtol=1e-13)
    said = [r.getMessage() for r in caplog.records]
    assert any("holds outputs of 2 more shapes apart" in m and "ran 1 groups as 3 batched calls" in m for m in said)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
