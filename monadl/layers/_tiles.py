"""Slices that tile an array: how a traced cell's backward writes its slices' deltas.

A Tree-LSTM cell cuts its gate vector into five slices that cover it exactly.
`monadl.layers._program.Program.backward` puts the slices' deltas into one
buffer of the gate vector's shape. Where the slices never overlap, each
delta can be *assigned* into its place instead of added (one pass over it,
not three), and where they also cover the whole array the buffer needs no
zeros first: `tiling` says which holds, from the slices and the shape.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

from monadl.deltas import is_basic_index
from monadl.layers._primitives import PRIMITIVES

if TYPE_CHECKING:
    from monadl.layers._step import Step

__all__ = ["Tiling", "basic_slice", "slice_readers", "tiling"]

Tiling = bool | None
"""True: the slices tile the array (disjoint, covering it); False: disjoint
only; None: they may overlap (their deltas must be added)."""


def basic_slice(step: Step) -> tuple[Any, ...] | None:
    """A getitem step's index as a tuple, when it takes a view (slices, ints,
    ``...``, None: `is_basic_index`); else None."""
    if step.op is not PRIMITIVES["getitem"] or step.takes is not None:
        return None
    (index,) = step.params
    if not is_basic_index(index):
        return None
    return index if isinstance(index, tuple) else (index,)


def slice_readers(steps: tuple[Step, ...], slices: tuple[tuple[Any, ...] | None, ...]) -> dict[int, tuple[int, ...]]:
    """Per slot of a program's environment, the steps that slice it (by
    index in ``steps``), where no other step reads it.

    >>> from monadl.layers._step import Step
    >>> cut = [Step(PRIMITIVES["getitem"], (0,), (s,), None, (True,)) for s in (slice(None, 2), slice(2, None))]
    >>> slice_readers(tuple(cut), ((slice(None, 2),), (slice(2, None),)))
    {0: (0, 1)}
    """
    readers: dict[int, list[int]] = {}
    others: set[int] = set()
    for j, (step, index) in enumerate(zip(steps, slices)):
        if index is not None and len(step.refs) == 1 and step.grads[0]:
            readers.setdefault(step.refs[0], []).append(j)
        else:
            others.update(step.refs)
    return {r: tuple(js) for r, js in readers.items() if r not in others}


def tiling(indices: list[tuple[Any, ...]], shape: tuple[int, ...]) -> Tiling:
    """Whether basic indices ``indices`` (one per slice) tile an array of ``shape``.

    >>> tiling([(slice(None), slice(None, 2)), (slice(None), slice(2, None))], (3, 5))
    True
    >>> tiling([(slice(None), slice(None, 2)), (slice(None), slice(3, None))], (3, 5))
    False
    >>> tiling([(slice(None, 2),), (slice(1, None),)], (5,)) is None
    True
    """
    axis = None  # the one axis the slices cut
    for index in indices:
        if len(index) > len(shape) or not all(type(item) is slice for item in index):
            return None  # ints, None, ...: not worth handling
        for a, item in enumerate(index):
            start, stop, step = item.indices(shape[a])
            if step != 1:
                return None
            if (start, stop) != (0, shape[a]):
                if axis is not None and a != axis:
                    return None  # cut along two axes
                axis = a
    if axis is None:  # every slice is the whole array
        return True if len(indices) == 1 else None
    spans = []
    for index in indices:
        start, stop, _ = (index[axis] if axis < len(index) else slice(None)).indices(shape[axis])
        spans.append((start, max(start, stop)))
    spans.sort()
    pairs = list(pairwise(spans))
    if any(start < end for (_, end), (start, _) in pairs):
        return None
    return spans[0][0] == 0 and spans[-1][1] == shape[axis] and all(end == start for (_, end), (start, _) in pairs)
