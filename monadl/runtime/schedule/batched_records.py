"""Batching as a rewrite into ordinary records, and the signatures that group nodes.

Per group of ``n`` members that ran as one kernel (`group_records`):

* per batched operand position, a *stack* record: its value the members'
  operands stacked (or, when they are the members of an earlier group in
  order, that group's output as it is: no copy), its VJPs ``g[i]`` (views)
  back to each member's operand;
* one *group* record: the batching rule on the stacked and shared operands;
  a shared weight's delta is summed over the group inside the rule (for a
  matrix product, one ``X_cat.T @ dY``);
* per member, a record whose value is ``out[i]`` (a view) and whose VJP puts
  its delta into the group's `_Gather`, which stacks the members' deltas once,
  when the backward reaches the group (members come after it in insertion
  order, so they are reached first; in the counted release, members hold the
  group): no O(n^2) accumulation, zeros only for members without a delta.

So the one node backward (`monadl.runtime.backward`) (its sweep, its counted
release, the worker pool's release) back-propagates a batched graph
unchanged, and reference counts stay exact: each record is held once per
record that lists it as an input.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any, Final

import numpy as np

from monadl._namespace import _HOST, namespace
from monadl.deltas import SparseRows
from monadl.layers._layer import Layer
from monadl.layers._program import Outputs, StackedOutputs
from monadl.layers._weight import Weight
from monadl.runtime.evaluation import Record

__all__ = ["NUMBERS", "Operand", "batchable", "group_records", "signature"]

NUMBERS: Final = frozenset({float, int, bool})


def signature(records: dict[Any, Record], node: Any) -> tuple[Any, ...] | None:
    """What nodes must share to run as one kernel; None: never batched.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((3, 2)))
    >>> a, b, c = np.ones(3) @ w, np.zeros(3) @ w, np.zeros(4) @ w
    >>> signature({}, a) == signature({}, b) != signature({}, c)
    True
    """
    key: tuple[Any, ...] = (node._op.name,)
    for x in node._inputs:
        kind = type(x)
        if kind is Layer:
            value = records[x].value
            if type(value) is Outputs:  # an operation node's outputs: their shapes
                key += value.signature()
                continue
            try:
                key += (type(value), value.shape, value.dtype)
            except AttributeError:  # a plain number: not batched
                return None
        elif kind is Weight:
            key += (x,)
        elif kind in NUMBERS:
            key += (kind, x) if x else (kind, x, str(x))  # -0.0 == 0.0, but not in a product
        else:
            try:
                key += (kind, x.shape, x.dtype)
            except AttributeError:
                return None
    params = node._params
    if params:
        for p in params:
            k = _param_key(p)
            if k is None:
                return None
            key += (k,)
    return key


def _param_key(p: Any) -> Any:
    """A hashable stand-in for a parameter (slices are unhashable before
    Python 3.12); arrays stand for their shape and dtype (they may differ per
    member, and are stacked); None where unsupported."""
    kind = type(p)
    if p is None or kind in NUMBERS or kind is str or p is Ellipsis:
        return (kind, p)
    if kind is slice:
        return (slice, p.start, p.stop, p.step)
    if kind is tuple:
        parts = tuple(_param_key(q) for q in p)
        return None if any(q is None for q in parts) else (tuple, parts)
    shape = getattr(p, "shape", None)
    if shape is not None and hasattr(p, "dtype"):
        return (kind, shape, p.dtype)
    return None


def group_records(
    records: dict[Any, Record],
    where: dict[Any, tuple[Record, int]],
    members: list[Any],
    result: Any,
    operands: list[Operand],
    args: list[Any],
) -> None:
    """The stack, group and member records of a group that ran: ``result``
    is its rule's, ``operands`` say where each operand came from and ``args``
    hold their values (stacked or shared); ``where`` learns each member's
    place in the group's output."""
    record = Record
    out, vjps = result
    n = len(members)
    first = members[0]
    ins: list[Record | None] = []
    for operand, value in zip(operands, args):
        rec = operand.rec
        if operand.stacked is not None:
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
    needs = any(r is not None and r.needs_grad for r in ins)
    group = record(out, None, tuple(ins), needs, first, False)
    group.refcount = n
    records[group] = group
    puts: list[Callable[[Any], _Gather]] | None = None
    if needs:
        group.vjps = tuple(_resolving(v) for v in vjps)
        puts = _Gather(out).puts(n)
    for i, node in enumerate(members):
        records[node] = record(out[i], None if puts is None else (puts[i],), (group,), needs, node, True)
        where[node] = (group, i)


class Operand:
    """Where one operand position of a group comes from: a record shared by
    all members, or the members' own operands, ``stacked`` (their records,
    None for data)."""

    __slots__ = ("rec", "stacked")

    def __init__(self, rec: Record | None, stacked: list[Record | None] | None) -> None:
        self.rec = rec
        self.stacked = stacked


def batchable(op: Any, kinds: set[type], operands: list[Any], batched: list[bool]) -> bool:
    """Operands that one member would take as they are: one array library, one
    floating dtype where the primitive needs one and no integer array beside it
    (else the members run one by one: the first that fails raises the usual
    error at its line, and integers are cast to the float's dtype)."""
    if not any(batched):  # the members compute the same thing: nothing to stack
        return False
    foreign = kinds - _HOST - {StackedOutputs}  # (operation nodes' outputs are host arrays)
    if foreign and (len(foreign) > 1 or kinds - NUMBERS - foreign):
        return False
    if op.same_dtype:
        dtypes = {np.dtype(a.dtype) for a in operands if getattr(a, "ndim", 0)}
        floats = {d for d in dtypes if d.kind == "f"}
        if len(floats) > 1 or (floats and len(dtypes) > len(floats)):
            return False  # (an integer array beside a float one is cast member by member)
    return True


_GETTERS: dict[int, tuple[itemgetter[Any], ...]] = {}


def _getters(n: int) -> tuple[itemgetter[Any], ...]:
    """The VJPs of a stack of ``n``: member ``i`` gets ``g[i]`` (a view)."""
    found = _GETTERS.get(n)
    if found is None:
        found = _GETTERS[n] = tuple(itemgetter(i) for i in range(n))
    return found


def _resolving(vjp: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A group VJP, reading its delta from the group's `_Gather`."""
    return lambda delta: vjp(delta.dense() if type(delta) is _Gather else delta)


class _Gather:
    """The delta of a group's stacked output: a slot per member, stacked once,
    when read.

    The group record's accumulator holds this one object: each member's VJP
    fills its slot and returns it, and ``+`` of it with itself is itself.
    """

    __slots__ = ("like", "parts", "stacked")

    def __init__(self, like: Any) -> None:
        self.like = like
        self.parts: list[Any] = []
        self.stacked: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked output's (so that fitting a delta to it leaves it be)."""
        return tuple(self.like.shape)

    def puts(self, n: int) -> list[Callable[[Any], _Gather]]:
        """The members' VJPs."""
        self.parts = [None] * n
        return [self._put(i) for i in range(n)]

    def _put(self, i: int) -> Callable[[Any], _Gather]:
        parts = self.parts

        def put(g: Any) -> _Gather:
            parts[i] = g.to_dense() if type(g) is SparseRows else g
            return self

        return put

    def __add__(self, other: object) -> _Gather:
        assert other is self, "a group's delta combines only with itself"
        return self

    def dense(self) -> Any:
        """The stacked delta (zeros for members that got none)."""
        if self.stacked is None:
            like, parts = self.like, self.parts
            if type(like) is StackedOutputs:  # a group of operation nodes with several outputs
                self.stacked = like.stack_deltas(parts)
                self.parts = []
                return self.stacked
            xp = namespace(like)
            zero = xp.zeros(like.shape[1:], dtype=like.dtype) if any(p is None for p in parts) else None
            self.stacked = xp.stack([zero if p is None else p for p in parts])
            self.parts = []
        return self.stacked
