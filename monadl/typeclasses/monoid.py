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
import numpy.typing as npt

from monadl._namespace import is_array, namespace
from monadl.layers._primitives import scatter_add

__all__ = ["DENSE", "SPARSE_ROWS", "Monoid", "SparseRows", "associativity_law", "identity_law"]

T = TypeVar("T")


class Monoid(Protocol[T]):
    """An associative ``combine`` with an identity ``empty``."""

    def empty(self) -> T: ...

    def combine(self, a: T, b: T) -> T: ...


@final
@dataclass(frozen=True, slots=True)
class SparseRows:
    """A delta of a table that is zero except on some rows.

    ``indices`` may repeat (a row looked up twice gets both deltas).

    >>> d = SparseRows(np.array([2, 0, 2]), np.ones((3, 2)), (4, 2))
    >>> d.to_dense()
    array([[1., 1.],
           [0., 0.],
           [2., 2.],
           [0., 0.]])
    """

    indices: npt.NDArray[np.integer[Any]]
    rows: npt.NDArray[Any]
    table_shape: tuple[int, ...]

    # NumPy must hand `dense + sparse` to __radd__, not build an object array.
    __array_ufunc__ = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the table this is a delta of."""
        return self.table_shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.rows.dtype

    def to_dense(self) -> npt.NDArray[Any]:
        xp = namespace(self.rows)
        dense = xp.zeros(self.table_shape, dtype=self.rows.dtype, device=self.rows.device)
        return scatter_add(xp, dense, self.indices, self.rows)  # type: ignore[no-any-return]

    def summed(self) -> tuple[npt.NDArray[np.integer[Any]], npt.NDArray[Any]]:
        """The distinct rows, each with the sum of its deltas."""
        xp = namespace(self.rows)
        unique, inverse = xp.unique_inverse(self.indices)
        total = xp.zeros((unique.shape[0], *self.table_shape[1:]), dtype=self.rows.dtype, device=self.rows.device)
        return unique, scatter_add(xp, total, xp.reshape(inverse, (-1,)), self.rows)

    def __add__(self, other: object) -> Any:
        if isinstance(other, SparseRows):
            if other.table_shape != self.table_shape:
                raise ValueError(f"sparse deltas of tables {self.table_shape} and {other.table_shape} cannot combine")
            xp = namespace(self.rows)
            return SparseRows(
                xp.concat([self.indices, other.indices]), xp.concat([self.rows, other.rows]), self.table_shape
            )
        if is_array(other):
            xp = namespace(other)
            return scatter_add(xp, xp.asarray(other, copy=True), self.indices, self.rows)
        return NotImplemented

    __radd__ = __add__


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
