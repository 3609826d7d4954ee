"""The operand rule's plans in a `monadl.layers._program.Program`: which of
its slots are tensors and which data (`tensor_slots`: the rule casts only
tensors' steps), the operands' `signature` a plan is kept by, and the `Casts`
a first call records (`casts_of`) and later calls apply (`apply_casts`),
instead of running the rule's checks at every step of every call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from monadl.layers._operands import NUMBERS, Numbers, as_dtype
from monadl.layers._outputs import Outputs, StackedOutputs
from monadl.layers._step import Step

__all__ = ["Casts", "apply_casts", "casts_of", "is_number", "numbers_made", "signature", "tensor_slots"]

Value = Any

# The primitives of Python's operators (``1.0 - beta``): on data alone, a step of one is data,
# as NumPy's or Python's arithmetic gives unmarked; any other step is a tensor, the value of
# a layer that an ml function builds (``ml.exp(beta)``), and so is one of a tensor.
_OPERATORS: Final = frozenset({"add", "subtract", "multiply", "divide", "power", "negative"})


def tensor_slots(size: int, consts: int, steps: tuple[Step, ...]) -> tuple[bool, ...]:
    """Per slot of a program (its ``size`` operands, its constants, its
    steps' values), whether it is a tensor, as it is unmarked: where a call
    gives a layer or a weight (whatever its value's type: a scalar layer's
    is a NumPy scalar; the trace marked what leads to one), or a step of one
    or of an ml function. The rest is data: a call's arrays and numbers,
    the trace's constants, and an operator's step on them alone (``d - p``
    is NumPy's arithmetic unmarked, with no operand rule: of a 0-d array
    ``d``, a NumPy scalar, a number); a tensor of no dimensions sets a
    number's float dtype, data's does not (`one_float_dtype`)."""
    tensors = [False] * (size + consts)
    for s in steps:
        for r, g in zip(s.refs, s.grads):
            if g and r < size:
                tensors[r] = True
    for s in steps:
        tensors.append(s.op.name not in _OPERATORS or True in [tensors[r] for r in s.refs])
    return tuple(tensors)


def numbers_made(values: tuple[Value, ...], stacked: tuple[bool, ...]) -> bool:
    """Whether an operator's step on data alone (see `tensor_slots`) makes a
    number in each member of a group: where no member's operand has
    dimensions (NumPy's arithmetic on 0-d arrays gives a NumPy scalar)."""
    return all(type(v) is Numbers or getattr(v, "ndim", 0) == s for v, s in zip(values, stacked))


Casts = tuple[Any, ...] | None
"""What the operand rule did to one step's operands: per operand, the dtype
it cast it to, or None; None for none cast."""


def signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What the operand rule depends on, per operand: its type (a NumPy float,
    data, is not a 0-d array, a tensor; an array library is its own), its
    dtype and its dimensions (a 0-d float64 array beside float32 ones is
    cast, one with dimensions raises), those of its parts (`Outputs`), the
    kind of a group's numbers."""
    return tuple([_signed(a) for a in args])


def _signed(a: Any) -> Any:
    t = type(a)
    if t is Outputs:
        return t, signature(a)
    if t is StackedOutputs:
        return t, signature(a.parts)
    if t is Numbers:
        return t, a.kind
    dtype = getattr(a, "dtype", None)
    return t if dtype is None else (t, dtype, getattr(a, "ndim", None))


def casts_of(values: Sequence[Value], fixed: Sequence[Value]) -> Casts:
    """The `Casts` that made ``fixed`` of ``values`` (an operand cast is a new object)."""
    casts = tuple([None if f is v else f.dtype for v, f in zip(values, fixed)])
    # (by identity: `casts.count(None)` compares by ==, and NumPy's float64 dtype == None)
    return casts if any(c is not None for c in casts) else None


def apply_casts(values: tuple[Value, ...], casts: tuple[Any, ...]) -> tuple[Value, ...]:
    """``values`` cast as ``casts`` says, as the operand rule casts them (`as_dtype`)."""
    return tuple([v if d is None else as_dtype(v, d) for v, d in zip(values, casts)])


def is_number(v: Value) -> bool:
    """Whether ``v`` is a number: a NumPy scalar, a Python number, a group's column of those."""
    return isinstance(v, np.generic) or type(v) in NUMBERS or type(v) is Numbers
