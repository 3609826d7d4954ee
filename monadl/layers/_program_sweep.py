"""One run of an operation's program backward (`monadl.layers._program`):
its reverse sweep, done once for all of the node's operands."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

if TYPE_CHECKING:
    from monadl.layers._program import Program

__all__ = ["Sweep"]

Value = Any
Vjp = Callable[[Value], Value]


@final
class Sweep:
    """One run's reverse sweep, done once when the first operand's VJP is
    called, shared by the others (the runtime calls them one after another
    with the same delta)."""

    __slots__ = ("called", "deltas", "env", "g", "program", "stacked", "vjps")

    def __init__(
        self,
        program: Program,
        env: list[Value],
        vjps: list[tuple[Vjp, ...]],
        stacked: list[bool] | None,
        called: str | None,
    ) -> None:
        self.program = program
        self.env = env
        self.vjps = vjps
        self.stacked = stacked
        self.called = called
        self.g: Value = None
        self.deltas: list[Value | None] | None = None

    def rules(self) -> tuple[Vjp, ...]:
        return tuple([self._rule(k) for k in range(self.program.size)])

    def _rule(self, k: int) -> Vjp:
        return lambda g: self.delta(k, g)

    def delta(self, k: int, g: Value) -> Value:
        """Operand ``k``'s delta; None where none reaches it (it feeds only
        outputs the graph did not use, as an unmarked function's unused
        layers are never reached: no gradient, no step)."""
        if self.deltas is None or self.g is not g:
            self.deltas = self.program.backward(self.env, self.vjps, g, self.stacked, self.called)
            self.g = g
        return self.deltas[k]
