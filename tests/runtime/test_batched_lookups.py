"""Batched lookups by each example's own index array: ``h[src]`` and
``ml.embedding(h, src)`` where ``h`` is each example's layer (a message-passing
step's), unmarked and inside a marked cell. The same values, gradients and
errors as node by node; the forms that do not batch run member by member."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

import monadl as ml
from monadl.layers._batching_rules import BATCHING_RULES
from monadl.layers._primitives import PRIMITIVES

HERE = __file__
ROWS, EDGES, D, MEMBERS = 5, 6, 3, 8
Ints = npt.NDArray[np.int64]
Form = Callable[[ml.ArrayLayer, Any], ml.ArrayLayer]
SHARED = np.array([4, 0, 0, 2])  # one index for every example's rows

FORMS: dict[str, tuple[str, Form, Callable[[Ints], Any]]] = {
    # (the primitive, the lookup, what each example passes as its index: its sources, or made of them)
    "h[src]": ("getitem", lambda h, s: h[s], lambda src: src),
    "h[src, :]": ("getitem", lambda h, s: h[s, :], lambda src: src),
    "h[src, ...]": ("getitem", lambda h, s: h[s, ...], lambda src: src),
    "h[src, 1]": ("getitem", lambda h, s: h[s, 1], lambda src: src),
    "h[src, None, 1:]": ("getitem", lambda h, s: h[s, None, 1:], lambda src: src),
    "h[src of 2 axes]": ("getitem", lambda h, s: h[s], lambda src: np.reshape(src, (2, -1))),
    "h[src - rows]": ("getitem", lambda h, s: h[s], lambda src: src - ROWS),  # from the end, as NumPy reads it
    "h[k]": ("getitem", lambda h, k: h[k], lambda src: np.array(src[0])),  # a 0-d index array of each example's
    "h[k, 1:]": ("getitem", lambda h, k: h[k, 1:], lambda src: np.array(src[0])),
    "h[uint8 src]": ("getitem", lambda h, s: h[s], lambda src: src.astype(np.uint8)),
    "h[shared]": ("getitem", lambda h, s: h[SHARED] * s, lambda src: 1.0),
    "embedding(h, src)": ("embedding", lambda h, s: ml.embedding(h, s), lambda src: src),
    "embedding(h, shared)": ("embedding", lambda h, s: ml.embedding(h, SHARED) * s, lambda src: 1.0),
}


def examples(seed: int = 0) -> list[tuple[npt.NDArray[np.float64], Ints]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(ROWS, D)), rng.integers(0, ROWS, EDGES)) for _ in range(MEMBERS)]


def run(loss: ml.ScalarLayer, weights: list[ml.Weight[Any, Any]], batching: bool) -> tuple[float, list[Any]]:
    with ml.settings(batching=batching):
        value = anyio.run(loss.predict)
        grads = anyio.run(ml.gradients, loss, weights)
    return float(value), list(grads)


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Whether each call of ``name``'s batching rule batched."""
    calls: list[bool] = []
    rule = BATCHING_RULES[name]

    def count(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> Any:
        result = rule(args, batched, n)
        calls.append(result is not None)
        return result

    monkeypatch.setitem(BATCHING_RULES, name, count)
    return calls


@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "marked"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_lookup_by_each_examples_indices_batches_with_the_unbatched_values_and_gradients(
    form: str, marked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each ran member by member: "its batching rule does not take these operands" (a new user's GNN).
    name, pick, index = FORMS[form]
    rng = np.random.default_rng(1)
    w, v = ml.Weight(rng.normal(size=(D, D))), ml.Weight(np.array(0.7))

    def step(h: ml.ArrayLayer, src: Any) -> ml.ScalarLayer:
        return ml.sum(ml.tanh(pick(h, src) * v) ** 2)

    cell = ml.operation(step) if marked else step
    calls = counting(monkeypatch, name)
    loss = ml.sum(ml.stack([cell(ml.tanh(x @ w), index(src)) for x, src in examples()]))
    want_value, want = run(loss, [w, v], False)
    assert not calls
    got_value, got = run(loss, [w, v], True)
    assert calls and all(calls)
    assert abs(got_value - want_value) <= 1e-12 * abs(want_value)
    for g, expected in zip(got, want):
        assert np.max(np.abs(g - expected)) <= 1e-12 * np.max(np.abs(expected))


@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "marked"])
def test_a_message_passing_step_batches_with_the_unbatched_gradients(
    marked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tester's GNN: gather by the edges' sources, sum into their targets, three rounds.
    rng = np.random.default_rng(2)
    msg = ml.Weight(rng.normal(size=(D, D)) / 2)
    graphs = [(x, src, rng.integers(0, ROWS, EDGES)) for x, src in examples(3)]

    def mp(h: ml.ArrayLayer, src: Ints, dst: Ints) -> ml.ArrayLayer:
        return ml.tanh(h + ml.segment_sum(h[src] @ msg, dst, ROWS))

    step = ml.operation(mp) if marked else mp
    calls = counting(monkeypatch, "getitem")
    finals = []
    for x, src, dst in graphs:
        h: ml.ArrayLayer = ml.as_layer(x) @ msg
        for _ in range(3):
            h = step(h, src, dst)
        finals.append(ml.sum(h**2))
    loss = ml.sum(ml.stack(finals))
    want_value, (want,) = run(loss, [msg], False)
    got_value, (got,) = run(loss, [msg], True)
    assert len(calls) == 6 and all(calls)  # one group a round, in each of two evaluations (value, gradients)
    assert abs(got_value - want_value) <= 1e-12 * abs(want_value)
    assert np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))


def test_each_members_index_tuple_is_its_own() -> None:
    # Grouped by the arrays' shapes and dtypes, a tuple's arrays would be the first member's if read
    # as one parameter: each member's rows must come from its own.
    xs = [np.arange(12.0).reshape(4, 3) * (i + 1) for i in range(8)]
    srcs = [np.array([i % 4, (i + 1) % 4]) for i in range(8)]
    w = ml.Weight(np.ones(()))
    picked = [(ml.as_layer(x) * w)[s, 1] for x, s in zip(xs, srcs)]
    with ml.settings(batching=True):
        values = anyio.run(ml.stack(picked).predict)
    np.testing.assert_array_equal(values, [x[s, 1] for x, s in zip(xs, srcs)])


def test_rows_of_one_weight_by_each_examples_indices_batch() -> None:
    table = ml.Weight(np.random.default_rng(4).normal(size=(7, 3)))
    rule = BATCHING_RULES["getitem"]
    ids = np.array([[0, 6, 6], [-1, 2, 0]])
    result = rule((table.data, (ids, slice(None))), (False, True), 2)
    assert result is not None
    out, (vjp,) = result
    np.testing.assert_array_equal(out, table.data[ids])
    g = np.arange(18.0).reshape(2, 3, 3)
    want = sum(PRIMITIVES["getitem"].rule(table.data, ids[i])[1][0](g[i]) for i in range(2))
    np.testing.assert_array_equal(vjp(g), want)


@pytest.mark.parametrize("name", ["getitem", "embedding"])
def test_the_rules_give_each_members_rows_and_deltas(name: str) -> None:
    rng = np.random.default_rng(5)
    tables = rng.normal(size=(4, ROWS, 2, 3))
    ids = rng.integers(0, ROWS, (4, 3, 2))
    result = BATCHING_RULES[name]((tables, ids), (True, True), 4)
    assert result is not None
    out, (vjp,) = result
    g = rng.normal(size=out.shape)
    got = vjp(g)
    assert got.shape == tables.shape
    for i in range(4):
        value, (single,) = PRIMITIVES[name].rule(tables[i], ids[i])
        np.testing.assert_array_equal(out[i], value)
        delta = single(g[i])
        np.testing.assert_allclose(got[i], delta.to_dense() if name == "embedding" else delta, rtol=1e-15, atol=0)


UNBATCHED: dict[str, tuple[Form, Callable[[Ints], Any]]] = {
    "h[mask]": (lambda h, s: h[s], lambda src: src % 2 == 0),
    "h[:, src]": (lambda h, s: h[:, s], lambda src: src[:2] % D),
    "h[src, dst]": (lambda h, s: h[s, s % D], lambda src: src),
    "h[1, src]": (lambda h, s: h[1, s], lambda src: src[:2] % D),
}


@pytest.mark.parametrize("form", list(UNBATCHED))
def test_other_fancy_indices_run_member_by_member_and_say_so(form: str, caplog: pytest.LogCaptureFixture) -> None:
    pick, index = UNBATCHED[form]
    w = ml.Weight(np.random.default_rng(6).normal(size=(D, D)))
    srcs = [np.resize(src, ROWS) for _, src in examples()]  # (a mask of one size: each member picks its own rows)
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(pick(ml.tanh(x @ w), index(s)))) for (x, _), s in zip(examples(), srcs)]))
    want_value, want = run(loss, [w], False)
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        got_value, got = run(loss, [w], True)
    assert abs(got_value - want_value) <= 1e-12 * abs(want_value)
    assert np.max(np.abs(got[0] - want[0])) <= 1e-12 * np.max(np.abs(want[0]))
    assert f"{MEMBERS} nodes of getitem built at {HERE}" in caplog.text
    assert "its batching rule does not take these operands" in caplog.text


@pytest.mark.parametrize(
    ("form", "bad", "error"),
    [
        ("h[src]", ROWS, IndexError),
        ("h[src]", -ROWS - 1, IndexError),
        ("embedding(h, src)", ROWS, ml.ShapeError),
        ("embedding(h, src)", -1, ml.ShapeError),
    ],
)
@pytest.mark.parametrize("marked", [False, True], ids=["unmarked", "marked"])
def test_an_index_out_of_its_members_rows_is_that_members_error(
    form: str, bad: int, error: type[Exception], marked: bool
) -> None:
    # Offset into the stack, an index past a member's rows would read the next member's row.
    _, pick, _ = FORMS[form]
    w = ml.Weight(np.ones((D, D)))

    def total(h: ml.ArrayLayer, src: Ints) -> ml.ScalarLayer:
        return ml.sum(pick(h, src))

    cell = ml.operation(total) if marked else total
    terms = []
    for i, (x, src) in enumerate(examples()):
        if i == 5:
            src[2] = bad
            terms.append(cell(ml.tanh(x @ w), src))  # BAD-MEMBER
        else:
            terms.append(cell(ml.tanh(x @ w), src))
    loss = ml.sum(ml.stack(terms))
    messages = []
    for batching in (False, True):
        with ml.settings(batching=batching), pytest.raises(error) as info:
            anyio.run(ml.gradients, loss, [w])
        messages.append("\n".join([str(info.value), *getattr(info.value, "__notes__", [])]))
    assert messages[0] == messages[1]
    if marked:  # (unmarked, every member's lookup is built at one line: the form's)
        assert f"{HERE}:{line_of('BAD-MEMBER')}" in messages[1]


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)
