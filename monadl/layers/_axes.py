"""The integer parameters of the shape functions (axes, sizes, counts) made
Python ints when a layer is built.

Axes and sizes often come computed: ``x.ndim - 1`` of an array, an
``np.argmax``, a ``shape`` from NumPy arithmetic, all NumPy integers. NumPy
takes any integer (``operator.index``); the rules and the batching rules ask
``isinstance(axis, int)``, and a layer's parameters key its batching
signature and an operation's traces. So each is made a Python int here, once,
at the user's line, and whatever is no integer (a float, a string, a bool
passed where ``keepdims`` was meant) is refused there, not at the run.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Self, SupportsIndex, TypeAlias, TypeGuard

from monadl.errors import OperandError

__all__ = ["Axis", "Integer", "as_axis", "as_int", "as_ints", "as_shape", "is_sizes"]


class Integer(Protocol):
    """One integer as `as_int` takes it: an ``int`` or a NumPy integer, not a
    bool nor an array (`SupportsIndex` lets both through: NumPy's stubs give
    every array ``__index__``).

    Structural, since bool is an int to mypy: ``~True`` is the int ``-2``
    (an integer's ``~`` gives its own type, a bool's does not), and an
    array has no ``numerator``.
    """

    def __index__(self) -> int: ...
    def __invert__(self) -> Self: ...
    @property
    def numerator(self) -> Any: ...


Axis: TypeAlias = Integer | Sequence[Integer]
"""An axis or a tuple (or list) of axes: Python or NumPy integers."""


def as_int(value: object, op: str, what: str) -> int:
    """``value`` as a Python int; `OperandError` naming ``op`` and ``what`` if it is no integer."""
    if type(value) is int:  # (the common case, on the path of every layer built)
        return value
    if isinstance(value, SupportsIndex) and not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:  # (an array of several integers)
            pass
    raise OperandError(f"{op}: {what} must be an integer, got {value!r}")


def is_sizes(value: object) -> TypeGuard[Iterable[object]]:
    """Whether ``value`` is a sequence of integers' kind (a tuple, a list, a 1-D array), not one integer."""
    if isinstance(value, (str, bytes)):
        return False
    return isinstance(value, Sequence) or getattr(value, "ndim", 0) == 1


def as_ints(values: object, op: str, what: str) -> tuple[int, ...]:
    """A sequence of integers (a tuple, a list, a 1-D integer array) as a tuple of Python ints."""
    if not is_sizes(values):
        raise OperandError(f"{op}: {what} must be a sequence of integers, got {values!r}")
    return tuple(as_int(v, op, what) for v in values)


def as_axis(axis: object, op: str) -> int | tuple[int, ...] | None:
    """A reduction's ``axis``: None (every axis), an integer, or a sequence of them (a tuple)."""
    if axis is None or type(axis) is int:
        return axis
    return as_ints(axis, op, "axis") if is_sizes(axis) else as_int(axis, op, "axis")


def as_shape(given: tuple[object, ...], op: str, what: str) -> tuple[int, ...]:
    """A method's shape or axes given as NumPy's methods take them: one
    sequence, ``x.reshape((3, 2))``, or the integers, ``x.reshape(3, 2)``."""
    return as_ints(given[0] if len(given) == 1 and is_sizes(given[0]) else given, op, what)
