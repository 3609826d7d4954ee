"""``out[index] += values`` where repeated indices add up (`scatter_add`),
by the fastest of the ways each array library offers, and what tells a
basic index from one that may repeat (`is_basic_index`). `monadl.deltas`
re-exports both: every sparse delta's rule sums by them."""

from __future__ import annotations

from math import prod
from typing import Any, Final

import numpy as np

__all__ = ["is_basic_index", "scatter_add"]

_ONE_HOT_LIMIT: Final = 1 << 22
"""The largest one-hot matrix (rows x indices) `scatter_add` builds (16 MiB in float32)."""

_ONE_HOT_ROWS: Final = 256
"""The most rows a table may have for `scatter_add` to sum by a one-hot product:
its multiply-adds grow with the rows, add.at's do not (4,000 rows of 256 into
16 rows: 0.6 ms against 13; into 1,000 rows of 64: 9.6 ms against 3.6)."""

Value = Any


def is_basic_index(index: Any) -> bool:
    """Whether ``index`` is basic indexing (integers, slices, None, ...): a view, no repeats."""
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in items)


def scatter_add(xp: Any, out: Value, index: Any, values: Value) -> Value:
    """``out[index] += values`` where repeated indices add up; returns the result.

    NumPy and CuPy do it in place with ``add.at``; NumPy's rows of floats by
    a one-hot product into a small table and by ``bincount`` into a large
    one, both many times faster than ``add.at``; there an index past the table
    raises ``IndexError``, as ``add.at`` does. The array API standard has
    no scatter, so elsewhere a one-hot matrix product adds the values up: over
    the rows of the first axis for a single index array (one past the table
    raises ``IndexError``, where its one-hot row would drop it), else over
    flat positions, found by indexing an ``arange`` with the same index (which
    raises for one past its axis); memory: rows, or elements, x number of
    picked ones.
    """
    if (
        type(index) is np.ndarray
        and type(out) is np.ndarray
        and index.ndim == 1
        and index.dtype.kind in "iu"  # (a boolean mask is no row number: add.at reads it)
        and out.ndim >= 1
        and getattr(values, "shape", None) == (*index.shape, *out.shape[1:])
    ):
        rows, width = out.shape[0], prod(out.shape[1:])
        low, high = (int(index.min()), int(index.max())) if index.size else (0, -1)
        inside = -rows <= low and high < rows  # (else add.at below raises IndexError)
        if inside and low < 0:
            index = _from_the_front(np, index, rows)
        if inside and out.ndim >= 2 and rows <= _ONE_HOT_ROWS and rows * index.shape[0] <= _ONE_HOT_LIMIT:
            # Rows of a small table (an embedding's summed delta): a one-hot product
            # sums them in one BLAS call, 4-25x faster than add.at (which takes
            # 13-17% of a batched Tree-LSTM step at batch 32); the sums' rounding
            # order differs, as any float reduction's may.
            one_hot = np.equal.outer(np.arange(rows), index).astype(out.dtype)
            with np.errstate(invalid="ignore"):  # (0 * inf: the sums are checked below)
                summed = one_hot @ np.reshape(values, (index.shape[0], width))
            if np.isfinite(summed).all():  # (else an inf among the values made 0 * inf = NaN in other rows)
                out += np.reshape(summed, out.shape)
                return out
        elif out.dtype.kind == "f" and out.itemsize <= 8 and index.shape[0] >= rows and inside:
            # At least as many rows as the table has (a graph's messages into its nodes,
            # the delta of h[edges]): add.at goes element by element, bincount over flat
            # positions sums in one pass, in float64 (1,300 rows of 128 into 560: 0.3-0.4
            # ms against 1.5-3.0). It makes a table-sized temporary: for few rows into a
            # large table add.at is faster (156 rows of 128 into 10,000: 0.3 ms against 4.8).
            flat = np.bincount(
                np.reshape(index.astype(np.intp, copy=False)[:, None] * width + np.arange(width), (-1,)),
                np.reshape(values, (-1,)),
                minlength=out.size,
            )
            out += np.reshape(flat, out.shape)
            return out
    add = getattr(xp, "add", None)
    if add is not None and hasattr(add, "at"):
        add.at(out, index, values)
        return out
    rows_of_a_mask = not isinstance(index, tuple) and index.dtype == xp.bool and index.ndim == 1
    if not isinstance(index, tuple) and not is_basic_index(index) and (index.dtype != xp.bool or rows_of_a_mask):
        rows, rest = out.shape[0], out.shape[1:]  # rows of the first axis
        if rows_of_a_mask:  # (the rows it picks, in order)
            index = xp.nonzero(index)[0]
        elif index.size:
            low, high = int(xp.min(index)), int(xp.max(index))
            if low < -rows or high >= rows:
                raise IndexError(f"index {high if high >= rows else low} is out of bounds for axis 0 with size {rows}")
        index = _from_the_front(xp, index, rows)
        picked = xp.reshape(xp.broadcast_to(values, (*index.shape, *rest)), (-1, prod(rest)))
        summed = _one_hot_sum(xp, rows, xp.reshape(index, (-1,)), xp.astype(picked, out.dtype))
        return out + xp.reshape(summed, out.shape)
    index = index if isinstance(index, tuple) else (index,)  # (a mask of several axes too: by flat positions)
    if all(is_basic_index(i) for i in index) and not any(i is Ellipsis for i in index):
        index = (*index, Ellipsis)  # the standard wants every axis of a basic index named
    size = prod(out.shape)
    positions = xp.reshape(xp.reshape(xp.arange(size, device=out.device), out.shape)[index], (-1,))
    flat = xp.reshape(xp.broadcast_to(values, positions.shape if values.ndim == 0 else values.shape), (-1, 1))
    return out + xp.reshape(_one_hot_sum(xp, size, positions, xp.astype(flat, out.dtype)), out.shape)


def _one_hot_sum(xp: Any, count: int, positions: Any, values: Any) -> Any:
    """``values`` (a row per position) summed into ``count`` rows by a one-hot
    product, for a library with no scatter; where a value is not finite, by
    ``where`` instead (in a product, 0 * inf is NaN in rows not picked)."""
    chosen = xp.arange(count, device=values.device)[:, None] == positions[None, :]
    if bool(xp.all(xp.isfinite(values))):
        return xp.astype(chosen, values.dtype) @ values
    zero = xp.zeros_like(values[None, :, :])
    return xp.sum(xp.where(chosen[:, :, None], values[None, :, :], zero), axis=1)


def _from_the_front(xp: Any, index: Any, rows: int) -> Any:
    """Row numbers counted from the end (-1: the last) counted from the
    front, as NumPy reads them; in the platform's index dtype (an int8 index
    plus 200 rows would overflow)."""
    index = xp.astype(index, xp.int64 if xp is not np else np.intp, copy=False)
    return xp.where(index < 0, index + rows, index)
