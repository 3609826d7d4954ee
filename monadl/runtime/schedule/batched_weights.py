"""Products and lookups by large weights: what their groups save beyond
their members' dispatch, for the cost rule of dynamic batching
(`monadl.runtime.schedule.batched_rule`, `monadl.runtime.schedule.batched_run`).
A product alone by a large weight makes a weight-sized delta (an outer
product) and, of several rows, packs the weight; a group makes one of each
(`packs`, `saves_kernels`); where deltas are kept as factors (merged runs)
even a lone one may run as a group of one (`MIN_FACTORED`).
"""

from __future__ import annotations

from math import prod
from typing import Any, Final

from monadl.layers._layer import Layer
from monadl.layers._program import Program
from monadl.layers._weight import Weight

__all__ = [
    "FACTORED",
    "MIN_FACTORED",
    "MIN_PACKED",
    "MIN_SHARED",
    "PACKED_WEIGHT",
    "PACKED_WORK",
    "WEIGHT_READERS",
    "packs",
    "reads_large",
    "saves_kernels",
    "weight_of",
]

MIN_PACKED: Final = 4
"""The smallest group that pays of products whose members each multiply 2
rows or more by one large weight (`packs`)."""

PACKED_WEIGHT: Final = 1 << 18
"""Elements of a weight from which `packs` counts its products (512 x 512,
as measured; smaller weights' packs cost about what a group does)."""

PACKED_WORK: Final = 1 << 20
"""Multiply-adds of a member's product (its rows times the weight's
elements) from which a group of them pays from `MIN_PACKED`."""


def packs(node: Any, records: Any, where: dict[Any, Any]) -> bool:
    """Whether a group of ``node``'s signature pays from `MIN_PACKED`
    members: a product (``dense`` too) of 2 rows or more by a weight (or
    ``ml.as_layer(w)``, its transpose, a reshape) of `PACKED_WEIGHT`
    elements or more, `PACKED_WORK` multiply-adds or more. For each call of
    more than one row OpenBLAS packs the weight, so one call for the group
    saves a pack per member (NumPy's OpenBLAS, one thread, a forward product
    and its delta to the rows: 4 members of 4 rows times 512 x 512, float32
    0.30 ms, float64 0.36 ms; of 2 rows, -0.04 to 0.07 ms; 1 row a member,
    a gemv that packs nothing: none; 8 rows times 256 x 256, 0.03-0.11 ms,
    about a group's own cost). On a GPU a group saves its members' launches
    as well. Read for groups of `MIN_PACKED` to ``MIN_GROUP - 1`` members,
    and by `saves_kernels` once a group that ran; False where the rows' shape is not known without computing a
    member's value.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((512, 512)))
    >>> packs(np.ones((4, 512)) @ w, {}, {}), packs(np.ones((2, 512)) @ w, {}, {}), packs(np.ones((4, 512)) @ w.T, {}, {})
    (True, False, True)
    """
    inputs = node._inputs
    if node._op.name not in FACTORED or len(inputs) < 2:
        return False
    weight = weight_of(inputs[1])
    if weight is None or weight.size < PACKED_WEIGHT:
        return False
    rows = _rows(inputs[0], records, where)
    return rows is not None and rows >= 2 and rows * int(weight.size) >= PACKED_WORK


def saves_kernels(node: Any, records: Any, where: dict[Any, Any]) -> bool:
    """Whether a group of ``node``'s signature that ran batched saves more
    than its members' dispatch, so that a graph that batched less than
    `BATCHED_SHARE` of its nodes pays all the same: a marked operation's
    (each member its program's steps), or a product (``dense`` too) by a
    weight of `MIN_SHARED` elements or more of one row a member (a gemv
    each, and a weight-sized outer product for its delta: 1,000 steps of an
    RNN whose input products alone batched, of one row by 128 x 128, ran
    0.8x node by node's time) or that packs its weight (`packs`).

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((128, 128)))
    >>> saves_kernels(np.ones(128) @ w, {}, {}), saves_kernels(np.ones((4, 128)) @ w, {}, {})
    (True, False)
    """
    op = node._op
    if type(op.rule) is Program:
        return True
    inputs = node._inputs
    if op.name not in FACTORED or len(inputs) < 2 or weight_of(inputs[1]) is None:
        return False
    rows = _rows(inputs[0], records, where)
    return rows == 1 or packs(node, records, where)


def _rows(x: Any, records: Any, where: dict[Any, Any]) -> int | None:
    """The rows a product's left operand ``x`` multiplies (1 for a vector),
    or None where its shape is not known without computing a member's value."""
    if type(x) is Layer:
        place = where.get(x)
        if place is None:  # (a node computed alone: its record holds its value)
            shape = getattr(records[x].value, "shape", None)
        else:  # (a member of an earlier group: its part of the signature, (kind, shape, dtype) for an array)
            part = place[2]
            shape = part[1] if len(part) == 3 and type(part[0]) is type and type(part[1]) is tuple else None
    else:
        shape = getattr(x, "shape", None)
    if shape is None or not shape:
        return None
    return prod(shape[:-1]) if len(shape) >= 2 else 1


def reads_large(node: Any) -> bool:
    """Whether ``node`` is a product or lookup that reads a weight of
    `MIN_SHARED` elements or more (as itself or a view of it)."""
    return node._op.name in WEIGHT_READERS and any(weight_of(x) is not None for x in node._inputs)


WEIGHT_READERS: Final = frozenset({"matmul", "dense", "embedding"})
"""The primitives that read a weight (a product's matrix, a lookup's table)
`large` counts."""

MIN_SHARED: Final = 1 << 14
"""Elements of a weight from which a product or lookup that reads it counts
as large (`large`, `MIN_LARGE`)."""


_VIEWS: Final = frozenset({"as_layer", "transpose", "reshape"})


def weight_of(x: Any) -> Weight[Any, Any] | None:
    """The large weight ``x`` is, or shows as a layer (``ml.as_layer(w)``,
    ``w.T``, a reshape of it), through a few such views; None for anything else."""
    for _ in range(3):
        if type(x) is Weight:
            return x if x.size >= MIN_SHARED else None  # (prod of the shape: a tensor's size is a method)
        op = getattr(x, "_op", None)
        if op is None or op.name not in _VIEWS:
            return None
        x = x._inputs[0]
    return None


MIN_FACTORED: Final = 1 << 16
"""Where weights' deltas are kept as factors (the merged runs of
`monadl.runtime.schedule.fibers`), a lone product by a weight of at least
this many elements runs as a group of one: its delta's rows join the other
groups' (one product when the weight is released) instead of a weight-sized
outer product and addition of its own; below, those cost less than a group."""

FACTORED: Final = frozenset({"matmul", "dense"})
