"""Where calls of marked operations are recorded rather than built: the
loom that an ``ml.loom()`` block opened in this context, if any.

`Operation.__call__` asks `RECORDING` first; the loom (`monadl.fold._loom`)
records a call whose operands are its own earlier calls' outputs or data,
and builds any other call's node as outside a block. A function being
traced records nothing (`monadl.layers._tracing`): its calls are steps of
the trace being made.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from monadl.layers._operation import Operation

__all__ = ["MISS", "RECORDING", "Recorder"]


class Recorder(Protocol):
    """What an open ``ml.loom()`` block does with an operation's call: per
    operation, ``recorders`` of calls like ones it recorded before (each
    records one or answers `MISS`: `monadl.fold._loom_recorders`), asked first;
    else ``record``."""

    recorders: dict[Operation[Any, Any], list[Callable[[tuple[Any, ...]], Any]]]

    def record(self, op: Operation[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


MISS: Final = object()
"""A loom's recorder's answer to a call unlike those it records."""

RECORDING: Final[ContextVar[Recorder | None]] = ContextVar("monadl.loom", default=None)
