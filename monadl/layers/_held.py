"""What an operation's signature holds besides its arguments: the objects its
function's closure holds, a partial's arguments, a bound method's object,
and, through functions among them, what those hold in turn
(`monadl.layers._operation`): a cell that closes over a helper closure, or a
function wrapped by a decorator, reads the helper's variables as its own."""

from __future__ import annotations

import functools
import types
from typing import Any, Final, final

__all__ = ["REACHED", "Held", "contents", "reach"]


@final
class Held:
    """An object held by an operation's signature as a closure cell holds one
    (a partial's argument, a bound method's object: it is never rebound)."""

    __slots__ = ("cell_contents",)

    def __init__(self, x: Any) -> None:
        self.cell_contents = x


def contents(cell: Any) -> Any:
    """A cell's object; None for a cell not yet filled."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def reach(roots: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
    """The cells reached from ``roots`` (cells, or `Held`) and their objects,
    in order: a function's closure cells, a partial's function and
    arguments, a bound method's function, and a marked operation's function,
    each object's once (a recursive helper's cell holds itself).

    >>> def outer():
    ...     scale = 2.0
    ...     def helper(x):
    ...         return x * scale
    ...     return lambda x: helper(x) + 1
    >>> cells, objects = reach(outer().__closure__)
    >>> [type(x).__name__ for x in objects]
    ['function', 'float']
    """
    cells: list[Any] = []
    objects: list[Any] = []
    met: set[int] = set()
    todo = list(roots)
    for cell in todo:  # (grows as it is walked)
        x = contents(cell)
        cells.append(cell)
        objects.append(x)
        if id(x) in met or len(todo) > REACHED:
            continue
        met.add(id(x))
        kind = type(x)
        if kind is types.FunctionType:
            todo += x.__closure__ or ()
        elif kind is functools.partial:
            todo += [Held(y) for y in (x.func, *x.args, *x.keywords.values())]
        elif kind is types.MethodType:
            todo.append(Held(x.__func__))
        elif getattr(kind, "holds_a_function", False):  # (a marked operation: its function; not any
            todo.append(Held(x.__wrapped__))  # object answering ``__wrapped__``, a proxy's: a new one each read)
    return cells, objects


REACHED: Final = 1_000
"""Objects `reach` walks past at most (a closure over a large web of helper
functions: the rest are held by their holders' identity alone)."""
