"""Batching rules of the lookups by index: ``getitem`` by an index array,
``embedding`` and ``segment_sum``, for `monadl.layers._batching_rules`' table.

A group's members have operands of one shape (their signature), so member
``i``'s rows are rows ``i * rows ...`` of the stack made ``(n * rows, ...)``:
its indices offset by that much (`_offset_rows`), the group is one lookup of
the unbatched rule, and its delta one scatter-add (or, for ``segment_sum``,
one gather) of all the members' rows. Indices are checked against a
member's rows first: one past them would read the next member's row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monadl._namespace import namespace
from monadl.deltas import is_basic_index
from monadl.layers._indexing import _checked_indices
from monadl.layers._primitives import PRIMITIVES

__all__ = ["batch_embedding", "batch_getitem", "batch_segment_sum"]

Value = Any
Vjp = Callable[[Value], Value]
BatchResult = tuple[Value, tuple[Vjp, ...]]


def batch_getitem(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """A basic index (ints, slices, ``None``, ``...``) that every member
    uses, after the batch axis; or a gather of rows by one integer array in
    the index's first place (``h[src]``, ``h[src, :]``, ``h[src, 0]``), each
    member's own or one for all, from each member's operand or one for all:
    one lookup (`_offset_rows`). Other fancy indices (a mask, two index
    arrays, an array after a slice or an int: ``h[:, src]``) run member by
    member."""
    a, index = args
    if batched[0] and not batched[1] and is_basic_index(index):
        items = index if isinstance(index, tuple) else (index,)
        return PRIMITIVES["getitem"].rule(a, (slice(None), *items))
    ids, *rest = index if isinstance(index, tuple) else (index,)
    while rest and (rest[-1] is Ellipsis or (type(rest[-1]) is slice and rest[-1] == slice(None))):
        rest.pop()  # (h[src, :] is h[src]: one index array, which the delta scatters fastest)
    if getattr(getattr(ids, "dtype", None), "kind", None) not in ("i", "u") or not is_basic_index(tuple(rest)):
        return None
    if True in [type(i) is bool for i in rest]:  # (a bool beside an index array is a mask of one axis)
        return None
    xp = namespace(a)
    ids = ids if batched[1] else namespace(ids).broadcast_to(ids, (n, *ids.shape))
    picked = ids.shape[1:]
    if batched[0]:
        if a.ndim < 2:
            return None  # (members of no axes: each one's own rule raises, at its line)
        rows = a.shape[1]
        table = xp.reshape(a, (n * rows, *a.shape[2:]))
        flat = _offset_rows(xp, _row_numbers(xp, ids, rows, a), rows, n, a)
    else:  # one operand, every member's ids (a weight's rows): all of them at once
        table, flat = a, namespace(ids).reshape(ids, (-1,))
    out, (vjp,) = PRIMITIVES["getitem"].rule(table, (flat, *rest) if rest else flat)
    whole, shape = out.shape, a.shape
    return xp.reshape(out, (n, *picked, *whole[1:])), (lambda g: xp.reshape(vjp(xp.reshape(g, whole)), shape),)


def _row_numbers(xp: Any, ids: Value, rows: int, like: Value) -> Value:
    """Each member's row numbers as NumPy's indexing reads them (-1: its last
    row), flat, in the library of ``like``; an IndexError outside ``[-rows,
    rows)``, where NumPy raises one (counted from the end past the front, or
    read at the stack's rows, it would be another member's row)."""
    ix = namespace(ids)
    flat = ix.reshape(ids, (-1,))
    if flat.shape[0]:
        low, high = int(ix.min(flat)), int(ix.max(flat))
        if low < -rows or high >= rows:
            raise IndexError(f"index {low if low < -rows else high} is out of bounds for {rows} rows")
        if low < 0:
            flat = ix.astype(flat, ix.int64)
            flat = ix.where(flat < 0, flat + rows, flat)
    return flat if ix is xp else xp.asarray(flat, device=like.device)


def _offset_rows(xp: Any, flat: Value, rows: int, n: int, like: Value) -> Value:
    """Member ``i``'s row numbers (``flat``: the ``n`` members' in order, each
    in ``[0, rows)``) as rows of the members' stack, ``(n * rows, ...)``:
    offset by ``i * rows``, in int64 (an int8 id plus the offset overflows)."""
    offsets = xp.arange(n, dtype=xp.int64, device=like.device)[:, None] * rows
    return xp.reshape(xp.astype(xp.reshape(flat, (n, -1)), xp.int64) + offsets, (-1,))


def batch_embedding(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """A shared table (a weight): the stacked indices are just more indices.
    Each member's table (a layer: ``ml.embedding(h, src)``): the stack's rows,
    each member's indices checked against its rows and offset to them
    (`_offset_rows`), one lookup; its delta one scatter-add into the stack
    (dense: a member's rows are a row of the stack's delta)."""
    table, indices = args
    if not batched[0]:
        return PRIMITIVES["embedding"].rule(table, indices) if batched[1] else None
    if table.ndim < 2:
        return None  # (a table of no rows: each member's rule refuses it, at its line)
    xp = namespace(table)
    indices = indices if batched[1] else namespace(indices).broadcast_to(indices, (n, *indices.shape))
    rows, shape = table.shape[1], table.shape
    flat = _offset_rows(
        xp, _checked_indices(xp, indices, rows, "indices", "index", "a table of {} rows", table), rows, n, table
    )
    out, (vjp,) = PRIMITIVES["embedding"].rule(xp.reshape(table, (n * rows, *shape[2:])), flat)
    whole = out.shape
    return xp.reshape(out, (*indices.shape, *shape[2:])), (
        lambda g: xp.reshape(vjp(xp.reshape(g, whole)).to_dense(), shape),
    )


def batch_segment_sum(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """Member ``i``'s segments as rows ``i * num_segments ...`` of one sum:
    its ids offset by that much, so the group is one scatter of all its rows
    and its delta one gather (a shared operand is broadcast to the members)."""
    data, ids, segments = args
    xp = namespace(data)
    if not batched[0]:
        data = xp.broadcast_to(data, (n, *data.shape))
    if not batched[1]:
        ids = namespace(ids).broadcast_to(ids, (n, *ids.shape))
    if data.ndim < 2 or data.shape[1] != ids.shape[1]:
        return None  # members one by one: each node's error names its line
    rows, rest = data.shape[1], data.shape[2:]
    # Checked per member first (an id past its member's segments would land in the next member's).
    flat = _offset_rows(
        xp, _checked_indices(xp, ids, segments, "segment_ids", "segment id", "{} segments", data), segments, n, data
    )
    out, (vjp,) = PRIMITIVES["segment_sum"].rule(xp.reshape(data, (n * rows, *rest)), flat, n * segments)
    return xp.reshape(out, (n, segments, *rest)), (
        lambda g: xp.reshape(vjp(xp.reshape(g, (n * segments, *rest))), (n, rows, *rest)),
    )
