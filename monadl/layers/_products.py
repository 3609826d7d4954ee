"""Which NumPy call computes a matrix product.

Every ``a @ b`` of the primitive rules (a product, its two deltas) and of the
batching rules goes through `product`, which picks, for three kinds of shape
that OpenBLAS serves badly, an equal product that it serves well. Only NumPy
arrays take another form; every other library's product is its own ``@``.
"""

from __future__ import annotations

from typing import Any, Final, final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import Outer

__all__ = ["OuterRule", "by_rows", "factored", "factors_pay", "form_of", "outer_rule", "product"]

Value = Any


def product(x: Value, y: Value) -> Value:
    """``x @ y``, by the fastest of equal NumPy products for three kinds of
    shape that OpenBLAS serves badly (measured on x86-64, NumPy 2.4's OpenBLAS;
    `benchmarks/transposed_products.py` prints the grid):

    * an inner size of one (a weight's delta from a single row): the broadcast
      product; OpenBLAS took 365 us for a 768 x 1 by 1 x 256 product that a
      multiplication does in 80 us (and 24 us for two rows);
    * two to six rows times a weight of 256K or 512K elements or more: one
      matrix-vector product a row (`by_rows`, where `_rows_pay`), with NumPy's
      OpenBLAS only (another BLAS may serve few rows well). For so few rows,
      sgemm packs the whole weight before it multiplies, where gemv reads it
      once: float32 rows times a 1024 x 1024 weight took 3.7x, 3.1x, 2.2x and
      1.7x the time of gemv row by row for 2, 3, 4 and 5 rows (W.T: 1.8x,
      1.8x for 2 and 3 rows, beside the next form); float64 gains for 2 and 3
      rows (1.2-1.7x), and for 2 to 6 times a transposed weight (1.8-4.4x for
      2 to 4 rows, 1.2-1.5x for 6; 3 to 6 rows of a 512 x 512 one: 1.3-3.2x,
      and 1.9-4.0x in float32; grids on the project's AMD EPYC VM,
      `benchmarks/transposed_products.py`, "by rows"). Each row is then the
      one-row product, bit for bit;
    * a float32 delta of a few rows times a large transposed weight (``g @
      w.T``, every layer's delta to its input): ``(w @ g.T).T``, made
      C-contiguous. The transposed-operand kernel of sgemm is slow for few
      rows: 1.5-3.8x the time for 2 to 48 rows of weights of 512K elements,
      1.5-2.4x for 4 to 48 rows of 128K, 1.4-2.1x for 5 to 32 rows of 64K;
      from about 64 rows on, for one row, for smaller weights, or in float64,
      the plain product is as fast or faster (`_slow_transposed`).
    """
    if type(x) is np.ndarray and type(y) is np.ndarray and x.ndim == 2 and y.ndim == 2:
        form = form_of(x, y)
        if form == "broadcast":
            return x * y
        if form == "rows":
            return by_rows(x, y)
        if form == "transposed":
            return np.ascontiguousarray((y.mT @ x.mT).mT)
    return x @ y


def form_of(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> str:
    """Which form `product` takes for the 2-D NumPy arrays ``x @ y``:
    "broadcast", "rows" (`by_rows`), "transposed" (``(y.T @ x.T).T``) or
    "plain".

    >>> w = np.ones((1024, 512), np.float32)
    >>> form_of(np.ones((8, 512), np.float32), w.T), form_of(np.ones((64, 512), np.float32), w.T)
    ('transposed', 'plain')
    """
    rows, inner = x.shape
    if inner == 1 and y.shape[0] == 1:
        return "broadcast"
    if 2 <= rows <= _BY_ROWS and y.size >= _WIDE_WEIGHT and x.dtype is y.dtype and _rows_pay(rows, y):
        return "rows"
    if (
        y.size >= _MID_WEIGHT
        and 2 <= rows <= _FEW_ROWS
        and x.dtype is _F32
        and y.dtype is _F32
        and y.strides[0] == 4  # (float32 columns side by side: a transposed C-ordered weight)
        and _slow_transposed(rows, y)
    ):
        return "transposed"
    return "plain"


@final
class OuterRule:
    """The delta rule ``g -> left.T @ g`` of a matrix operand ``w`` in
    ``left @ w``, marked so that the backward may keep the delta of a weight
    as its factors (`monadl.deltas.Outer`) instead of calling it.

    >>> rule = OuterRule(np.ones((2, 3)))
    >>> rule(np.ones((2, 4))).shape
    (3, 4)
    """

    __slots__ = ("left",)

    def __init__(self, left: np.ndarray[Any, Any]) -> None:
        self.left = left

    def __call__(self, g: Value) -> Value:
        return product(self.left.mT, g)


def outer_rule(left: np.ndarray[Any, Any], matrix: np.ndarray[Any, Any]) -> Any:
    """The delta rule of ``matrix`` in the 2-D NumPy product ``left @ matrix``:
    an `OuterRule` where factors pay (a large matrix, factors smaller than it),
    else a plain closure.

    >>> type(outer_rule(np.ones((16, 512)), np.ones((512, 256)))).__name__
    'OuterRule'
    >>> type(outer_rule(np.ones((16, 4)), np.ones((4, 4)))).__name__
    'function'
    """
    if factors_pay(left.shape[0], *matrix.shape):
        return OuterRule(left)
    return lambda g: product(left.mT, g)


def by_rows(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``x @ y`` for 2-D NumPy arrays of one dtype, one matrix-vector product a row of ``x``.

    >>> x, y = np.arange(6.0).reshape(2, 3), np.ones((3, 2))
    >>> bool((by_rows(x, y) == x @ y).all())
    True
    """
    out = np.empty((x.shape[0], y.shape[1]), dtype=y.dtype)
    for i in range(x.shape[0]):
        np.matmul(x[i], y, out=out[i])
    return out


def _rows_pay(rows: int, y: np.ndarray[Any, Any]) -> bool:
    """Whether ``rows`` rows (2 to `_BY_ROWS`) times the matrix ``y`` of
    `_WIDE_WEIGHT` elements or more, of the rows' dtype, go faster one gemv a
    row, with NumPy's OpenBLAS (the grids of
    `benchmarks/transposed_products.py`, "by rows", and of the thirty-first
    and thirty-second sessions in `BENCHMARKS.md`):

    * float32 times a weight of `_HUGE_WEIGHT` elements or more, up to 5
      rows; up to 3 when ``y`` is a transposed weight, whose other form is
      faster from 4; 3 to 6 rows times a transposed 512 x 512 (256K) weight
      (3.5-4.0x at 3, 2.7x at 4, 1.9-2.5x at 5 and 6, where its other form
      gave 1.9-2.7x, 2.3-2.9x, 1.5-1.8x; 2 rows 0.5x);
    * float64 times a plain weight of `_HUGE_WEIGHT` elements or more, 2 or
      3 rows (1.2-1.7x); times a transposed weight (for which float64 has no
      faster form), 2 to 6 rows from `_HUGE_WEIGHT` elements (1.8-4.4x at 2
      to 4 rows, 1.2-1.5x at 6; 5 not measured), 3 to 6 rows from
      `_WIDE_WEIGHT` (512 x 512, the one shape measured at that size:
      2.3-3.2x at 3, 1.8-2.1x at 4, 1.3x at 6; 2 rows 0.5x, 8 rows 1.0x)."""
    if not _OPENBLAS:
        return False
    if y.dtype is not _F32 and y.dtype is not _F64:
        return False
    huge = y.size >= _HUGE_WEIGHT
    if y.strides[1] == y.itemsize:  # (a plain C-ordered weight)
        return huge and rows <= (5 if y.dtype is _F32 else 3)
    if y.strides[0] != y.itemsize:  # (neither: a strided view)
        return huge and rows <= 3
    if y.dtype is _F32:
        return rows <= 3 if huge else 3 <= rows <= 6
    return rows <= 6 if huge else rows >= 3


def _slow_transposed(rows: int, y: np.ndarray[Any, Any]) -> bool:
    """Whether sgemm's transposed kernel is the slow one for ``rows`` rows
    times ``y`` (the grid of `benchmarks/transposed_products.py`): from 8
    rows on; 4 to 7 when the product is at least 256 wide; 2 and 3 for
    weights of 512K elements. For weights of 64K to 128K elements (256 x
    256), from 12 rows on, and 5 to 11 when the product is at least 256
    wide (1.4-1.9x a 256 x 256 weight's delta of 6 to 32 rows, 1.8-2.1x of 5
    rows in the thirty-second session's grid; its 4 rows,
    and 6 to 8 rows of a product 128 wide, ran faster as they were; 3 and 4
    rows of a product 512 wide ran faster by the other form, 2.2-2.3x, and
    are left as they were: one shape of the grid)."""
    if y.size < _LARGE_WEIGHT:
        return rows >= 12 or (rows >= 5 and bool(y.shape[1] >= 256))
    if rows >= 8:
        return True
    if rows >= 4:
        return bool(y.shape[1] >= 256)
    return bool(y.size >= _HUGE_WEIGHT)


_F32: Final = np.dtype(np.float32)
_F64: Final = np.dtype(np.float64)
_BY_ROWS: Final = 6


def _numpy_blas() -> str:
    """The name of the BLAS NumPy was built with ("" where NumPy does not say)."""
    try:
        return str(np.__config__.CONFIG["Build Dependencies"]["blas"]["name"])
    except (AttributeError, KeyError, TypeError):
        return ""


_OPENBLAS: Final = "openblas" in _numpy_blas().lower()
"""Whether NumPy calls OpenBLAS (its wheels for Linux, Windows and x86 macOS
do; arm64 macOS wheels call Accelerate, whose few-row products were not
measured)."""
_FEW_ROWS: Final = 48
_MID_WEIGHT: Final = 1 << 16
_LARGE_WEIGHT: Final = 1 << 17
_WIDE_WEIGHT: Final = 1 << 18
_HUGE_WEIGHT: Final = 1 << 19
_FACTORED: Final = 1 << 16
"""The fewest elements of a matrix whose delta a weight keeps as factors: for
smaller ones, the finite check of the product costs about what it saves."""


def factors_pay(rows: int, k: int, m: int) -> bool:
    """Whether the delta of a ``k`` x ``m`` matrix from a product with ``rows``
    rows is kept as factors (the rows and the delta's rows) rather than
    multiplied out: the matrix is large (`_FACTORED` elements or more) and
    the factors are smaller than it."""
    size = k * m
    return size >= _FACTORED and rows * (k + m) <= size


def factored(rules: tuple[Any, ...], rows: Value, matrix: Value, always: bool) -> tuple[Any, ...]:
    """A batched product's VJPs (``rows @ matrix``, the members' rows stacked)
    with the matrix's delta sent as factors (a `monadl.deltas.Outer`: the
    rows and the delta's rows, multiplied once where the weight is released);
    unless ``always`` (the merged runs of `monadl.runtime.schedule.fibers`),
    only where factors pay, as for one node (`outer_rule`: a large weight,
    and factors smaller than it: a group of few rows sends them, and the
    weight gets one product for all groups instead of a weight-sized one per
    group)."""
    if getattr(matrix, "ndim", 0) != 2 or getattr(rows, "ndim", 0) < 2 or rows.shape[-1] != matrix.shape[0]:
        return rules
    k, m = matrix.shape
    if not always and not factors_pay(rows.size // k, k, m):
        return rules
    xp = namespace(rows)
    flat = xp.reshape(rows, (-1, k))
    return (rules[0], lambda g: Outer(flat, xp.reshape(g, (-1, m))), *rules[2:])
