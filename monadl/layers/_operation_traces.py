"""An operation's calls by the signature's walk, and the traces it keeps.

A call that no plan reads (`monadl.layers._plans`) walks its arguments into
their signature (`monadl.layers._structures.items`): their structure, the
views among them of other operations' outputs, a data array's shape and
dtype, and the objects the function's closure holds. An operation keeps one
trace per signature, tracing a new one (`monadl.layers._tracing.traced`),
up to `_TRACES_LIMIT`, past which one goes in turn (`evict`); the walk also
learns the plan that later calls of the same types use instead of it.
"""

from __future__ import annotations

import functools
import logging
import types
import weakref
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from monadl.layers._held import reach
from monadl.layers._plans import learn
from monadl.layers._structures import flatten, items
from monadl.layers._trace_advice import why_traces
from monadl.layers._tracing import Trace, traced

if TYPE_CHECKING:
    from monadl.layers._operation import Operation

__all__ = ["evict", "walked"]

_TRACES_LIMIT: Final = 256  # (traces an operation keeps; past it, one goes: `evict`)
_log: Final = logging.getLogger("monadl.batching")  # (how many traces an operation has: each its own groups)


def walked(
    op: Operation[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any], kinds: tuple[type, ...] | None
) -> tuple[Trace, list[Any], list[Any]]:
    """A call by the signature's walk (`items`), tracing a new signature;
    ``kinds``, its arguments' types where a plan may learn its trace."""
    leaves: list[Any] = []
    keep: list[Any] = []
    found: list[int] = []
    key: Any = items(args, leaves, keep, found) if not kwargs else flatten((args, kwargs), leaves, keep, found)
    sources: list[Any] = []
    views: Any = ()
    if found:  # outputs of other operations: their nodes are the operands
        views = []
        for j in found:
            x = leaves[j]
            node = x._inputs[0]
            if node in sources:  # (a handful, scanned in C: layers compare by identity)
                views.append((j, sources.index(node), x._params[0]))
            else:
                views.append((j, len(sources), x._params[0]))
                sources.append(node)
        views = tuple(views)
        key = (key, views)
    data = [(x.shape, x.dtype) for x in leaves if isinstance(x, np.ndarray)]
    if data:  # (the function may read a data array's shape and dtype: they are part of the signature)
        key = (key, tuple(data))
    cells: list[Any] = []
    held: list[Any] = []
    if op._ids is not None:  # what a partial or a bound method holds: the same objects every call
        key = (key, op._ids)
    elif op._closure is not None:
        cells, held = reach(op._closure)
        key = (key, tuple([id(x) for x in held]))
    trace = op._traces.get(key)
    if trace is None:
        full = len(op._traces) >= _TRACES_LIMIT
        if full:
            if not op._evictions:  # (said once: each call of a new signature now traces, 40-80x a call)
                _log.warning(
                    "operation %s keeps %d traces, its limit: each new signature now replaces one and is traced, "
                    "at tens of times a call's cost, and calls of different signatures never batch; %s",
                    op.__name__,
                    _TRACES_LIMIT,
                    why_traces(op.__wrapped__, op._traces),
                )
            evict(op)
        keep.extend(held)  # (the trace holds them: their ids stay theirs while it is cached)
        placed = {j: (s, k) for j, s, k in views}
        trace = traced(op.__name__, op.__wrapped__, (args, kwargs), leaves, tuple(keep), placed)
        op._traces[key] = trace
        count = len(op._traces)
        if count == 1:
            _marked_again(op, trace)
        # (8, 16, 32, ...: said once each; at the limit, where each new trace replaces one, not again)
        if not full and count >= 8 and not count & (count - 1) and _log.isEnabledFor(logging.DEBUG):
            _log.debug("operation %s has %d traces, %s", op.__name__, count, why_traces(op.__wrapped__, op._traces))
    if kinds is not None:
        with op._learning:  # (another thread's walk may rebind between the check and the plan's store)
            if (op._live is None or op._learned_under(cells, held)) and not keep:
                learn(op._plans, kinds, args, leaves, views, trace)
    return trace, leaves, sources


_MARKS: dict[
    Any, tuple[int, list[weakref.ref[Any]], tuple[int, ...]]
] = {}  # (per function's code: marks in a row over its weights)
_MARKS_SAID: Final = 32


def _marked_again(op: Operation[Any, Any], trace: Trace) -> None:
    """Count an operation's first trace by its function's code, while the
    marks trace it over the same live weights; say once, at the 32nd, that
    each mark traces anew: an operation made where each step's graph is
    built (``ml.operation(step)`` inside the loss function) traces every
    step, at tens of times a call's cost (1.7x a capsule network's step, a
    new user's), and nothing else says so. Models built anew (a sweep, a
    benchmark) mark their cells over weights of their own: counted afresh."""
    f = op.__wrapped__
    while isinstance(f, (functools.partial, types.MethodType)):  # (a partial's function, a bound method's)
        f = f.func if isinstance(f, functools.partial) else f.__func__
    code = getattr(f, "__code__", None)
    if code is None:
        return
    weights = trace.weights
    if not weights:  # (weights passed as arguments, or none: models built anew cannot be told from steps)
        return
    held = tuple([id(x) for x in reach(op._closure or ())[1]])  # (a partial's arguments too: another is another cell)
    count, seen, was = _MARKS.get(code, (0, [], ()))
    same = was == held and len(seen) == len(weights) and all(r() is w for r, w in zip(seen, weights))
    n = count + 1 if same else 1
    if len(_MARKS) >= _TRACES_LIMIT * 16 and code not in _MARKS:  # (bounded: a program's cells are fewer)
        _MARKS.clear()
    # (threads may race here: a count off by one, never an error)
    _MARKS[code] = (n, seen if same else [weakref.ref(w) for w in weights], held)
    if n == _MARKS_SAID:
        _log.warning(
            "operation %s (the function at %s:%d) was marked %d times over the same weights, and each mark traces "
            "it anew, at tens of times a call's cost: mark it once (ml.operation outside the code that builds "
            "each step's graph)",
            op.__name__,
            code.co_filename,
            code.co_firstlineno,
            n,
        )


def evict(op: Operation[Any, Any]) -> None:
    """Forget one trace, and its plans' entries, picked in turn by a
    stride through them all (deterministic, and as good as a random pick
    where the shapes come round in turn: a batch's lengths, epoch after
    epoch, where forgetting the oldest misses every call). Clearing all
    made a 257th shape retrace almost every call."""
    keys = list(op._traces)
    op._evictions += 1
    old = op._traces.pop(keys[(op._evictions * 97) % len(keys)])
    for plan in op._plans.values():
        if plan is not None:
            for entry in plan.entries.values():
                for k in [k for k, t in entry.traces.items() if t is old]:
                    del entry.traces[k]
