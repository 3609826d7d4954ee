"""A semiring's contractions on arrays: the log-real einsum's sums, exact
where the terms underflow, and empty sums."""

from __future__ import annotations

import numpy as np

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
