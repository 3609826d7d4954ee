"""The values of an operation with several outputs, and the primitives of a trace's edges.

An operation node whose function returns several layers (a Tree-LSTM cell's
``h`` and ``c``) has an `Outputs` tuple as its value, read by one view node
per output (`OUTPUT`); a group of such nodes run as one has a
`StackedOutputs`; their deltas are `OutputsDelta`s. `ARGUMENT` is a
placeholder's primitive while a cell is traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, final

from monadl._namespace import all_finite, namespace
from monadl.errors import OperandError
from monadl.layers._primitives import Primitive

__all__ = ["ARGUMENT", "OUTPUT", "Outputs", "OutputsDelta", "StackedOutputs", "arrays_of", "batch_output"]

Value = Any
Vjp = Callable[[Value], Value]


# ---- values of an operation with several outputs -------------------------------------------------
@final
class Outputs(tuple[Value, ...]):
    """The value of an operation node with several outputs: one array per
    output, read by its view nodes."""

    __slots__ = ()
    # Not an array: the batching scheduler's signature reads these without an
    # exception (so its view nodes group, one read of the cells' group's
    # stacked outputs: `batch_output`).
    shape: Final = None
    dtype: Final = None

    def signature(self) -> tuple[Any, ...] | None:
        """What a consumer's batching signature holds of it: its arrays'
        types, shapes and dtypes; None where one is a plain number (a cell
        returning one: its consumers are not batched)."""
        try:
            return tuple([(type(p), p.shape, p.dtype) for p in self])
        except AttributeError:
            return None


def finite_value(value: Value) -> bool:
    """Whether a node's value holds no NaN and no infinity (an `Outputs`: any
    of its arrays; a value that is no array, a Fold batch's loom's: its own ``finite()``)."""
    if type(value) is Outputs:
        return all(map(all_finite, value))
    finite = getattr(value, "finite", None)
    return all_finite(value) if finite is None else bool(finite())


def arrays_of(values: tuple[Value, ...]) -> tuple[Value, ...]:
    """``values`` with each `Outputs` replaced by its arrays (for the one-library check)."""
    return tuple([p for v in values for p in (v if type(v) is Outputs else (v,))])


@final
@dataclasses.dataclass(frozen=True, slots=True)
class OutputsDelta:
    """The delta of an `Outputs`: per output its delta, or None (zero). Two
    add slot by slot, as `SplitDelta`'s do.

    >>> import numpy as np
    >>> (OutputsDelta((np.ones(2), None)) + OutputsDelta((np.ones(2), np.ones(1)))).parts[0]
    array([2., 2.])
    """

    parts: tuple[Value | None, ...]
    # As its value's (None for an `Outputs`, (n,) for a `StackedOutputs`), so
    # that the runtime finds no broadcasting to undo.
    shape: tuple[int, ...] | None = None

    def __getitem__(self, i: int) -> OutputsDelta:
        """Member ``i``'s share of a group's delta (the stack's VJP takes it)."""
        return OutputsDelta(tuple([None if p is None else p[i] for p in self.parts]))

    def __add__(self, other: OutputsDelta) -> OutputsDelta:
        parts = tuple(a if b is None else b if a is None else a + b for a, b in zip(self.parts, other.parts))
        return OutputsDelta(parts, self.shape)


@final
class StackedOutputs:
    """The value of a group of operation nodes run as one: per output, the
    members' arrays stacked; member ``i`` reads its `Outputs` as ``[i]``."""

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[Value, ...]) -> None:
        self.parts = parts

    @staticmethod
    def stack(members: list[Outputs]) -> StackedOutputs:
        """The members' `Outputs`, stacked output by output."""
        xp = namespace(members[0][0])
        n = len(members)
        # One concatenation per output (its rows have axes), not stack's Python per array.
        return StackedOutputs(
            tuple(
                [
                    xp.reshape(xp.concat(part, axis=0), (n, *part[0].shape)) if part[0].ndim else xp.stack(part)
                    for part in map(list, zip(*members))
                ]
            )
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.parts[0].shape[0]),)

    def __getitem__(self, i: int) -> Outputs:
        return Outputs([p[i] for p in self.parts])


def _output_rule(value: Outputs, k: int) -> tuple[Value, tuple[Callable[[Value], OutputsDelta]]]:
    """Output ``k`` of an operation node: a view; its delta fills slot ``k``."""
    count = len(value)

    def vjp(g: Value) -> OutputsDelta:
        parts: list[Value | None] = [None] * count
        parts[k] = g
        return OutputsDelta(tuple(parts))

    return value[k], (vjp,)


def _argument_rule(*_: Any) -> Any:
    raise OperandError(
        "an operation's placeholder was evaluated: a cell's argument exists only while the cell is traced (a "
        "layer the cell kept, evaluated after it: return it from the cell instead, as one of its outputs)"
    )


OUTPUT: Final = Primitive("output", _output_rule)
ARGUMENT: Final = Primitive("argument", _argument_rule)


def batch_output(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> tuple[Value, tuple[Vjp, ...]] | None:
    """Output ``k`` of a group of operation nodes (a nested operation's in a
    cell's program, or the scheduler's group of the views of one)."""
    stacked, k = args
    if type(stacked) is not StackedOutputs:
        return None
    count, shape = len(stacked.parts), stacked.shape

    def vjp(g: Value) -> OutputsDelta:
        parts: list[Value | None] = [None] * count
        parts[k] = g
        return OutputsDelta(tuple(parts), shape)

    return stacked.parts[k], (vjp,)
