"""An optimizer of one's own: its state is what a checkpoint stores (None, a
number, an array, tuples and NamedTuples of these), refused where its init or
a step makes another, not at the first save; any such state steps an
embedding's rows row by row; and an update that is no numbers is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.optim import GradientTransformation, chain, scale_by_learning_rate

RULE = (
    "a state is stored as None, a number, an array, or a tuple or NamedTuple of these (an optimizer of your own: "
    "make its state one; a NamedTuple's arrays shaped like the weight also step row by row for an embedding's rows)"
)


@dataclasses.dataclass
class Box:
    ema: Any


def keeping(state: Any) -> GradientTransformation:
    """A descent of rate 0.1 whose own state is ``state``, kept as it is."""
    return chain(GradientTransformation(lambda p: state, lambda g, s, p: (g, s)), scale_by_learning_rate(0.1))


@pytest.mark.parametrize(
    ("state", "found"),
    [
        ({"ema": np.zeros(3)}, "dict at 'state[0]'"),
        ([np.zeros(3)], "list at 'state[0]'"),
        (Box(np.zeros(3)), "Box at 'state[0]'"),
        ((None, (0, "adam")), "str at 'state[0][1][1]'"),
    ],
)
def test_a_state_a_checkpoint_cannot_store_is_refused_when_init_makes_it(state: Any, found: str) -> None:
    """A dict state trained 100 steps and was refused at the first ml.save."""
    with pytest.raises(TypeError) as caught:
        ml.Weight(np.ones(3), optimizer=keeping(state))
    line = caught.traceback[0].lineno + 1  # (the traceback's lines count from 0)
    assert str(caught.value) == (
        f"Weight(...): the optimizer's init made a state that a checkpoint cannot store ({found}), for the weight "
        f"built at {__file__}:{line}: {RULE}"
    )
    w = ml.Weight(np.ones(3), optimizer=ml.optim.momentum(0.1))
    optimizer, kept = w.optimizer, w.state
    with pytest.raises(TypeError, match=r"^Weight\.optimizer: the optimizer's init made a state .* \(" + found[:4]):
        w.optimizer = keeping(state)
    assert w.optimizer is optimizer and w.state is kept


class Counted(NamedTuple):
    steps: int
    ema: Any


def test_a_state_a_step_turns_into_one_a_checkpoint_cannot_store_is_refused_and_changes_nothing() -> None:
    def update(g: Any, s: Counted, p: Any) -> tuple[Any, Any]:
        return g, {"count": s.steps + 1, "ema": 0.9 * s.ema + 0.1 * g}

    w = ml.Weight(np.ones(3), optimizer=chain(GradientTransformation(lambda p: Counted(0, np.zeros(3)), update)))
    with pytest.raises(TypeError) as caught:
        anyio.run(ml.sum(w * w).train)
    assert str(caught.value) == (
        f"the optimizer of the weight built at {__file__}:{caught.traceback[0].lineno - 1} returned a state that a "
        f"checkpoint cannot store (dict at 'state[0]'): {RULE}; no weight was changed"
    )
    np.testing.assert_array_equal(w.data, np.ones(3))
    assert w.state[0] == Counted(0, w.state[0].ema) and not w.state[0].ema.any()


@pytest.mark.parametrize(("update", "shown"), [("0.1", "str"), (np.array(["0.1"] * 3), "ndarray of dtype <U3")])
def test_an_update_of_no_numbers_is_refused(update: Any, shown: str) -> None:
    """A str update failed with NumPy's 'ufunc add did not contain a loop'."""
    w = ml.Weight(np.ones(3), optimizer=GradientTransformation(lambda p: None, lambda g, s, p: (update, s)))
    with pytest.raises(TypeError) as caught:
        anyio.run(ml.sum(w * w).train)
    assert str(caught.value) == (
        f"the optimizer of the weight built at {__file__}:{caught.traceback[0].lineno - 1} returned an update of "
        f"type {shown}, not an array or a number; no weight was changed"
    )
    np.testing.assert_array_equal(w.data, np.ones(3))


class Moments(NamedTuple):
    steps: int
    m: Any  # shaped like the weight: per row
    scale: np.float64
    nothing: None
    nested: tuple[Any, ...]  # (an array shaped like the weight, a 0-d array, a float)


V, D = 5, 2


def rich(seen: list[tuple[tuple[int, ...], ...]]) -> GradientTransformation:
    """An Adagrad-like step whose state holds every kind a state may hold;
    the shapes its update is given go to ``seen``."""

    def init(p: Any) -> Moments:
        return Moments(0, np.zeros_like(p), np.float64(0.5), None, (np.ones_like(p), np.zeros(()), 2.0))

    def update(g: Any, s: Moments, p: Any) -> tuple[Any, Moments]:
        seen.append((g.shape, s.m.shape, s.nested[0].shape, p.shape))
        m = s.m * s.scale + g
        squares = s.nested[0] + g * g
        step = -0.1 * m / np.sqrt(squares) * s.nested[2]
        return step, Moments(s.steps + 1, m, s.scale, None, (squares, s.nested[1] + 1.0, s.nested[2]))

    return GradientTransformation(init, update)


def test_every_state_a_checkpoint_stores_steps_an_embeddings_rows_row_by_row(tmp_path: Path) -> None:
    """A dict state reached the rows' step whole: its (5, 2) arrays beside the
    rows' (2, 2) gradient, a bare NumPy broadcasting error."""
    start = np.arange(V * D, dtype=float).reshape(V, D) / 10
    seen: list[tuple[tuple[int, ...], ...]] = []
    table = ml.Weight(start.copy(), optimizer=rich(seen))
    rows = np.array([1, 3])
    anyio.run(ml.sum(ml.embedding(table, rows) * np.array([1.0, -2.0])).train)
    assert seen == [((2, D), (2, D), (2, D), (2, D))]
    g = np.array([1.0, -2.0])
    expected = start.copy()
    expected[rows] += -0.1 * g / np.sqrt(1.0 + g * g) * 2.0
    np.testing.assert_allclose(table.data, expected, rtol=1e-15)
    state = table.state
    assert (state.steps, state.scale, state.nothing, state.nested[1], state.nested[2]) == (1, 0.5, None, 1.0, 2.0)
    m, squares = np.zeros((V, D)), np.ones((V, D))
    m[rows], squares[rows] = g, 1.0 + g * g  # the rows not looked up keep theirs
    np.testing.assert_array_equal(state.m, m)
    np.testing.assert_array_equal(state.nested[0], squares)
    ml.save(tmp_path / "table.safetensors", {"table": table})
    again = ml.Weight(start.copy(), optimizer=rich([]))
    ml.load(tmp_path / "table.safetensors", {"table": again})
    assert type(again.state) is Moments and again.state.steps == 1 and type(again.state.scale) is np.float64
    np.testing.assert_array_equal(again.state.nested[0], squares)
