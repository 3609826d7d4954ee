"""Differentiable elementwise functions, and the nodes that lift plain data
or a weight into a layer (`monadl.as_layer`). Each accepts plain data,
weights and layers alike and builds one primitive node (`apply_primitive`,
which the other functions' modules build with too: products and reductions,
`_axis_functions`; losses, lookups and shapes, `_losses` and `_structure`).
"""

from __future__ import annotations

import weakref
from typing import Any, Final, Never, overload

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import OperandError
from monadl.layers._arrays import Array, DeviceArray
from monadl.layers._layer import (
    ArrayLayer,
    ArrayOperand,
    Expr,
    Layer,
    Operand,
    ScalarLayer,
    ScalarOperand,
    _build,
)
from monadl.layers._operand import operand as _operand
from monadl.layers._operands import describe
from monadl.layers._primitives import AS_LAYER, PRIMITIVES, WEIGHT_LAYER
from monadl.layers._weight import Weight

__all__ = [
    "abs",
    "apply_primitive",
    "cos",
    "data_layer",
    "exp",
    "log",
    "log_sigmoid",
    "maximum",
    "minimum",
    "relu",
    "sigmoid",
    "sin",
    "softplus",
    "sqrt",
    "stop_gradient",
    "tanh",
    "weight_layer",
    "where",
]


_CHECKED: Final = frozenset({Layer, Weight, float})  # operands that need no check


def apply_primitive(name: str, operands: tuple[object, ...], params: tuple[Any, ...] = ()) -> Layer[Any, Any]:
    """A layer of primitive ``name`` over checked ``operands``, built at the user's line."""
    for x in operands:
        if type(x) not in _CHECKED:
            _operand(x, name)  # raises on what monadl cannot compute with
    # The layer's site: from the caller of the public function that called here.
    return _build(PRIMITIVES[name], operands, params, 3)


# ---- elementwise ------------------------------------------------------------------------
# Each first takes `Expr[Never, Never]`, which only a weight or layer of Any matches: its result is a
# `Layer[Any, Any]`, as an operator's (`monadl.layers._layer.Expr`), where mypy took the scalar
# overload in some contexts (a list passed to `concatenate`) and rejected correct code.
@overload
def exp(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def exp(x: ScalarOperand) -> ScalarLayer: ...
@overload
def exp(x: ArrayOperand) -> ArrayLayer: ...
def exp(x: Operand) -> Layer[Any, Any]:
    """``e ** x``, elementwise."""
    return apply_primitive("exp", (x,))


@overload
def log(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def log(x: ScalarOperand) -> ScalarLayer: ...
@overload
def log(x: ArrayOperand) -> ArrayLayer: ...
def log(x: Operand) -> Layer[Any, Any]:
    """Natural logarithm, elementwise."""
    return apply_primitive("log", (x,))


@overload
def sqrt(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def sqrt(x: ScalarOperand) -> ScalarLayer: ...
@overload
def sqrt(x: ArrayOperand) -> ArrayLayer: ...
def sqrt(x: Operand) -> Layer[Any, Any]:
    """Square root, elementwise."""
    return apply_primitive("sqrt", (x,))


@overload
def abs(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def abs(x: ScalarOperand) -> ScalarLayer: ...
@overload
def abs(x: ArrayOperand) -> ArrayLayer: ...
def abs(x: Operand) -> Layer[Any, Any]:
    """Absolute value; its delta at 0 is 0."""
    return apply_primitive("abs", (x,))


@overload
def sin(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def sin(x: ScalarOperand) -> ScalarLayer: ...
@overload
def sin(x: ArrayOperand) -> ArrayLayer: ...
def sin(x: Operand) -> Layer[Any, Any]:
    """Sine (radians), elementwise; its delta is ``cos(x)``. A primitive, so a
    physics step that needs it (a pendulum's ``-g / L * sin(theta)``) can be
    marked with `operation` and batched.

    >>> import anyio, numpy as np
    >>> anyio.run(sin(np.array([0.0, np.pi / 2, np.pi / 6])).predict).round(12).tolist()
    [0.0, 1.0, 0.5]
    """
    return apply_primitive("sin", (x,))


@overload
def cos(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def cos(x: ScalarOperand) -> ScalarLayer: ...
@overload
def cos(x: ArrayOperand) -> ArrayLayer: ...
def cos(x: Operand) -> Layer[Any, Any]:
    """Cosine (radians), elementwise; its delta is ``-sin(x)``.

    >>> import anyio, numpy as np
    >>> anyio.run(cos(np.array([0.0, np.pi, np.pi / 3])).predict).round(12).tolist()
    [1.0, -1.0, 0.5]
    """
    return apply_primitive("cos", (x,))


@overload
def tanh(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def tanh(x: ScalarOperand) -> ScalarLayer: ...
@overload
def tanh(x: ArrayOperand) -> ArrayLayer: ...
def tanh(x: Operand) -> Layer[Any, Any]:
    """Hyperbolic tangent, elementwise."""
    return apply_primitive("tanh", (x,))


@overload
def sigmoid(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def sigmoid(x: ScalarOperand) -> ScalarLayer: ...
@overload
def sigmoid(x: ArrayOperand) -> ArrayLayer: ...
def sigmoid(x: Operand) -> Layer[Any, Any]:
    """The logistic function ``1 / (1 + e ** -x)``, without overflow."""
    return apply_primitive("sigmoid", (x,))


@overload
def relu(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def relu(x: ScalarOperand) -> ScalarLayer: ...
@overload
def relu(x: ArrayOperand) -> ArrayLayer: ...
def relu(x: Operand) -> Layer[Any, Any]:
    """``max(x, 0)``; its delta at 0 is 0.

    >>> import anyio, numpy as np
    >>> anyio.run(relu(np.array([-1.0, 2.0])).predict)
    array([0., 2.])
    """
    return apply_primitive("relu", (x,))


@overload
def softplus(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def softplus(x: ScalarOperand) -> ScalarLayer: ...
@overload
def softplus(x: ArrayOperand) -> ArrayLayer: ...
def softplus(x: Operand) -> Layer[Any, Any]:
    """``log(1 + e ** x)``, elementwise, without overflow (PyTorch's
    ``F.softplus``, exact where PyTorch's returns ``x`` above 20); its delta
    is ``sigmoid(x)``. A GAN's non-saturating loss ``-log(sigmoid(d))`` is
    ``softplus(-d)``, finite for any score, where ``log(sigmoid(d))`` is
    ``-inf`` below -745 (float64; -104 in float32).

    >>> import anyio, numpy as np
    >>> anyio.run(softplus(np.array([-1000.0, 0.0, 2.0, 1000.0])).predict).round(4).tolist()
    [0.0, 0.6931, 2.1269, 1000.0]
    """
    return apply_primitive("softplus", (x,))


@overload
def log_sigmoid(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def log_sigmoid(x: ScalarOperand) -> ScalarLayer: ...
@overload
def log_sigmoid(x: ArrayOperand) -> ArrayLayer: ...
def log_sigmoid(x: Operand) -> Layer[Any, Any]:
    """``log(sigmoid(x))``, elementwise, without overflow: ``-softplus(-x)``
    (PyTorch's ``F.logsigmoid``); its delta is ``sigmoid(-x)``, kept where
    ``1 - sigmoid(x)`` rounds to 0.

    >>> import anyio, numpy as np
    >>> anyio.run(log_sigmoid(np.array([-1000.0, 0.0, 40.0])).predict)
    array([-1.00000000e+03, -6.93147181e-01, -4.24835426e-18])
    """
    return apply_primitive("log_sigmoid", (x,))


@overload
def maximum(a: Expr[Never, Never], b: Operand) -> Layer[Any, Any]: ...
@overload
def maximum(a: Operand, b: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def maximum(a: ScalarOperand, b: ScalarOperand) -> ScalarLayer: ...
@overload
def maximum(a: ArrayOperand, b: Operand) -> ArrayLayer: ...
@overload
def maximum(a: Operand, b: ArrayOperand) -> ArrayLayer: ...
def maximum(a: Operand, b: Operand) -> Layer[Any, Any]:
    """Elementwise maximum; at ties each side gets half the delta."""
    return apply_primitive("maximum", (a, b))


@overload
def minimum(a: Expr[Never, Never], b: Operand) -> Layer[Any, Any]: ...
@overload
def minimum(a: Operand, b: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def minimum(a: ScalarOperand, b: ScalarOperand) -> ScalarLayer: ...
@overload
def minimum(a: ArrayOperand, b: Operand) -> ArrayLayer: ...
@overload
def minimum(a: Operand, b: ArrayOperand) -> ArrayLayer: ...
def minimum(a: Operand, b: Operand) -> Layer[Any, Any]:
    """Elementwise minimum; at ties each side gets half the delta."""
    return apply_primitive("minimum", (a, b))


def where(condition: Array | DeviceArray | list[bool] | bool | np.bool_, a: Operand, b: Operand) -> ArrayLayer:
    """``a`` where ``condition`` holds, else ``b`` (NumPy's ``where``, PyTorch's
    ``masked_fill`` as ``where(mask, -inf, x)``); the three broadcast together.
    ``condition`` is data, a boolean array (a mask built from lengths, say):
    a layer's value is not known while the graph is built. Each side's delta
    is the result's where it was chosen and 0 elsewhere, so an infinite side
    sends no NaN back to the other (as a mask added or multiplied in would).
    Under ``check_finite``, whose values must all be finite, mask with a
    large negative number (-1e9) instead of -inf.

    >>> import anyio, numpy as np, monadl as ml
    >>> scores = ml.Weight(np.array([[1.0, 2.0, 3.0]]))
    >>> mask = np.array([[True, True, False]])  # the third position is padding
    >>> attention = ml.softmax(where(mask, scores, -np.inf), axis=-1)
    >>> anyio.run(attention.predict).round(3)
    array([[0.269, 0.731, 0.   ]])
    >>> anyio.run(ml.gradients, ml.sum(attention * np.array([1.0, 0.0, 5.0])), [scores])[0].round(3)
    array([[ 0.197, -0.197,  0.   ]])
    """
    if isinstance(condition, Expr):
        raise OperandError(
            "where: the condition is a layer or a weight, whose value is not known while the graph is built; "
            "a condition is data, a boolean array (a mask: lengths[:, None] > np.arange(n)); "
            "to choose by a layer's value, read it with bind or ml.direct, or use ml.maximum"
        )
    if isinstance(condition, (list, bool, np.bool_)):  # (a Python or NumPy bool: a 0-d mask, as NumPy's)
        condition = np.asarray(condition)
    kind = getattr(condition, "dtype", None)
    if kind is None or not is_array(condition) or not namespace(condition).isdtype(kind, "bool"):
        what = describe((condition,)) if is_array(condition) else type(condition).__name__
        raise OperandError(f"where: the condition must be a boolean array, got {what}; compare to make one (x > 0)")
    return apply_primitive("where", (condition, a, b))


@overload
def stop_gradient(x: Expr[Never, Never]) -> Layer[Any, Any]: ...
@overload
def stop_gradient(x: ScalarOperand) -> ScalarLayer: ...
@overload
def stop_gradient(x: ArrayOperand) -> ArrayLayer: ...
def stop_gradient(x: Operand) -> Layer[Any, Any]:
    """The same value, through which no delta flows back.

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]))
    >>> anyio.run(ml.gradients, ml.sum(w * stop_gradient(w)), [w])
    [array([1., 2.])]
    """
    return apply_primitive("stop_gradient", (x,))


def data_layer(x: Operand) -> Layer[Any, Any]:
    """Plain data as a layer, for `monadl.as_layer`: a `stop_gradient` node,
    named ``as_layer`` in a refusal of its operand, its repr and `monadl.to_dot`."""
    if type(x) not in _CHECKED:
        _operand(x, "as_layer")
    return _build(AS_LAYER, (x,), (), 3)


def weight_layer(w: Weight[Any, Any]) -> Layer[Any, Any]:
    """A weight as a layer, for `monadl.as_layer`: one primitive node per
    weight (while any graph holds it: the weight holds it weakly), its value
    the weight's and its delta the weight's delta.

    One node, not one per call: the examples of a batch that each lift the
    weight then share one operand, as they share the weight itself, so
    their products batch with it as one matrix and its delta is summed
    once. (It was a layer built from a ``Do``, which keeps a graph from
    batching: a parser's every first step ran alone, 41% of its steps.)
    Its line is the first call's.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones(2))
    >>> weight_layer(w) is weight_layer(w), weight_layer(w)._inputs == (w,)
    (True, True)
    """
    held = w._layer
    layer = None if held is None else held()
    if layer is None or layer._inputs[0] is not w:  # (a deep copy's is its original's)
        layer = _build(WEIGHT_LAYER, (w,), (), 3)
        w._layer = weakref.ref(layer)
    return layer
