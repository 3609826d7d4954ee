"""One layer graph of an evaluation, computed by the scheduler that fits it:
CUDA streams for a graph on a GPU, the worker pool for a coarse graph when
``workers > 1``, the batching scheduler where its cost rule says so, the
inline loop for the rest; a graph that meets layers built from a ``Do``
hands them back to the interpreter (`monadl.runtime.interpret`) and resumes
after them, batching what was built on them (`dos`); such a layer's tape,
checked, as its record (`from_do`); the error of a cycle among them (`cycle`)."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from monadl.errors import NonFiniteError, OperandError
from monadl.layers._outputs import finite_value
from monadl.layers._site import site_text
from monadl.runtime import frames as F
from monadl.runtime.evaluation import Evaluation, Record, is_value
from monadl.runtime.node import collecting, compute
from monadl.runtime.schedule import batched, cuda, inline, pool
from monadl.tape import Tape

__all__ = ["cycle", "dos", "from_do", "run"]


def run(ev: Evaluation, frame: F.Graph, stack: list[Any]) -> Generator[Any, Any, Any]:
    """Compute a layer graph's records, with the scheduler that fits it.

    Returns None when done; ``("do", do)`` when it met a layer built from a
    ``Do`` (the frames to resume are pushed); ``("wait", x)`` when the fiber
    must wait for ``x`` (the pool's awaitable, or another fiber's Do layer).
    """
    records = ev.records
    order = frame.order
    if order is None:
        order = frame.order = yield from collecting(ev, frame.roots)
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


def from_do(ev: Evaluation, node: Any, val: Any, tok: Any) -> None:
    if not isinstance(val, Tape):
        raise TypeError(f"the Do of {node!r} yielded {type(val).__name__}, not a Tape")
    backward = val.backward
    owner = getattr(backward, "__self__", None)
    if type(owner) is Record and ev.records.get(owner.node) is not owner:
        raise RuntimeError(
            f"the Do of {node!r} yielded a Tape of another evaluation (a past train() or predict()): "
            "its value is stale and its backward leads nowhere; build the layer itself into this graph instead"
        )
    if not is_value(val.data):  # (it failed where a consumer read it: 'builtins.list is not an array ...')
        raise OperandError(
            f"the layer built at {site_text(node._site)} from a Do (a Tape of your own, bind, ml.direct) holds "
            f"{'None' if val.data is None else 'a ' + type(val.data).__name__}, not an array or a number: a "
            "Tape's data is an array or a number (np.asarray of a list)"
        )
    ev.effects = True
    if ev.check_finite and not finite_value(val.data):  # (the next primitive was blamed: "already holds a NaN")
        raise NonFiniteError(
            f"the layer built at {site_text(node._site)} from a Do (a Tape of your own, bind, ml.direct) holds a "
            "NaN or an infinity"
        )
    rec = Record(val.data, None, (), backward is not None, node)
    rec.tape_backward = backward
    rec.release = tok
    ev.records[node] = rec


def cycle(ev: Evaluation) -> OperandError:
    """The error of an evaluation in which every fiber waits for a layer
    built from a ``Do`` that another (or itself) is evaluating: a ``Do``
    that reads a layer built on its own (an ``@ml.direct`` call that awaits
    a sum holding that very call): it would wait forever."""
    sites = list(dict.fromkeys(site_text(n._site) for n in ev.pending if getattr(n, "_site", None) is not None))
    which = f"the layer built from a Do at {sites[0]}" if len(sites) == 1 else "a layer built from a Do"
    if len(sites) > 1:
        which += f" (at {', '.join(sites)})"
    return OperandError(
        f"the evaluation cannot go on: {which} waits for a layer built on itself (its bind or @ml.direct "
        "function reads a layer that holds it): a cycle; read only layers built before it"
    )
