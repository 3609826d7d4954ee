"""A loom's group called (`group_call`): its program's batching rule over
the rows gathered from the arenas, or, where a step does not batch (a
matrix product by a stack of matrices, a convolution), its calls one by
one as one batched call (`Looped`), so that the loom's other groups still
run batched (`monadl.fold._loom_run`).

Its value is the calls' outputs stacked; its VJPs hand each call its row of
the delta and stack what the calls send their operands (zeros for a call
that sends one none), and add up what they send the weights, call by call.
Each call's VJPs go once they have sent (a call's holds its deltas, a
weight's among them: held for all calls, a 3-D weight's by 300 calls tripled
the peak). Where only some calls got a delta, those calls' VJPs serve them
(`Looped.only`): nothing runs forward twice, but for calls whose VJPs were
spent (the loom's backward runs each pattern of outputs read again where a
group's deltas were not finite). Calls whose outputs differ in shape (by
their data's values: a boolean mask's count) are parted by shape
(`Looped.by_shape`), each part stacked, as the loom holds outputs of
another shape apart (`monadl.fold._loom_arenas`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, final

import numpy as np

from monadl._namespace import index_for, namespace
from monadl.layers._outputs import Outputs, OutputsDelta, StackedOutputs

if TYPE_CHECKING:
    from monadl.fold._loom_arenas import Arenas
    from monadl.fold._loom_schedule import _Planned as Planned

__all__ = ["Looped", "group_call"]


@final
class Looped:
    """A group's calls of ``program``, one by one, on the rows of its first
    ``count`` arguments (its operands, each stacked over the members) and
    the rest as they are (its weights)."""

    __slots__ = ("calls", "count", "positions", "program", "ragged", "read", "rows", "sent", "shared", "value")

    def __init__(self, program: Any, args: tuple[Any, ...], count: int, n: int) -> None:
        self.program = program
        self.shared = args[count:]
        self.rows = args[:count]  # (a call that sends an operand none gets zeros of its row)
        self.count = count
        self.positions = len(args)
        calls = [self._call(i) for i in range(n)]
        outs = [out for out, _ in calls]
        self.calls: list[Any] = [vjps for _, vjps in calls]  # (None: spent)
        kinds = [_kind(out) for out in outs]
        one = kinds.count(kinds[0]) == n
        self.value: Any = _stacked_outputs(outs) if one else None
        self.ragged: list[Any] | None = None if one else outs  # (outputs of several shapes: `by_shape` parts them)
        self.read: Any = None  # (the delta `sent` is for)
        self.sent: list[Any] = []

    def _call(self, i: int) -> Any:
        return self.program(*[a[i] for a in self.rows], *self.shared)

    def vjps(self) -> tuple[Callable[[Any], Any], ...]:
        """Per position, what the calls send it from a delta of the group's outputs."""
        return tuple([partial(self._sent, p) for p in range(self.positions)])

    def only(self, keep: Any) -> Looped:
        """The calls ``keep`` (host indices) alone: their VJPs handed over
        (run again where spent)."""
        other: Looped = object.__new__(Looped)
        other.program, other.shared, other.count, other.positions = (
            self.program,
            self.shared,
            self.count,
            self.positions,
        )
        calls = []
        for i in keep.tolist():
            vjps = self.calls[i]
            calls.append(self._call(i)[1] if vjps is None else vjps)
            self.calls[i] = None
        other.calls = calls
        other.rows = tuple([r[index_for(r, keep)] for r in self.rows])
        other.value, other.ragged, other.read, other.sent = None, None, None, []
        return other

    def by_shape(self) -> list[tuple[Any, Looped]]:
        """Where the calls' outputs differ in shape: per shape, its calls
        (host indices) alone, their outputs stacked as their value."""
        outs = self.ragged
        assert outs is not None
        self.ragged = None
        parts: dict[Any, list[int]] = {}
        for i, out in enumerate(outs):
            parts.setdefault(_kind(out), []).append(i)
        shaped = []
        for members in parts.values():
            keep = np.asarray(members, np.intp)
            part = self.only(keep)
            part.value = _stacked_outputs([outs[i] for i in members])
            shaped.append((keep, part))
        return shaped

    def _sent(self, p: int, delta: Any) -> Any:
        if self.read is not delta:
            self.read, self.sent = delta, self._send(delta)
        g = self.sent[p]
        self.sent[p] = None  # (each position reads it once: the caller holds it now)
        return g

    def _send(self, delta: Any) -> list[Any]:
        """What the calls send each position: per operand the rows stacked,
        per weight the sum, added call by call (one call's weight deltas
        held at a time, as the calls built as nodes)."""
        count = self.count
        rows: list[list[Any]] = [[] for _ in range(count)]
        totals: list[Any] = [None] * (self.positions - count)
        for i, vjps in enumerate(self.calls):
            if vjps is None:
                vjps = self._call(i)[1]
            self.calls[i] = None  # (spent: its deltas go with it)
            mine = delta[i]
            if type(mine) is OutputsDelta and all(q is None for q in mine.parts):
                for column in rows:
                    column.append(None)
                continue
            for p, vjp in enumerate(vjps):
                g = vjp(mine)
                if p < count:
                    rows[p].append(g)
                elif g is not None:
                    k = p - count
                    totals[k] = g if totals[k] is None else totals[k] + g
        sent: list[Any] = [_stacked(column, self.rows[p]) for p, column in enumerate(rows)]
        return sent + totals


def _kind(out: Any) -> Any:
    """A call's outputs' shapes and dtypes (calls of one kind stack)."""
    if type(out) is Outputs:
        return tuple([(o.shape, o.dtype) for o in out])
    return out.shape, out.dtype


def _stacked_outputs(outs: list[Any]) -> Any:
    return StackedOutputs.stack(outs) if type(outs[0]) is Outputs else namespace(outs[0]).stack(outs)


def _stacked(column: list[Any], rows: Any) -> Any:
    """An operand's delta from the calls' (None: zeros of its row; all None: None)."""
    if all(g is None for g in column):
        return None
    xp = namespace(rows)
    return xp.stack([xp.zeros_like(rows[i]) if g is None else g for i, g in enumerate(column)])


def group_call(
    plan: Planned, operands: list[tuple[int | None, Any, bool]], arenas: Arenas, weights: list[Any], n: int
) -> tuple[Any, Any] | Looped:
    """The batching rule of a group's program over ``n`` members' operands:
    rows gathered from the arenas (for data, the members' stacked), then the
    shared weights; where a step does not batch (no rule, or not for these
    operands), the calls one by one as one batched call (`Looped`)."""
    data = arenas.data
    args = [rows if source is None else arenas.take(data[source], rows) for source, rows, _ in operands]
    count = len(args)
    args += [weights[j] for j in plan.weights]
    program = plan.program
    result: tuple[Any, Any] | None = program.batch(tuple(args), (True,) * count + (False,) * len(plan.weights), n)
    if result is None:  # (a step that does not batch: this group's calls one by one, the others' batched)
        return Looped(program, tuple(args), count, n)
    return result
