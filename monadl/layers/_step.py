"""`Step`: one traced layer of an operation's `monadl.layers._program.Program`.

A step names its operands by slots of the program's environment (the node's
operands, the trace's constants, the earlier steps' values), and its
parameters by value, except where a parameter is a data argument of the
call, or a tuple holding some (an index such as ``x[:, d]``): then it reads
that slot (`Step.takes`), so each call's own array is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import itemgetter
from typing import Any, final

from monadl.layers._primitives import Primitive

__all__ = ["Step"]

Value = Any


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One traced layer: its primitive, the slots of its operands, its
    parameters, where it was written (for messages) and, per operand,
    whether a delta must reach it (it leads to a layer or weight operand)."""

    op: Primitive
    refs: tuple[int, ...]
    params: tuple[Any, ...]
    site: Any
    grads: tuple[bool, ...]
    # Per parameter, the slot of the data argument it is, or per item of a tuple parameter (an index) the slot of each.
    takes: tuple[int | tuple[int | None, ...] | None, ...] | None = None

    def parameters(self, env: list[Value]) -> tuple[Any, ...]:
        """The parameters, with the call's data arguments in their places."""
        if self.takes is None:
            return self.params
        return tuple([_taken(p, r, env) for p, r in zip(self.params, self.takes)])

    def stacked_parameters(self, stacked: list[bool]) -> tuple[bool, ...]:
        """Per parameter, whether it reads a group's stacked data argument."""
        if self.takes is None:
            return (False,) * len(self.params)
        return tuple([r is not None and _stacked(r, stacked) for r in self.takes])

    def operands(self) -> Callable[[list[Value]], tuple[Value, ...]]:
        """A fast reader of the step's operands from an environment."""
        if len(self.refs) == 1:
            (r,) = self.refs
            return lambda env: (env[r],)
        if not self.refs:
            return lambda env: ()
        return itemgetter(*self.refs)  # (of two or more: a tuple)


def _taken(p: Any, r: int | tuple[int | None, ...] | None, env: list[Value]) -> Any:
    """A parameter with the call's data arguments in their places (see `Step.takes`)."""
    if r is None:
        return p
    if isinstance(r, int):
        return env[r]
    return tuple([q if s is None else env[s] for q, s in zip(p, r)])


def _stacked(r: int | tuple[int | None, ...], stacked: list[bool]) -> bool:
    """Whether a parameter that reads data arguments (see `Step.takes`) reads a stacked one."""
    if isinstance(r, int):
        return stacked[r]
    return any(s is not None and stacked[s] for s in r)
