"""A semiring's contractions on arrays: the log-real einsum's sums, exact
where the terms underflow, and empty sums."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from monadl.dyna.einsum import contract
from monadl.dyna.semiring import LOG_REAL, REAL


def test_a_sum_over_an_empty_axis_is_the_zero() -> None:
    """The sum of no terms is the semiring's zero: 0 in the real semiring,
    -inf in the log-real one (a zero-length sentence or batch), where the
    log-real sum's largest term over an empty axis raised ValueError."""
    for semiring in (REAL, LOG_REAL):
        total = contract(semiring, semiring.one, [("i", np.zeros(0))], "", {})
        rows = contract(semiring, semiring.one, [("ij", np.zeros((2, 0)))], "i", {})
        assert total.shape == () and total == semiring.zero
        assert rows.tolist() == [semiring.zero, semiring.zero]


def test_a_log_real_matrix_product_holds_no_more_than_its_operands() -> None:
    """a(I, K) += b(I, J) * c(J, K) at n = 256: one einsum of the shifted
    operands, a few arrays of n^2 (0.5 MiB each), where building every term
    took n^3 (128 MiB each, 385 MiB at the peak). Where every entry underflows
    (b and c peak 800 apart) the entries are summed from their terms in
    chunks, and agree with the log-sum-exp of the terms to rounding."""
    n = 256
    rng = np.random.default_rng(0)
    b, c = np.log(rng.random((n, n))), np.log(rng.random((n, n)))
    apart_b, apart_c = b - 800.0, c.copy()
    apart_b[:, 0], apart_c[0, :] = 0.0, -800.0  # (b peaks where c does not)
    for x, y in ((b, c), (apart_b, apart_c)):
        contract(LOG_REAL, 0.0, [("ij", x), ("jk", y)], "ik", {})  # (NumPy's first-call allocations)
        tracemalloc.start()
        try:
            got = contract(LOG_REAL, 0.0, [("ij", x), ("jk", y)], "ik", {})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * 2**20, peak
        terms = x[:8, :, None] + y[None, :, :]
        want = np.logaddexp.reduce(terms, axis=1)
        assert np.all(np.isfinite(got)) and np.allclose(got[:8], want, rtol=1e-13, atol=0.0)


def test_an_entry_summed_from_subnormal_terms_is_summed_again_exactly() -> None:
    """2^20 terms of e^b each, 2^-1040.3, below the smallest normal float
    (2^-1022) though their sum is not: each lost bits to rounding, the same
    way, and the log of their sum was 130 units in the last place off."""
    n = 2**20 + 1
    deep = -1040.3 * math.log(2.0)
    a, b = np.zeros(n), np.full(n, deep)
    a[0], b[0] = -np.inf, 0.0  # (b's largest entry, 0, where a's term is zero: b shifts by nothing)
    got = contract(LOG_REAL, 0.0, [("i", a), ("i", b)], "", {})
    assert got == pytest.approx(math.log(n - 1) + deep, rel=4e-16)


def test_entries_with_no_term_above_minus_infinity_are_minus_infinity() -> None:
    """Rows of b that are impossible (-inf) give rows of -inf, which are not
    summed again; a row whose terms underflow, with one of them finite, is."""
    b = np.log(np.random.default_rng(1).random((4, 3)))
    c = np.zeros((3, 2))
    b[1], b[2] = -np.inf, [-np.inf, -900.0, -np.inf]
    got = contract(LOG_REAL, 0.0, [("ij", b), ("jk", c)], "ik", {})
    assert np.isneginf(got[1]).all() and got[2].tolist() == [-900.0, -900.0]
    assert np.allclose(got[[0, 3]], np.logaddexp.reduce(b[[0, 3], :, None] + c[None], axis=1), rtol=1e-15, atol=0.0)
