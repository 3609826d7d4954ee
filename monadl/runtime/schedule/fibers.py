"""Batching across data-dependent control flow: the layer graphs of many fibers, as one.

When many examples are evaluated together (a loss summed over examples that
each choose their path by their own values, with ``bind`` or ``await`` in
``@ml.direct``), each example is a fiber of `monadl.runtime.interpret`. A
fiber that reaches a layer graph while other fibers can still run *parks*
there instead of computing it alone. When no fiber can run, the parked graphs
are merged (the union of their nodes, each once, in one topological order)
and run as one graph, through the batching scheduler where the cost rules say
so (`MIN_MERGED` here, then
`monadl.runtime.schedule.batched_rule.worth_batching`, told how many of the graphs
are alike), so that the k examples' nodes of equal signature run as one
kernel; then every parked fiber resumes with its values. A fiber whose
direct-style coroutine a task is stepping is waited for, unless its step said
it awaits something foreign (it may be waiting for a parked fiber; a turn of
the event loop that an ``ml.gradients`` inside the step gives is not foreign,
`monadl.runtime.stepping.step_in_task`): so which
graphs run together does not depend on the order the event loop runs tasks
in (trio's is random), and the parked fibers are taken in the order their
branches were written. So each example runs
up to its next read, all pending nodes of all examples are computed together,
each example gets its values and continues: what DyNet's autobatching (which
stops at the first read) and Fold (which needs the whole structure first)
cannot batch.

Which graphs run together, and how they line up: a merged run's nodes are
levelled by their distance to each fiber's read (`heights`), not from the
inputs, so that a step's product lines up across fibers whatever each
computed before it; and a graph of a kind no fiber was seen to park at twice
(a parse's last graphs: not a step of its loop) waits while graphs of steps
are parked (`Parked.take`), so that those run together at the end, not a few
in each of many runs. Each
group of products reads its weight once forward and once backward: fewer,
larger groups read it fewer times.

The runs of one evaluation share their groups: a later run's group reads an
earlier run's members by index (a parser's stack entries), and sends their
delta back in one scatter per group. A weight's delta from the runs' products
is kept as their rows and the rows' deltas (`batched_records.Outer`),
multiplied once when the counted release releases the weight, not a
weight-sized product and addition per run.

Nothing else changes: a node is computed by the same `compute`, back-propagated
by the same backward, shared nodes once; a failure raises the node's own error
(at the user's line) and fails the evaluation. A graph holding layers built
from a ``Do`` (a recursion's ``@ml.direct`` calls) has them evaluated first,
side by side, each parking at its own graphs; what it builds on them parks
after them (`parks`), so a recursive decoder's losses merge level by level.
On a GPU a merged run batches however
few its graphs (`run`). ``Settings.batching=False`` parks all the same and
runs the merged graph node by node (its branches on CUDA streams on a GPU, as
`monadl.runtime.graphs` runs one graph that does not batch): the examples
then step in the same order, every example's first step, then every second
step, and examples that draw from one random generator draw the same numbers
with batching on or off.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from itertools import pairwise
from typing import Any, Final, final

from monadl.layers._layer import Layer
from monadl.runtime import frames as F
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import collect, compute
from monadl.runtime.schedule import batched, cuda, inline
from monadl.runtime.schedule.batched_groups import Groups
from monadl.runtime.schedule.batched_log import merged, unbatched
from monadl.runtime.schedule.batched_rule import MIN_NODES
from monadl.runtime.settings import current_settings

__all__ = ["MIN_MERGED", "PARKED", "Parked", "heights", "merge", "parks", "run"]

MIN_MERGED: Final = 10
"""Automatic mode batches a merge of at least this many fibers' graphs that
are alike, ending at one line or a model's steps (`_similar`; or
one of `monadl.runtime.schedule.batched_rule.MIN_NODES` nodes or more),
whatever its weights' size: batching saves per-node work for each member
of a group, and a merge of few graphs has few members a group. In
`benchmarks/control_flow.py`'s parser (merged runs batched against run
node by node, 2026-11-26), 2 and 4 sentences lost 2-8% batched at hidden
128 to 1024; 8 gained up to 18% from hidden 24 on but lost 12% at 16; 10
and 12 gained 3-27% at every size from 16 to 512, 32 gained 1.5-2x. So
from 10 on batching never lost; below, a merge runs node by node, giving
up what 8 and 9 would gain at most sizes. (The rule before asked for
weights of 4,096 elements per merged node: it left a batch of 32
unbatched below hidden 128, 1.5-1.75x slower, and batched 2 to 4 sentences
at any size.) Every parked graph counts, alike or not: the steps of one
model differ by their path (a parser's tracker after a shift, or after a
reduce's composition) yet line up by height (`heights`), each adding a
member to the same groups."""

PARKED: Final = object()
"""What a fiber waits on while parked: the next merged run."""


_KINDS_LIMIT: Final = 4096
_steps: set[Any] = set()
"""Kinds of graph (the line of a graph's last node) at which a fiber was seen
to park twice in one evaluation: a step of a loop (a parser's tracker)."""
_leads: set[Any] = set()
"""Kinds of graph that some fiber parked at before it parked at a step (a
model's first graph, or one between two loops). A graph of any other kind
(a parse's last graphs, its loss) waits in `Parked.take` while graphs of
steps or of these kinds are parked."""


def _learn(kinds: set[Any], kind: Any) -> None:
    if len(kinds) >= _KINDS_LIMIT:
        kinds.clear()
    kinds.add(kind)


@final
class Parked:
    """The fibers parked at their graphs, and the graphs' nodes in order;
    the groups that earlier merged runs of the evaluation batched; the kinds
    of graph each fiber parked at so far."""

    __slots__ = ("fibers", "groups", "orders", "seen")

    def __init__(self) -> None:
        self.fibers: list[F.Fiber] = []
        self.orders: list[list[Any]] = []
        self.groups: Groups | None = None
        self.seen: dict[F.Fiber, set[Any]] = {}

    def add(self, fiber: F.Fiber, frame: F.Graph) -> None:
        """Park ``fiber`` at ``frame``, whose order `parks` collected."""
        order = frame.order
        assert order is not None
        self.fibers.append(fiber)
        self.orders.append(order)
        kind = order[-1]._site
        seen = self.seen.get(fiber)
        if seen is None:
            self.seen[fiber] = {kind}
            return
        if kind in seen and kind not in _steps:  # the second time here: a step
            _learn(_steps, kind)
        if kind in _steps:
            for earlier in seen:  # (a few kinds)
                if earlier not in _steps and earlier not in _leads:
                    _learn(_leads, earlier)
        seen.add(kind)

    def take(self) -> tuple[list[F.Fiber], list[list[Any]]]:
        """The fibers to run now and their graphs' orders; the rest stay parked.

        A graph that is no step and was never seen to lead to one
        (`_steps`, `_leads`: a parse's last graphs, its loss) waits while
        graphs of steps or leading to them are parked: the last graphs of
        many fibers then run as one, late, instead of a few in each of many
        runs (at hidden 512 the shift-reduce parser's matrix products, each
        reading its weight once per group, fell from 119 groups a step to 63
        with `heights`). A graph that leads to a step is not held: its
        fiber's loop would run late, alone."""
        fibers, orders = self.fibers, self.orders
        if len(fibers) > 1:  # in the order the branches were written: a merge's order, its sums', is the same every run
            places = [f.place() for f in fibers]  # (trio resumes tasks in random order, and they park so)
            if any(a > b for a, b in pairwise(places)):
                ranks = sorted(range(len(fibers)), key=places.__getitem__)
                fibers, orders = [fibers[k] for k in ranks], [orders[k] for k in ranks]
        steps = [(kind := order[-1]._site) in _steps or kind in _leads for order in orders]
        if all(steps) or not any(steps):
            self.fibers, self.orders = [], []
            return fibers, orders
        self.fibers = [f for f, step in zip(fibers, steps) if not step]
        self.orders = [o for o, step in zip(orders, steps) if not step]
        return [f for f, step in zip(fibers, steps) if step], [o for o, step in zip(orders, steps) if step]

    def __bool__(self) -> bool:
        return bool(self.fibers)


def parks(ev: Evaluation, frame: F.Graph) -> bool | int:
    """Whether the graph of ``frame`` may wait for a merged run: one made of
    primitives only, not begun (on the host or a GPU), or what is left of
    one back from its layers built from a ``Do``. Its order is kept on the
    frame if so. A graph that holds such layers, not evaluated yet, gives
    the index in its order (kept on the frame) of the first: they are
    evaluated first (`monadl.runtime.graphs.dos`: a recursion's calls, side
    by side, each parking at its own graphs), and what the graph builds on
    them parks after them, merged with the other examples' graphs (a
    recursive tree decoder's losses, before: node by node, each example's
    alone)."""
    order = frame.order
    if order is not None:
        if not frame.redo:  # (begun: computed in part, or by a scheduler)
            return False
        computed = ev.records.computed
        order = [node for node in order[frame.index :] if not computed(node)]
        if not order:
            return False
    else:
        order = collect(ev, frame.roots)
        if not order:
            return False
    for i, node in enumerate(order):
        if node._op is None:  # a layer built from a Do: evaluated first, the graph parks after it
            frame.order, frame.index = order, 0
            return i
    frame.order, frame.index, frame.redo = order, 0, False
    return True


def run(ev: Evaluation, parked: Parked) -> Generator[Any, Any, list[F.Fiber]]:
    """Compute the parked graphs as one; returns the fibers to resume (the
    parked list is emptied)."""
    fibers, orders = parked.take()
    try:
        yield from _run_merged(ev, parked, orders)
    except Exception as exc:
        _note_example(ev, exc, fibers, orders)
        raise
    for fiber in fibers:  # past its Graph frame: the next frame reads its records
        fiber.save(fiber.stack, None, None, None, False)
    return fibers


def _note_example(ev: Evaluation, error: Exception, fibers: list[F.Fiber], orders: list[list[Any]]) -> None:
    """Note on an error of a merged run which example's graph held the node
    that raised it (`Fiber.note_example`): the examples' graphs are built by
    one function at one line, so the error's line alone could not tell them
    apart (a new user's out-of-range token in one of 32 decoders)."""
    node, ev.failed = ev.failed, None
    if node is not None:
        for fiber, order in zip(fibers, orders):
            if node in order:
                fiber.note_example(error)
                return


def _run_merged(ev: Evaluation, parked: Parked, orders: list[list[Any]]) -> Generator[Any, Any, None]:
    """`run`'s computation of the parked graphs' union."""
    order, alike = merge(ev, orders)
    if order:
        batching = current_settings().batching
        # On a GPU a merged run pays however few its graphs: the host's launches are the cost.
        similar = _similar(orders)
        pays = batching is True or similar >= MIN_MERGED or len(order) >= MIN_NODES
        if batching is False:  # node by node; on a GPU as one graph that does not batch (parks(): no Do layers)
            if cuda.loaded() and cuda.on_device(ev.records, order):
                cuda.forward(order, ev.cuda_streams, lambda node: ev.records.__setitem__(node, compute(ev, node, True)))
                order = []
        elif not pays and not (cuda.loaded() and cuda.on_device(ev.records, order)):
            unbatched(
                order,
                f"a merge of {len(orders)} fibers' graphs, {similar} of them alike (ending at one line, or a model's "
                f"steps), fewer than {MIN_MERGED} (MIN_MERGED)",
            )
        elif batched.worth_batching(ev, order, alike):
            merged(order, len(orders))
            if parked.groups is None:
                parked.groups = Groups(ev.records, outer=True)
                ev.effects = True  # (as a Do layer sets it) the counted release: it makes the factored deltas arrays
            # One `Groups` for all runs: a later run's group reads an earlier one's
            # members by index (a parser's stack entries, computed steps before), and
            # its delta goes back in one scatter per group, not a view per member.
            levels = heights(order)
            if time.perf_counter() > ev.deadline:  # (the merge and its levels of a large batch's graphs)
                yield inline.CHECKPOINT
            order = yield from batched.stepwise(ev, order, parked.groups, levels)  # (it leaves none: no Do layers)
        index = 0
        while True:
            outcome, index = inline.forward(ev, order, index, True)
            if outcome is None:
                break
            assert outcome is inline.CHECKPOINT  # no Do layers: parks() said so
            yield inline.CHECKPOINT
        if time.perf_counter() > ev.deadline:  # many small graphs add up too
            yield inline.CHECKPOINT


def merge(ev: Evaluation, orders: list[list[Any]]) -> tuple[list[Any], int]:
    """The union of the graphs ``orders`` (each in topological order) in one
    topological order, each node once, leaving those computed meanwhile; and
    how many graphs are alike (built at one line, with as many nodes).

    >>> import numpy as np, monadl as ml
    >>> from monadl.runtime.evaluation import Evaluation
    >>> w = ml.Weight(np.ones((2, 2)))
    >>> shared = w * 2.0
    >>> a, b = (ml.sum(np.ones(2) @ w + shared) for _ in range(2))  # built at one place
    >>> graphs = [[shared, *x._inputs[0]._inputs, x._inputs[0], x] for x in (a, b)]
    >>> order, alike = merge(Evaluation(train=False), graphs)
    >>> len(order), alike
    (7, 2)
    """
    computed = ev.records.computed
    seen: set[Any] = set()
    order: list[Any] = []
    shapes: dict[Any, int] = {}
    for part in orders:
        # Concatenated topological orders, each node at its first place, stay topological.
        for node in part:
            if node not in seen and not computed(node):  # another fiber's graph may have computed it
                seen.add(node)
                order.append(node)
        if part:
            key = (part[-1]._site, len(part))
            shapes[key] = shapes.get(key, 0) + 1
    return order, max(shapes.values(), default=0)


def _similar(orders: list[list[Any]]) -> int:
    """How many of the graphs are alike enough for their nodes to group:
    those that end at one line, or those of the kinds known as a model's
    steps (`_steps`, `_leads`: reached again and again, whatever line built
    the node a step reads, one branch's or another's). Examples that stop
    early park graphs that end elsewhere, and few of their nodes group: a
    merge of 16 examples of which 9 read at one line ran 8-18% slower
    batched than node by node (a new user's early-stopping RNN), counted by
    examples; 16 examples that read a node built on one of two lines, 8
    each, lost their batching (a review's), counted by lines alone."""
    sites: dict[Any, int] = {}
    steps = 0
    for part in orders:
        if part:
            site = part[-1]._site
            sites[site] = sites.get(site, 0) + 1
            steps += site in _steps or site in _leads
    return max(steps, *sites.values()) if sites else 0


def heights(order: list[Any]) -> list[list[Any]]:
    """The nodes of ``order`` (topological) by height: the longest path to
    a node that none of ``order`` uses, the highest first. So each fiber's
    read (its graph's last node) is at height 0, and the steps before it
    line up by their distance to it, whatever each fiber computed first (a
    parser's tracker after a shift, or after a reduce's composition): one
    group per step, where depth from the inputs makes one per path length.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((2, 2)))
    >>> a = ml.tanh(np.ones((1, 2)) @ w)
    >>> b = ml.tanh(ml.tanh(np.ones((1, 2))) @ w)  # one step more before its product
    >>> levels = heights([a._inputs[0], a, b._inputs[0]._inputs[0], b._inputs[0], b])
    >>> [[node._op.name for node in level] for level in levels]
    [['tanh'], ['matmul', 'matmul'], ['tanh', 'tanh']]
    """
    height: dict[Any, int] = {}
    get = height.get
    for node in reversed(order):
        h = get(node, 0)
        height[node] = h
        h += 1
        for x in node._inputs:
            if type(x) is Layer and get(x, -1) < h:
                height[x] = h
    top = max([height[node] for node in order], default=-1)
    levels: list[list[Any]] = [[] for _ in range(top + 1)]
    for node in order:
        levels[top - height[node]].append(node)
    return [level for level in levels if level]
