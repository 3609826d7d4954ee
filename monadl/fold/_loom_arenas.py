"""A loom's arenas as its node runs (`monadl.fold._loom_run`), by shape.

The schedule (`monadl.fold._loom_schedule`) gives each output an arena:
the outputs that one consumer's position reads, a row each. Their shapes
are known only when the calls run (layers are lazy), and may differ: a
CTC recursion's alpha is each example's own length. So an arena's rows of
its first shape and dtype stay in place (its row is its row: the batches
of one shape, the common case, pay nothing), and rows of another go to an
arena of their own per shape, packed in the order written; a group whose
members read rows of different arenas at one position runs as one batched
call per pattern of them (`Arenas.split`), as the runtime's batching groups
nodes by their operands' shapes.

The schedule's row numbers are NumPy's, on the host; arenas on a device
(CuPy's) are indexed by a copy of them there, the groups' gathers' all
copied at once (`Arenas.index`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, final

import numpy as np

from monadl._namespace import index_for, namespace
from monadl._scatter import scatter_add

if TYPE_CHECKING:
    from monadl.fold._loom_schedule import _Planned

__all__ = ["Arenas", "Operand"]

# Per operand position: an arena and the rows to gather, and whether none repeats; or None, the members' data.
Operand: TypeAlias = tuple[int | None, Any, bool]


@final
class Arenas:
    """Per arena of the schedule, the array of its rows in place (its first
    shape's: `data` up to `count`), and, once a row of another shape came,
    each row's arena and row there (`home`, `at`); the arenas of other
    shapes (`data` beyond `count`), packed, each with its rows used (`fill`)."""

    __slots__ = (
        "at",
        "capacity",
        "count",
        "data",
        "fill",
        "gathers",
        "home",
        "other",
        "split_calls",
        "split_groups",
        "uploaded",
    )

    def __init__(self, capacity: list[int], gathers: Sequence[Any] = ()) -> None:
        self.capacity = capacity
        self.gathers = gathers  # (the row numbers the groups gather by, on the host: for a device, copied at once)
        self.uploaded: dict[int, Any] | None = None  # (by the host array's identity, its copy on the device)
        self.count = len(capacity)
        self.data: list[Any] = [None] * self.count
        self.fill: list[int] = [0] * self.count  # (in place: unused)
        self.home: list[Any] = [None] * self.count  # (None: all the arena's rows in place)
        self.at: list[Any] = [None] * self.count
        self.other: list[dict[tuple[Any, Any], int] | None] = [None] * self.count  # (per shape and dtype, its arena)
        self.split_groups = 0  # (groups run as several calls, and those calls: a DEBUG line says)
        self.split_calls = 0

    def row(self, a: int, row: int) -> tuple[int, int]:
        """Where row ``row`` of arena ``a`` is held: an arena and its row there."""
        home = self.home[a]
        if home is None:
            return a, row
        return int(home[row]), int(self.at[a][row])

    def write(self, a: int, rows: Any, part: Any) -> tuple[int, Any]:
        """Hold ``part`` (a group's, or part of one's, output stacked) as
        ``rows`` (a slice or an index array) of arena ``a``; where they are held."""
        data = self.data[a]
        if data is None:
            xp = namespace(part)
            data = self.data[a] = xp.empty((self.capacity[a], *part.shape[1:]), dtype=part.dtype)
        elif data.shape[1:] != part.shape[1:] or data.dtype != part.dtype:
            return self._elsewhere(a, rows, part)
        self.put(data, rows, part)
        return a, rows

    def _elsewhere(self, a: int, rows: Any, part: Any) -> tuple[int, Any]:
        """Rows of another shape than arena ``a``'s first: to the arena of
        theirs (made, or grown by doubling, as rows come)."""
        other = self.other[a]
        if other is None:
            other = self.other[a] = {}
            self.home[a] = np.full(self.capacity[a], a, np.intp)
            self.at[a] = np.arange(self.capacity[a], dtype=np.intp)
        kind = (part.shape[1:], part.dtype)
        n = len(part)
        p = other.get(kind)
        if p is None:
            p = other[kind] = len(self.data)
            self.data.append(namespace(part).empty((n, *kind[0]), dtype=kind[1]))
            self.fill.append(0)
        start = self.fill[p]
        data = self.data[p]
        if start + n > len(data):
            grown = namespace(part).empty(
                (min(max(2 * len(data), start + n), self.capacity[a]), *kind[0]), dtype=kind[1]
            )
            grown[:start] = data[:start]
            data = self.data[p] = grown
        held = slice(start, start + n)
        data[held] = part
        self.fill[p] = start + n
        self.home[a][rows] = p
        self.at[a][rows] = np.arange(start, start + n, dtype=np.intp)
        return p, held

    def split(self, plan: _Planned, operands: list[Operand]) -> Iterator[tuple[_Planned, list[Operand], Any]]:
        """A group's calls as batched calls, each of members whose operands
        are held in one arena per position (rows of one shape): per call, its
        plan, its operands (where they are held) and its members (None: all)."""
        held: list[Operand] = []
        mixed: list[int] = []  # (positions whose members' rows are held in several arenas)
        for p, (source, rows, distinct) in enumerate(operands):
            if source is None or self.home[source] is None:  # (data, or rows all in place)
                held.append((source, rows, distinct))
                continue
            where = self.home[source][rows]
            first = int(where[0])
            if (where == first).all():
                held.append((first, self.at[source][rows], distinct))
            else:
                held.append((source, where, distinct))
                mixed.append(p)
        if not mixed:
            yield plan, held, None
            return
        code = held[mixed[0]][1]
        for p in mixed[1:]:  # (a pattern's number: its arenas position by position, renumbered as it goes)
            code = np.unique(code * len(self.data) + held[p][1], return_inverse=True)[1]
        patterns = np.unique(code, return_inverse=True)[1]
        count = int(patterns.max()) + 1
        self.split_groups += 1
        self.split_calls += count
        for k in range(count):
            members = np.flatnonzero(patterns == k)
            mine: list[Operand] = []
            for p, (source, rows, distinct) in enumerate(held):
                if p in mixed:
                    assert source is not None
                    virtual = operands[p][1][members]
                    mine.append((int(rows[members[0]]), self.at[source][virtual], distinct))
                elif source is None:  # (the members' data, on a device too: the index copied over)
                    mine.append((source, rows[index_for(rows, members)], distinct))
                else:
                    mine.append((source, rows[members], distinct))
            yield plan.part(len(members), mine), mine, members

    def index(self, data: Any, rows: Any) -> Any:
        """``rows`` (host row numbers, a host mask, a slice) as an index of
        ``data`` (an arena, or its deltas): on a device, a copy there (the
        first one copies all the groups' gathers over, in one piece)."""
        if type(data) is np.ndarray or type(rows) is slice:
            return rows
        uploaded = self.uploaded
        if uploaded is None:
            uploaded = self.uploaded = self._upload(data)
        found = uploaded.get(id(rows))  # (the gathers are held: no other array has their identity)
        return index_for(data, rows) if found is None else found

    def _upload(self, like: Any) -> dict[int, Any]:
        gathers = self.gathers
        if not gathers:
            return {}
        flat = index_for(like, np.concatenate(gathers))
        uploaded, at = {}, 0
        for rows in gathers:
            uploaded[id(rows)] = flat[at : at + len(rows)]
            at += len(rows)
        return uploaded

    def take(self, data: Any, rows: Any) -> Any:
        """``data[rows]``."""
        return data[self.index(data, rows)]

    def put(self, data: Any, rows: Any, part: Any) -> None:
        """``data[rows] = part``."""
        data[self.index(data, rows)] = part

    def add(self, data: Any, rows: Any, part: Any, distinct: bool) -> Any:
        """``data[rows] += part``, rows that repeat added up (``distinct``: none
        repeats); returns the sum (a library with no scatter in place makes a new array)."""
        if distinct:
            data[self.index(data, rows)] += part
            return data
        return scatter_add(namespace(data), data, self.index(data, rows), part)
