"""A batched group's delta: `Gather`, the sink its VJPs feed, and its sum.

What reaches a group that ran as one kernel comes in pieces: the rows its
gather records sent back (one scatter per source group, by the `Source`
that says where they sit: `monadl.runtime.schedule.batched_groups`), the
slices of a joint's scatter, and what its members' own records got (from a
consumer that ran alone). `Gather` holds them and sums them once, when the
backward reaches the group, and says which members got a delta at all
(``reached``), for `Groups.narrow`. Apart from
`monadl.runtime.schedule.batched_groups`, which says where members sit and
how a gathered operand reads them: this module only adds up what came back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import SparseRows, scatter_add
from monadl.layers._outputs import OutputsDelta, StackedOutputs
from monadl.layers._split import SplitDelta

if TYPE_CHECKING:
    from monadl.runtime.schedule.batched_groups import Source

__all__ = ["Gather"]


@final
class Gather:
    """The delta of a group's stacked output: the rows that gathered
    operands sent back (by index), and a slot per member for what its own
    record got (from a consumer that ran alone); summed once, when read.
    ``reached``, once summed: which members got a delta (a host mask;
    None: all), for `Groups.narrow`; ``seen``, for several outputs: per
    output, which members got a delta for it (None: all), where some got one
    for an output that others reached did not (else None).

    The group record's accumulator holds this one object: each VJP that
    feeds it returns it, and ``+`` of it with itself is itself.
    """

    __slots__ = ("like", "parts", "reached", "read", "rows", "seen", "stacked", "whole")

    def __init__(self, like: Any) -> None:
        self.like = like
        self.parts: dict[int, Any] = {}
        self.rows: list[tuple[Source, Any]] = []
        self.stacked: Any = None
        self.whole: list[Any] | None = None  # per output part: the joints' slices summed as they come
        self.read: list[tuple[Any, list[bool]]] = []  # per joint's slice: its rows with a delta (host), its outputs
        self.reached: Any = None
        self.seen: list[Any] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked output's (so that fitting a delta to it leaves it be)."""
        return tuple(self.like.shape)

    def put(self, i: int, g: Any) -> Gather:
        """Member ``i``'s delta (its record's VJP)."""
        self.parts[i] = g.to_dense() if type(g) is SparseRows or type(g) is SplitDelta else g
        return self

    def add(self, source: Source, delta: Any) -> Gather:
        """A gathered operand's delta, of which ``source`` says which rows are this group's."""
        self.rows.append((source, delta))
        return self

    def accumulate(self, delta: Any, read: Any) -> Gather:
        """A joint's slice of its delta: all the group's rows, in order (an
        `OutputsDelta` for several outputs), of which ``read`` (host indices)
        carry one. Summed now, into an array of the
        group's own (a copy the first time): a slice is a view of the joint's
        scatter, which is freed once every group it reads has taken its rows,
        so that a group read by many levels holds one delta, not a scatter per
        level."""
        pieces = delta.parts if type(delta) is OutputsDelta else (delta,)
        self.read.append((read, [d is not None for d in pieces]))  # (not the slices: views of the scatter)
        if self.whole is None:
            self.whole = [None] * len(pieces)
        for k, d in enumerate(pieces):
            if d is None:
                continue
            held = self.whole[k]
            if held is None:
                self.whole[k] = namespace(d).asarray(d, copy=True)
            else:
                held += d
        return self

    def __add__(self, other: object) -> Gather:
        assert other is self, "a group's delta combines only with itself"
        return self

    def dense(self) -> Any:
        """The summed delta (zeros for rows that got none)."""
        if self.stacked is None:
            like = self.like
            whole = self.whole
            if type(like) is StackedOutputs:  # a group of operation nodes with several outputs
                self.reached, self.seen = _seen(like, self.rows, self.parts, self.read)
                parts = []
                for k, part in enumerate(like.parts):
                    rows = [(s, d.parts[k]) for s, d in self.rows if d.parts[k] is not None]
                    members = {i: d.parts[k] for i, d in self.parts.items() if d.parts[k] is not None}
                    start = None if whole is None else whole[k]
                    parts.append(_summed(part, rows, members, start) if rows or members or start is not None else None)
                self.stacked = OutputsDelta(tuple(parts))
            else:
                self.reached = reached = _reached(like.shape[0], self.rows, self.parts, [r for r, _ in self.read])
                start = None if whole is None else whole[0]
                self.stacked = _summed(like, self.rows, self.parts, start, reached is None)
            self.rows, self.parts, self.whole, self.read = [], {}, None, []
        return self.stacked


def _reached(n: int, rows: list[tuple[Source, Any]], members: dict[int, Any], read: list[Any]) -> Any:
    """Which of a group's ``n`` members got a delta from ``rows`` (gathered
    operands'), ``members`` (their own records') and ``read`` (joints' rows):
    a host mask, or None for all."""
    if len(members) == n:
        return None
    mask = np.zeros(n, dtype=bool)
    for source, _ in rows:
        if source.rows is None:
            return None
        mask[source.rows] = True
    for r in read:
        mask[r] = True
    if members:
        mask[list(members)] = True
    return None if mask.all() else mask


def _seen(
    like: StackedOutputs, rows: list[tuple[Source, Any]], members: dict[int, Any], read: list[tuple[Any, Any]]
) -> tuple[Any, list[Any] | None]:
    """Of a group with several outputs: which members got a delta (as
    `_reached`), and per output which got one for it, where the members
    reached read different outputs (else None: each output's delta has a
    row for every member reached, or for none)."""
    n = like.shape[0]
    seen = [
        _reached(
            n,
            [(s, d) for s, d in rows if d.parts[k] is not None],
            {i: d for i, d in members.items() if d.parts[k] is not None},
            [r for r, carried in read if carried[k]],
        )
        for k in range(len(like.parts))
    ]
    if all(s is None for s in seen):  # (every member got a delta for every output: a tree's)
        return None, None
    masks = [np.ones(n, dtype=bool) if s is None else s for s in seen]
    hit = np.logical_or.reduce(masks)
    mixed = any(m.any() and not (m | ~hit).all() for m in masks)
    return (None if hit.all() else hit), (masks if mixed else None)


def _summed(
    like: Any, rows: list[tuple[Source, Any]], members: dict[int, Any], start: Any = None, covered: bool | None = None
) -> Any:
    """The delta of ``like`` (a stacked output) from gathered rows and members'
    own deltas, added to ``start`` (the joints' slices summed, an array of its
    own) if there is one. ``covered``: whether ``rows`` and ``members`` hold
    a delta for every row, when known."""
    if start is not None:
        out, tiled = start, False
    else:
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
            if covered is None:
                covered = _reached(n, rows, members, []) is None
            tiled = covered and sum(n if s.rows is None else len(s.rows) for s, _ in rows) == n
        shape, dtype, device = like.shape, like.dtype, like.device
        out = xp.empty(shape, dtype=dtype, device=device) if tiled else xp.zeros(shape, dtype=dtype, device=device)
    for source, d in rows:
        if tiled:
            index = source.indices
            out[slice(None) if index is None else index] = d if source.positions is None else d[source.positions]
        else:
            out = _add_rows(out, source, d)
    for i, d in members.items():
        out[i] += d
    return out


def _add_rows(out: Any, source: Source, d: Any) -> Any:
    """``out`` with a gathered operand's delta ``d`` added at the rows ``source`` names."""
    if source.positions is not None:
        d = d[source.positions]
    index = source.indices
    if index is None:
        out += d
    elif source.unique:
        out[index] += d
    else:  # a node read twice by one gathered operand: its rows add up
        out = scatter_add(namespace(out), out, index, d)
    return out
