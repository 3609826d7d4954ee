"""The rules of ``split``: one cut of an array into parts, whose backward builds
the input's delta once.

A layer has one value, so a split is one ``split`` node (its value is its
input, unchanged) and one cheap ``split_part`` node per part (a view of a
slice). A part's delta does not become an input-sized array of zeros with the
part filled in, as a slice's does: it becomes a `SplitDelta` holding just that
part, deltas of several parts combine by filling their slots, and the split
node's backward concatenates the slots once, with zeros only for parts that
got no delta. A Tree-LSTM cutting its gate vector in five pays for one
gate-sized array in the backward, not five.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, final

from monadl._namespace import namespace

__all__ = ["Layout", "SplitDelta", "layout", "part_bounds", "split_part_rule", "split_rule"]

Value = Any


@lru_cache(maxsize=256)  # a model cuts a few shapes, again and again
def part_bounds(length: int, sections: int | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Where each part starts and ends along an axis of ``length``.

    ``sections``: a count of equal parts (it must divide ``length``, as in
    ``np.split``), or the parts' sizes (they must add up to ``length``, as in
    ``torch.split``). A ValueError otherwise, which the runtime reports as a
    `monadl.ShapeError` naming the user's line.

    >>> part_bounds(6, 3)
    ((0, 2), (2, 4), (4, 6))
    >>> part_bounds(6, (1, 5))
    ((0, 1), (1, 6))
    """
    if isinstance(sections, int):
        if length % sections:
            raise ValueError(f"an axis of length {length} does not split into {sections} equal parts")
        sizes: Sequence[int] = (length // sections,) * sections
    else:
        if sum(sections) != length:
            raise ValueError(f"sizes {list(sections)} add up to {sum(sections)}, not to the axis length {length}")
        sizes = sections
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


@final
@dataclass(frozen=True, slots=True)
class Layout:
    """How an array of ``shape`` is cut along ``axis``: each part's bounds and
    the index that takes it. Made once per shape and cut (`layout`) and shared
    by the parts and their deltas."""

    shape: tuple[int, ...]
    axis: int
    bounds: tuple[tuple[int, int], ...]
    indices: tuple[tuple[Any, ...], ...]  # slices and an Ellipsis


@lru_cache(maxsize=256)
def layout(shape: tuple[int, ...], axis: int, sections: int | tuple[int, ...]) -> Layout:
    """The `Layout` of cutting ``shape`` along ``axis`` into ``sections`` (see `part_bounds`).

    >>> layout((2, 6), -1, 2).indices[1]
    (slice(None, None, None), slice(3, 6, None), Ellipsis)
    """
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"axis {axis} is out of bounds for an array of {len(shape)} dimensions")
    axis %= len(shape)
    bounds = part_bounds(shape[axis], sections)
    whole: tuple[slice, ...] = (slice(None),) * axis
    indices = tuple((*whole, slice(lo, hi), ...) for lo, hi in bounds)
    return Layout(shape, axis, bounds, indices)


@final
@dataclass(frozen=True, slots=True)
class SplitDelta:
    """The delta of a split array, part by part: ``parts[i]`` is the delta of
    part ``i``, or None where that part got none (zero).

    Two combine by adding slot by slot; `to_dense` concatenates the slots once.

    >>> import numpy as np
    >>> cut = layout((5,), 0, (2, 1, 2))
    >>> one = SplitDelta((np.ones(2), None, None), cut)
    >>> other = SplitDelta((None, None, np.full(2, 3.0)), cut)
    >>> (one + other).to_dense()
    array([1., 1., 0., 3., 3.])
    """

    parts: tuple[Value | None, ...]
    layout: Layout

    @property
    def shape(self) -> tuple[int, ...]:
        """The whole array's: the runtime compares it with the split's value."""
        return self.layout.shape

    __array_ufunc__ = None  # (an array + a SplitDelta comes to __radd__, not an object array)

    def __add__(self, other: Any) -> Any:
        if type(other) is not SplitDelta:  # (a batched group's part delta, made one array)
            return self.to_dense() + other
        parts = tuple(a if b is None else b if a is None else a + b for a, b in zip(self.parts, other.parts))
        return SplitDelta(parts, self.layout)

    def __radd__(self, other: Any) -> Any:
        return other + self.to_dense()

    def to_dense(self) -> Value:
        """One array of the whole shape."""
        parts, cut = self.parts, self.layout
        if all(p is not None for p in parts):  # every part has a delta: the common case, one concatenation
            return namespace(parts[0]).concat(parts, axis=cut.axis)
        like = next(p for p in parts if p is not None)
        xp = namespace(like)
        pieces = []
        for part, (lo, hi) in zip(parts, cut.bounds):
            if part is None:
                shape = list(cut.shape)
                shape[cut.axis] = hi - lo
                part = xp.zeros(tuple(shape), dtype=like.dtype, device=like.device)
            pieces.append(part)
        return xp.concat(pieces, axis=cut.axis)


def split_rule(a: Value, sections: int | tuple[int, ...], axis: int) -> tuple[Value, tuple[Any, ...]]:
    """The split node: its value is its input (the parts are views of it); its
    delta arrives as a `SplitDelta` from the parts and leaves as one array."""
    if a.ndim == 0:
        raise ValueError("a zero-dimensional operand cannot be split")
    layout(a.shape, axis, sections)  # check here, where the user's line is reported
    return a, (_assemble,)


def _assemble(g: Value) -> Value:
    return g.to_dense() if type(g) is SplitDelta else g


def split_part_rule(a: Value, sections: int | tuple[int, ...], axis: int, i: int) -> tuple[Value, tuple[Any, ...]]:
    """Part ``i`` of a split node's value: a view of a slice."""
    cut = layout(a.shape, axis, sections)
    empty = (None,) * len(cut.bounds)

    def vjp(g: Value) -> SplitDelta:
        return SplitDelta((*empty[:i], g, *empty[i + 1 :]), cut)

    return a[cut.indices[i]], (vjp,)
