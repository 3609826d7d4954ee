"""A loom's group whose program has a step with no batching rule (a matrix
product by a stack of matrices, a convolution): its calls run one by one,
as one batched call (`looped`), so that the loom's other groups still run
batched (`monadl.fold._loom_run`).

Its value is the calls' outputs stacked; its VJPs hand each call its row of
the delta and stack what the calls send their operands (zeros for a call
that sends one none), and add up what they send the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monadl._namespace import namespace
from monadl.layers._outputs import Outputs, OutputsDelta, StackedOutputs

__all__ = ["looped"]


def looped(program: Any, args: tuple[Any, ...], count: int, n: int) -> tuple[Any, tuple[Callable[[Any], Any], ...]]:
    """``program`` called per member on the rows of ``args``' first
    ``count`` (its operands, each stacked over the ``n`` members) and the
    rest as they are (its weights): the batched call's value and VJPs."""
    shared = args[count:]
    calls = [program(*[a[i] for a in args[:count]], *shared) for i in range(n)]
    outs = [out for out, _ in calls]
    value: Any = StackedOutputs.stack(outs) if type(outs[0]) is Outputs else namespace(outs[0]).stack(outs)
    cache: list[Any] = [None, None]  # (the delta last read, and what the members sent for it)

    def member_deltas(delta: Any) -> list[list[Any]]:
        """Per member, what its VJPs send (run once for all positions)."""
        if cache[0] is not delta:
            sent = []
            for i, (_, vjps) in enumerate(calls):
                mine = delta[i]
                if type(mine) is OutputsDelta and all(p is None for p in mine.parts):
                    sent.append([None] * len(vjps))
                else:
                    sent.append([vjp(mine) for vjp in vjps])
            cache[:] = [delta, sent]
        found: list[list[Any]] = cache[1]
        return found

    def operand(p: int) -> Callable[[Any], Any]:
        def vjp(delta: Any) -> Any:
            gs = [s[p] for s in member_deltas(delta)]
            if all(g is None for g in gs):
                return None
            rows = args[p]
            xp = namespace(rows)
            return xp.stack([xp.zeros_like(rows[i]) if g is None else g for i, g in enumerate(gs)])

        return vjp

    def weight(p: int) -> Callable[[Any], Any]:
        def vjp(delta: Any) -> Any:
            total = None
            for s in member_deltas(delta):
                g = s[p]
                if g is not None:
                    total = g if total is None else total + g
            return total

        return vjp

    return value, tuple([operand(p) if p < count else weight(p) for p in range(len(args))])
