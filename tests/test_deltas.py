"""`monadl.deltas`: summing rows into a table, both ways it is done."""

from __future__ import annotations

import numpy as np
import pytest

from monadl.deltas import scatter_add


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
