"""Dynamic batching: a scheduler that runs nodes of equal signature as one kernel.

A graph's nodes are grouped by *signature* (DyNet's ``autobatch_sig``): the
primitive, its parameters, the shapes, dtypes and array types of its operands,
and the identity of weights it uses. Plain numbers among its operands are in
it by kind for an elementwise primitive or an operation (`ml.operation`),
whose group stacks its members' numbers as a column in the dtype that each
member's number computes in (`batched_records.number_columns`: a Python
number beside a float32 array computes in float32; an operation's program
decides it step by step),
or else groups them by value; for the others, by value. Nodes of one signature that are ready
together run as one call of the primitive's batching rule
(`monadl.layers._batching_rules`) on their operands stacked along a new
leading axis (a run over one graph, its groups and their operands:
`monadl.runtime.schedule.batched_run`). Here: the levels of a graph, the
grouping strategy, the event loop's turns between levels, and what a run
paid, remembered.

Batching is a rewrite into ordinary records (`monadl.runtime.schedule.batched_records`):
per batched operand a gather record (rows of earlier groups' outputs, by
index) or a stack record, a group record, and per member a record made when
something other than a gather reads it (its value a view of the group's
output), so the one node backward of `monadl.runtime.backward.backprop`
back-propagates it unchanged.

Grouping is by depth (the longest path from the graph's inputs: nodes of one
depth never depend on each other) or by agenda (DyNet's: of the groups ready,
run the one whose kind of operation sits earliest in the graph on average,
the largest on ties: `monadl.runtime.schedule.batched_agenda`). `STRATEGY`
says which is the default, and why.

Cost rule: batching is on where it pays. Whether a graph comes here at all is
`monadl.runtime.schedule.batched_rule`'s (cheap checks, before any signature);
here, a graph whose widest depth has one node runs as before, and a group
smaller than `MIN_GROUP` (a marked operation's: 2 to 4, `marked_minimum`; products that pack a
large weight, and in merged runs any product by a large one: `MIN_PACKED`) or whose members are coarse
(`MAX_MEMBER_SIZE`) runs node by node; a graph whose analysis batched nothing, or
under a third of its nodes with no group that saves more than its members' dispatch (`BATCHED_SHARE`),
is analysed again 1, 2, 4, ... and at most `REPROBE` evaluations later. Graphs that the fork rule
sends to the worker pool are not batched (the hook sits on the inline path of
`monadl.runtime.interpret`); on a GPU a graph that does not batch runs its
branches on CUDA streams instead. ``Settings.batching``
forces either way. Under ``check_finite`` (per-node debugging) nothing is
batched.
"""

from __future__ import annotations

from collections.abc import Generator
from itertools import islice
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final

from monadl.layers._layer import Layer
from monadl.runtime.node import PIECE
from monadl.runtime.schedule.batched_agenda import agenda
from monadl.runtime.schedule.batched_log import paid_nothing, ran
from monadl.runtime.schedule.batched_rule import (
    BATCHED_SHARE,
    MAX_MEMBER_SIZE,
    MIN_ALIKE,
    MIN_GROUP,
    MIN_NODES,
    NOTHING_PAID,
    PAID_LITTLE,
    REPROBE,
    paid,
    remember,
    worth_batching,
)
from monadl.runtime.schedule.batched_run import Run
from monadl.runtime.schedule.batched_signature import signature
from monadl.runtime.schedule.inline import CHECKPOINT
from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from monadl.runtime.evaluation import Evaluation
    from monadl.runtime.schedule.batched_groups import Groups

__all__ = [
    "MAX_MEMBER_SIZE",
    "MIN_ALIKE",
    "MIN_GROUP",
    "MIN_NODES",
    "REPROBE",
    "STRATEGY",
    "forward",
    "signature",
    "stepwise",
    "worth_batching",
]

STRATEGY: Final = "depth"
"""The default grouping, "depth" or "agenda". Depth measured faster in
`benchmarks/batching.py` (Tree-LSTM, 128-leaf random trees, batch 32, one
thread: 1.43x and 2.36x unbatched at hidden 128 and 256, agenda 1.14x and
2.17x): its groups are whole levels, so a group's consumers are more often
exactly its members in order and take its output without a copy."""


def forward(
    ev: Evaluation,
    order: list[Any],
    strategy: str | None = None,
    groups: Groups | None = None,
    levels: list[list[Any]] | None = None,
) -> list[Any]:
    """Compute the records of ``order`` (a graph in topological order), group
    by group; returns the nodes it left: those built from a ``Do`` and all
    that depend on one, in order, for the caller's loop (which skips the
    nodes computed here).

    ``groups``: the groups of earlier runs in the same evaluation (the merged
    runs of `monadl.runtime.schedule.fibers`), which this run adds to: a
    group whose operands are their members reads them by index, and sends
    their deltas back in one scatter per group, not a view per member.
    ``levels``: the caller's levels of ``order``, no ``Do`` layers among them (`fibers.heights`).

    >>> import numpy as np, monadl as ml
    >>> from monadl.runtime.evaluation import Evaluation
    >>> from monadl.runtime.node import collect as _collect
    >>> w = ml.Weight(np.ones((3, 2)))
    >>> nodes = [np.full(3, float(i)) @ w for i in range(4)]
    >>> ev = Evaluation(train=False)
    >>> with ml.settings(batching=True):
    ...     forward(ev, _collect(ev, nodes))
    []
    >>> ev.records[nodes[2]].value
    array([6., 6.])
    """
    steps = _steps(ev, order, strategy, groups, levels)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            left: list[Any] = done.value
            return left


def _steps(
    ev: Evaluation,
    order: list[Any],
    strategy: str | None = None,
    groups: Groups | None = None,
    levels: list[list[Any]] | None = None,
) -> Generator[object, None, list[Any]]:
    """`forward`, yielding `CHECKPOINT` where the evaluation's deadline has
    passed: after the levels are found and after each level; returns what
    `forward` returns."""
    run = Run(ev, current_settings().batching is True, groups)
    if levels is None:
        levels, left, depth = yield from _levels(ev, order)
    else:
        left, depth = [], None
    if perf_counter() > ev.deadline:
        yield CHECKPOINT
    if not run.forced and max(map(len, levels), default=0) < 2:
        for level in levels:
            run.each(level)
            if perf_counter() > ev.deadline:
                yield CHECKPOINT
    elif (strategy or STRATEGY) == "agenda" and depth is not None:
        agenda(run, levels, depth)
    else:
        for level in levels:
            run.level(level)
            if perf_counter() > ev.deadline:
                yield CHECKPOINT
    little = not run.saving and run.batched * BATCHED_SHARE < len(order)
    if little and not run.forced and order:  # nothing paid, or too little: skip the analysis next time
        why = PAID_LITTLE if run.batches else NOTHING_PAID
        wait = remember((order[-1]._site, len(order)), False, why)
        then = f"analysed again {wait} evaluation(s) later (at most {REPROBE})"
        if run.batches:
            why = f"{why}: {run.batched:,} of its {len(order):,} nodes in {run.batches} group(s)"
        paid_nothing(order, why, then, run.alone, run.records, run.groups.where)
    elif order:
        if run.batches:
            paid((order[-1]._site, len(order)))
        ran(order, run.batches, run.batched, run.alone, run.records, run.groups.where)
    return left


def stepwise(
    ev: Evaluation, order: list[Any], groups: Groups | None = None, levels: list[list[Any]] | None = None
) -> Generator[object, None, list[Any]]:
    """`forward` of one graph, as the interpreter runs it: yielding `CHECKPOINT`
    after a level when the evaluation's deadline has passed (the driver then
    gives the event loop its turn, as between the inline loop's nodes)."""
    return _steps(ev, order, None, groups, levels)


def _levels(
    ev: Evaluation, order: list[Any]
) -> Generator[object, None, tuple[list[list[Any]], list[Any], dict[Any, int]]]:
    """Nodes by depth (the longest path from operands computed before); and
    the nodes at or under a ``Do``-built layer, left out (their depth -1 in
    the map, so that one lookup per operand says both). Yields `CHECKPOINT`
    between pieces of a large graph once ``ev``'s deadline has passed (a
    90,000-node chain's took 42 ms)."""
    depth: dict[Any, int] = {}
    get = depth.get
    levels: list[list[Any]] = []
    left: list[Any] = []
    walking = iter(order)
    for start in range(0, len(order), PIECE):
        if start and perf_counter() > ev.deadline:
            yield CHECKPOINT
        for node in islice(walking, PIECE):
            d = 0
            if node._op is None:
                d = -1
            else:
                for x in node._inputs:
                    if type(x) is Layer:
                        dx = get(x)
                        if dx is not None and dx >= d:
                            d = dx + 1
                        elif dx == -1:
                            d = -1
                            break
            if d < 0:
                depth[node] = -1
                left.append(node)
                continue
            depth[node] = d
            if d == len(levels):
                levels.append([node])
            else:
                levels[d].append(node)
    return levels, left, depth
