"""Sparse deltas: an embedding table steps only the rows it looked up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import monadl as ml
from monadl.gradcheck import check_grads
from monadl.typeclasses import DENSE, SPARSE_ROWS, SparseRows, associativity_law, identity_law

pytestmark = pytest.mark.anyio

INDICES = np.array([[3, 1], [3, 0]])  # row 3 twice, rows 2 and 4 never


async def test_embedding_gradient_matches_a_dense_lookup() -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((5, 3))
    projection = rng.standard_normal((2, 2, 3))
    w = ml.Weight(table.copy())
    [sparse_grad] = await ml.gradients(ml.sum(ml.embedding(w, INDICES) * projection), [w])
    one_hot = np.eye(5)[INDICES]  # (2, 2, 5)
    dense = ml.Weight(table.copy())
    [dense_grad] = await ml.gradients(ml.sum((one_hot @ dense) * projection), [dense])
    np.testing.assert_allclose(sparse_grad, dense_grad, rtol=1e-12)
    check_grads(lambda t: ml.embedding(t, INDICES), table)


@pytest.mark.parametrize(
    "optimizer", [ml.optim.sgd(0.1), ml.optim.adam(0.1), ml.optim.momentum(0.1)], ids=["sgd", "adam", "momentum"]
)
async def test_a_step_touches_only_the_rows_used(optimizer: ml.optim.GradientTransformation) -> None:
    table = np.arange(15.0).reshape(5, 3) + 1.0  # no zeros: every used entry has a gradient
    w = ml.Weight(table.copy(), optimizer=optimizer)
    for _ in range(3):
        await ml.sum(ml.embedding(w, INDICES) ** 2.0).train()
    untouched = [2, 4]
    assert w.data[untouched].tobytes() == table[untouched].tobytes()
    assert np.all(w.data[[0, 1, 3]] != table[[0, 1, 3]])


async def test_sparse_step_equals_the_dense_step_for_sgd() -> None:
    table = np.random.default_rng(1).standard_normal((5, 3))
    sparse, dense = (
        ml.Weight(table.copy(), optimizer=ml.optim.sgd(0.1)),
        ml.Weight(table.copy(), optimizer=ml.optim.sgd(0.1)),
    )
    await ml.sum(ml.embedding(sparse, INDICES) ** 2.0).train()
    await ml.sum((np.eye(5)[INDICES] @ dense) ** 2.0).train()
    np.testing.assert_allclose(sparse.data, dense.data, rtol=1e-12)


async def test_sparse_and_dense_deltas_of_one_table_combine() -> None:
    table = np.random.default_rng(2).standard_normal((5, 3))
    w = ml.Weight(table.copy())
    loss = ml.sum(ml.embedding(w, INDICES)) + ml.sum(w * 2.0) + ml.sum(ml.embedding(w * 1.0, np.array([4])))
    [grad] = await ml.gradients(loss, [w])
    expected = np.full((5, 3), 2.0)
    np.add.at(expected, INDICES.ravel(), 1.0)
    expected[4] += 1.0
    np.testing.assert_allclose(grad, expected)


def sparse(table_shape: tuple[int, int]) -> st.SearchStrategy[SparseRows]:
    return st.integers(0, 4).flatmap(
        lambda k: st.tuples(
            st.lists(st.integers(0, table_shape[0] - 1), min_size=k, max_size=k),
            st.lists(st.integers(-5, 5), min_size=k * table_shape[1], max_size=k * table_shape[1]),
        ).map(
            lambda pair: SparseRows(
                np.array(pair[0], np.int64), np.array(pair[1], np.float64).reshape(k, table_shape[1]), table_shape
            )
        )
    )


def same_sparse(a: SparseRows, b: SparseRows) -> bool:
    return bool(np.array_equal(a.to_dense(), b.to_dense()))


@given(sparse((4, 2)), sparse((4, 2)), sparse((4, 2)))
def test_sparse_rows_monoid_laws(a: SparseRows, b: SparseRows, c: SparseRows) -> None:
    monoid = SPARSE_ROWS((4, 2))
    assert associativity_law(monoid, a, b, c, same_sparse)
    assert identity_law(monoid, a, same_sparse)


@given(st.integers(-100, 100), st.integers(-100, 100), st.integers(-100, 100))
def test_dense_monoid_laws(a: int, b: int, c: int) -> None:
    assert associativity_law(DENSE, float(a), float(b), float(c), lambda x, y: bool(x == y))
    assert identity_law(DENSE, float(a), lambda x, y: bool(x == y))


def test_embedding_rejects_float_indices() -> None:
    with pytest.raises(ml.OperandError, match="integers"):
        ml.embedding(ml.Weight(np.zeros((3, 2))), np.array([0.5]))


# ---- equal rows are summed before the step (issue 16, section 5) -----------------------------
async def test_a_row_looked_up_twice_steps_once_with_the_sum() -> None:
    w = ml.Weight(np.arange(6.0).reshape(3, 2), optimizer=ml.optim.sgd(0.1))
    loss = ml.sum(ml.embedding(w, np.array([2, 2])) * np.array([[1.0, 2.0], [3.0, 4.0]]))
    rows, deltas = SparseRows(np.array([2, 2]), np.array([[1.0, 2.0], [3.0, 4.0]]), (3, 2)).summed()
    np.testing.assert_array_equal(rows, [2])
    np.testing.assert_array_equal(deltas, [[4.0, 6.0]])
    await loss.train()
    np.testing.assert_allclose(w.data, [[0.0, 1.0], [2.0, 3.0], [3.6, 4.4]], rtol=1e-15)


async def test_a_row_looked_up_by_two_layers_steps_once_with_the_sum() -> None:
    w = ml.Weight(np.arange(6.0).reshape(3, 2), optimizer=ml.optim.sgd(0.1))
    loss = ml.sum(ml.embedding(w, np.array(1)) * np.array([1.0, 2.0])) + ml.sum(
        ml.embedding(w, np.array([1])) * np.array([[3.0, 4.0]])
    )
    await loss.train()
    np.testing.assert_allclose(w.data, [[0.0, 1.0], [1.6, 2.4], [4.0, 5.0]], rtol=1e-15)


@pytest.mark.parametrize("optimizer", [ml.optim.adam, ml.optim.momentum], ids=["adam", "momentum"])
async def test_state_rows_of_equal_indices_are_summed_too(
    optimizer: Callable[[float], ml.optim.GradientTransformation],
) -> None:
    # Every row is looked up each step, so the lazy sparse step must equal the dense one.
    indices = np.array([2, 0, 2, 1, 2])
    projection = np.random.default_rng(3).standard_normal((5, 2))
    table = np.random.default_rng(4).standard_normal((3, 2))
    sparse, dense = ml.Weight(table.copy(), optimizer=optimizer(0.1)), ml.Weight(table.copy(), optimizer=optimizer(0.1))
    for _ in range(4):
        await ml.sum(ml.embedding(sparse, indices) ** 2.0 * projection).train()
        await ml.sum((np.eye(3)[indices] @ dense) ** 2.0 * projection).train()
    np.testing.assert_allclose(sparse.data, dense.data, rtol=1e-12)


def test_many_lookups_of_one_table_accumulate_in_linear_time() -> None:
    """Adding sparse deltas keeps parts and joins them once (no copy per add)."""
    parts = [SparseRows(np.array([i % 7]), np.full((1, 2), float(i)), (7, 2)) for i in range(5000)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    assert total._parts is not None  # nothing joined yet
    expected = np.zeros((7, 2))
    np.add.at(expected, np.arange(5000) % 7, np.arange(5000.0)[:, None])
    np.testing.assert_array_equal(total.to_dense(), expected)
    assert total.indices.shape == (5000,)


@pytest.mark.anyio
async def test_a_table_of_no_columns_has_an_empty_gradient() -> None:
    table = ml.Weight(np.zeros((2, 0)))
    [g] = await ml.gradients(ml.sum(ml.embedding(table, np.array([0, 1, 1]))), [table])  # (reshape(g, (-1, 0)))
    assert np.asarray(g.to_dense() if hasattr(g, "to_dense") else g).shape == (2, 0)


def test_an_embeddings_gradient_compares_as_the_table_sized_array() -> None:
    """A user compared two runs' gradients of an embedding (`SparseRows`):
    ``np.asarray`` made a 0-d object array, ``np.allclose`` raised and
    ``==`` was identity, False for equal gradients. Now each sees the
    table-sized array."""
    table = ml.Weight(np.ones((5, 2)))

    def gradient() -> Any:
        return anyio.run(ml.value_and_gradients, ml.sum(ml.embedding(table, np.array([1, 1, 3]))))[1][table]

    g, h = gradient(), gradient()
    want = np.array([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    assert type(g) is SparseRows and g is not h
    np.testing.assert_array_equal(np.asarray(g), want)
    assert np.allclose(g, h) and np.array_equal(g, h) and bool((g == h).all())
    np.testing.assert_allclose(g, want)
    assert np.asarray(g, dtype=np.float32).dtype == np.float32
