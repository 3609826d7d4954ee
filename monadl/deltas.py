"""Deltas that are not plain arrays, and the two helpers every rule relies on.

* `unbroadcast`: undo broadcasting, so that a delta has its operand's shape
  (the runtime calls it once per operand, so no rule handles broadcasting).
* `scatter_add`: ``out[index] += values`` with repeated indices adding up.
* `SparseRows`: an embedding table's delta, the rows that were looked up and
  their deltas (the paper's example of a ``Delta`` that differs from ``Data``).
* `Outer`: a weight's delta from products, kept as their factors (the rows
  and the rows' deltas) until the weight is released or stepped.
"""

from __future__ import annotations

from collections.abc import Generator
from math import prod
from typing import Any, Final, cast, final

import numpy as np
import numpy.typing as npt

from monadl._namespace import is_array, namespace
from monadl._scatter import is_basic_index, scatter_add

__all__ = ["Outer", "SparseRows", "is_basic_index", "scatter_add", "unbroadcast"]

Value = Any


def unbroadcast(delta: Value, shape: tuple[int, ...]) -> Value:
    """Sum ``delta`` over the axes that broadcasting added or stretched.

    >>> unbroadcast(np.ones((2, 3)), (3,))
    array([2., 2., 2.])
    >>> unbroadcast(np.ones((2, 3)), (2, 1)).shape
    (2, 1)
    >>> float(unbroadcast(np.ones((2, 3)), ()))
    6.0
    """
    if type(delta) is np.ndarray and delta.ndim == 2 and delta.shape[1:] == shape:
        return np.add.reduce(delta, axis=0)  # the common case, a bias's rows: one call
    xp = namespace(delta)
    # NumPy's add.reduce is np.sum without its Python wrapper (half the time on small arrays).
    total = np.add.reduce if xp is np else xp.sum
    extra = delta.ndim - len(shape)
    if extra:
        delta = total(delta, axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and delta.shape[i] != 1)
    if stretched:
        delta = total(delta, axis=stretched, keepdims=True)
    return delta


_PART_ROWS: Final = 64
"""`SparseRows.summed` sums a part of this many rows or more on its own (a
product of its own); smaller parts are joined first."""

PIECE_ROWS: Final = 256
"""`Outer.pieces` takes this many rows a piece or all of them: a piece's
block of the weight is added into the output once per piece, so about
1/256 of its multiply-adds."""

PIECE_BLOCK: Final = 256
"""`Outer.pieces` takes blocks of the weight of this many rows and columns
or more (or all there are): each piece's product packs its factors again,
which costs about what the product does in smaller blocks. Measured on the
project's VM, one thread, float32, pieces of 64M multiply-adds against one
product: 1.01-1.22x over weights of 64 x 64 to 4,096 x 4,096 and 64 to
20,000 rows, the longest piece 1.5-5 ms (a 1 x 1,000,000 weight's, 15 ms).
Pieces of a few rows each summed, as `Outer.pieces` cut them before, took
150x as long for a 3,072 x 1,024 weight's delta of 228 rows."""


def _joined_flat(parts: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Flat indices and rows of parts, joined in order."""
    if len(parts) == 1:
        return parts[0]
    xp = namespace(parts[0][1])
    return xp.concat([index for index, _ in parts]), xp.concat([rows for _, rows in parts])


def _is_number(x: object) -> bool:
    """A plain or NumPy number, or a 0-d array: what scales a table's rows."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int | float | np.number) or (is_array(x) and getattr(x, "ndim", None) == 0)


@final
class SparseRows:
    """A delta of a table that is zero except on some rows.

    ``indices`` may repeat (a row looked up twice gets both deltas). Adding two
    is O(1): they are kept as parts and joined once, when the rows are read,
    so a table looked up n times accumulates its n deltas in O(n), not O(n^2).

    >>> d = SparseRows(np.array([2, 0]), np.ones((2, 2)), (4, 2)) + SparseRows(np.array([2]), np.ones((1, 2)), (4, 2))
    >>> d.to_dense()
    array([[1., 1.],
           [0., 0.],
           [2., 2.],
           [0., 0.]])
    """

    __slots__ = ("_indices", "_parts", "_rows", "table_shape")

    # NumPy must hand `dense + sparse` to __radd__, not build an object array.
    __array_ufunc__ = None

    def __init__(
        self, indices: npt.NDArray[np.integer[Any]], rows: npt.NDArray[Any], table_shape: tuple[int, ...]
    ) -> None:
        self._indices: Any = indices
        self._rows: Any = rows
        self._parts: tuple[SparseRows, SparseRows] | None = None
        self.table_shape = table_shape

    @classmethod
    def _joined(cls, left: SparseRows, right: SparseRows) -> SparseRows:
        joined = cls.__new__(cls)
        joined._indices = joined._rows = None
        joined._parts = (left, right)
        joined.table_shape = left.table_shape
        return joined

    def _leaves(self) -> list[SparseRows]:
        """The parts that hold rows, left to right, found without recursion."""
        leaves: list[SparseRows] = []
        stack: list[SparseRows] = [self]
        while stack:
            node = stack.pop()
            if node._parts is None:
                leaves.append(node)
            else:
                stack.append(node._parts[1])
                stack.append(node._parts[0])
        return leaves

    def _flatten(self) -> None:
        """Join the parts, left to right, as one flat index and its rows."""
        self._indices, self._rows = _joined_flat([leaf._flat() for leaf in self._leaves()])
        self._parts = None

    def _flat(self) -> tuple[Any, Any]:
        """This part's indices as a vector and its rows, one per index (the
        parts of one table may have indices of different shapes)."""
        indices, rows = self._indices, self._rows
        xp = namespace(rows)
        rest = self.table_shape[1:]
        count = prod(indices.shape)
        if tuple(rows.shape) != (*indices.shape, *rest):  # (rows that broadcast over the indices)
            rows = xp.broadcast_to(rows, (*indices.shape, *rest))
        return xp.reshape(indices, (count,)), xp.reshape(rows, (count, *rest))

    @property
    def indices(self) -> npt.NDArray[np.integer[Any]]:
        """The row of each delta (repeats allowed)."""
        if self._parts is not None:
            self._flatten()
        return self._indices  # type: ignore[no-any-return]

    @property
    def rows(self) -> npt.NDArray[Any]:
        """The deltas, one per index."""
        if self._parts is not None:
            self._flatten()
        return self._rows  # type: ignore[no-any-return]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the table this is a delta of."""
        return self.table_shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.rows.dtype

    def to_dense(self) -> npt.NDArray[Any]:
        rows = self.rows
        xp = namespace(rows)
        dense = xp.zeros(self.table_shape, dtype=rows.dtype, device=rows.device)
        return scatter_add(xp, dense, self.indices, rows)  # type: ignore[no-any-return]

    def summed(self) -> tuple[npt.NDArray[np.integer[Any]], npt.NDArray[Any]]:
        """The distinct rows, each with the sum of its deltas.

        Parts of many rows each (a batched lookup's, one per group) are summed
        part by part, not joined first: joining copies every row once more,
        and those rows are most of what a batched Tree-LSTM's step reads
        for its embeddings' steps (its operator table's: 21 MB at H = 256).

        >>> d = SparseRows(np.array([2, 0]), np.ones((2, 2)), (4, 2)) + SparseRows(np.array([2]), np.ones((1, 2)), (4, 2))
        >>> d.summed()
        (array([0, 2]), array([[1., 1.],
               [2., 2.]]))
        """
        leaves = [self] if self._parts is None else self._leaves()
        parts = [leaf._flat() for leaf in leaves]
        # Each part of many rows is a summand of its own; the small ones are
        # joined into one (a product each would cost more than copying their rows).
        summands = [part for part in parts if part[0].shape[0] >= _PART_ROWS]
        small = [part for part in parts if part[0].shape[0] < _PART_ROWS]
        if small:
            summands.append(_joined_flat(small))
        xp = namespace(summands[0][1])
        indices = xp.concat([index for index, _ in summands]) if len(summands) > 1 else summands[0][0]
        unique, inverse = xp.unique_inverse(indices)
        dtype = xp.result_type(*[rows for _, rows in summands])
        total = xp.zeros((unique.shape[0], *self.table_shape[1:]), dtype=dtype, device=summands[0][1].device)
        start = 0
        for index, rows in summands:
            stop = start + index.shape[0]
            total = scatter_add(xp, total, inverse[start:stop], rows)
            start = stop
        return unique, total

    def __add__(self, other: object) -> Any:
        if isinstance(other, SparseRows):
            if other.table_shape != self.table_shape:
                raise ValueError(f"sparse deltas of tables {self.table_shape} and {other.table_shape} cannot combine")
            return SparseRows._joined(self, other)
        if _is_number(other) and other == 0:  # (Python's sum() starts from 0: sum(grads) / n)
            return self
        if is_array(other):
            xp = namespace(other)
            return scatter_add(xp, xp.asarray(other, copy=True), self.indices, self.rows)
        return NotImplemented

    __radd__ = __add__

    def __mul__(self, other: object) -> Any:
        """The rows scaled by a number (a mean of micro-batches' gradients:
        ``sum(grads) / n``), still sparse. Another table or an array is not a
        scale: ``.to_dense()`` first."""
        if not _is_number(other):
            return NotImplemented
        return SparseRows(self.indices, self.rows * other, self.table_shape)

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Any:
        if not _is_number(other):
            return NotImplemented
        return SparseRows(self.indices, self.rows / other, self.table_shape)

    def __neg__(self) -> SparseRows:
        return SparseRows(self.indices, -self.rows, self.table_shape)

    def __sub__(self, other: object) -> Any:
        if isinstance(other, SparseRows) or is_array(other):
            return self + -cast(Any, other)
        return NotImplemented

    def __rsub__(self, other: object) -> Any:
        if is_array(other):
            return -self + other
        return NotImplemented

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        """The table-sized array (`to_dense`), for NumPy: ``np.asarray(g)``,
        ``np.allclose(g, h)`` and ``np.testing`` compare a user's gradients
        as arrays (they made a 0-d object array of it, and compared
        nothing). A device's rows stay there: CuPy refuses the conversion.

        >>> g = SparseRows(np.array([1, 1]), np.ones((2, 2)), (3, 2))
        >>> np.asarray(g).tolist(), np.allclose(g, g + 0.0), bool((g == np.asarray(g)).all())
        ([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]], True, True)
        """
        dense = self.to_dense()
        if type(dense) is not np.ndarray:
            raise TypeError(f"SparseRows of {type(dense).__name__} rows: call to_dense(), then that library's copy")
        return dense if dtype is None else dense.astype(dtype, copy=False)

    def __eq__(self, other: object) -> Any:
        """Entry by entry, as the table-sized arrays' ``==`` (identity, before:
        two equal gradients compared unequal)."""
        return self.to_dense() == (other.to_dense() if isinstance(other, SparseRows) else other)

    __hash__ = None  # type: ignore[assignment]  # (compared by value, as an array: not a key)

    def __repr__(self) -> str:
        return f"SparseRows(indices={self.indices!r}, rows={self.rows!r}, table_shape={self.table_shape!r})"


@final
class Outer:
    """A weight's delta from products, as its factors: the sum of
    ``lefts[i].T @ rights[i]`` (and of ``others``, deltas that came as arrays),
    multiplied once, when the weight is released (`dense`) or stepped.

    Its producers: the merged runs of `monadl.runtime.schedule.fibers` each
    multiply by the weight, and each sends its rows, not a weight-sized
    product that the next one's is added to; a product of a few rows by a
    large weight (`monadl.layers._products.OuterRule`: a node's, or a step's
    of an operation's program), whose plain-SGD step then scales the few
    rows' deltas instead of the weight-sized product, and whose finite check
    reads the factors (`monadl.optim.apply`); and a batched group of few
    rows by such a weight (`monadl.layers._products.factors_pay`).

    >>> a, b = np.ones((2, 3)), np.ones((2, 4))
    >>> d = Outer(a, b) + Outer(a, b) + np.ones((3, 4))
    >>> d.shape, float(d.dense()[0, 0])
    ((3, 4), 5.0)
    """

    __slots__ = ("lefts", "others", "rights", "shape")

    # NumPy must hand `dense + outer` to __radd__, not build an object array.
    __array_ufunc__ = None

    def __init__(self, left: Any, right: Any) -> None:
        self.lefts = [left]
        self.rights = [right]
        self.others: list[Any] = []
        self.shape = (left.shape[1], right.shape[1])

    def __add__(self, other: object) -> Outer:
        # In place: the accumulator is this object alone (each VJP makes a new one).
        if type(other) is Outer:
            self.lefts += other.lefts
            self.rights += other.rights
            self.others += other.others
        else:
            self.others.append(other)
        return self

    __radd__ = __add__

    def pieces(self, work: int) -> Generator[tuple[int, int, int], None, Any]:
        """`dense`, in pieces of about ``work`` multiply-adds, pausing after
        each (a ``yield`` of the piece's rows and block of the weight, its
        rows and columns): a driver gives the event loop its turns between
        them. NumPy's factors (the output is written by parts).

        A piece is a block of the weight (`PIECE_BLOCK` rows and columns or
        more, so that each piece's product packs enough of its factors)
        from some of the rows (`PIECE_ROWS` or more, so that adding the
        block into the output costs little beside it); fewer rows than
        that are all taken at once, and a block is then written, not
        summed. Where the pieces fall depends on the shapes alone, so the
        sums round the same every run.

        >>> d = Outer(np.ones((4, 3)), np.ones((4, 2)))
        >>> list(d.pieces(1))  # (one piece: the delta is smaller than a piece's least)
        [(4, 3, 2)]
        """
        lefts, rights = self.lefts, self.rights
        xp = namespace(lefts[0])
        left = lefts[0] if len(lefts) == 1 else xp.concat(lefts)
        right = rights[0] if len(rights) == 1 else xp.concat(rights)
        rows = left.shape[0]
        m, n = self.shape
        by_rows = max(1, min(rows, max(work // max(m * n, 1), PIECE_ROWS)))  # (rows a piece)
        block = max(work // by_rows, PIECE_BLOCK * PIECE_BLOCK)  # (a piece's block of the weight, in elements)
        if block >= m * n:
            tall, wide = max(m, 1), max(n, 1)
        elif block >= min(m, PIECE_BLOCK) * n:
            tall, wide = block // n, n
        else:
            tall = min(m, PIECE_BLOCK)
            wide = max(block // tall, min(n, PIECE_BLOCK))
        out = xp.zeros(self.shape, dtype=xp.result_type(left.dtype, right.dtype))
        for i in range(0, m, tall):
            for j in range(0, n, wide):
                for k in range(0, rows, by_rows):
                    part = (
                        xp.matrix_transpose(left[k : k + by_rows, i : i + tall]) @ right[k : k + by_rows, j : j + wide]
                    )
                    if k == 0:
                        out[i : i + tall, j : j + wide] = part
                    else:
                        out[i : i + tall, j : j + wide] += part
                    yield min(by_rows, rows - k), part.shape[0], part.shape[1]
        return self._with_others(out)

    def dense(self) -> Any:
        """The summed delta, as one product of the stacked rows."""
        lefts, rights = self.lefts, self.rights
        xp = namespace(lefts[0])
        if len(lefts) > 1:
            lefts, rights = [xp.concat(lefts)], [xp.concat(rights)]
        return self._with_others(xp.matrix_transpose(lefts[0]) @ rights[0])

    def _with_others(self, out: Any) -> Any:
        """The product ``out`` (a new array) with ``others`` added."""
        for other in self.others:
            if type(out) is type(other) is np.ndarray and other.shape == out.shape and other.dtype == out.dtype:
                out += other  # (the product is a new array: summed in it, not in a new one)
            else:
                out = out + other
        return out
