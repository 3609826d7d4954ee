"""The backward of a loom's node (`monadl.fold._loom_run`): the slots'
deltas into arenas, then the groups by depth in reverse, each one call of
its VJPs on its rows (`_sent`); a group some of whose members got no delta
runs its others again as a group of their own, and one whose members read
different outputs sends an operand no delta from a member whose outputs
read do not reach it (`_feeding`), each pattern of outputs read run alone
where the deltas are not finite (zero rows times an infinite derivative,
``sqrt``'s at 0, are NaN). Calls run one by one go back one by one
(`_backward_one_by_one`)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from monadl._namespace import index_for, namespace
from monadl.errors import NonFiniteError
from monadl.fold._loom_looped import Looped, group_call
from monadl.fold._loom_schedule import _Planned, calls, op_of
from monadl.layers._non_finite import all_finite_deltas, backward_made, finite_delta
from monadl.layers._outputs import OutputsDelta
from monadl.layers._primitives import shown

if TYPE_CHECKING:
    from monadl.fold._loom_run import LoomValue

__all__ = ["backward"]


def backward(value: LoomValue, count: int, checked: bool) -> list[Any]:
    """Each weight's delta (None: not reached), from the slots' deltas."""
    if value.values is not None:
        return _backward_one_by_one(value, count, checked)
    schedule = value.schedule
    arenas = value.arenas
    held = arenas.data  # (per arena, and per shape apart: `monadl.fold._loom_arenas`)
    deltas: list[Any] = [None] * len(held)
    reached: list[Any] = [None] * len(held)
    for a, arena in enumerate(held):
        if arena is not None:
            deltas[a] = namespace(arena).zeros_like(arena)
            reached[a] = np.zeros(len(arena), bool)
    for slot, g in value.deltas.by_slot.items():
        a, row = arenas.row(schedule.arena[slot], schedule.rows[slot])
        deltas[a][row] += g
        reached[a][row] = True
    grads: list[Any] = [None] * count
    for plan, vjps, operands in zip(reversed(value.plans), reversed(value.vjps), reversed(value.operands)):
        parts = [arenas.take(deltas[a], rows) for a, rows in plan.outs]
        seen = [reached[a][rows] for a, rows in plan.outs]
        hit = seen[0] if len(seen) == 1 else np.logical_or.reduce(seen)
        if not hit.any():  # (no member got a delta: none sends one)
            continue
        if len(seen) > 1:  # (an output no member's reader reached sends none, as one call's would)
            parts = [p if s.any() else None for p, s in zip(parts, seen)]
        mixed = len(seen) > 1 and any(s.any() and not (s | ~hit).all() for s in seen)
        feeding = _feeding(plan, seen) if mixed else None
        with np.errstate(divide="ignore", invalid="ignore") if mixed else nullcontext():
            sent = _sent(value, plan, operands, vjps, parts, hit, feeding=feeding)
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
            else:
                if unique and not reached[source][rows].any():  # (a tree's: each output read once; one pass)
                    arenas.put(deltas[source], rows, g)
                else:  # (rows another reader sent a delta to, or rows that repeat)
                    deltas[source] = arenas.add(deltas[source], rows, g, unique)
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
    feeding: list[Any] | None = None,
) -> list[tuple[int | None, Any, bool, Any]]:
    """The deltas a group's members ``hit`` (a mask) send back from their
    outputs' ``parts`` (None: an output none of them sends a delta for):
    per operand read from an arena, (arena, rows, distinct, delta); per
    weight, (None, its number, False, delta). Members not hit run again as a
    group of their own (the others' zero deltas times an infinite
    derivative, sqrt's at 0, would be NaN); ``whole``: the group ran with
    all its members (else always again); ``feeding``: per operand, which
    members' outputs read reach it (`_feeding`), the others' rows no delta."""
    n = plan.n
    if not whole or not hit.all():
        keep = np.flatnonzero(hit)
        vjps, operands, parts, n = _reached_only(value, plan, operands, keep, parts, vjps)
        if feeding is not None:
            feeding = [m[keep] for m in feeding]
    if type(vjps) is Looped:
        vjps = vjps.vjps()
    d = OutputsDelta(tuple(parts), (n,)) if len(parts) > 1 else parts[0]
    sent: list[tuple[int | None, Any, bool, Any]] = []
    for p, (source, rows, unique) in enumerate(operands):
        if source is not None:  # (else data)
            g = vjps[p](d)
            if g is not None:
                if feeding is not None and not feeding[p].all():
                    m = feeding[p]
                    rows, g = rows[m], g[index_for(g, m)]
                sent.append((source, rows, unique, g))
    base = len(plan.operands)
    for i, j in enumerate(plan.weights):
        g = vjps[base + i](d)
        if g is not None:
            sent.append((None, j, False, g))
    return sent


def _feeding(plan: _Planned, seen: list[Any]) -> list[Any]:
    """Per operand of a group whose members read different outputs
    (``seen``: per output, a mask of the members that read it), the members
    whose outputs read reach it (`Program.feeds`): the others' rows of its
    delta are zeros, no delta, and would mark the calls that made it
    reached (their zero rows then times an infinite derivative: NaN)."""
    feeds = plan.program.feeds
    masks = []
    for p in range(len(plan.operands)):
        mask = np.zeros(plan.n, dtype=bool)
        for k in feeds[p]:
            mask |= seen[k]
        masks.append(mask)
    return masks


def _finite(sent: list[tuple[int | None, Any, bool, Any]]) -> bool:
    return all_finite_deltas([g for *_, g in sent])


def _reached_only(
    value: LoomValue, plan: _Planned, operands: list[Any], keep: Any, parts: list[Any], ran: Any
) -> tuple[Any, list[tuple[int | None, Any, bool]], list[Any], int]:
    """A group's members that got a delta (``keep``), run again as a group of
    their own, as they would send deltas alone (those of a group that ``ran``
    call by call, a `Looped`, as they ran): their VJPs, operands, output
    deltas and count."""
    operands = [
        (source, rows[index_for(rows, keep)], unique) for source, rows, unique in operands
    ]  # (data: a device's)
    result = (
        ran.only(keep) if type(ran) is Looped else group_call(plan, operands, value.arenas, value.weights, len(keep))
    )
    vjps = result if type(result) is Looped else result[1]
    return vjps, operands, [None if p is None else p[index_for(p, keep)] for p in parts], len(keep)


def _backward_one_by_one(value: LoomValue, count: int, checked: bool) -> list[Any]:
    schedule = value.schedule
    deltas: list[Any] = [None] * schedule.span
    for slot, g in value.deltas.by_slot.items():
        deltas[slot] = g
    grads: list[Any] = [None] * count
    for (plan, group, row), vjps in zip(reversed(list(calls(schedule))), reversed(value.vjps)):
        first = group.firsts[row]
        outs = deltas[first : first + group.trace.outputs]
        if all(g is None for g in outs):
            continue
        d = OutputsDelta(tuple(outs)) if len(outs) > 1 else outs[0]
        operands = group.member(row)
        for p, x in enumerate(operands):
            if type(x) is int:
                g = vjps[p](d)
                if g is None:
                    continue
                if checked and not finite_delta(g):
                    raise NonFiniteError(backward_made(shown(op_of(group)), schedule.where(group, row)))
                deltas[x] = g if deltas[x] is None else deltas[x] + g
        base = len(operands)
        for i, j in enumerate(plan.weights):
            g = vjps[base + i](d)
            if g is not None:
                grads[j] = g if grads[j] is None else grads[j] + g
    return grads
