"""Which `monadl.operation` each thread is tracing now.

A trace runs a cell's function once per signature
(`monadl.layers._tracing`), so what the function reads of a weight's value
there, its ``.data`` or ``.state`` or a copy of the weight, would be that
array at every later call (an assignment to the weight after it changing
nothing), and what it assigns (``.data``, ``.state``, ``.optimizer``) would
be assigned once, not at each call. `Weight` refuses each while its thread
traces, and a layer asked for a weight's attribute (a
weight argument, a placeholder in the cell) names the cell. A trace is
synchronous, so a thread traces one function at a time, nested operations
innermost first.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NUMBERS", "TRACING", "refuse_evaluating", "refuse_while_tracing"]

TRACING: Final[dict[int, str]] = {}
"""The operations being traced now, by the tracing thread's id: the
innermost one's name. Read before the lock on every read of a weight's
``.data``: empty, it costs that read one truth test."""

NUMBERS: Final[dict[int, frozenset[int]]] = {}
"""The placeholders of the numbers (floats, data) the innermost trace was
given, by the tracing thread's id: their ids. A layer compared with a
number for equality reads it (`monadl.layers._unvalued`): ``k == 4.0`` on
a float argument compared the placeholder's identity, always False."""


def refuse_while_tracing(what: str) -> None:
    """Refuse ``what`` (a function that changes or writes weights:
    ``ml.load``, ``apply_gradients``, ``ml.save``) called while this thread
    traces an operation: the trace would run it once, and later calls, which
    replay the trace, never."""
    if TRACING:
        from threading import get_ident

        name = TRACING.get(get_ident())
        if name is not None:
            from monadl.errors import OperandError

            raise OperandError(
                f"operation {name}: the cell called {what} while it was traced; a trace runs once per signature, "
                f"not at each call, so later calls would not call it: call {what} outside the cell (before or "
                "after the call, or after predict() or train())"
            )


def refuse_evaluating() -> None:
    """Refuse an evaluation (``predict()``, ``train()``, ``ml.gradients``)
    started while this thread traces an operation: the cell's layers have no
    value then (its arguments are placeholders), and whatever it computed
    would be the trace's constant at every later call."""
    if TRACING:
        from threading import get_ident

        name = TRACING.get(get_ident())
        if name is not None:
            from monadl.errors import OperandError

            raise OperandError(
                f"operation {name}: the cell evaluates a layer (predict(), train(), ml.gradients) while it is "
                "traced; a cell is traced once per signature, with placeholders for its arguments and no values, "
                "and later calls replay the trace: to see a value inside it, call the function unmarked (without "
                "ml.operation); to find a NaN, ml.settings(check_finite=True) names the step inside the cell that "
                "made it; or evaluate the cell's result outside it"
            )
