"""Batching across data-dependent control flow: the layer graphs of many fibers, as one.

When many examples are evaluated together (a loss summed over examples that
each choose their path by their own values, with ``bind`` or ``await`` in
``@ml.direct``), each example is a fiber of `monadl.runtime.interpret`. A
fiber that reaches a layer graph while other fibers can still run *parks*
there instead of computing it alone. When no fiber can run, the parked graphs
are merged (the union of their nodes, each once, in one topological order)
and run as one graph, through the batching scheduler where the cost rule says
so (`monadl.runtime.schedule.batched.worth_batching`, told how many of the
graphs are alike), so that the k examples' nodes of equal signature run as one
kernel; then every parked fiber resumes with its values. So each example runs
up to its next read, all pending nodes of all examples are computed together,
each example gets its values and continues: what DyNet's autobatching (which
stops at the first read) and Fold (which needs the whole structure first)
cannot batch.

Nothing else changes: a node is computed by the same `compute`, back-propagated
by the same backward, shared nodes once; a failure raises the node's own error
(at the user's line) and fails the evaluation. Graphs holding a layer built
from a ``Do``, graphs on a GPU, and evaluations with the worker pool
(``workers > 1``) keep their own path; ``Settings.batching=False`` turns
parking off.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any, Final

from monadl.runtime import frames as F
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import collect
from monadl.runtime.schedule import batched, cuda, inline
from monadl.runtime.settings import current_settings

__all__ = ["PARKED", "Parked", "enabled", "merge", "parks", "run"]

PARKED: Final = object()
"""What a fiber waits on while parked: the next merged run."""


def enabled(ev: Evaluation) -> bool:
    """Whether fibers of ``ev`` park at their graphs: not with the worker pool
    (its fork rule decides per graph), nor with batching forced off."""
    return ev.workers <= 1 and current_settings().batching is not False


class Parked:
    """The fibers parked at their graphs, and the graphs' nodes in order."""

    __slots__ = ("fibers", "orders")

    def __init__(self) -> None:
        self.fibers: list[F.Fiber] = []
        self.orders: list[list[Any]] = []

    def add(self, fiber: F.Fiber, frame: F.Graph) -> None:
        """Park ``fiber`` at ``frame``, whose order `parks` collected."""
        assert frame.order is not None
        self.fibers.append(fiber)
        self.orders.append(frame.order)

    def __bool__(self) -> bool:
        return bool(self.fibers)


def parks(ev: Evaluation, frame: F.Graph) -> bool:
    """Whether the graph of ``frame`` may wait for a merged run: one made of
    primitives only, on the host, not begun. Its order is kept on the frame if so."""
    if frame.order is not None:
        return False
    order = collect(ev, frame.roots)
    if not order:
        return False
    for node in order:
        if node._op is None:  # a layer built from a Do: its fibers take today's path
            return False
    if cuda.loaded() and cuda.on_device(ev.records, order):
        return False
    frame.order = order
    return True


def run(ev: Evaluation, parked: Parked) -> Generator[Any, Any, list[F.Fiber]]:
    """Compute the parked graphs as one; returns the fibers to resume (the
    parked list is emptied)."""
    fibers = parked.fibers
    order, alike = merge(ev, parked.orders)
    parked.orders, parked.fibers = [], []
    if order:
        if batched.worth_batching(ev, order, alike):
            batched.forward(ev, order)
        index = 0
        while True:
            outcome, index = inline.forward(ev, order, index, True)
            if outcome is None:
                break
            assert outcome is inline.CHECKPOINT  # no Do layers: parks() said so
            yield inline.CHECKPOINT
        if time.perf_counter() > ev.deadline:  # many small graphs add up too
            yield inline.CHECKPOINT
    for fiber in fibers:  # past its Graph frame: the next frame reads its records
        fiber.save(fiber.stack, None, None, None, False)
    return fibers


def merge(ev: Evaluation, orders: list[list[Any]]) -> tuple[list[Any], int]:
    """The union of the graphs ``orders`` (each in topological order) in one
    topological order, each node once, leaving those computed meanwhile; and
    how many graphs are alike (built at one line, with as many nodes).

    >>> import numpy as np, monadl as ml
    >>> from monadl.runtime.evaluation import Evaluation
    >>> w = ml.Weight(np.ones((2, 2)))
    >>> shared = w * 2.0
    >>> a, b = (ml.sum(shared + 1.0) for _ in range(2))  # built at one place
    >>> order, alike = merge(Evaluation(train=False), [[shared, a._inputs[0], a], [shared, b._inputs[0], b]])
    >>> len(order), alike
    (5, 2)
    """
    records = ev.records
    seen: set[Any] = set()
    order: list[Any] = []
    shapes: dict[Any, int] = {}
    for part in orders:
        # Concatenated topological orders, each node at its first place, stay topological.
        for node in part:
            if node not in seen and node not in records:  # another fiber's graph may have computed it
                seen.add(node)
                order.append(node)
        if part:
            key = (part[-1]._site, len(part))
            shapes[key] = shapes.get(key, 0) + 1
    return order, max(shapes.values(), default=0)
