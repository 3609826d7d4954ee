"""A batched group run again on the members that got a delta (`Again`).

A group's delta has a zero row for each member that got none (its output
unread, or read under ``stop_gradient``) and, for operation nodes with
several outputs, for each output a member left unread while others read it.
Those zeros are no delta: alone, such a member sends nothing. But a zero
times an infinite derivative (``sqrt``'s at 0), or times an infinite
operand, is a NaN in a delta the group shares (a weight's, summed over its
members). `monadl.runtime.schedule.batched_records` hands such a group's
VJPs here when a delta they make is not finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import numpy as np

from monadl._namespace import index_for, namespace
from monadl.deltas import SparseRows
from monadl.layers._operands import Numbers
from monadl.layers._outputs import OutputsDelta, StackedOutputs
from monadl.layers._program import Program
from monadl.layers._split import SplitDelta
from monadl.runtime.schedule.batched_gather import Gather
from monadl.runtime.schedule.batched_operands import PRODUCTS, Operand, factor_products

__all__ = ["Again"]


@final
class Again:
    """A group's rule and what it ran with, to run it again on the members
    that got a delta: where a delta of the group's VJPs is not finite and
    some members got none (or, with several outputs, got a delta for some
    outputs and not others: `Gather.seen`), the members of each pattern of
    outputs read run again as a group, and each pattern's deltas are what
    its members send alone (a NaN they make themselves stays)."""

    __slots__ = ("args", "batched", "first", "n", "operands", "outer", "rule", "runs", "scalars")

    def __init__(
        self,
        rule: Callable[..., Any],
        batched: tuple[bool, ...],
        scalars: tuple[bool | None, ...] | None,
        outer: bool,
        args: list[Any],
        operands: list[Operand],
        first: Any,
        n: int,
    ) -> None:
        self.rule = rule
        self.batched = batched
        self.scalars = scalars  # (an operation's program's: which operands are numbers; else None)
        self.outer = outer
        self.args = args  # (the rule's operands: the group's records hold them already)
        self.operands = operands
        self.first = first  # (and ``n`` members)
        self.n = n
        self.runs: list[tuple[Any, Any, tuple[Any, ...]]] | None = None

    def reaching(self, p: int, gather: Gather) -> Any:
        """Which members send operand ``p`` a delta, where they read
        different outputs (`Gather.seen`): those whose outputs read depend
        on it (an operation's `Program.feeds`; a host mask, None: all).
        The others' rows are zeros, no delta: sent on, a zero times an
        infinite derivative where the operand was made is a NaN."""
        seen = gather.seen
        assert seen is not None
        rule = self.first._op.rule
        feeds = rule.feeds[p] if type(rule) is Program and p < len(rule.feeds) else range(len(seen))
        mask = np.zeros(self.n, dtype=bool)
        for k in feeds:
            mask |= seen[k]
        return None if mask.all() else mask

    def reaching_parts(self, p: int, gather: Gather) -> list[Any] | None:
        """Per output of operand ``p`` (operation nodes with several, read
        by the program's views: `Program.part_feeds`), which members send it
        a delta (a host mask, None: all), as `reaching` for a whole operand;
        None where the operand has no such outputs, or all its outputs are
        sent by the same members."""
        seen = gather.seen
        assert seen is not None
        rule = self.first._op.rule
        if type(rule) is not Program:
            return None
        parts = sorted(k for q, k in rule.part_feeds if q == p)
        if not parts:
            return None
        masks: list[Any] = [None] * (parts[-1] + 1)
        for k in parts:
            mask = np.zeros(self.n, dtype=bool)
            for o in rule.part_feeds[(p, k)]:
                mask |= seen[o]
            masks[k] = mask  # (an output no view reads: None, no delta at all)
        found = [m for m in masks if m is not None]
        return None if all(np.array_equal(m, found[0]) for m in found) else masks

    def delta(self, p: int, gather: Gather, made: Any) -> Any:
        """Operand ``p``'s delta as the members that got one send it (``made``
        where the rule declines to run again)."""
        if self.runs is None:
            self.runs = self._runs(gather)
        if not self.runs:
            return made
        total = None
        for keep, d, vjps in self.runs:
            g = vjps[p](d)
            if g is not None and self.batched[p]:
                g = _spread(g, keep, self.n)
            total = g if total is None else total if g is None else total + g
        return total

    def _runs(self, gather: Gather) -> list[tuple[Any, Any, tuple[Any, ...]]]:
        """Per pattern of outputs read: its members (host indices), their
        delta, the VJPs of the rule run on them alone."""
        dense = gather.stacked
        if gather.seen is None:
            patterns = [(gather.reached, dense)]
        else:
            code = sum(m.astype(np.intp) << k for k, m in enumerate(gather.seen))
            patterns = [
                (code == c, OutputsDelta(tuple([q if c >> k & 1 else None for k, q in enumerate(dense.parts)])))
                for c in np.unique(code[code != 0]).tolist()
            ]
        runs = []
        for mask, d in patterns:
            keep = np.flatnonzero(mask)
            args = [_rows(a, keep, self.first, k) if b else a for k, (a, b) in enumerate(zip(self.args, self.batched))]
            if self.scalars is None:
                result = self.rule(tuple(args), self.batched, len(keep))
            else:
                result = self.rule(tuple(args), self.batched, len(keep), scalars=self.scalars)
            if result is None:
                return []
            vjps = result[1]
            if self.first._op.name in PRODUCTS:
                vjps = factor_products(vjps, self.operands, args, self.outer)
            runs.append((keep, _rows(d, keep, None, 0), vjps))
        return runs


def _rows(value: Any, keep: Any, first: Any, p: int) -> Any:
    """Rows ``keep`` (host indices) of a group's operand ``p`` (``first``:
    its first member) or delta: arrays, several outputs' (stacked values,
    deltas), numbers, an index holding arrays stacked (those that are not
    the first member's own)."""
    kind = type(value)
    if kind is StackedOutputs:
        return StackedOutputs(tuple([_rows(q, keep, first, p) for q in value.parts]))
    if kind is OutputsDelta:
        return OutputsDelta(tuple([None if q is None else _rows(q, keep, first, p) for q in value.parts]), (len(keep),))
    if kind is Numbers:
        return Numbers(value.values[keep], value.kind)
    if kind is tuple:  # (an index parameter: its items that differ between members were stacked)
        own = first._params[p - len(first._inputs)]
        return tuple([q if q is o else _rows(q, keep, first, p) for q, o in zip(value, own)])
    if kind is SparseRows or kind is SplitDelta:
        value = value.to_dense()
    return value[index_for(value, keep)]


def _spread(g: Any, keep: Any, n: int) -> Any:
    """A delta of rows ``keep`` of ``n`` (an operand's of the members run
    again) as all ``n``'s, the others' rows zeros (its stack or gather
    record sends them nothing: `_narrow`)."""
    if type(g) is OutputsDelta:
        return OutputsDelta(tuple([None if q is None else _spread(q, keep, n) for q in g.parts]), (n,))
    if type(g) is SparseRows or type(g) is SplitDelta:
        g = g.to_dense()
    xp = namespace(g)
    out = xp.zeros((n, *g.shape[1:]), dtype=g.dtype, device=g.device)
    out[index_for(g, keep)] = g
    return out
