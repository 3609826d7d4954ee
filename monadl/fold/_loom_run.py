"""How a Fold batch's loom node runs (the recording: `monadl.fold._loom`;
its schedule, worked out once when the batch is built:
`monadl.fold._loom_schedule`). Its rule (`LOOM`) runs each group
as one `Program.batch` over rows gathered from the arenas (a group with a
step that has no batching rule, call by call: `monadl.fold._loom_looped`),
or every call one by one where that cannot be (batching off,
``check_finite``, shapes that differ within an arena, a group that
failed); its value is read by the slots (`SLOT`), whose deltas it keeps
(`LoomDelta`), and its backward runs the depths in reverse.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Final, final

import numpy as np

from monadl._namespace import all_finite, namespace
from monadl.errors import NonFiniteError, OperandError
from monadl.fold._loom_looped import Looped
from monadl.fold._loom_schedule import Schedule, _Planned
from monadl.layers._layer import Layer
from monadl.layers._non_finite import backward_made, data_held, finite_delta, made
from monadl.layers._outputs import Outputs, OutputsDelta, StackedOutputs, finite_value
from monadl.layers._primitives import Primitive, shown
from monadl.layers._site import site_text
from monadl.runtime.node import failed, where
from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from monadl.fold._loom import _Group
    from monadl.layers._site import Site

__all__ = ["LOOM", "SLOT", "LoomDelta", "Open"]

_log: Final = logging.getLogger("monadl.batching")


# ---- the slots: a call's outputs, read from the loom's value -----------------------------------
def _slot_rule(value: LoomValue, slot: int, depth: int) -> tuple[Any, tuple[Callable[[Any], Any]]]:
    """A slot of the loom's calls (numbered: a call's first slot, plus the
    output's number; and its call's depth): a view of its row; its delta is
    kept by slot."""
    deltas = value.deltas

    def vjp(g: Any) -> LoomDelta:
        deltas.add(slot, g)
        return deltas

    return value.read(slot), (vjp,)


SLOT: Final = Primitive("slot", _slot_rule)


@final
class LoomDelta:
    """The deltas that reads of a loom's slots sent back, by slot. Every read's
    VJP returns this one object, and ``+`` of it with itself is itself (the
    runtime sums a node's deltas: here, once)."""

    __slots__ = ("by_slot", "lock")
    shape: Final = None  # (as its value's: no broadcasting to undo)

    def __init__(self) -> None:
        self.by_slot: dict[int, Any] = {}
        self.lock = threading.Lock()  # (reads may run on the worker pool's threads)

    def add(self, slot: int, g: Any) -> None:
        with self.lock:
            old = self.by_slot.get(slot)
            self.by_slot[slot] = g if old is None else old + g

    def __add__(self, other: LoomDelta) -> LoomDelta:
        assert other is self
        return self

    def finite(self) -> bool:
        return all(finite_delta(g) for g in self.by_slot.values())


# ---- running it --------------------------------------------------------------------------------
@final
class Open:
    """The loom node's parameter while its ``ml.loom()`` block is open (`Schedule` when it ends)."""

    __slots__ = ("site",)

    def __init__(self, site: Site) -> None:
        self.site = site


class _Unbatched(Exception):
    """The schedule cannot run batched (shapes that differ within an arena,
    a group that failed): its calls run one by one."""


@final
class LoomValue:
    """The loom node's value: its calls' outputs (batched: in arenas; one by
    one: per slot), read by the slots, and the deltas the reads send back."""

    __slots__ = ("arenas", "deltas", "operands", "schedule", "values", "vjps", "weights")
    shape: Final = None  # (not an array: the runtime finds no broadcasting to undo, no signature to batch)
    dtype: Final = None

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.arenas: list[Any] = []
        self.values: list[Any] | None = None  # (one by one: per slot)
        self.vjps: list[Any] = []  # (per group batched; per call one by one)
        self.operands: list[Any] = []  # (per group batched: its operands, its data read when it ran)
        self.deltas = LoomDelta()
        self.weights: list[Any] = []  # (their values: a group's reached members run again in the backward)

    def read(self, slot: int) -> Any:
        if self.values is not None:
            return self.values[slot]
        schedule = self.schedule
        return self.arenas[schedule.arena[slot]][schedule.rows[slot]]

    def finite(self) -> bool:
        """(Under ``check_finite`` the calls ran one by one, each checked.)"""
        return True


def _loom_rule(*args: Any) -> tuple[LoomValue, tuple[Callable[[Any], Any], ...]]:
    """The loom node's rule: its weights' values, then its `Schedule`."""
    if type(args[-1]) is Open:  # (an ``ml.loom()`` block still open: no schedule yet)
        raise OperandError(
            f"ml.loom(): a call recorded in the ml.loom() block at {site_text(args[-1].site)} was read while "
            "the block was open (its calls are scheduled when it ends); read its outputs (predict, train, "
            "await) after the block"
        )
    *weights, schedule = args
    value = LoomValue(schedule)
    value.weights = weights
    settings = current_settings()
    checked = settings.check_finite
    if checked or settings.batching is False:
        _one_by_one(value, weights, checked)
    else:
        try:
            _batched(value, weights)
        except _Unbatched as why:
            if _log.isEnabledFor(logging.DEBUG):
                calls = sum(plan.n for plan in schedule.planned)
                where = site_text(schedule.site)
                _log.debug("a loom of %d calls (built at %s) runs its calls one by one: %s", calls, where, why)
            value.arenas, value.vjps, value.operands = [], [], []
            _one_by_one(value, weights, False)
    grads: list[Any] | None = None

    def rule(j: int) -> Callable[[Any], Any]:
        def vjp(delta: LoomDelta) -> Any:
            nonlocal grads
            if grads is None:  # (the first weight's VJP runs the backward for all)
                grads = _backward(value, len(weights), checked)
            return grads[j]

        return vjp

    return value, tuple([rule(j) for j in range(len(weights))])


LOOM: Final = Primitive("loom", _loom_rule, names_errors=True)


def _batched(value: LoomValue, weights: list[Any]) -> None:
    """The schedule's groups by depth, each one call of its program's batching rule."""
    schedule = value.schedule
    arenas: list[Any] = [None] * len(schedule.capacity)
    value.arenas = arenas
    for plan in schedule.planned:
        n = plan.n
        program = plan.program
        try:
            operands = [(s, rows.read() if s is None else rows, u) for s, rows, u in plan.operands]  # (data read now)
            value.operands.append(operands)
            result = _group_call(plan, operands, arenas, weights, n)
        except Exception as exc:  # (one by one: the first call that fails raises its own error)
            raise _Unbatched(f"a group of {n} calls of {program.name} raised {type(exc).__name__}") from None
        if type(result) is Looped:  # (its VJPs: the calls', which a backward of some of them reads again)
            out, vjps = result.value, result
            if _log.isEnabledFor(logging.DEBUG):
                said = f"{n} calls of {program.name} at depth {plan.group.depth} one by one: its step"
                step = "?" if program.declined is None else shown(program.declined.op)
                _log.debug(
                    "a loom (built at %s) runs its %s %s does not batch here", site_text(schedule.site), said, step
                )
        else:
            out, vjps = result
        parts = out.parts if type(out) is StackedOutputs else (out,)
        for (a, start), part in zip(plan.outs, parts):
            arena = arenas[a]
            if arena is None:
                xp = namespace(part)
                arena = arenas[a] = xp.empty((schedule.capacity[a], *part.shape[1:]), part.dtype)
            elif arena.shape[1:] != part.shape[1:] or arena.dtype != part.dtype:
                raise _Unbatched(
                    f"calls give outputs of shapes {arena.shape[1:]} ({arena.dtype}) and {part.shape[1:]} "
                    f"({part.dtype}) to one position of a cell (the latter {program.name}'s)"
                )
            arena[start : start + n] = part
        value.vjps.append(vjps)


def _group_call(
    plan: _Planned, operands: list[tuple[int | None, Any, bool]], arenas: list[Any], weights: list[Any], n: int
) -> tuple[Any, Any] | Looped:
    """The batching rule of a group's program over ``n`` members' operands:
    rows gathered from the arenas (for data, the members' stacked), then the
    shared weights; where a step does not batch (no rule, or not for these
    operands), the calls one by one as one batched call (`Looped`)."""
    args = [rows if source is None else arenas[source][rows] for source, rows, _ in operands]
    count = len(args)
    args += [weights[j] for j in plan.weights]
    program = plan.program
    result: tuple[Any, Any] | None = program.batch(tuple(args), (True,) * count + (False,) * len(plan.weights), n)
    if result is None:  # (a step that does not batch: this group's calls one by one, the others' batched)
        return Looped(program, tuple(args), count, n)
    return result


def _one_by_one(value: LoomValue, weights: list[Any], checked: bool) -> None:
    """The calls one by one (by depth), each as its node would run alone
    (``checked``: ``check_finite``'s checks, its errors naming the call)."""
    schedule = value.schedule
    values: list[Any] = [None] * schedule.span
    value.values = values
    for plan, group, row in _calls(schedule):
        operands = [_operand(values, x, checked) for x in group.members[row]]
        args = (*operands, *[weights[j] for j in plan.weights])
        program = plan.program
        try:
            if checked:
                with np.errstate(all="ignore"):
                    out, vjps = program(*args, called=schedule.where(group, row))
                if not finite_value(out):
                    raise NonFiniteError(made(shown(_op(group)), args, schedule.where(group, row)))
            else:
                out, vjps = program(*args)
        except Exception as exc:  # (the error names the weights' lines too; raised without a local, as compute's)
            raise failed(exc, _op(group), args, schedule.where(group, row), (*operands, *_weights(schedule, plan)))  # noqa: B904
        first = group.firsts[row]
        if type(out) is Outputs:
            values[first : first + len(out)] = out
        else:
            values[first] = out
        value.vjps.append(vjps)


def _weights(schedule: Schedule, plan: _Planned) -> list[Any]:
    return [schedule.weights[j] for j in plan.weights]


def _operand(values: list[Any], x: Any, checked: bool) -> Any:
    """A call's operand, one by one: a slot's value, a constant row's data
    (``checked``: refused with its line if it holds a NaN or an infinity,
    as its own node's check would), or data."""
    kind = type(x)
    if kind is int:
        return values[x]
    if kind is Layer:
        data = x._inputs[0]
        if checked and not all_finite(data):
            raise NonFiniteError(data_held(data, where(x)))
        return data
    return x


def _calls(schedule: Schedule) -> Iterator[tuple[_Planned, _Group, int]]:
    """The calls one by one, group by group (by depth: each after its operands' calls)."""
    for plan in schedule.planned:
        for row in range(plan.n):
            yield plan, plan.group, row


def _op(group: _Group) -> Primitive:
    op = group.trace.op
    assert op is not None
    return op


def _backward(value: LoomValue, count: int, checked: bool) -> list[Any]:
    """Each weight's delta (None: not reached), from the slots' deltas."""
    if value.values is not None:
        return _backward_one_by_one(value, count, checked)
    schedule = value.schedule
    arenas = value.arenas
    deltas: list[Any] = [None] * len(arenas)
    reached: list[Any] = [None] * len(arenas)
    for a, arena in enumerate(arenas):
        if arena is not None:
            deltas[a] = namespace(arena).zeros_like(arena)
            reached[a] = np.zeros(len(arena), bool)
    for slot, g in value.deltas.by_slot.items():
        a, row = schedule.arena[slot], schedule.rows[slot]
        deltas[a][row] += g
        reached[a][row] = True
    grads: list[Any] = [None] * count
    for plan, vjps, operands in zip(reversed(schedule.planned), reversed(value.vjps), reversed(value.operands)):
        n = plan.n
        parts = [deltas[a][start : start + n] for a, start in plan.outs]
        seen = [reached[a][start : start + n] for a, start in plan.outs]
        hit = seen[0] if len(seen) == 1 else np.logical_or.reduce(seen)
        if not hit.any():  # (no member got a delta: none sends one)
            continue
        if len(seen) > 1:  # (an output no member's reader reached sends none, as one call's would)
            parts = [p if s.any() else None for p, s in zip(parts, seen)]
        mixed = len(seen) > 1 and any(s.any() and not (s | ~hit).all() for s in seen)
        with np.errstate(divide="ignore", invalid="ignore") if mixed else nullcontext():
            sent = _sent(value, plan, operands, vjps, parts, hit)
        if mixed and not _finite(sent):
            # Some members read an output that others did not: their zero rows times an infinite
            # derivative (sqrt's at 0) made a NaN. Each pattern of read outputs alone, as one by one.
            code = sum(s.astype(np.intp) << k for k, s in enumerate(seen))
            sent = []
            for c in np.unique(code[hit]).tolist():
                read = [p if c >> k & 1 else None for k, p in enumerate(parts)]
                sent += _sent(value, plan, operands, vjps, read, code == c, whole=False)
        for source, rows, unique, g in sent:
            if source is None:  # (a weight's)
                grads[rows] = g if grads[rows] is None else grads[rows] + g
            elif unique:
                deltas[source][rows] += g
                reached[source][rows] = True
            else:
                np.add.at(deltas[source], rows, g)
                reached[source][rows] = True
    return grads


def _sent(
    value: LoomValue,
    plan: _Planned,
    operands: list[Any],
    vjps: Any,
    parts: list[Any],
    hit: Any,
    whole: bool = True,
) -> list[tuple[int | None, Any, bool, Any]]:
    """The deltas a group's members ``hit`` (a mask) send back from their
    outputs' ``parts`` (None: an output none of them sends a delta for):
    per operand read from an arena, (arena, rows, distinct, delta); per
    weight, (None, its number, False, delta). Members not hit run again as a
    group of their own (the others' zero deltas times an infinite
    derivative, sqrt's at 0, would be NaN); ``whole``: the group ran with
    all its members (else always again)."""
    n = plan.n
    if not whole or not hit.all():
        vjps, operands, parts, n = _reached_only(value, plan, operands, np.flatnonzero(hit), parts, vjps)
    if type(vjps) is Looped:
        vjps = vjps.vjps()
    d = OutputsDelta(tuple(parts), (n,)) if len(parts) > 1 else parts[0]
    sent: list[tuple[int | None, Any, bool, Any]] = []
    for p, (source, rows, unique) in enumerate(operands):
        if source is not None:  # (else data)
            g = vjps[p](d)
            if g is not None:
                sent.append((source, rows, unique, g))
    base = len(plan.operands)
    for i, j in enumerate(plan.weights):
        g = vjps[base + i](d)
        if g is not None:
            sent.append((None, j, False, g))
    return sent


def _finite(sent: list[tuple[int | None, Any, bool, Any]]) -> bool:
    return all(finite_delta(g) for *_, g in sent)


def _reached_only(
    value: LoomValue, plan: _Planned, operands: list[Any], keep: Any, parts: list[Any], ran: Any
) -> tuple[Any, list[tuple[int | None, Any, bool]], list[Any], int]:
    """A group's members that got a delta (``keep``), run again as a group of
    their own, as they would send deltas alone (those of a group that ``ran``
    call by call, a `Looped`, as they ran): their VJPs, operands, output
    deltas and count."""
    operands = [(source, rows[keep], unique) for source, rows, unique in operands]
    result = (
        ran.only(keep) if type(ran) is Looped else _group_call(plan, operands, value.arenas, value.weights, len(keep))
    )
    vjps = result if type(result) is Looped else result[1]
    return vjps, operands, [None if p is None else p[keep] for p in parts], len(keep)


def _backward_one_by_one(value: LoomValue, count: int, checked: bool) -> list[Any]:
    schedule = value.schedule
    deltas: list[Any] = [None] * schedule.span
    for slot, g in value.deltas.by_slot.items():
        deltas[slot] = g
    grads: list[Any] = [None] * count
    for (plan, group, row), vjps in zip(reversed(list(_calls(schedule))), reversed(value.vjps)):
        first = group.firsts[row]
        outs = deltas[first : first + group.trace.outputs]
        if all(g is None for g in outs):
            continue
        d = OutputsDelta(tuple(outs)) if len(outs) > 1 else outs[0]
        operands = group.members[row]
        for p, x in enumerate(operands):
            if type(x) is int:
                g = vjps[p](d)
                if g is None:
                    continue
                if checked and not finite_delta(g):
                    raise NonFiniteError(backward_made(shown(_op(group)), schedule.where(group, row)))
                deltas[x] = g if deltas[x] is None else deltas[x] + g
        base = len(operands)
        for i, j in enumerate(plan.weights):
            g = vjps[base + i](d)
            if g is not None:
                grads[j] = g if grads[j] is None else grads[j] + g
    return grads
