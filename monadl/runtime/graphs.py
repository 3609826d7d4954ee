"""One layer graph of an evaluation, computed by the scheduler that fits it:
CUDA streams for a graph on a GPU, the worker pool for a coarse graph when
``workers > 1``, the batching scheduler where its cost rule says so, the
inline loop for the rest; a graph that meets layers built from a ``Do``
hands them back to the interpreter (`monadl.runtime.interpret`) and resumes
after them, batching what was built on them."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from monadl.runtime import frames as F
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import collect, compute
from monadl.runtime.schedule import batched, cuda, inline, pool

__all__ = ["dos", "run"]


def run(ev: Evaluation, frame: F.Graph, stack: list[Any]) -> Generator[Any, Any, Any]:
    """Compute a layer graph's records, with the scheduler that fits it.

    Returns None when done; ``("do", do)`` when it met a layer built from a
    ``Do`` (the frames to resume are pushed); ``("wait", x)`` when the fiber
    must wait for ``x`` (the pool's awaitable, or another fiber's Do layer).
    """
    records = ev.records
    order = frame.order
    if order is None:
        order = frame.order = collect(ev, frame.roots)
        if not order:
            return None
        device = cuda.loaded() and cuda.on_device(records, order)  # (then groups, else streams: no threads)
        if ev.workers > 1 and not device:
            if pool.worth_forking(ev, order):
                ev.forked = True
                return "wait", pool.forward(ev, order)
            frame.started = time.perf_counter()
        # The batching scheduler computes what batches; the inline loop what it left, if any.
        if batched.worth_batching(ev, order):
            if time.perf_counter() > ev.deadline:  # (the walk of a large graph: a turn before its analysis)
                yield inline.CHECKPOINT
            left = yield from batched.stepwise(ev, order)  # (a turn of the event loop after a level, when due)
            frame.index = 0 if left else len(order)
            frame.resumed = True
        elif device and all(node._op is not None for node in order):
            cuda.forward(order, ev.cuda_streams, lambda node: records.__setitem__(node, compute(ev, node, True)))
            return None
    elif frame.redo:  # back from its Do layers (each example's `bind`): what was built on them may batch now
        frame.redo = False
        rest = [node for node in order[frame.index :] if not records.computed(node)]
        if batched.worth_batching(ev, rest) and not (yield from batched.stepwise(ev, rest)):
            frame.index = len(order)
    while True:
        outcome, i = inline.forward(ev, order, frame.index, frame.resumed)
        frame.index = i
        if outcome is None:
            now = time.perf_counter()
            if frame.started:
                pool.measured(ev, order, now - frame.started)
            if now > ev.deadline:  # many small graphs add up too
                yield inline.CHECKPOINT
            return None
        if outcome is inline.CHECKPOINT:
            yield inline.CHECKPOINT
            continue
        frame.started = 0.0  # timing a graph that awaits would measure the wait
        return dos(ev, frame, stack, i)


def dos(ev: Evaluation, frame: F.Graph, stack: list[Any], i: int) -> tuple[str, Any]:
    """The layers built from a ``Do`` of a graph's order from ``order[i]``
    (one): evaluated now, the graph resumed after them (pushed back on
    ``stack``), what it built on them computed then. ``("do", do)``: one to
    evaluate; ``("fork", layers)``: several, a fiber each, side by side;
    ``("wait", waiters)``: ``order[i]`` is another fiber's, being evaluated."""
    order = frame.order
    assert order is not None
    records = ev.records
    node = order[i]
    frame.resumed = True
    frame.redo = True  # (back from them: what it built on them may batch, or park, now)
    stack.append(frame)
    if node in ev.pending:
        return "wait", ev.pending[node]
    # The graph holds no edge into a Do layer (its Do reaches what it needs
    # itself), so every Do layer still to come may run now, side by side.
    ahead = [n for n in order[i:] if n._op is None and n not in records and n not in ev.pending]
    for n in ahead:
        ev.pending[n] = []
    if len(ahead) > 1:  # (every Do layer still to come is one of these: a redo at most once a wait)
        return "fork", ahead
    stack.append(F.FromDo(node))
    return "do", node._do
