"""An operation's program backward (`monadl.layers._program`): its reverse
sweep over the steps' VJPs (`backward`), done once per run for all of the
node's operands (`Sweep`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import Outer, SparseRows, unbroadcast
from monadl.errors import NonFiniteError
from monadl.layers._non_finite import backward_made, finite_delta
from monadl.layers._outputs import OutputsDelta
from monadl.layers._primitives import shown
from monadl.layers._products import OuterRule
from monadl.layers._site import site_text
from monadl.layers._tiles import Tiling, tiling

if TYPE_CHECKING:
    from monadl.layers._program import Program

__all__ = ["Sweep", "backward"]

Value = Any
Vjp = Callable[[Value], Value]
_TILINGS_LIMIT: Final = 256


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
            self.deltas = backward(self.program, self.env, self.vjps, g, self.stacked, self.called)
            self.g = g
        return self.deltas[k]


def backward(
    program: Program,
    env: list[Value],
    vjps: list[tuple[Vjp, ...]],
    g: Value,
    stacked: list[bool] | None = None,
    called: str | None = None,
) -> list[Value | None]:
    """The deltas of ``program``'s node's operands from the delta ``g`` of its value:
    the steps' VJPs in reverse, each share fitted to its operand's shape.
    ``stacked``: per slot, whether it holds a group's stacked values.
    ``called``: see `Program.__call__`.

    Slices (a cell cutting its gate vector) add their deltas into one
    zero buffer of the sliced array, in place, instead of each building a
    buffer of zeros of its own (their VJP) that are then added up."""
    deltas: list[Value | None] = [None] * len(env)
    owned: set[int] = set()  # slots whose delta is a buffer made here (safe to add into)
    if program.multi:
        for o, d in zip(program.outputs, g.parts):
            if d is not None:
                d = _unstacked(d, o, stacked)
                deltas[o] = d if deltas[o] is None else deltas[o] + d
    else:
        deltas[program.outputs[0]] = _unstacked(g, program.outputs[0], stacked)
    first = len(env) - len(program.steps)
    assigned: dict[int, set[int]] = {}  # slots whose slices never overlap: slice steps not written yet
    for j in range(len(program.steps) - 1, -1, -1):
        if first + j in assigned:  # its slices are done: what none wrote is zero
            _fill(program, deltas, first + j, assigned.pop(first + j), stacked)
        d = deltas[first + j]
        if d is None or not program.live[j]:
            continue
        deltas[first + j] = None  # spent: its memory can go
        if type(d) is SparseRows:
            d = d.to_dense()
        step, rules = program.steps[j], vjps[j]
        index = program.slices[j]
        r = step.refs[0] if step.refs else -1
        if index is not None and step.grads[0] and (deltas[r] is None or type(deltas[r]) is type(env[r])):
            # A slice: its delta goes into one buffer, in place.
            lifted = stacked is not None and stacked[r]
            if lifted:
                index = (slice(None), *index)
            if r not in owned:
                value = env[r]
                xp = namespace(value)
                tiled = None if deltas[r] is not None else _tiling(program, r, value.shape, lifted)
                if tiled:  # every element gets written: no zeros first
                    buffer = xp.empty(value.shape, dtype=value.dtype)
                else:
                    buffer = xp.zeros(value.shape, dtype=value.dtype)
                    if deltas[r] is not None:
                        buffer += deltas[r]
                if tiled is not None:
                    assigned[r] = set(program.tiles[r]) if tiled else set()
                deltas[r] = buffer
                owned.add(r)
            target: Any = deltas[r]
            written = assigned.get(r)
            if written is not None:  # its own region, written once: assigned, not added
                target[index] = d
                written.discard(j)
            else:
                target[index] += d
            continue
        for p, r in enumerate(step.refs):
            if not step.grads[p] or p >= len(rules):  # (stop_gradient has no rules)
                continue
            try:
                rule = rules[p]
                share: Any
                if type(rule) is OuterRule and r in program.factors and type(d) is np.ndarray:
                    # A weight's delta from a few rows, kept as factors, as the backward keeps
                    # an unmarked product's: one product per weight when it is stepped.
                    share = Outer(rule.left, d)
                else:
                    share = rule(d)
                if share is None:  # (a nested operation's operand that no delta reaches)
                    continue
                value = env[r]
                shape = getattr(value, "shape", ())
                if type(share) is not OutputsDelta and getattr(share, "shape", ()) != shape:
                    share = unbroadcast(share, shape)
            except NonFiniteError:  # (a nested operation's step: named already)
                raise
            except Exception as exc:
                exc.add_note(f"monadl: in the backward of {shown(step.op)} at {site_text(step.site)}")
                raise
            if called is not None and not finite_delta(share):
                raise NonFiniteError(backward_made(shown(step.op), program._site(step, called)))
            deltas[r] = share if deltas[r] is None else deltas[r] + share  # (a new array: still owned)
    for r, unwritten in assigned.items():  # (operands and constants that were sliced)
        _fill(program, deltas, r, unwritten, stacked)
    return deltas[: program.size]


def _tiling(program: Program, r: int, shape: tuple[int, ...], stacked: bool) -> Tiling:
    """How slot ``r``'s slices cut it (see `tiling`), for its shape (a member's when stacked)."""
    readers = program.tiles.get(r)
    if readers is None:
        return None
    key = (r, shape[1:] if stacked else shape)
    if key in program.tilings:
        return program.tilings[key]
    if len(program.tilings) >= _TILINGS_LIMIT:
        program.tilings.clear()
    found = program.tilings[key] = tiling([index for j in readers if (index := program.slices[j]) is not None], key[1])
    return found


def _fill(
    program: Program, deltas: list[Value | None], r: int, unwritten: set[int], stacked: list[bool] | None
) -> None:
    """Zeros where the slices of slot ``r`` that got no delta would have written theirs."""
    target: Any = deltas[r]
    for j in unwritten:
        index = program.slices[j]
        assert index is not None
        target[(slice(None), *index) if stacked is not None and stacked[r] else index] = 0


def _unstacked(d: Value, o: int, stacked: list[bool] | None) -> Value:
    """The delta of output slot ``o`` for the steps that made it: a group's
    output that no stacked operand reaches was one value broadcast to every
    member, so its members' deltas add up."""
    if stacked is None or stacked[o] or type(d) is OutputsDelta:
        return d
    if type(d) is SparseRows:
        d = d.to_dense()
    return namespace(d).sum(d, axis=0)
