"""How a Fold batch's loom node runs (the recording: `monadl.fold._loom`;
its schedule, worked out once when the batch is built:
`monadl.fold._loom_schedule`). Its rule (`LOOM`) runs each group
as one `Program.batch` over rows gathered from the arenas (a group whose
members' operands differ in shape: one per pattern of shapes,
`monadl.fold._loom_arenas`; a group with a step that has no batching
rule, call by call: `monadl.fold._loom_looped`), or every call one by one
where that cannot be (batching off, ``check_finite``, a group that
failed); its value is read by the slots (`SLOT`), whose deltas it keeps
(`LoomDelta`), and its backward runs the depths in reverse.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final

import numpy as np

from monadl._namespace import all_finite, index_for
from monadl.errors import NonFiniteError, OperandError
from monadl.fold._loom_arenas import Arenas
from monadl.fold._loom_backward import backward
from monadl.fold._loom_looped import Looped, group_call
from monadl.fold._loom_schedule import MixedData, Schedule, _Planned, calls, op_of
from monadl.layers._layer import Layer
from monadl.layers._non_finite import data_held, finite_delta, made
from monadl.layers._outputs import Outputs, StackedOutputs, finite_value
from monadl.layers._primitives import Primitive, shown
from monadl.layers._site import site_text
from monadl.runtime.node import failed, one_library, where
from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
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


@final
class _Unbatched(Exception):
    """The schedule cannot run batched (a group failed): its calls run one
    by one, the first that fails raising its own error."""


@final
class LoomValue:
    """The loom node's value: its calls' outputs (batched: in arenas; one by
    one: per slot), read by the slots, and the deltas the reads send back."""

    __slots__ = ("arenas", "deltas", "operands", "plans", "schedule", "values", "vjps", "weights")
    shape: Final = None  # (not an array: the runtime finds no broadcasting to undo, no signature to batch)
    dtype: Final = None

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.arenas = Arenas(schedule.capacity, schedule.gathers)
        self.values: list[Any] | None = None  # (one by one: per slot)
        self.plans: list[_Planned] = []  # (batched: per call of a group's, or of a shape's part of one, as it ran)
        self.vjps: list[Any] = []  # (per call batched; per call one by one)
        self.operands: list[Any] = []  # (per call batched: its operands where held, its data read when it ran)
        self.deltas = LoomDelta()
        self.weights: list[Any] = []  # (their values: a group's reached members run again in the backward)

    def read(self, slot: int) -> Any:
        if self.values is not None:
            return self.values[slot]
        schedule = self.schedule
        arenas = self.arenas
        a, row = arenas.row(schedule.arena[slot], schedule.rows[slot])
        return arenas.data[a][row]

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
        except (_Unbatched, MixedData) as why:
            value.arenas, value.plans, value.vjps, value.operands = Arenas([]), [], [], []
            _one_by_one(value, weights, False)  # (the first call that fails raises its own error)
            if type(why) is MixedData:  # (the user's data of two array libraries at one position: as their nodes)
                _log.debug(
                    "a loom (built at %s) runs its calls one by one: data of two array libraries at one "
                    "position of a group",
                    site_text(schedule.site),
                )
            else:
                _log.warning(
                    "a loom of %d calls (built at %s) runs its calls one by one, at several times its batched time: "
                    "%s, where each of its calls alone did not (a batching rule's fault: please report it)",
                    sum(plan.n for plan in schedule.planned),
                    site_text(schedule.site),
                    why,
                )
    grads: list[Any] | None = None

    def rule(j: int) -> Callable[[Any], Any]:
        def vjp(delta: LoomDelta) -> Any:
            nonlocal grads
            if grads is None:  # (the first weight's VJP runs the backward for all)
                grads = backward(value, len(weights), checked)
            return grads[j]

        return vjp

    return value, tuple([rule(j) for j in range(len(weights))])


LOOM: Final = Primitive("loom", _loom_rule, names_errors=True)


def _batched(value: LoomValue, weights: list[Any]) -> None:
    """The schedule's groups by depth, each one call of its program's
    batching rule (one per pattern of its members' operands' shapes)."""
    schedule = value.schedule
    arenas = value.arenas
    for plan in schedule.planned:
        program = plan.program
        try:
            operands = [(s, rows.read() if s is None else rows, u) for s, rows, u in plan.operands]  # (data read now)
        except MixedData:  # (the user's data: each call one by one, refused as its node would be where it mixes)
            raise
        except Exception as exc:
            raise _Unbatched(f"a group of {plan.n} calls of {program.name} raised {type(exc).__name__}") from None
        for part, held, members in arenas.split(plan, operands):
            n = part.n
            try:
                result = group_call(part, held, arenas, weights, n)
            except Exception as exc:  # (one by one: the first call that fails raises its own error)
                raise _Unbatched(f"a group of {n} calls of {program.name} raised {type(exc).__name__}") from None
            if type(result) is not Looped:
                _kept(value, plan, part, held, members, *result)
                continue
            if _log.isEnabledFor(logging.DEBUG):
                said = f"{n} calls of {program.name} at depth {plan.group.depth} one by one: its step"
                step = "?" if program.declined is None else shown(program.declined.op)
                _log.debug(
                    "a loom (built at %s) runs its %s %s does not batch here", site_text(schedule.site), said, step
                )
            if result.value is not None:  # (its VJPs: the calls', which a backward of some of them reads again)
                _kept(value, plan, part, held, members, result.value, result)
                continue
            for some, looped in result.by_shape():  # (outputs whose shapes the calls' data set: a mask's count)
                mine = [(s, rows[index_for(rows, some)], u) for s, rows, u in held]  # (data: a device's)
                whose = some if members is None else members[some]
                _kept(value, plan, part.part(len(some), mine), mine, whose, looped.value, looped)
    if (arenas.split_groups or len(arenas.data) > arenas.count) and _log.isEnabledFor(logging.DEBUG):
        done = [f"holds outputs of {len(arenas.data) - arenas.count} more shapes apart from their arenas' first"]
        if arenas.split_groups:
            done.append(
                f"ran {arenas.split_groups} groups as {arenas.split_calls} batched calls, one per pattern of "
                "their operands' shapes"
            )
        _log.debug("a loom (built at %s) %s", site_text(schedule.site), " and ".join(done))


def _kept(value: LoomValue, plan: _Planned, part: _Planned, held: list[Any], members: Any, out: Any, vjps: Any) -> None:
    """A call of ``plan``'s group (``part``: of its ``members``, None: all)
    ran over ``held``: its outputs ``out`` into the arenas, and what its
    backward reads kept (where its outputs are held apart, on a part of its own)."""
    arenas = value.arenas
    parts = out.parts if type(out) is StackedOutputs else (out,)
    outs = [
        arenas.write(a, rows if members is None else rows.start + members, p) for (a, rows), p in zip(plan.outs, parts)
    ]
    if part is plan and any(held_in != a for (held_in, _), (a, _) in zip(outs, plan.outs)):
        part = plan.part(plan.n, held)
    if part is not plan:
        part.outs = outs
    value.plans.append(part)
    value.operands.append(held)
    value.vjps.append(vjps)


def _one_by_one(value: LoomValue, weights: list[Any], checked: bool) -> None:
    """The calls one by one (by depth), each as its node would run alone
    (``checked``: ``check_finite``'s checks, its errors naming the call)."""
    schedule = value.schedule
    values: list[Any] = [None] * schedule.span
    value.values = values
    for plan, group, row in calls(schedule):
        operands = [_operand(values, x, checked) for x in group.member(row)]
        args = (*operands, *[weights[j] for j in plan.weights])
        program = plan.program
        try:
            if not all(type(a) is np.ndarray for a in args):  # (as its node would: one library, a host's indices)
                args = one_library(op_of(group), args, schedule.where(group, row))
            if checked:
                with np.errstate(all="ignore"):
                    out, vjps = program(*args, called=schedule.where(group, row))
                if not finite_value(out):
                    raise NonFiniteError(made(shown(op_of(group)), args, schedule.where(group, row)))
            else:
                out, vjps = program(*args)
        except Exception as exc:  # (the error names the weights' lines too; raised without a local, as compute's)
            raise failed(exc, op_of(group), args, schedule.where(group, row), (*operands, *_weights(schedule, plan)))  # noqa: B904
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
