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
class SplitDelta:
    """The delta of a split array, part by part: ``parts[i]`` is the delta of
    part ``i``; a part with none has no entry (zero).

    Two combine by adding part by part, into the left one (each part's delta
    rule makes a new one, and only the runtime's accumulator adds into it,
    as `monadl.deltas.Outer` does): a split into n parts whose deltas arrive
    one by one costs n additions, not n slots each (n squared); `to_dense`
    concatenates the parts once.

    >>> import numpy as np
    >>> cut = layout((5,), 0, (2, 1, 2))
    >>> one = SplitDelta({0: np.ones(2)}, cut)
    >>> other = SplitDelta({2: np.full(2, 3.0)}, cut)
    >>> (one + other).to_dense()
    array([1., 1., 0., 3., 3.])
    """

    __slots__ = ("layout", "parts")

    __array_ufunc__ = None  # (an array + a SplitDelta comes to __radd__, not an object array)

    def __init__(self, parts: dict[int, Value], layout: Layout) -> None:
        self.parts = parts
        self.layout = layout

    @property
    def shape(self) -> tuple[int, ...]:
        """The whole array's: the runtime compares it with the split's value."""
        return self.layout.shape

    def __add__(self, other: Any) -> Any:
        if type(other) is not SplitDelta:  # (a batched group's part delta, made one array)
            return self.to_dense() + other
        mine = self.parts  # (the left one: the accumulator; the right, a part's, is only read)
        for i, part in other.parts.items():
            held = mine.get(i)
            mine[i] = part if held is None else held + part
        return self

    def __radd__(self, other: Any) -> Any:
        return other + self.to_dense()

    def to_dense(self) -> Value:
        """One array of the whole shape."""
        parts, cut = self.parts, self.layout
        if len(parts) == len(cut.bounds):  # every part has a delta: the common case, one concatenation
            return namespace(parts[0]).concat([parts[i] for i in range(len(parts))], axis=cut.axis)
        like = next(iter(parts.values()))
        xp = namespace(like)
        pieces = []
        for i, (lo, hi) in enumerate(cut.bounds):
            part = parts.get(i)
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

    def vjp(g: Value) -> SplitDelta:
        return SplitDelta({i: g}, cut)

    return a[cut.indices[i]], (vjp,)
