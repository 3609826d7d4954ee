"""Delta accumulation as a monoid: how the deltas of several consumers combine.

A node's accumulator starts empty and combines each consumer's delta. Dense
deltas combine by addition. An embedding table's delta is sparse: the rows
that were looked up and their deltas (the paper's example of a ``Delta`` that
differs from ``Data``); sparse deltas combine by concatenation, and a sparse
and a dense delta by scattering the rows into the dense one.

The laws (associativity, identity) are written beside the instances, as
functions that tests check with Hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, final

import numpy as np

from monadl.deltas import SparseRows

__all__ = ["DENSE", "SPARSE_ROWS", "Monoid", "SparseRows", "associativity_law", "identity_law"]

T = TypeVar("T")


class Monoid(Protocol[T]):
    """An associative ``combine`` with an identity ``empty``."""

    def empty(self) -> T: ...

    def combine(self, a: T, b: T) -> T: ...


@final
@dataclass(frozen=True, slots=True)
class _Dense:
    """Deltas as arrays or numbers, combined by addition; 0 is the identity."""

    def empty(self) -> Any:
        return 0.0

    def combine(self, a: Any, b: Any) -> Any:
        return a + b


@final
@dataclass(frozen=True, slots=True)
class _SparseRowsMonoid:
    table_shape: tuple[int, ...]
    dtype: Any = np.float64

    def empty(self) -> SparseRows:
        return SparseRows(np.zeros(0, np.int64), np.zeros((0, *self.table_shape[1:]), self.dtype), self.table_shape)

    def combine(self, a: SparseRows, b: SparseRows) -> SparseRows:
        result: SparseRows = a + b
        return result


DENSE: Monoid[Any] = _Dense()


def SPARSE_ROWS(table_shape: tuple[int, ...], dtype: Any = np.float64) -> Monoid[SparseRows]:
    """The monoid of sparse deltas of a table of ``table_shape``."""
    return _SparseRowsMonoid(table_shape, dtype)


# ---- laws -------------------------------------------------------------------------------------
def associativity_law(monoid: Monoid[T], a: T, b: T, c: T, same: Callable[[T, T], bool]) -> bool:
    """``(a + b) + c == a + (b + c)``, compared by ``same``."""
    return same(monoid.combine(monoid.combine(a, b), c), monoid.combine(a, monoid.combine(b, c)))


def identity_law(monoid: Monoid[T], a: T, same: Callable[[T, T], bool]) -> bool:
    """``empty + a == a == a + empty``."""
    return same(monoid.combine(monoid.empty(), a), a) and same(monoid.combine(a, monoid.empty()), a)
