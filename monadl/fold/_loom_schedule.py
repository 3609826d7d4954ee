"""A Fold batch loom's schedule (`monadl.fold._loom`), worked out once, when
the batch is built, with NumPy: the calls as groups by depth and trace (a
valid order: a call's operands are outputs of shallower calls), where each
group's operands are gathered from (rows of an arena, or the members' data
stacked) and where its outputs go. The outputs that one consumer's position
reads share one arena (a union-find of the traces' outputs): a tree's left
child's ``h`` is a leaf's or an internal node's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import numpy as np

from monadl._namespace import namespace
from monadl.layers._batch_site import built_for
from monadl.layers._layer import Layer
from monadl.layers._site import site_text

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from monadl.fold._loom import Loom
    from monadl.fold._loom_recorders import Group
    from monadl.layers._primitives import Primitive

__all__ = ["MixedData", "Rows", "Schedule", "calls", "op_of"]


@final
class _Planned:
    """A group as the schedule runs it: its program, its operands (per
    position: an arena and the rows to gather, or the members' data
    stacked), where its weights are among the loom's, and where its
    outputs go (per output: an arena and its rows, a slice). As it ran
    (`part`), some or all of its members: their operands and outputs
    where they were held (`monadl.fold._loom_arenas`)."""

    __slots__ = ("group", "n", "operands", "outs", "program", "weights")

    def __init__(self, group: Group, weights: list[int]) -> None:
        self.group = group
        self.n = len(group.firsts)
        assert group.trace.op is not None
        self.program: Any = group.trace.op.rule
        self.weights = weights
        self.operands: list[tuple[int | None, Any, bool]] = []
        self.outs: list[tuple[int, Any]] = []

    def part(self, n: int, operands: list[tuple[int | None, Any, bool]]) -> _Planned:
        """``n`` of the group's members (or all, their outputs held apart), as
        they ran over ``operands``; their outputs' places set as they are held."""
        other: _Planned = object.__new__(_Planned)
        other.group, other.n, other.program, other.weights = self.group, n, self.program, self.weights
        other.operands, other.outs = operands, []
        return other


@final
class Schedule:
    """The loom's calls as groups by depth (a valid order: a call's operands
    are outputs of shallower calls), and the arenas their outputs go to."""

    __slots__ = ("arena", "base", "capacity", "gathers", "planned", "rows", "site", "span", "weights")

    def __init__(self, loom: Loom) -> None:
        # (not the loom itself: its node holds this schedule, and a cycle would keep both till a collection)
        self.site = loom.node._site
        self.base = loom.base
        self.weights = list(loom.weights)
        groups = sorted(loom.groups.values(), key=lambda g: g.depth)  # (stable: in the order first built)
        span = max(g.firsts[-1] + g.trace.outputs for g in groups)
        self.span = span  # (slots are numbered below it)
        keys = np.zeros(span, np.intp)  # per slot, its output's key: its trace's first, plus its number
        firsts = {id(g): np.asarray(g.firsts, np.intp) for g in groups}
        for g in groups:
            for k in range(g.trace.outputs):
                keys[firsts[id(g)] + k] = g.key + k
        # Arenas: the outputs that one consumer's position reads go to one arena (union-find of keys).
        parent = list(range(loom.count))

        def find(a: int) -> int:
            while parent[a] != a:
                a = parent[a]
            return a

        # Per group, per operand position, the members' (slots as one array).
        columns = {id(g): [_slots(column) for column in g.columns] for g in groups}
        for g in groups:
            for column in columns[id(g)]:
                if type(column) is np.ndarray:
                    read = [find(int(r)) for r in np.flatnonzero(np.bincount(keys[column]))]
                    for r in read[1:]:
                        parent[find(r)] = read[0]
        arena: dict[int, int] = {}
        for key in range(loom.count):
            arena.setdefault(find(key), len(arena))
        capacity = [0] * len(arena)
        rows = np.zeros(span, np.intp)  # per slot, its row in its arena
        arena_of = np.zeros(span, np.intp)
        weights = loom.weights
        self.planned: list[_Planned] = []
        for g in groups:
            plan = _Planned(g, [weights[w] for w in g.trace.weights])
            for k in range(g.trace.outputs):
                a = arena[find(g.key + k)]
                plan.outs.append((a, slice(capacity[a], capacity[a] + plan.n)))
                rows[firsts[id(g)] + k] = np.arange(capacity[a], capacity[a] + plan.n)
                arena_of[firsts[id(g)] + k] = a
                capacity[a] += plan.n
            self.planned.append(plan)
        for plan in self.planned:  # (the operands' rows: every producer's rows are known now)
            for column in columns[id(plan.group)]:
                if type(column) is np.ndarray:  # (slots: rows of one arena, distinct where the slots are)
                    plan.operands.append((int(arena_of[column[0]]), rows[column], _distinct(column, span)))
                else:  # (constant rows of data, or arrays of one shape and dtype, which the trace's signature holds)
                    plan.operands.append((None, Rows(column), False))
        self.rows = rows
        self.arena = arena_of
        # (the row numbers the groups gather by: on a device, copied over in one piece)
        self.gathers = [rows for plan in self.planned for source, rows, _ in plan.operands if source is not None]
        self.capacity = capacity

    def where(self, group: Group, row: int) -> str:
        """``file:line`` of the block that made a call (of an ``ml.loom()``
        block's, the line that called it), and the input of the batch it was built for."""
        site = group.sites[row] if group.sites else self.site if group.site is None else group.site
        return site_text(site) + built_for(self.base + group.firsts[row])


def _slots(column: list[Any]) -> Any:
    """An operand position's members: their slots as one array, else as they are."""
    return np.fromiter(column, np.intp, len(column)) if type(column[0]) is int else column


def _distinct(slots: Any, span: int) -> bool:
    """Whether no slot repeats (a scatter of deltas then needs no ``add.at``):
    by marks, a few passes over ``span`` bytes, where the column is not
    small beside the batch (a tree batch's groups: twice as fast as
    ``np.unique``'s sort); else by the sort (a long sequence's step: a
    group of 32 among a million slots, 2.6 us against 36)."""
    if span > _MARKS_PER_SLOT * len(slots):
        return len(np.unique(slots)) == len(slots)
    marks = np.zeros(span, bool)
    marks[slots] = True
    return int(np.count_nonzero(marks)) == len(slots)


_MARKS_PER_SLOT = 64


@final
class Rows:
    """A group's data at one operand position (constant rows' layers, or
    arrays), stacked when the loom runs (`read`): read then, as a node reads
    its data, so that a buffer refilled after the block is read refilled."""

    __slots__ = ("column",)

    def __init__(self, column: list[Any]) -> None:
        self.column = column

    def read(self) -> Any:
        column = self.column
        if type(column[0]) is Layer:  # (of one library: the group's key holds the rows' type)
            return _stacked([v._inputs[0] for v in column])
        if type(column[0]) is not np.ndarray and len(set(map(type, column))) > 1:
            raise MixedData
        try:
            return _stacked(column)
        except TypeError:  # (NumPy's concatenation refuses a device's array: CuPy's)
            raise MixedData from None


@final
class MixedData(Exception):
    """A group's data at one position are arrays of two libraries (a host's
    and a device's): its calls run one by one, each as its node would."""


def _stacked(arrays: Sequence[Any]) -> Any:
    """``np.stack(arrays)`` of arrays of one shape (and library: a device's
    too), by one concatenation (a 4,000-member group's one-element index
    arrays: 0.3 ms against 1.0)."""
    first = arrays[0]
    xp = np if type(first) is np.ndarray else namespace(first)
    if first.ndim == 0:
        return xp.stack(arrays)
    return xp.reshape(xp.concat(arrays) if xp is not np else np.concatenate(arrays), (len(arrays), *first.shape))


def calls(schedule: Schedule) -> Iterator[tuple[_Planned, Group, int]]:
    """The calls one by one, group by group (by depth: each after its operands' calls)."""
    for plan in schedule.planned:
        for row in range(plan.n):
            yield plan, plan.group, row


def op_of(group: Group) -> Primitive:
    op = group.trace.op
    assert op is not None
    return op
