"""Where calls of marked operations are recorded rather than built: the
loom that an ``ml.loom()`` block opened in this context, if any.

`Operation.__call__` asks `RECORDING` first; the loom (`monadl.fold._loom`)
records a call whose operands are its own earlier calls' outputs or data,
and builds any other call's node as outside a block. A function being
traced records nothing (`monadl.layers._tracing`): its calls are steps of
the trace being made.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from monadl.layers._operation import Operation

__all__ = ["RECORDING", "Recorder"]


class Recorder(Protocol):
    """What an open ``ml.loom()`` block does with an operation's call."""

    def record(self, op: Operation[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


RECORDING: Final[ContextVar[Recorder | None]] = ContextVar("monadl.loom", default=None)
