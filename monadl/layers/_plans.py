"""An operation's plans: how calls whose arguments have one tuple of types
find their trace by those types and their views, without the signature's
walk (`monadl.layers._operation`, where a plan is learnt and used)."""

from __future__ import annotations

from operator import is_not
from typing import Any, Final, final

import numpy as np

from monadl.layers._layer import Layer
from monadl.layers._structures import LEAVES, MISMATCH, read_parts, reader
from monadl.layers._tracing import Trace

__all__ = ["UNSEEN", "Entry", "Plan", "keyed", "learn", "same"]


def same(read: list[Any] | None, leaves: list[Any]) -> bool:
    """Whether a plan's reading of a call is the walk's leaves, object for object."""
    return read is not None and len(read) == len(leaves) and not any(map(is_not, read, leaves))


@final
class Plan:
    """How calls of one operation whose arguments have one tuple of types
    are read without the signature's walk: per argument, the `reader` of its
    leaves (None: the argument is a leaf; ``readers`` None when all are),
    and per tuple of the leaves' types, an `Entry` (those of a call whose
    leaves' types are none of them take the walk)."""

    __slots__ = ("entries", "readers")

    def __init__(self, readers: tuple[Any, ...] | None) -> None:
        self.readers = readers
        self.entries: dict[tuple[type, ...], Entry] = {}

    def leaves(self, args: tuple[Any, ...]) -> list[Any] | None:
        """The leaves of a call's arguments, in `items`' order; None if a
        tuple or list among them has other items' types than the plan's."""
        if self.readers is None:
            return list(args)
        leaves = read_parts(args, self.readers)
        return None if leaves is MISMATCH else leaves


UNSEEN: Final = Plan(None)  # (for arguments' types no call has had yet: it finds nothing)


@final
class Entry:
    """The calls of a plan whose leaves have one tuple of types: which leaves
    are layers (other operations' outputs among them are views) and which
    are NumPy arrays (data), and the traces by views and the arrays' shapes
    and dtypes (`keyed`)."""

    __slots__ = ("arrays", "layers", "traces")

    def __init__(self, layers: tuple[int, ...], arrays: tuple[int, ...]) -> None:
        self.layers = layers
        self.arrays = arrays
        self.traces: dict[Any, Trace] = {}


def keyed(views: list[tuple[int, int, int]], leaves: list[Any], arrays: tuple[int, ...]) -> Any:
    """A plan's key of a call's trace where some leaves are data arrays: the
    views and each array's shape and dtype (the function may read them)."""
    return (tuple(views), *[v for j in arrays for v in (leaves[j].shape, leaves[j].dtype)])


def learn(
    plans: dict[tuple[type, ...], Plan | None],
    kinds: tuple[type, ...],
    args: tuple[Any, ...],
    leaves: list[Any],
    views: tuple[Any, ...],
    trace: Trace,
) -> None:
    """Let an operation's plan of ``kinds`` (the arguments' types) find
    ``trace``, where its readers read exactly the walk's ``leaves`` (else
    the types do not fix the signature: a field holding a tuple, or an int)
    and each leaf is a layer, weight, array or float (`LEAVES`)."""
    plan = plans.get(kinds)
    if plan is None:
        readers = [None if kind in LEAVES else reader(x) for kind, x in zip(kinds, args)]
        if any(kind not in LEAVES and read is None for kind, read in zip(kinds, readers)):
            plans[kinds] = None  # (a dict, a named tuple, an int: never read by types)
            return
        plan = Plan(None if readers == [None] * len(kinds) else tuple(readers))
        if not same(plan.leaves(args), leaves):
            plans[kinds] = None  # (its first call's values are not leaves in the places types say)
            return
        plans[kinds] = plan
    elif not same(plan.leaves(args), leaves):
        return
    leaf_kinds = tuple(map(type, leaves))
    entry = plan.entries.get(leaf_kinds)
    if entry is None:
        if not set(leaf_kinds) <= LEAVES:
            return
        entry = plan.entries[leaf_kinds] = Entry(
            tuple([j for j, kind in enumerate(leaf_kinds) if kind is Layer]),
            tuple([j for j, kind in enumerate(leaf_kinds) if kind is np.ndarray]),
        )
    entry.traces[keyed(list(views), leaves, entry.arrays) if entry.arrays else views] = trace
