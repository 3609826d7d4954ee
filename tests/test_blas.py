"""`monadl._blas.add_product`: a product added into an array by NumPy's own BLAS, or a clear no."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import monadl._blas as blas


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adds_the_product_as_numpy_computes_it(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 300)).astype(dtype), rng.standard_normal((16, 40)).astype(dtype)
    c = rng.standard_normal((300, 40)).astype(dtype)
    expected = c + np.asarray(-0.25, dtype) * (a.T @ b)
    if not blas.add_product(c, -0.25, a, b):
        pytest.skip("NumPy's BLAS exports no cblas gemm here")
    np.testing.assert_allclose(c, expected, rtol=1e-5 if dtype is np.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    ["strided c", "read-only c", "other dtype", "rows differ", "shape differs", "integers"],
)
def test_refuses_what_it_cannot_add_into_and_changes_nothing(case: str) -> None:
    a, b, c = np.ones((4, 3), np.float32), np.ones((4, 2), np.float32), np.ones((3, 2), np.float32)
    if case == "strided c":
        c = np.ones((3, 4), np.float32)[:, ::2]
    elif case == "read-only c":
        c.flags.writeable = False
    elif case == "other dtype":
        b = b.astype(np.float64)
    elif case == "rows differ":
        b = np.ones((5, 2), np.float32)
    elif case == "shape differs":
        c = np.ones((3, 3), np.float32)
    else:
        a, b, c = a.astype(np.int64), b.astype(np.int64), c.astype(np.int64)
    before = c.copy()
    assert not blas.add_product(c, 1.0, a, b)
    np.testing.assert_array_equal(c, before)


def test_no_gemm_found_means_no(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "_found", {"s": None, "d": None})
    c = np.ones((3, 2), np.float32)
    assert not blas.add_product(c, 1.0, np.ones((4, 3), np.float32), np.ones((4, 2), np.float32))
    assert c.tolist() == [[1.0, 1.0]] * 3
