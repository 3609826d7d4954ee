"""Where batched groups' members sit, and how a group's delta is gathered.

`Groups` keeps, per member of a group that ran, its `Place` (its group's
record, its row, its part of a consumer's signature); `Groups.sources`
says where a consumer group's operand rows sit in earlier groups' outputs,
and a gather record reads them by index (see
`monadl.runtime.schedule.batched_records`). A group's delta is a
`Gather` (`monadl.runtime.schedule.batched_gather`): the rows its gather
records sent back (one scatter per source group) and what its members' own
records got, summed once when the backward reaches the group, and which
members got a delta at all: a member that got none sends none
(`Groups.narrow`), as it would run alone, so a weight that only such
members read is not reached and takes no step.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any, cast, final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import scatter_add
from monadl.layers._outputs import OutputsDelta, StackedOutputs
from monadl.runtime.evaluation import Record, Records
from monadl.runtime.schedule.batched_gather import Gather

__all__ = ["Groups", "Place", "Source"]


Place = tuple[Record, int, tuple[Any, ...]]
"""Where a member's value sits: its group's record, its row, and its value's
part of a consumer's signature (the same for all members)."""


@final
class Source:
    """The rows one gathered operand reads from one earlier group: the
    gathered rows ``positions`` (None: all, in order) are the group's rows
    ``indices`` (None: all, in order), both index arrays of the group's
    library; ``rows`` and ``at``: ``indices`` and ``positions`` on the host."""

    __slots__ = ("at", "group", "indices", "joint", "positions", "rows", "unique")

    def __init__(
        self,
        group: Record,
        positions: Any,
        indices: Any,
        unique: bool,
        rows: Any = None,
        joint: Joint | None = None,
        at: Any = None,
    ) -> None:
        self.group = group
        self.positions = positions
        self.indices = indices
        self.unique = unique
        self.rows = indices if rows is None else rows
        self.joint = joint
        self.at = positions if at is None else at


@final
class Joint:
    """A device's gathered operand that reads several groups: their outputs
    concatenated, then one index (``index``, on the device) into them; its
    delta scattered once into the concatenation, each group then taking its
    slice (``offsets``: where each group's rows start). Two device calls each
    way, where a gather group by group takes two a group: on a GPU each call
    is a launch, and a random tree's level reads a dozen earlier levels."""

    __slots__ = ("_delta", "_full", "_left", "_read", "groups", "host", "index", "offsets", "total", "unique")

    def __init__(
        self, groups: list[Record], index: Any, offsets: list[int], total: int, unique: bool, host: Any
    ) -> None:
        self.groups = groups
        self.index = index
        self.offsets = offsets
        self.total = total
        self.unique = unique
        self.host = host  # (``index`` on the host)
        self._read: dict[int, Any] = {}
        self._delta: Any = None  # the delta scattered (one per backward), its scatter, and the slices still to take
        self._full: Any = None
        self._left = 0

    def gather(self, values: list[Any]) -> Any:
        """The gathered rows of ``values`` (the groups' outputs, in order)."""
        return namespace(values[0]).concat(values, axis=0)[self.index]

    def slice(self, delta: Any, k: int) -> Any:
        """Group ``k``'s rows (all of them, in order) of the delta's scatter
        into the concatenation: made at the first group's call, dropped after
        the last's."""
        if self._delta is not delta:
            whole = delta.parts if type(delta) is OutputsDelta else (delta,)
            self._delta, self._full = delta, [None if d is None else self._scattered(d) for d in whole]
            self._left = sum(g.needs_grad for g in self.groups)
        start, stop = self.bounds(k)
        parts = tuple([None if f is None else f[start:stop] for f in self._full])
        self._left -= 1
        if self._left <= 0:
            self._delta = self._full = None
        return OutputsDelta(parts) if type(delta) is OutputsDelta else parts[0]

    def bounds(self, k: int) -> tuple[int, int]:
        """Where group ``k``'s rows sit in the concatenation."""
        return self.offsets[k], self.offsets[k + 1] if k + 1 < len(self.offsets) else self.total

    def read(self, k: int) -> Any:
        """Group ``k``'s rows that the index reads (on the host): those its
        slice of a delta carries one for, the others' zeros."""
        found = self._read.get(k)
        if found is None:
            start, stop = self.bounds(k)
            host = self.host
            found = self._read[k] = host[(host >= start) & (host < stop)] - start
        return found

    def _scattered(self, d: Any) -> Any:
        xp = namespace(d)
        full = xp.zeros((self.total, *d.shape[1:]), dtype=d.dtype, device=d.device)
        if self.unique:
            full[self.index] = d
            return full
        return scatter_add(xp, full, self.index, d)  # a row read twice: its deltas add up


@final
class Groups:
    """The groups of one scheduler run: each member's `Place`, and each
    group's delta sink (a `Gather`, when a delta is worth computing).
    ``outer``: a weight's delta from a group's product is sent as factors
    (`monadl.runtime.schedule.batched_records.Outer`), for a counted release
    that makes it an array when the weight is released."""

    __slots__ = ("outer", "records", "sinks", "where")

    def __init__(self, records: Records, outer: bool = False) -> None:
        self.records = records
        self.outer = outer
        # The evaluation's: a member's record is made from them when it is read (`Records`).
        self.where: dict[Any, Place] = records.places
        self.sinks: dict[Record, Gather] = records.sinks

    def sources(self, column: list[Any]) -> list[Source] | None:
        """Where each of ``column`` (layers) sits in earlier groups' outputs,
        grouped by group; None if some of them ran alone."""
        # Once per member of a group's operand: walked in C (map, count), no frame per member.
        try:
            found = list(map(self.where.get, column))
        except TypeError:  # (an array among the layers, in this operand's place: stacked instead)
            return None
        if None in found:
            return None
        places = cast(list[Place], found)
        owners = list(map(_group, places))
        first = owners[0]
        if owners.count(first) == len(owners):  # one group's rows (the common case; records compare by identity)
            return [_source(first, None, list(map(_row, places)))]
        rows: dict[Record, list[int]] = {}
        for p, place in enumerate(places):
            positions = rows.get(place[0])
            if positions is None:
                rows[place[0]] = [p]
            else:
                positions.append(p)
        if type(_like(first)) is not np.ndarray:
            return _joint(list(rows), places)
        return [_source(group, positions, [places[p][1] for p in positions]) for group, positions in rows.items()]

    def gather(self, sources: list[Source], n: int) -> Any:
        """The gathered operand: rows of earlier groups' outputs, by index (no copy
        when it is one group's whole output, in order)."""
        first = sources[0].group.value
        joint = sources[0].joint
        if joint is not None:
            if type(first) is StackedOutputs:
                parts = range(len(first.parts))
                return StackedOutputs(tuple([joint.gather([s.group.value.parts[k] for s in sources]) for k in parts]))
            return joint.gather([s.group.value for s in sources])
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
        out = namespace(like).empty((n, *like.shape[1:]), dtype=like.dtype, device=like.device)
        for value, s in zip(values, sources):
            out[s.positions] = value if s.indices is None else value[s.indices]
        return out

    def gather_record(self, value: Any, sources: list[Source], node: Any) -> Record:
        """The record of a gathered operand: it holds the groups it reads (its
        delta goes to each in one scatter); the members it reads need no
        records (`Records`)."""
        groups = tuple([s.group for s in sources])
        needs = any(g.needs_grad for g in groups)
        # (a group that reads no weight has no sink: no delta goes to it)
        vjps = (
            tuple([_scatter(self.sinks[s.group], s) if s.group.needs_grad else None for s in sources])
            if needs
            else None
        )
        rec = Record(value, vjps, groups, needs, node, True)
        for g in groups:
            g.refcount += 1
        self.records[rec] = rec
        return rec

    def narrow(self, rec: Record, sources: list[Source], reached: Any) -> None:
        """Make ``rec``, the gather record of ``sources``, send back the delta
        of the gathered rows ``reached`` (a host mask: those whose member of
        the group that read them got a delta) alone. The others' rows hold
        zeros, which are no delta: alone, those members would have sent
        none, so a group that only they read gets nothing, and the weights
        behind it are not reached (a target network's under
        ``stop_gradient``, a value read and left out of the loss)."""
        vjps = rec.vjps
        if vjps is not None:
            rec.vjps = tuple(
                [None if v is None else _narrowed(self.sinks[s.group], s, reached) for v, s in zip(vjps, sources)]
            )

    def narrow_parts(self, rec: Record, sources: list[Source], masks: list[Any]) -> None:
        """`narrow`, per output of the gathered operation nodes: output
        ``k``'s delta of the rows ``masks[k]`` alone (None: of no row)."""
        vjps = rec.vjps
        if vjps is not None:
            rec.vjps = tuple(
                [None if v is None else _narrowed_parts(self.sinks[s.group], s, masks) for v, s in zip(vjps, sources)]
            )


_group = itemgetter(0)
_row = itemgetter(1)


def _source(group: Record, positions: list[int] | None, indices: list[int]) -> Source:
    """A `Source` from Python lists: None for rows that are all, in order."""
    n = len(indices)
    whole = n == group.value.shape[0] and indices == list(range(n))
    unique = len(set(indices)) == n
    at = None if positions is None else np.array(positions)
    return _made(group, at, None if whole else np.array(indices), unique)


def _made(group: Record, at: Any, rows: Any, unique: bool) -> Source:
    """A `Source` from host index arrays (None: all, in order)."""
    like = _like(group)
    if type(like) is np.ndarray:
        return Source(group, at, rows, unique)
    # Another library's (a GPU's): its index arrays made once, for the gather and the scatter back.
    xp = namespace(like)
    return Source(
        group,
        None if at is None else xp.asarray(at, device=like.device),
        None if rows is None else xp.asarray(rows, device=like.device),
        unique,
        rows,
        at=at,
    )


def _like(group: Record) -> Any:
    """A group's output (its first part, for several)."""
    value = group.value
    return value.parts[0] if type(value) is StackedOutputs else value


def _joint(groups: list[Record], places: list[Place]) -> list[Source]:
    """The sources of a device's operand that reads several groups: one index
    into their outputs concatenated (`Joint`), made on the host and copied
    over once."""
    offsets: dict[Record, int] = {}
    total = 0
    for group in groups:
        offsets[group] = total
        total += _like(group).shape[0]
    rows = [offsets[group] + row for group, row, _ in places]
    like = _like(groups[0])
    host = np.array(rows)
    index = namespace(like).asarray(host, device=like.device)
    joint = Joint(groups, index, list(offsets.values()), total, len(set(rows)) == len(rows), host)
    return [Source(group, None, None, True, joint=joint) for group in groups]


def _scatter(sink: Gather, source: Source) -> Callable[[Any], Gather]:
    """A gathered operand's VJP into one source group: its rows of the delta, by
    index (a joint's: its slice of the delta's scatter, all the group's rows)."""
    joint = source.joint
    if joint is None:
        return lambda delta: sink.add(source, delta)
    k = joint.groups.index(source.group)
    return lambda delta: sink.accumulate(joint.slice(delta, k), joint.read(k))


def _narrowed(sink: Gather, source: Source, reached: Any) -> Callable[[Any], Gather | None]:
    """`_scatter`, where only the gathered rows ``reached`` (a host mask)
    carry a delta: its rows of those alone, or nothing if it has none."""
    joint = source.joint
    if joint is None:
        picked = reached if source.at is None else reached[source.at]
        if picked.all():
            return _scatter(sink, source)
        at = np.flatnonzero(picked) if source.at is None else source.at[picked]
        rows = np.flatnonzero(picked) if source.rows is None else source.rows[picked]
    else:  # (one group's rows by index, not its slice of the joint's scatter: that holds zeros for the rest)
        start, stop = joint.bounds(joint.groups.index(source.group))
        host = joint.host
        picked = reached & (host >= start) & (host < stop)
        at = np.flatnonzero(picked)
        rows = host[at] - start
    if not len(at):
        return _nothing
    # (rows of unique rows are unique; a joint's source says unique of its slice, its rows may repeat)
    unique = source.unique if joint is None else joint.unique
    narrowed = _made(source.group, at, rows, unique)
    return lambda delta: sink.add(narrowed, delta)


def _narrowed_parts(sink: Gather, source: Source, masks: list[Any]) -> Callable[[Any], Gather | None]:
    """`_narrowed` for a delta of several outputs (an `OutputsDelta`), each
    output's of the gathered rows its mask holds alone: output by output,
    its delta with the others' left None."""
    sends = [(k, _narrowed(sink, source, m)) for k, m in enumerate(masks) if m is not None and m.any()]

    def scatter(delta: Any) -> Gather | None:
        sent = None
        parts = delta.parts
        for k, send in sends:
            if k < len(parts) and parts[k] is not None:
                sent = send(OutputsDelta(tuple([d if j == k else None for j, d in enumerate(parts)])))
        return sent

    return scatter


def _nothing(delta: Any) -> None:
    """The VJP of an operand that gets no delta."""
    return None
