"""What ``ml.settings(check_finite=True)`` says when a value or a delta holds a NaN or an infinity.

The runtime checks each node's value and each delta it sends upstream
(`monadl.runtime.node`, `monadl.runtime.backward`); a marked cell's program
checks each of its steps the same way (`monadl.layers._program.Program`),
with these same words, so that marking a cell changes a message only by its
place: the line inside the cell, then "inside the operation ... called at"
the line that called it.

>>> import numpy as np
>>> made("multiply", (np.ones(2), 10.0), "f.py:8")
'multiply produced a NaN or an infinity from float64[2], float 10.0; layer built at f.py:8'
>>> made("dense", (np.array([np.nan]), np.ones((1, 2))), "f.py:9")
"dense's operand 0 (float64[1]) already holds a NaN or an infinity; layer built at f.py:9"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from monadl._namespace import all_finite, is_array, namespace
from monadl.deltas import Outer, SparseRows
from monadl.layers._operands import describe
from monadl.layers._outputs import Outputs, OutputsDelta, finite_value
from monadl.layers._split import SplitDelta

__all__ = ["all_finite_deltas", "backward_made", "data_held", "finite_delta", "made", "non_finite"]


def non_finite(a: Any) -> bool:
    """Whether an operand (an array, an `Outputs`, a number) holds a NaN or
    an infinity; other operands (indices as tuples ...) never do."""
    kind = type(a)
    if kind is Outputs or kind is float or is_array(a) or isinstance(a, np.generic):
        return not finite_value(a)
    return False


def made(name: str, operands: Sequence[Any], site: str) -> str:
    """The message of a forward value that holds a NaN or an infinity: the
    first operand that already held one, else the operation ``name`` made it
    (``site``: where the layer, or the step inside a cell, was built)."""
    for i, a in enumerate(operands):
        if non_finite(a):
            mask = (  # (an attention mask of -inf: the check wants every value finite)
                "; under check_finite, mask with a large negative number (-1e9) instead of -inf"
                if name == "where" and i
                else ""
            )
            return (
                f"{name}'s operand {i} ({describe([a])}) already holds a NaN or an infinity; layer built at {site}"
                + mask
            )
    return f"{name} produced a NaN or an infinity from {describe(operands)}; layer built at {site}"


def data_held(data: Any, site: str) -> str:
    """The message of plain data given to the graph (``ml.as_layer(x)``) that
    holds a NaN or an infinity: no operation made it."""
    return f"the data given at {site} already holds a NaN or an infinity ({describe([data])})"


def backward_made(name: str, site: str) -> str:
    """The message of a delta that the backward of ``name`` made with a NaN or an infinity."""
    return f"the backward of {name} produced a NaN or an infinity; layer built at {site}"


def all_finite_deltas(deltas: Sequence[Any]) -> bool:
    """Whether every one of ``deltas`` is finite (`finite_delta`); those on a
    device read back at once, not one by one (each reading waits for the
    device to finish what it was given)."""
    flags = []
    for delta in deltas:
        kind = type(delta)
        if kind is Outer:
            delta = _product(delta)
        elif kind is SparseRows:
            delta = delta.rows
        if type(delta) is np.ndarray or not is_array(delta):
            if not finite_delta(delta):
                return False
        else:
            xp = namespace(delta)
            flags.append(xp.all(xp.isfinite(delta)))
    if not flags:
        return True
    xp = namespace(flags[0])
    return bool(xp.all(xp.stack(flags)))


def finite_delta(delta: Any) -> bool:
    """Whether a delta (an array, sparse rows, a weight's as factors, an
    operation's outputs' or a split's) holds no NaN and no infinity."""
    kind = type(delta)
    if kind is Outer:
        return all_finite(_product(delta))
    if kind is SparseRows:
        return all_finite(delta.rows)
    if kind is OutputsDelta:  # an operation's outputs' deltas (None: zero)
        return all(p is None or finite_delta(p) for p in delta.parts)
    if kind is SplitDelta:
        return all_finite(delta.to_dense())
    finite = getattr(delta, "finite", None)  # (a Fold batch's loom's deltas, by slot)
    return all_finite(delta) if finite is None else bool(finite())


def _product(delta: Outer) -> Any:
    """A weight's delta as factors, multiplied out to be checked: without
    NumPy's warning of the infinity or NaN a factor may hold (NumPy 2.5 warns
    of them in a product), which the check is there to find."""
    with np.errstate(over="ignore", invalid="ignore"):
        return delta.dense()
