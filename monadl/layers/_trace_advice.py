"""The DEBUG log's advice for an operation that keeps many traces
(`monadl.layers._operation`): what in its calls makes each its own trace."""

from __future__ import annotations

from typing import Any

from monadl.layers._tracing import Trace

__all__ = ["why_traces"]


def why_traces(traces: dict[Any, Trace]) -> str:
    """The DEBUG log's advice for an operation of many traces: where lists or
    tuples among the arguments differ in length, to make each one layer."""
    if len({_lengths(key) for key in traces}) > 1:
        return (
            "one per signature: a list or tuple argument whose length differs per call traces each length apart, "
            "and calls of different lengths never batch together (concatenate or stack its items into one layer, "
            "ml.concatenate or ml.stack, and pass that)"
        )
    return (
        "one per signature: calls whose ints, strings or other static arguments, or data arrays' shapes or dtypes, "
        "differ never batch together (pass a number that differs per call as a float, and an array whose shape "
        "differs as a layer, ml.as_layer(x), whose shape is no part of the signature where the cell reads none)"
    )


def _lengths(key: Any) -> tuple[int, ...]:
    """The lengths of the lists and tuples of a signature's key (`items`
    writes one as ``(list, items)``), in order, without recursion."""
    found: list[int] = []
    todo = [key]
    while todo:
        part = todo.pop()
        if type(part) is tuple:
            if len(part) == 2 and (part[0] is list or part[0] is tuple) and type(part[1]) is tuple:
                found.append(len(part[1]))
            todo.extend(reversed(part))
    return tuple(found)
