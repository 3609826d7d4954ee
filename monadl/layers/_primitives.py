"""The differentiable primitives: one table, forward and backward side by side.

Each primitive is a function ``f(*operands, *params) -> (value, vjps)``.
``vjps`` holds one closure per operand that maps the delta of ``value`` to the
delta of that operand (a vector-Jacobian product). The runtime calls only the
closures whose operand leads to a trainable weight, and undoes broadcasting
afterwards with `monadl.deltas.unbroadcast`, so no rule handles broadcasting itself. A
closure captures only what its rule needs, so the rest can be freed early.

Rules compute in the namespace of their operands (`monadl._namespace`): they
use only names of the Python array API standard, so the same table runs on
NumPy, CuPy and any standard array library. No rule multiplies by a boolean
mask or calls a NumPy-only function.

The functions of `monadl.layers` build layers of these; whatever else a
model computes is composed from them.

The rules live in modules by kind (`_elementwise`, `_matmul`,
`_reductions`, `_indexing`, `_convolution`, `_split`); this module holds
the one table that names them, so a reader scans every primitive here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, final

from monadl.layers._convolution import _conv2d, _max_pool2d
from monadl.layers._elementwise import (
    _abs,
    _add,
    _as_layer,
    _cos,
    _div,
    _exp,
    _log,
    _log_sigmoid,
    _maximum,
    _minimum,
    _mul,
    _neg,
    _pow,
    _relu,
    _sigmoid,
    _sin,
    _softplus,
    _sqrt,
    _stop_gradient,
    _sub,
    _tanh,
    _where,
)
from monadl.layers._indexing import (
    _concatenate,
    _embedding,
    _getitem,
    _reshape,
    _roll,
    _segment_sum,
    _stack,
    _transpose,
)
from monadl.layers._matmul import _dense, _matmul
from monadl.layers._reductions import (
    _binary_cross_entropy,
    _cross_entropy,
    _log_softmax,
    _logsumexp,
    _max,
    _mean,
    _softmax,
    _sum,
)
from monadl.layers._split import split_part_rule, split_rule

__all__ = ["PRIMITIVES", "Primitive"]

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]
Rule = Callable[..., tuple[Value, tuple[Vjp, ...]]]


@final
@dataclass(frozen=True, slots=True)
class Primitive:
    """A named rule. ``same_dtype``: refuse to mix float32 and float64 arrays.
    ``elementwise``: the value has the broadcast shape of the operands, and
    each delta comes back in that shape (so a unary rule's delta needs no
    unbroadcasting, nor an array's beside a plain number). ``names_errors``:
    its rule's errors name the user's line themselves (a Fold batch's loom,
    whose calls were built at many), and the runtime adds nothing."""

    name: str
    rule: Rule
    same_dtype: bool = False
    elementwise: bool = False
    names_errors: bool = False

    def floats_from(self) -> int | None:
        """The first operand from which the rule casts its operands to one
        float dtype (`monadl.layers._operands.one_float_dtype`), so a group
        casts its members' alike: 0 for a ``same_dtype`` primitive, 1 for
        ``where`` (its two sides; the condition is not cast), None for the rest."""
        if self.same_dtype:
            return 0
        return 1 if self.name == "where" else None


PRIMITIVES: Final[dict[str, Primitive]] = {
    p.name: p
    for p in (
        Primitive("add", _add, same_dtype=True, elementwise=True),
        Primitive("subtract", _sub, same_dtype=True, elementwise=True),
        Primitive("multiply", _mul, same_dtype=True, elementwise=True),
        Primitive("divide", _div, same_dtype=True, elementwise=True),
        Primitive("power", _pow, same_dtype=True, elementwise=True),
        Primitive("maximum", _maximum, same_dtype=True, elementwise=True),
        Primitive("minimum", _minimum, same_dtype=True, elementwise=True),
        Primitive("where", _where, elementwise=True),
        Primitive("negative", _neg, elementwise=True),
        Primitive("stop_gradient", _stop_gradient),
        Primitive("as_layer", _as_layer, elementwise=True),
        Primitive("exp", _exp, elementwise=True),
        Primitive("log", _log, elementwise=True),
        Primitive("sqrt", _sqrt, elementwise=True),
        Primitive("abs", _abs, elementwise=True),
        Primitive("sin", _sin, elementwise=True),
        Primitive("cos", _cos, elementwise=True),
        Primitive("tanh", _tanh, elementwise=True),
        Primitive("sigmoid", _sigmoid, elementwise=True),
        Primitive("relu", _relu, elementwise=True),
        Primitive("softplus", _softplus, elementwise=True),
        Primitive("log_sigmoid", _log_sigmoid, elementwise=True),
        Primitive("matmul", _matmul, same_dtype=True),
        Primitive("dense", _dense, same_dtype=True),
        Primitive("sum", _sum),
        Primitive("mean", _mean),
        Primitive("max", _max),
        Primitive("logsumexp", _logsumexp),
        Primitive("softmax", _softmax),
        Primitive("log_softmax", _log_softmax),
        Primitive("cross_entropy", _cross_entropy),
        Primitive("binary_cross_entropy_with_logits", _binary_cross_entropy, same_dtype=True),
        Primitive("reshape", _reshape),
        Primitive("transpose", _transpose),
        Primitive("roll", _roll),
        Primitive("getitem", _getitem),
        Primitive("embedding", _embedding),
        Primitive("segment_sum", _segment_sum),
        Primitive("concatenate", _concatenate, same_dtype=True),
        Primitive("stack", _stack, same_dtype=True),
        Primitive("split", split_rule),
        Primitive("split_part", split_part_rule),
        Primitive("conv2d", _conv2d, same_dtype=True),
        Primitive("max_pool2d", _max_pool2d),
    )
}

AS_LAYER: Final = Primitive("stop_gradient", _stop_gradient)
"""Plain data lifted into a graph by `monadl.as_layer`: `stop_gradient` to whatever runs a layer (batching,
the runtime's message of data that holds a NaN), shown as ``as_layer`` where a layer is shown (`shown`)."""


WEIGHT_LAYER: Final = PRIMITIVES["as_layer"]
"""A weight lifted into a graph by `monadl.as_layer`: its value, and its delta passed back to the weight;
one node per weight (`monadl.layers._functions.weight_layer`)."""


def shown(op: Primitive) -> str:
    """The name a layer of ``op`` goes by in its repr, in `monadl.to_dot` and
    in errors: what the user called. An operation's primitive is named
    ``f"{function}#{n}"`` (`monadl.layers._tracing.traced`), which keeps its
    signature and the rule tables' lookups by name apart from another
    function's of the same name, or a primitive's; the user sees the function's."""
    if op is AS_LAYER:
        return "as_layer"
    return op.name.partition("#")[0]
