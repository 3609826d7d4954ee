"""What the interpreter (`monadl.runtime.interpret`) asks of its driver
(`monadl.runtime.drive`), besides an awaitable to await in its own task."""

from __future__ import annotations

from typing import Any, Final

from monadl.runtime import frames as F

__all__ = ["CHECKPOINT", "NEXT", "Spawn", "Steps"]

CHECKPOINT: Final = object()
"""Yielded to the driver: give the event loop a turn, then resume."""

NEXT: Final = object()
"""Yielded to the driver when no fiber can run: send back the next completion
(``(fiber, ok, result)``; ``ok`` None: that fiber's coroutine step awaits
something foreign, `monadl.runtime.stepping.step_each`)."""


class Spawn:
    """Yielded to the driver: await ``awaitable`` in a task, report it for ``fiber``."""

    __slots__ = ("awaitable", "fiber")

    def __init__(self, fiber: F.Fiber, awaitable: Any) -> None:
        self.fiber = fiber
        self.awaitable = awaitable


class Steps:
    """Yielded to the driver: step these fibers' direct-style coroutines
    (``(fiber, coroutine, sending, context)``), one after another in a task, each
    reported for its fiber (`monadl.runtime.stepping.step_each`). Once the
    fibers that can run have stopped, the steps they asked for go as one: a
    task each cost more than most steps (which return at once, asking for
    layers)."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[F.Fiber, Any, Any, Any]]) -> None:
        self.items = items
