"""`monadl.deltas`: summing rows into a table, both ways it is done."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import monadl as ml
from monadl.deltas import SparseRows, scatter_add


@pytest.mark.parametrize("rows", [1, 16, 256, 257, 1000])
def test_scatter_add_sums_repeated_rows_as_add_at(rows: int) -> None:
    # Up to 256 rows a one-hot product sums them, above add.at: the same sums either way.
    rng = np.random.default_rng(rows)
    index = rng.integers(0, rows, 300)
    values = rng.standard_normal((300, 3, 2))
    want = np.zeros((rows, 3, 2))
    np.add.at(want, index, values)
    got = scatter_add(np, np.zeros((rows, 3, 2)), index, values)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert got.shape == (rows, 3, 2)


@pytest.mark.parametrize("rows", [3, 300])  # (a one-hot product)
@pytest.mark.parametrize("past", [3, -4])
def test_an_index_past_a_small_table_raises_as_add_at(rows: int, past: int) -> None:
    # The one-hot product matched no row for it and dropped its values, silently.
    values = np.ones((rows, 640), np.float32)
    with pytest.raises(IndexError):
        np.add.at(np.zeros((3, 640), np.float32), np.full(rows, past), values)
    with pytest.raises(IndexError):
        scatter_add(np, np.zeros((3, 640), np.float32), np.full(rows, past), values)


@pytest.mark.parametrize("past", [3, -4])
def test_an_index_past_the_table_raises_where_a_library_has_no_add_at(past: int) -> None:
    # The array API's one-hot product matched no row for it and dropped its values, silently.
    xp = pytest.importorskip("array_api_strict")
    values = xp.ones((2, 4))
    for index in (xp.asarray([0, past]), xp.asarray([[0], [past]])):
        with pytest.raises(IndexError, match=f"index {past} is out of bounds for axis 0 with size 3"):
            scatter_add(xp, xp.zeros((3, 4)), index, xp.reshape(values, (*index.shape, 4)))
    summed = scatter_add(xp, xp.zeros((3, 4)), xp.asarray([0, -1, 2]), xp.ones((3, 4)))  # (within: from the end)
    np.testing.assert_array_equal(np.asarray(summed), [[1.0] * 4, [0.0] * 4, [2.0] * 4])


@pytest.mark.parametrize("parts", [[1] * 40, [300, 2, 90], [5, 700], [64, 64]])
def test_sparse_rows_sum_their_parts_as_one_table(parts: list[int]) -> None:
    # Parts of many rows are summed one by one, parts of few rows joined first: the same sums,
    # whatever the indices' shape (a lookup by a matrix of indices gives a part of its own shape).
    rng = np.random.default_rng(len(parts))
    total: SparseRows | None = None
    want = np.zeros((7, 3))
    for k in parts:
        index = rng.integers(0, 7, (k, 2)) if k % 2 == 0 else rng.integers(0, 7, k)
        rows = rng.standard_normal((*index.shape, 3)).astype(np.float32)
        np.add.at(want, index, rows)
        part = SparseRows(index, rows, (7, 3))
        total = part if total is None else total + part
    assert total is not None
    unique, summed = total.summed()
    assert summed.dtype == np.float32 and unique.tolist() == sorted(set(unique.tolist()))
    np.testing.assert_allclose(summed, want[unique], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(total.to_dense(), want, rtol=1e-5, atol=1e-5)  # (joined, after summing)


def test_a_part_whose_rows_broadcast_over_its_indices_sums_as_one_row_each() -> None:
    one = SparseRows(np.array([1, 2, 1]), np.ones((1, 3)), (7, 3))
    unique, summed = one.summed()
    assert unique.tolist() == [1, 2] and summed.tolist() == [[2.0] * 3, [1.0] * 3]
    both = one + SparseRows(np.arange(70) % 7, np.ones((70, 3)), (7, 3))  # (and beside a part summed on its own)
    np.testing.assert_array_equal(both.summed()[1], [[10.0] * 3, [12.0] * 3, [11.0] * 3] + [[10.0] * 3] * 4)


@pytest.mark.parametrize("rows", [4, 200, 300])  # (the one-hot product for small tables; add.at for large)
def test_scatter_add_of_masks_negative_indices_and_infinities_is_add_at(rows: int) -> None:
    rng = np.random.default_rng(0)
    cases: list[tuple[Any, Any]] = [
        (np.ones(rows, bool), rng.standard_normal((rows, 2))),  # every row picked (row 1 got them all: 1 == True)
        (np.array([-1, rows - 1, 0, -rows]), rng.standard_normal((4, 2))),  # counted from the end (lost before)
        (np.array([-1, 2], np.int8), rng.standard_normal((2, 2))),  # (int8 - 1 + rows overflows: counted in intp)
        (np.array([1, 2]), np.array([[1.0, np.inf], [2.0, 3.0]])),  # an inf: 0 * inf was NaN in other rows
    ]
    for index, values in cases:
        expected = np.zeros((rows, 2))
        np.add.at(expected, index, values)
        got = scatter_add(np, np.zeros((rows, 2)), index, values)
        np.testing.assert_allclose(got, expected, rtol=1e-12)  # (inf and NaN where add.at has them)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(300,), (300, 4), (300, 2, 3)])
def test_many_rows_into_a_large_table_sum_as_add_at_in_its_dtype(
    shape: tuple[int, ...], dtype: type[np.floating[Any]]
) -> None:
    # More rows than the table has, of more than 256 (a graph's messages into its nodes): summed by bincount.
    rng = np.random.default_rng(len(shape))
    index = rng.integers(-300, 300, 700)
    values = rng.standard_normal((700, *shape[1:])).astype(dtype)
    values[3] = np.inf
    expected = np.zeros(shape, dtype)
    np.add.at(expected, index, values)
    got = scatter_add(np, np.zeros(shape, dtype), index, values)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, expected, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
    with pytest.raises(IndexError):  # (as add.at: bincount would have made the table longer)
        scatter_add(np, np.zeros(shape, dtype), np.append(index, 300), np.concatenate([values, values[:1]]))


@pytest.mark.anyio
async def test_the_gradient_of_a_full_mask_and_of_negative_indices() -> None:
    w = ml.Weight(np.ones((4, 2)))
    c = np.arange(1.0, 9.0).reshape(4, 2)
    [g] = await ml.gradients(ml.sum(w[np.ones(4, bool)] * c), [w])
    np.testing.assert_array_equal(g, c)
    [g] = await ml.gradients(ml.sum(w[np.array([-1, 3])]), [w])
    np.testing.assert_array_equal(g, [[0, 0], [0, 0], [0, 0], [2, 2]])


@pytest.mark.anyio
async def test_micro_batches_gradients_of_a_table_average_as_one_step_of_the_mean() -> None:
    # The tour's accumulation recipe: a table's gradient (its rows) summed over micro-batches and
    # divided by their count steps as one train() of the mean loss, with Adam's lazy rows.
    def model(seed: int) -> tuple[ml.Weight[Any, Any], ml.Weight[Any, Any]]:
        rng = np.random.default_rng(seed)
        adam = ml.optim.adam(0.1)
        return ml.Weight(rng.standard_normal((6, 3)), optimizer=adam), ml.Weight(rng.standard_normal(3), optimizer=adam)

    ids = [np.array([0, 2, 2]), np.array([5, 0]), np.array([1])]

    def loss(table: Any, v: Any, i: int) -> Any:
        return ml.sum(ml.tanh(ml.embedding(table, ids[i]) @ v))

    table, v = model(0)
    await ml.mean(ml.stack([loss(table, v, i) for i in range(3)])).train()
    other, u = model(0)
    summed: dict[Any, Any] = {}
    for i in range(3):
        _, grads = await ml.value_and_gradients(loss(other, u, i))
        for w, g in grads.items():
            summed[w] = summed[w] + g if w in summed else g
    assert type(summed[other]) is SparseRows
    ml.optim.apply_gradients({w: g / 3 for w, g in summed.items()})
    np.testing.assert_allclose(other.data, table.data, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(u.data, v.data, rtol=1e-12, atol=1e-12)


def test_a_tables_rows_scale_by_numbers_and_nothing_else() -> None:
    d = SparseRows(np.array([2, 0, 2]), np.ones((3, 2), np.float32), (4, 2))
    dense = d.to_dense()
    for got, want in [
        (d * 0.5, dense * 0.5),
        (2 * d, 2 * dense),
        (d / np.float32(4), dense / 4),
        (d * np.array(3.0, np.float32), dense * 3),
        (-d, -dense),
        (d - d * 2, -dense),
        (np.ones((4, 2), np.float32) - d, 1 - dense),
        (d - np.ones((4, 2), np.float32), dense - 1),
    ]:
        got = got.to_dense() if type(got) is SparseRows else got
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.float32
    assert type(d / 2) is SparseRows  # (still its rows: the step stays sparse)
    summed: Any = sum([d, d])  # (sum() starts from 0)
    np.testing.assert_array_equal((summed / 2).to_dense(), dense)
    for other in [np.ones((4, 2)), True, "2", d]:
        with pytest.raises(TypeError):
            d * other
