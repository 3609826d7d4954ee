"""Batching as a rewrite into ordinary records (the signatures that group
nodes: `monadl.runtime.schedule.batched_signature`).

Per group of ``n`` members that ran as one kernel (`group_records`):

* per batched operand position, either a *gather* record, when every
  member's operand is a member of an earlier group (a Tree-LSTM's children):
  its value the rows of those groups' outputs taken by index (or one
  group's whole output as it is: no copy), its VJP per source group one
  scatter of the delta's rows into that group's `Gather`; or else a
  *stack* record: the members' operands stacked, its VJPs ``g[i]`` (views)
  back to each member's operand;
* one *group* record: the batching rule on the gathered, stacked and shared
  operands; a shared weight's delta is summed over the group inside the rule
  (for a matrix product, one ``X_cat.T @ dY``; in the merged runs of
  `monadl.runtime.schedule.fibers`, its factors ``X_cat`` and ``dY``, an
  `Outer`, multiplied once for all runs when the weight is released);
* per member, its place (`Place`: the group's record and its row) in the
  evaluation's `Records`, and a record only when something reads it: a
  consumer that runs alone, a root, a later graph
  (`monadl.runtime.evaluation.Records.__missing__`). Such a record's value is
  ``out[i]`` (a view), it holds the group, and its VJP puts its delta into
  the group's `Gather`. The gather records read the group's output by the
  places, so a value or delta that goes group to group costs no per-member
  record: `Gather` sums its parts once, when the backward reaches the group
  (members' records and gathers come after it in insertion order, so they
  are reached first).

Where only some members got a delta, the group's operand records send back
theirs alone (`_narrow`), and a delta that the others' zero rows made not
finite is made again from the members that got one
(`monadl.runtime.schedule.batched_again`).

So the one node backward (`monadl.runtime.backward`) (its sweep, its counted
release, the worker pool's release) back-propagates a batched graph
unchanged, and reference counts stay exact: each record is held once per
record that lists it as an input; a group by its gather records and by its
members' records, once made, so that it is released in the counted release
after all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import is_not, itemgetter
from typing import Any

import numpy as np

from monadl._namespace import _HOST, all_finite, namespace
from monadl.deltas import Outer
from monadl.layers._non_finite import finite_delta
from monadl.layers._operands import NUMBERS, Numbers, cast_numbers, member_float_dtype
from monadl.layers._outputs import Outputs, OutputsDelta, StackedOutputs
from monadl.layers._program import Program
from monadl.runtime.evaluation import Record
from monadl.runtime.node import host_integers
from monadl.runtime.schedule.batched_again import Again
from monadl.runtime.schedule.batched_gather import Gather
from monadl.runtime.schedule.batched_groups import Groups
from monadl.runtime.schedule.batched_operands import PRODUCTS, Operand, factor_products

__all__ = [
    "Operand",
    "Outer",
    "batchable",
    "cast_scalars",
    "differs",
    "group_records",
    "number_columns",
    "stack",
    "stack_index",
]


def group_records(
    groups: Groups,
    members: list[Any],
    result: Any,
    operands: list[Operand],
    args: list[Any],
    rule: Callable[..., Any],
    batched: tuple[bool, ...],
    scalars: tuple[bool | None, ...] | None,
) -> None:
    """The records of a group that ran: ``result`` is its ``rule``'s (called
    with ``batched`` and, for an operation's program, ``scalars``: run again
    on some members, `Again`), ``operands`` say where each operand came from
    and ``args`` hold their values (gathered, stacked or shared); ``groups``
    learns each member's place in the group's output."""
    records, record = groups.records, Record
    out, vjps = result
    n = len(members)
    first = members[0]
    ins: list[Record | None] = []
    for operand, value in zip(operands, args):
        rec = operand.rec
        if operand.sources is not None:
            rec = groups.gather_record(value, operand.sources, first)
        elif operand.stacked is not None:
            needs = False
            for r in operand.stacked:
                if r is not None:
                    r.refcount += 1
                    needs = needs or r.needs_grad
            rec = record(value, _getters(n) if needs else None, tuple(operand.stacked), needs, first, True)
            records[rec] = rec
        if rec is not None:
            rec.refcount += 1
        ins.append(rec)
    needs = bool(vjps) and any(r is not None and r.needs_grad for r in ins)  # (no rules: stop_gradient)
    if needs and first._op.name in PRODUCTS:
        vjps = factor_products(vjps, operands, args, groups.outer)
    group = record(out, None, tuple(ins), needs, first, False)
    records[group] = group
    if needs:
        groups.sinks[group] = Gather(out)
        again = Again(rule, batched, scalars, groups.outer, args, operands, first, n)
        group.vjps = tuple(
            [_resolving(v, r, o, groups, again, p) for p, (v, r, o) in enumerate(zip(vjps, ins, operands))]
        )
    # The members' values are rows of ``out``; a member gets a record (holding
    # the group) only when something reads it (`Records`): here, its place.
    part: tuple[Any, ...] | None
    if type(out) is StackedOutputs:
        outputs = Outputs(tuple([p[0] for p in out.parts])).signature()
        assert outputs is not None  # (rows of arrays)
        part = (len(outputs), *outputs)  # (as `signature` keys a member's outputs: their count, then each)
    else:
        row = out[0]  # (as a member's record reads its row: the same type, for one signature)
        part = (type(row), row.shape, row.dtype)
    groups.where.update(zip(members, zip(repeat(group), range(n), repeat(part))))  # (the places made in C)


def batchable(op: Any, kinds: set[type], operands: list[Any], batched: list[bool]) -> bool:
    """Operands of one array library (else the members run one by one: the
    first that fails raises the usual error at its line); their dtypes were
    made each member's by `cast_scalars`."""
    if not any(batched):  # the members compute the same thing: nothing to stack
        return False
    if StackedOutputs in kinds or Outputs in kinds:  # operation nodes' outputs: the kinds of their arrays
        # (an `Outputs`: one node's that every member reads, as a shared weight)
        parts = {type(p) for a in operands if type(a) in _OUTPUTS for p in (a if type(a) is Outputs else a.parts)}
        kinds = (kinds - _OUTPUTS) | parts
    foreign = kinds - _HOST
    if foreign and (len(foreign) > 1 or kinds - NUMBERS - foreign):
        # (an operation's host integers, its indices, may go with one other library's arrays)
        indices = type(op.rule) is Program and kinds - NUMBERS - foreign == {np.ndarray}
        if not indices or not all(host_integers(a) for a in operands if type(a) is np.ndarray):
            return False
    return True


_OUTPUTS = frozenset({Outputs, StackedOutputs})


def cast_scalars(args: list[Any], batched: list[bool], arity: int, scalars: list[bool | None], start: int = 0) -> bool:
    """Cast in place the operands of a group that one member's node would
    cast (`monadl.layers._operands.member_float_dtype`: a NumPy float, a 0-d
    weight, a group's 0-d values stacked, beside a float array of another
    dtype, or beside a 0-d tensor): batched, NumPy would promote the group
    to another dtype. ``scalars``: per operand, whether its members are
    numbers, NumPy scalars that are data (not layers' values). False where
    a member would raise (two float arrays of different dtypes) or its
    dtype is unknown. ``start``: the first operand cast
    (`monadl.layers._primitives.Primitive.floats_from`)."""
    cast = member_float_dtype(args[start:arity], batched[start:arity], scalars[start:arity])
    if cast is None:
        return False
    args[start:arity] = cast
    return True


def stack(values: list[Any]) -> Any:
    """The members' arrays along a new leading axis: one concatenation (no
    per-array Python of ``stack``) where they have axes."""
    first = values[0]
    xp = namespace(first)
    if getattr(first, "ndim", 0):
        return xp.reshape(xp.concat(values, axis=0), (len(values), *first.shape))
    return xp.stack(values)


def stack_index(column: list[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The members' index tuples (a parameter, ``h[src, 0]``'s) as one: each
    array in it that is not one object in all of them stacked along a new
    leading axis; None where all are the first member's. Their signature held
    only the arrays' shapes and dtypes (and the other items' values): read
    as one, every member would take the first member's rows."""
    first = column[0]
    items: list[Any] = []
    for j, q in enumerate(first):
        if hasattr(q, "shape"):
            arrays = [index[j] for index in column]
            if any(map(is_not, arrays, repeat(q))):
                q = stack(arrays)
        items.append(q)
    return tuple(items) if any(map(is_not, items, first)) else None


_GETTERS: list[tuple[itemgetter[Any], ...]] = [()]


def _getters(n: int) -> tuple[itemgetter[Any], ...]:
    """The VJPs of a stack of ``n``: member ``i`` gets ``g[i]`` (a view).
    One tuple of getters, grown to the largest group, cut to ``n`` (a tuple
    per size held every size's getters: groups of up to n members of varying
    sizes held about n * n / 2 of them, a soak test's finding)."""
    found = _GETTERS[0]
    if len(found) < n:
        found = _GETTERS[0] = found + tuple(itemgetter(i) for i in range(len(found), n))
    return found if len(found) == n else found[:n]


def _resolving(
    vjp: Callable[[Any], Any], rec: Record | None, operand: Operand, groups: Groups, again: Again, p: int
) -> Callable[[Any], Any]:
    """A group VJP (of operand ``p``), reading its delta from the group's
    `Gather`; where only some members got a delta, ``rec`` (the operand's
    gather or stack record) is narrowed to send back theirs alone
    (`_narrow`), and where the delta it makes is not finite, it is the
    members' that got one, run again as a group of their own (`Again`)."""

    def resolved(delta: Any) -> Any:
        if type(delta) is Gather:
            dense = delta.dense()
            if delta.reached is None and delta.seen is None:
                return vjp(dense)
            reached = delta.reached if delta.seen is None else again.reaching(p, delta)
            parts = None if delta.seen is None or rec is None else again.reaching_parts(p, delta)
            if parts is not None and rec is not None:  # (operation nodes: each output from its own members)
                _narrow_parts(rec, operand, parts, groups)
            elif reached is not None and rec is not None:
                _narrow(rec, operand, reached, groups)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                g = vjp(dense)
            if g is None or _finite(g):
                return g
            return again.delta(p, delta, g)
        return vjp(delta)

    return resolved


def _finite(g: Any) -> bool:
    """`finite_delta`, an `Outer`'s factors read first: finite factors make
    a finite product (but for an overflow, which the product then shows),
    and it is multiplied once, when the weight is released, not here too
    (a variable-length LSTM's groups, whose members read different outputs:
    1.2x a step with the product made for the check)."""
    if type(g) is Outer and all(map(all_finite, g.lefts)) and all(map(all_finite, g.rights)):
        return all(map(finite_delta, g.others))
    return finite_delta(g)


def _narrow(rec: Record, operand: Operand, reached: Any, groups: Groups) -> None:
    """Where only the members ``reached`` (a host mask) of a group got a
    delta, its operand's record ``rec`` sends back their rows of the
    operand's delta alone: the rest are zeros, which would reach the
    members' operands (and the weights behind them) as a delta they never
    got, and a step. A record shared by all members is left as it is: it
    gets a delta when some member got one."""
    if operand.sources is not None:
        groups.narrow(rec, operand.sources, reached)
    elif operand.stacked is not None and rec.vjps is not None:
        rec.vjps = tuple([g if hit else _nothing for g, hit in zip(rec.vjps, reached.tolist())])


def _narrow_parts(rec: Record, operand: Operand, masks: list[Any], groups: Groups) -> None:
    """`_narrow` for an operand of operation nodes with several outputs:
    output ``k`` gets the delta of the members ``masks[k]`` alone (None:
    of none), as alone a member whose outputs read do not reach it sends it
    none (`Again.reaching_parts`)."""
    if operand.sources is not None:
        groups.narrow_parts(rec, operand.sources, masks)
    elif operand.stacked is not None and rec.vjps is not None:
        n = len(rec.vjps)
        kept = zip(*[[False] * n if m is None else m.tolist() for m in masks])
        rec.vjps = tuple([_outputs_kept(g, keep) for g, keep in zip(rec.vjps, kept)])


def _outputs_kept(vjp: Callable[[Any], Any], keep: tuple[bool, ...]) -> Callable[[Any], Any]:
    """A member's VJP of an `OutputsDelta` (its share of the stack's) with
    the outputs not in ``keep`` left None: no delta."""
    if not any(keep):
        return _nothing

    def kept(delta: Any) -> Any:
        got = vjp(delta)
        if got is None:
            return None
        return OutputsDelta(tuple([d if k < len(keep) and keep[k] else None for k, d in enumerate(got.parts)]))

    return kept


def _nothing(delta: Any) -> None:
    """The VJP of a member's operand where the member got no delta."""
    return None


def differs(x: Any, x0: Any) -> bool:
    """Whether a member's plain number is not ``x0``'s: unequal, NaN, or a
    zero that may be the other's negative (``-0.0 == 0.0``)."""
    return x is not x0 and (x != x0 or not x)


def number_columns(
    args: list[Any], numbers: list[int], batched: list[bool], arity: int, operation: bool, kinds: set[type]
) -> bool:
    """Make the members' numbers at ``numbers`` (lists in ``args``) columns:
    for an operation, `Numbers` that its program casts step by step; else
    arrays of the dtype that each member's number computes in beside the
    node's other operands (`cast_numbers`: a Python number beside a float32
    array computes in float32), their type added to ``kinds``. False where
    they cannot be (an integer beyond int64, or beyond that dtype; no dtype
    decided): the members then group by value."""
    try:
        for p in numbers:
            args[p] = Numbers(args[p], type(args[p][0]))
    except OverflowError:
        return False
    if operation:
        return True
    cast = cast_numbers(args[:arity], batched[:arity])
    if cast is None:
        return False
    args[:arity] = cast
    kinds.update(type(args[p]) for p in numbers)
    return True
