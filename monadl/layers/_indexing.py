"""The rules of shape and indexing: ``reshape``, ``transpose``, ``getitem``,
``embedding``, ``segment_sum``, and the joins ``concatenate`` and ``stack``.

Each delta puts the output's delta back where the operand's values came
from: a reshape or an inverse permutation, a scatter into zeros for an index
(fancy indices may repeat, so they add), one slice per joined operand. An
embedding's delta is sparse, the rows looked up (`SparseRows`), so a
weight's step touches only those. ``segment_sum`` is a lookup turned around:
its value a scatter of rows into zeros, its delta the gather of the rows
back. Their indices are checked to lie in range by `_checked_indices`, which
``cross_entropy`` and the batching rules use for labels too: a negative one
is refused, not counted from the end, and one out of range raises
`IndexRangeError` (the shapes fit: a value does not). ``getitem`` lets
its array library check its index (a negative one counts from the end
there; CuPy checks no integer array) and turns the IndexError of one out of
range into `IndexRangeError` (`_out_of_bounds`), so a lookup in range pays
nothing for the words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import SparseRows, is_basic_index, scatter_add
from monadl.errors import IndexRangeError
from monadl.layers._elementwise import _scalar
from monadl.layers._operands import describe

Value = Any  # an ndarray or a NumPy scalar
PLAIN: Final = (float, int, bool)
"""A plain number reduced or reshaped (data, or a number an operation was given): as NumPy's 0-d array."""
Vjp = Callable[[Value], Value]


# ---- shape and indexing -------------------------------------------------------------
def _reshape(a: Value, shape: tuple[int, ...]) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp, old = namespace(a), a.shape
    out = xp.reshape(a, shape)
    return _scalar(xp, out), (lambda g: xp.reshape(g, old),)


def _transpose(a: Value, axes: tuple[int, ...] | None) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp = namespace(a)
    axes = tuple(range(a.ndim - 1, -1, -1)) if axes is None else tuple(_axis(ax, a.ndim) for ax in axes)
    inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))
    return xp.permute_dims(a, axes), (lambda g: xp.permute_dims(g, inverse),)


def _roll(a: Value, shift: int, axis: int) -> tuple[Value, tuple[Vjp, ...]]:
    """NumPy's ``roll`` along one axis; its delta rolls back."""
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp = namespace(a)
    axis = _axis(axis, a.ndim)
    return xp.roll(a, shift, axis=axis), (lambda g: xp.roll(g, -shift, axis=axis),)


def _axis(axis: int, ndim: int) -> int:
    """``axis`` counted from the front; a ValueError (the runtime's `ShapeError`)
    outside ``[-ndim, ndim)``, as NumPy refuses it, not wrapped."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of bounds for an array of {ndim} dimensions")
    return axis % ndim


def _getitem(a: Value, index: Any) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp, shape, dtype, device = namespace(a), a.shape, a.dtype, a.device

    def vjp(g: Value) -> Value:
        out = xp.zeros(shape, dtype=dtype, device=device)
        if is_basic_index(index):
            out[index] = g
            return out
        return scatter_add(xp, out, index, g)  # fancy indices may repeat

    try:
        return a[index], (vjp,)
    except IndexError:
        try:
            text = _out_of_bounds(shape, index)
        except Exception:  # (an index array its library would not let be read: the library's own error)
            text = None
        if text is None:  # (too many indices, a mask of another shape: NumPy's own words)
            raise
        raise IndexRangeError(text) from None  # (NumPy's words, said again: noise)


def _out_of_bounds(shape: tuple[int, ...], index: Any) -> str | None:
    """What `_getitem` says of an index that its array library refused:
    its first integer outside ``[-length, length)`` of its axis, where it
    sits in the index, and the axis; None where no integer is out of range.
    Read only once the library has raised: the lookups in range pay nothing
    for it. An index array is read in its own namespace (CuPy refuses to
    become a NumPy array unasked)."""
    items = index if type(index) is tuple else (index,)
    axes = [_axes_taken(item) for item in items]
    axis = 0
    for k, (item, taken) in enumerate(zip(items, axes)):
        if item is Ellipsis:
            axis = len(shape) - sum(axes[k + 1 :])
            continue
        if isinstance(item, int | np.integer | list):
            item = np.asarray(item)
        if hasattr(item, "dtype") and axis < len(shape):
            xp = namespace(item)
            if xp.isdtype(item.dtype, "integral"):
                size, flat = shape[axis], xp.reshape(item, (-1,))
                bad = xp.astype((flat < -size) | (flat >= size), xp.int8)
                if bool(xp.any(bad)):
                    first = int(xp.argmax(bad))
                    place = f"[{', '.join(map(str, np.unravel_index(first, item.shape)))}]" if item.ndim else ""
                    item_at = f"[{k}]" if len(items) > 1 else ""
                    at = f" at index{item_at}{place}" if place or item_at else ""
                    return (
                        f"index {int(flat[first])}{at} out of range for axis {axis} of length {size} "
                        f"(indices must lie in [{-size}, {size}), a negative one counted from the end)"
                    )
        axis += taken
    return None


def _axes_taken(item: Any) -> int:
    """How many axes of the array one item of an index takes: none for
    ``None``, ``...`` and a bool, a mask's number of axes, one for the rest."""
    if item is None or item is Ellipsis or isinstance(item, bool | np.bool_):
        return 0
    kind = getattr(getattr(item, "dtype", None), "kind", None)
    if kind == "b":
        return int(item.ndim)
    return 1


def _embedding(table: Value, indices: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # The delta of the table is sparse: only the rows looked up (the paper's
    # Data != Delta example). A weight's step then touches only those rows.
    xp, shape = namespace(table), table.shape
    if not shape:
        raise ValueError("the table must have at least one axis (its rows)")
    # As PyTorch's embedding: no wrapping, so equal rows have equal indices
    # (the sparse step sums a row's deltas by its index).
    flat = _checked_indices(xp, indices, shape[0], "indices", "index", "a table of {} rows", table)
    rows = xp.reshape(xp.take(table, flat, axis=0), (*indices.shape, *shape[1:]))
    return rows, (
        lambda g: SparseRows(flat, xp.reshape(g, (flat.shape[0], *shape[1:])), shape),
    )  # (not -1: a row of 0)


def _segment_sum(data: Value, segment_ids: Value, num_segments: int) -> tuple[Value, tuple[Vjp, ...]]:
    # Row i of data goes to row segment_ids[i] of zeros, repeated ids adding up (`scatter_add`, which
    # picks the fastest way); the delta of row i is the delta of its segment, a gather.
    xp = namespace(data)
    if data.ndim == 0 or data.shape[0] != segment_ids.shape[0]:
        raise ValueError(
            f"segment_ids must hold one id per row of the data, got {segment_ids.shape[0]} ids"
            f" for data of shape {tuple(data.shape)}"
        )
    ids = _checked_indices(xp, segment_ids, num_segments, "segment_ids", "segment id", "{} segments", data)
    out = xp.zeros((num_segments, *data.shape[1:]), dtype=data.dtype, device=data.device)
    return scatter_add(xp, out, ids, data), (lambda g: xp.take(g, ids, axis=0),)


def _checked_indices(xp: Any, ints: Value, size: int, what: str, one: str, of: str, like: Value) -> Value:
    """``ints`` flat, in ``[0, size)`` (`_check_range`), in the library of ``like``.

    NumPy integers for a table on a device (a tree's symbols, a batch's
    labels: host data) are checked on the host, where that costs no wait, and
    then copied over (a few bytes, queued on the stream like a kernel)."""
    if xp is not np and type(ints) is np.ndarray:
        flat = np.reshape(ints, (-1,))
        _check_range(np, flat, size, ints.shape, what, one, of)
        return xp.asarray(flat, device=like.device)
    flat = xp.reshape(ints, (-1,))
    _check_range(xp, flat, size, ints.shape, what, one, of)
    return flat


def _check_range(xp: Any, ints: Value, size: int, shape: tuple[int, ...], what: str, one: str, of: str) -> None:
    """Refuse integers outside ``[0, size)`` with `IndexRangeError` (``ints``:
    ``what``, flat, of ``shape``; ``one``: what one of them is; ``of``: what
    they index, ``{}`` standing for ``size``), which the runtime completes
    with the operation and the user's line. On a GPU this waits for the two
    reductions: a wrong answer would cost more."""
    if ints.shape[0] == 0:
        return
    if xp is np:
        low, high = int(np.minimum.reduce(ints)), int(np.maximum.reduce(ints))
    else:
        low, high = int(xp.min(ints)), int(xp.max(ints))
    if low < 0 or high >= size:
        raise IndexRangeError(out_of_range(xp, ints, size, shape, what, one, of))


def out_of_range(xp: Any, ints: Value, size: int, shape: tuple[int, ...], what: str, one: str, of: str) -> str:
    """What `_check_range` says of ``ints``: the first integer out of range,
    and where it sits in ``what`` when they are several (which word of a
    sentence, which label of a batch)."""
    first = int(xp.argmax((ints < 0) | (ints >= size)))
    bad = int(ints[first])
    at = f" at {what}[{', '.join(map(str, np.unravel_index(first, shape)))}]" if ints.shape[0] > 1 else ""
    negative = f"; negative {what} are refused, not counted from the end" if bad < 0 else ""
    return f"{one} {bad}{at} out of range for {of.format(size)} ({what} must lie in [0, {size}){negative})"


def _first_array(values: list[Any]) -> Any:
    """The first operand that is an array (Python numbers may come first)."""
    return next((x for x in values if hasattr(x, "ndim")), None)


def _axis_index(ndim: int, axis: int, at: Any) -> tuple[Any, ...]:
    """The index that takes ``at`` (an int or a slice) along ``axis``."""
    return (slice(None),) * (axis % ndim) + (at, ...)


def _concatenate(*args: Any) -> tuple[Value, tuple[Vjp, ...]]:
    *arrays, axis = args
    first = next((x for x in arrays if getattr(x, "ndim", 0) > 0), None)
    if first is None:
        raise ValueError("zero-dimensional operands cannot be concatenated (ml.stack joins them)")
    for i, x in enumerate(arrays):
        if getattr(x, "ndim", 0) == 0:
            j = next(j for j, y in enumerate(arrays) if y is first)
            raise ValueError(
                f"part {i} ({describe((x,))}) is zero-dimensional and part {j} ({describe((first,))}) is not: "
                "concatenate joins parts of one number of dimensions (Python's sum() of no layers is the int 0: "
                "where there is nothing to sum, give zeros of the sum's shape)"
            )
    xp = namespace(first)
    ndim, bounds, start = first.ndim, [], 0
    axis = _axis(axis, ndim)
    for x in arrays:
        bounds.append((start, start + x.shape[axis]))
        start += x.shape[axis]

    def piece(lo: int, hi: int) -> Vjp:
        return lambda g: g[_axis_index(ndim, axis, slice(lo, hi))]

    return xp.concat(arrays, axis=axis), tuple(piece(lo, hi) for lo, hi in bounds)


def _stack(*args: Any) -> tuple[Value, tuple[Vjp, ...]]:
    *arrays, axis = args
    first = _first_array(arrays)
    if first is None:  # numbers only
        first = np.asarray(arrays[0])
    xp = namespace(first)
    ndim = first.ndim + 1
    if not all(hasattr(x, "ndim") for x in arrays):
        # A Python number takes the arrays' dtype, as beside an array in a binary
        # operation (NEP 50's weak scalars): np.stack made 1.0 float64 beside float32.
        dtype = np.result_type(*arrays) if xp is np else first.dtype
        arrays = [x if hasattr(x, "ndim") else xp.asarray(x, dtype=dtype, device=first.device) for x in arrays]

    def piece(i: int) -> Vjp:
        return lambda g: g[_axis_index(ndim, axis, i)]

    return xp.stack(arrays, axis=axis), tuple(piece(i) for i in range(len(arrays)))
