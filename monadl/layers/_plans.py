"""An operation's plans: how calls whose arguments have one tuple of types
find their trace by those types and their views, without the signature's
walk (`monadl.layers._operation`, where a plan is learnt and used)."""

from __future__ import annotations

from operator import is_not
from typing import Any, Final, final

from monadl.layers._structures import MISMATCH, read_parts
from monadl.layers._tracing import Trace

__all__ = ["UNSEEN", "Entry", "Plan", "keyed", "same"]


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
