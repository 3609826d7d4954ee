"""Batching as a rewrite into ordinary records, and the signatures that group nodes.

Per group of ``n`` members that ran as one kernel (`group_records`):

* per batched operand position, either a *gather* record, when every
  member's operand is a member of an earlier group (a Tree-LSTM's children):
  its value the rows of those groups' outputs taken by index (or one
  group's whole output as it is: no copy), its VJP per source group one
  scatter of the delta's rows into that group's `_Gather`; or else a
  *stack* record: the members' operands stacked, its VJPs ``g[i]`` (views)
  back to each member's operand;
* one *group* record: the batching rule on the gathered, stacked and shared
  operands; a shared weight's delta is summed over the group inside the rule
  (for a matrix product, one ``X_cat.T @ dY``);
* per member, a record whose value is ``out[i]`` (a view), for consumers
  that run alone, the graph's roots and later graphs; its VJP puts its delta
  into the group's `_Gather`. The gather records read the group's output, not
  these records, so a delta that goes group to group costs no per-member
  work: `_Gather` sums its parts once, when the backward reaches the group
  (members and gathers come after it in insertion order, so they are
  reached first).

So the one node backward (`monadl.runtime.backward`) (its sweep, its counted
release, the worker pool's release) back-propagates a batched graph
unchanged, and reference counts stay exact: each record is held once per
record that lists it as an input, and a member that a gather record reads is
held by that gather record's release token (released with it), so that the
member, and through it its group, is released in the counted release.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import Any, Final, cast, final

import numpy as np

from monadl._namespace import _HOST, namespace
from monadl.deltas import SparseRows, scatter_add
from monadl.layers._layer import Layer
from monadl.layers._program import Outputs, OutputsDelta, StackedOutputs
from monadl.layers._weight import Weight
from monadl.runtime.evaluation import Record

__all__ = ["NUMBERS", "Groups", "Operand", "Place", "Source", "batchable", "group_records", "signature", "stack"]

NUMBERS: Final = frozenset({float, int, bool})


def signature(records: dict[Any, Record], node: Any, where: dict[Any, Place] | None = None) -> tuple[Any, ...] | None:
    """What nodes must share to run as one kernel; None: never batched.
    ``where``: the places of earlier groups' members, whose part of the key
    their group computed once.

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
            if where is not None:
                place = where.get(x)
                if place is not None:
                    key += place[2]
                    continue
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


def group_records(groups: Groups, members: list[Any], result: Any, operands: list[Operand], args: list[Any]) -> None:
    """The records of a group that ran: ``result`` is its rule's,
    ``operands`` say where each operand came from and ``args`` hold their
    values (gathered, stacked or shared); ``groups`` learns each member's
    place in the group's output."""
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
    needs = any(r is not None and r.needs_grad for r in ins)
    group = record(out, None, tuple(ins), needs, first, False)
    group.refcount = n  # its members hold it (and each gather record that reads it, one more)
    records[group] = group
    sink = None
    if needs:
        sink = groups.sinks[group] = _Gather(out)
        group.vjps = tuple([_resolving(v) for v in vjps])
    if type(out) is StackedOutputs:
        values: list[Any] = list(map(Outputs, zip(*out.parts)))  # (their rows as views, made in C)
        part = values[0].signature()
    else:
        values = list(out)
        part = (type(values[0]), values[0].shape, values[0].dtype)
    held = (group,)
    if sink is None:
        for node, value in zip(members, values):
            records[node] = record(value, None, held, needs, node, True)
    else:
        put = sink.put
        for i, node in enumerate(members):
            records[node] = record(values[i], (partial(put, i),), held, needs, node, True)
    groups.where.update(zip(members, [(group, i, part) for i in range(n)]))


Place = tuple[Record, int, tuple[Any, ...]]
"""Where a member's value sits: its group's record, its row, and its value's
part of a consumer's signature (the same for all members)."""


@final
class Source:
    """The rows one gathered operand reads from one earlier group: the
    gathered rows ``positions`` (None: all, in order) are the group's rows
    ``indices`` (None: all, in order); ``held``: the members' records, which
    the gather record holds in their stead."""

    __slots__ = ("group", "held", "indices", "positions", "unique")

    def __init__(self, group: Record, positions: Any, indices: Any, unique: bool, held: tuple[Record, ...]) -> None:
        self.group = group
        self.positions = positions
        self.indices = indices
        self.unique = unique
        self.held = held


@final
class Groups:
    """The groups of one scheduler run: each member's `Place`, and each
    group's delta sink (a `_Gather`, when a delta is worth computing)."""

    __slots__ = ("records", "sinks", "where")

    def __init__(self, records: dict[Any, Record]) -> None:
        self.records = records
        self.where: dict[Any, Place] = {}
        self.sinks: dict[Record, _Gather] = {}

    def sources(self, column: list[Any]) -> list[Source] | None:
        """Where each of ``column`` (layers) sits in earlier groups' outputs,
        grouped by group; None if some of them ran alone."""
        where = self.where
        found = [where.get(x) for x in column]
        if None in found:
            return None
        places = cast(list[Place], found)
        held = list(map(self.records.__getitem__, column))
        first = places[0][0]
        if all(place[0] is first for place in places):  # one group's rows (the common case)
            return [_source(first, None, [place[1] for place in places], held)]
        rows: dict[Record, list[int]] = {}
        for p, place in enumerate(places):
            positions = rows.get(place[0])
            if positions is None:
                rows[place[0]] = [p]
            else:
                positions.append(p)
        return [
            _source(group, positions, [places[p][1] for p in positions], [held[p] for p in positions])
            for group, positions in rows.items()
        ]

    def gather(self, sources: list[Source], n: int) -> Any:
        """The gathered operand: rows of earlier groups' outputs, by index (no copy
        when it is one group's whole output, in order)."""
        first = sources[0].group.value
        if type(first) is StackedOutputs:
            parts = range(len(first.parts))
            return StackedOutputs(
                tuple([self._rows([s.group.value.parts[k] for s in sources], sources, n) for k in parts])
            )
        return self._rows([s.group.value for s in sources], sources, n)

    @staticmethod
    def _rows(values: list[Any], sources: list[Source], n: int) -> Any:
        if len(sources) == 1:
            index = sources[0].indices
            return values[0] if index is None else values[0][index]
        like = values[0]
        out = namespace(like).empty((n, *like.shape[1:]), dtype=like.dtype)
        for value, s in zip(values, sources):
            out[s.positions] = value if s.indices is None else value[s.indices]
        return out

    def gather_record(self, value: Any, sources: list[Source], node: Any) -> Record:
        """The record of a gathered operand: it holds the groups it reads (its
        delta goes to each in one scatter), and the members it reads in their
        stead (a member is released, so its group, once the gather is)."""
        groups = tuple([s.group for s in sources])
        needs = any(g.needs_grad for g in groups)
        vjps = tuple([_scatter(self.sinks[s.group], s) for s in sources]) if needs else None
        rec = Record(value, vjps, groups, needs, node, True)
        held: list[Record] = []
        for s in sources:
            s.group.refcount += 1
            for r in s.held:
                r.refcount += 1
            held.extend(s.held)
        rec.release = tuple(held)
        self.records[rec] = rec
        return rec


def _source(group: Record, positions: list[int] | None, indices: list[int], held: list[Record]) -> Source:
    """A `Source` from Python lists: None for rows that are all, in order."""
    n = len(indices)
    whole = n == group.value.shape[0] and indices == list(range(n))
    return Source(
        group,
        None if positions is None else np.array(positions),
        None if whole else np.array(indices),
        len(set(indices)) == n,
        tuple(held),
    )


def _scatter(sink: _Gather, source: Source) -> Callable[[Any], _Gather]:
    """A gathered operand's VJP into one source group: its rows of the delta, by index."""
    return lambda delta: sink.add(source, delta)


class Operand:
    """Where one operand position of a group comes from: a record shared by
    all members, the members' own operands ``stacked`` (their records, None
    for data), or ``sources``: rows of earlier groups' outputs."""

    __slots__ = ("rec", "sources", "stacked")

    def __init__(
        self, rec: Record | None, stacked: list[Record | None] | None, sources: list[Source] | None = None
    ) -> None:
        self.rec = rec
        self.stacked = stacked
        self.sources = sources


def batchable(op: Any, kinds: set[type], operands: list[Any], batched: list[bool]) -> bool:
    """Operands that one member would take as they are: one array library, one
    floating dtype where the primitive needs one (else the members run one by
    one, and the first that fails raises the usual error at its line)."""
    if not any(batched):  # the members compute the same thing: nothing to stack
        return False
    foreign = kinds - _HOST - {StackedOutputs}  # (operation nodes' outputs are host arrays)
    if foreign and (len(foreign) > 1 or kinds - NUMBERS - foreign):
        return False
    if op.same_dtype:
        floats = {a.dtype for a in operands if getattr(a, "ndim", 0) and np.dtype(a.dtype).kind == "f"}
        if len(floats) > 1:
            return False
    return True


def stack(values: list[Any]) -> Any:
    """The members' arrays along a new leading axis: one concatenation (no
    per-array Python of ``stack``) where they have axes."""
    first = values[0]
    xp = namespace(first)
    if getattr(first, "ndim", 0):
        return xp.reshape(xp.concatenate(values, axis=0), (len(values), *first.shape))
    return xp.stack(values)


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
    """The delta of a group's stacked output: the rows that gathered
    operands sent back (by index), and a slot per member for what its own
    record got (from a consumer that ran alone); summed once, when read.

    The group record's accumulator holds this one object: each VJP that
    feeds it returns it, and ``+`` of it with itself is itself.
    """

    __slots__ = ("like", "parts", "rows", "stacked")

    def __init__(self, like: Any) -> None:
        self.like = like
        self.parts: dict[int, Any] = {}
        self.rows: list[tuple[Source, Any]] = []
        self.stacked: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked output's (so that fitting a delta to it leaves it be)."""
        return tuple(self.like.shape)

    def put(self, i: int, g: Any) -> _Gather:
        """Member ``i``'s delta (its record's VJP)."""
        self.parts[i] = g.to_dense() if type(g) is SparseRows else g
        return self

    def add(self, source: Source, delta: Any) -> _Gather:
        """A gathered operand's delta, of which ``source`` says which rows are this group's."""
        self.rows.append((source, delta))
        return self

    def __add__(self, other: object) -> _Gather:
        assert other is self, "a group's delta combines only with itself"
        return self

    def dense(self) -> Any:
        """The summed delta (zeros for rows that got none)."""
        if self.stacked is None:
            like = self.like
            if type(like) is StackedOutputs:  # a group of operation nodes with several outputs
                parts = []
                for k, part in enumerate(like.parts):
                    rows = [(s, d.parts[k]) for s, d in self.rows if d.parts[k] is not None]
                    members = {i: d.parts[k] for i, d in self.parts.items() if d.parts[k] is not None}
                    parts.append(_summed(part, rows, members) if rows or members else None)
                self.stacked = OutputsDelta(tuple(parts))
            else:
                self.stacked = _summed(like, self.rows, self.parts)
            self.rows, self.parts = [], {}
        return self.stacked


def _summed(like: Any, rows: list[tuple[Source, Any]], members: dict[int, Any]) -> Any:
    """The delta of ``like`` (a stacked output) from gathered rows and members' own deltas."""
    if not members and len(rows) == 1:
        source, d = rows[0]
        if source.indices is None and source.positions is None and d.shape == like.shape and d.dtype == like.dtype:
            return d  # a consumer that read the whole output in order: its delta as it is
    xp = namespace(like)
    n = like.shape[0]
    # In a tree each row is read once: the gathers' rows then tile the output,
    # and each is written once into an empty array (no zeros, no additions).
    tiled = not members and all(s.unique for s, _ in rows)
    if tiled:
        indices = [np.arange(n) if s.indices is None else s.indices for s, _ in rows]
        tiled = sum(len(i) for i in indices) == n and bool(np.all(np.bincount(np.concatenate(indices), minlength=n)))
    out = xp.empty(like.shape, dtype=like.dtype) if tiled else xp.zeros(like.shape, dtype=like.dtype)
    for source, d in rows:
        if source.positions is not None:
            d = d[source.positions]
        index = source.indices
        if tiled:
            out[slice(None) if index is None else index] = d
        elif index is None:
            out += d
        elif source.unique:
            out[index] += d
        else:  # a node read twice by one gathered operand: its rows add up
            out = scatter_add(xp, out, index, d)
    for i, d in members.items():
        out[i] += d
    return out
