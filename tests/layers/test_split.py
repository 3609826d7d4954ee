"""``split``: values, deltas against finite differences, one assembled delta, errors, types."""

from __future__ import annotations

from typing import Any, assert_type

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.gradcheck import check_grads
from monadl.layers._split import SplitDelta, layout, part_bounds


def test_parts_are_the_slices_numpy_gives() -> None:
    x = np.arange(24.0).reshape(2, 12)
    cases: list[tuple[int | tuple[int, ...], list[int]]] = [(3, [4, 8]), ((2, 7, 3), [2, 9]), ((0, 12), [0])]
    for sections, cuts in cases:
        got = [anyio.run(p.predict) for p in ml.split(x, sections)]
        want = np.split(x, cuts, axis=-1)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    rows = [anyio.run(p.predict) for p in ml.split(x, 2, axis=0)]
    np.testing.assert_array_equal(rows[1], x[1:])


def test_deltas_when_only_some_parts_are_used() -> None:
    w = ml.Weight(np.arange(10.0).reshape(2, 5))
    first, _, last = ml.split(w, [2, 1, 2])
    [grad] = anyio.run(ml.gradients, ml.sum(first * 2.0) + ml.sum(last * last), [w])
    np.testing.assert_array_equal(grad, [[2.0, 2.0, 0.0, 6.0, 8.0], [2.0, 2.0, 0.0, 16.0, 18.0]])


def test_a_part_used_twice_and_parts_in_a_diamond() -> None:
    rng = np.random.default_rng(0)
    check_grads(lambda x: ml.sum(ml.split(x, 2)[0] * ml.split(x, 2)[0]), rng.standard_normal((3, 4)))
    # The parts of one split, recombined in another order and reused.

    def diamond(x: Any) -> ml.ArrayLayer:
        a, b, c = ml.split(x, 3, axis=0)
        return ml.tanh(c) * a + b * a

    check_grads(diamond, rng.standard_normal((6, 2)))


def test_the_backward_assembles_one_array_and_no_zeros_when_every_part_has_a_delta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    zeros = np.zeros
    calls: list[tuple[int, ...]] = []

    def counting(shape: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(shape))
        return zeros(shape, *args, **kwargs)

    gates = np.random.default_rng(1).standard_normal((1, 5 * 4))
    w = ml.Weight(gates)
    i, f, o, u, r = ml.split(w, 5)
    loss = ml.sum(ml.sigmoid(i) * ml.tanh(u) + ml.sigmoid(f) * 0.5 + ml.sigmoid(o) * r)
    monkeypatch.setattr(np, "zeros", counting)
    [grad] = anyio.run(ml.gradients, loss, [w])
    monkeypatch.undo()
    assert calls == []  # a slice per part would build five (1, 20) arrays of zeros
    sliced = ml.Weight(gates)
    parts = [sliced[:, k * 4 : (k + 1) * 4] for k in range(5)]
    same = ml.sum(
        ml.sigmoid(parts[0]) * ml.tanh(parts[3]) + ml.sigmoid(parts[1]) * 0.5 + ml.sigmoid(parts[2]) * parts[4]
    )
    [want] = anyio.run(ml.gradients, same, [sliced])
    np.testing.assert_allclose(grad, want, rtol=1e-15)
    # With a part unused, one zero block of that part's size, still one array.
    monkeypatch.setattr(np, "zeros", counting)
    anyio.run(ml.gradients, ml.sum(i * f), [w])
    monkeypatch.undo()
    assert calls == [(1, 4), (1, 4), (1, 4)]


def test_split_deltas_combine_part_by_part() -> None:
    cut = layout((3,), -1, (1, 2))

    def a() -> SplitDelta:
        return SplitDelta({0: np.array([1.0])}, cut)

    def b() -> SplitDelta:
        return SplitDelta({0: np.array([2.0]), 1: np.array([3.0, 4.0])}, cut)

    np.testing.assert_array_equal((a() + b()).to_dense(), [3.0, 3.0, 4.0])
    np.testing.assert_array_equal((b() + a()).to_dense(), [3.0, 3.0, 4.0])
    right = b()
    a() + right
    np.testing.assert_array_equal(right.to_dense(), [2.0, 3.0, 4.0])  # (only the left one grows)
    np.testing.assert_array_equal((a() + a()).to_dense(), [2.0, 0.0, 0.0])
    assert (a() + b()).shape == (3,)


def test_the_deltas_of_many_parts_add_into_one_accumulator() -> None:
    # Each part's delta made a tuple of n slots and each addition zipped them all:
    # a split into 8,000 parts took 12x a loop of slices to train (a user's RNN).
    n = 1000
    cut = layout((n,), 0, n)
    total = SplitDelta({0: np.array([1.0])}, cut)
    grown = total.parts
    for i in range(1, n):
        total = total + SplitDelta({i: np.array([float(i + 1)])}, cut)
    assert total.parts is grown  # (one dict, grown by one entry an addition)
    np.testing.assert_array_equal(total.to_dense(), np.arange(1.0, n + 1))


def test_part_bounds() -> None:
    assert part_bounds(5, 1) == ((0, 5),)
    assert part_bounds(5, (5, 0)) == ((0, 5), (5, 5))
    with pytest.raises(ValueError, match="does not split into 2 equal parts"):
        part_bounds(5, 2)
    with pytest.raises(ValueError, match=r"add up to 4, not to the axis length 5"):
        part_bounds(5, (1, 3))


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "_line_of" not in text)


@pytest.mark.anyio
async def test_errors_name_the_users_line() -> None:
    parts = ml.split(ml.Weight(np.ones((2, 5))), 2)  # SPLIT-SITE
    line = _line_of("# SPLIT-SITE")
    with pytest.raises(ml.ShapeError, match=rf"split: .*does not split into 2 equal parts.*{__file__}:{line}"):
        await parts[0].predict()
    assert f"{__file__}:{line}" in repr(parts[1])
    with pytest.raises(ml.ShapeError, match="zero-dimensional"):
        await ml.split(ml.Weight(1.0), 1)[0].predict()  # type: ignore[arg-type]  # the mistake under test
    with pytest.raises(ml.OperandError, match="at least one part"):
        ml.split(np.ones(2), 0)
    with pytest.raises(ml.OperandError, match="sizes >= 0"):
        ml.split(np.ones(2), [3, -1])
    with pytest.raises(ml.OperandError, match="a count or a sequence"):
        ml.split(np.ones(2), 2.0)  # type: ignore[arg-type]  # the mistake under test


@pytest.mark.anyio
async def test_training_through_split_steps_once() -> None:
    w = ml.Weight(np.array([1.0, 2.0, 3.0, 4.0]), optimizer=ml.optim.sgd(0.5))
    a, b = ml.split(w, 2)
    await ml.sum(a * np.array([1.0, 2.0]) + b).train()
    np.testing.assert_array_equal(w.data, [0.5, 1.0, 2.5, 3.5])


def test_split_types() -> None:
    w = ml.Weight(np.ones(4))
    assert_type(ml.split(w, 2), tuple[ml.ArrayLayer, ...])
    assert_type(ml.split(w * 2.0, [1, 3], axis=0), tuple[ml.ArrayLayer, ...])


def test_check_finite_covers_split_deltas() -> None:
    w = ml.Weight(np.ones(4))
    a, b = ml.split(w, 2)
    with ml.settings(check_finite=True):
        [grad] = anyio.run(ml.gradients, ml.sum(a * 2.0) + ml.sum(b), [w])
    np.testing.assert_array_equal(grad, [2.0, 2.0, 1.0, 1.0])
