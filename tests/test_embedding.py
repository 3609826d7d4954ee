"""Sparse deltas: an embedding table steps only the rows it looked up."""

from __future__ import annotations

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
