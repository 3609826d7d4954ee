"""Differentiable functions that combine values along axes: the matrix
products (``matmul``, ``dot``, ``dense``) and the reductions (``sum``,
``mean``, ``max``, ``logsumexp``, and the softmax pair). Each accepts plain
data, weights and layers alike, and builds one primitive node
(`monadl.layers._functions.apply_primitive`); the elementwise functions:
`monadl.layers._functions`."""

from __future__ import annotations

from typing import Any, Literal, overload

from monadl.layers._axes import Axis, Integer, as_axis, as_int
from monadl.layers._functions import apply_primitive
from monadl.layers._layer import ArrayLayer, ArrayOperand, Layer, Operand, ScalarLayer

__all__ = [
    "dense",
    "dot",
    "log_softmax",
    "logsumexp",
    "matmul",
    "max",
    "mean",
    "softmax",
    "sum",
]


# ---- linear algebra ----------------------------------------------------------------------
def matmul(a: ArrayOperand, b: ArrayOperand) -> ArrayLayer:
    """Matrix product with NumPy's rules (``a @ b``), batch axes broadcast.

    >>> import anyio, numpy as np
    >>> anyio.run(matmul(np.ones((2, 3)), np.arange(3.0)).predict)
    array([3., 3.])
    """
    return apply_primitive("matmul", (a, b))


dot = matmul
"""An alias of `matmul` (NumPy's ``dot`` and ``matmul`` agree on 1-D and 2-D operands)."""


def dense(x: ArrayOperand, weight: ArrayOperand, bias: ArrayOperand | None = None) -> ArrayLayer:
    """``x @ weight + bias``: one node with a bias (the ``dense`` primitive), a
    ``matmul`` without.

    Args:
        x: inputs of shape ``(batch, n_in)`` (or ``(n_in,)``).
        weight: a ``(n_in, n_out)`` matrix.
        bias: ``(n_out,)``, added to every row; none by default.

    >>> import anyio, numpy as np, monadl as ml
    >>> w, b = ml.Weight(np.eye(2)), ml.Weight(np.array([0.5, -0.5]))
    >>> anyio.run(dense(np.array([[1.0, 2.0]]), w, b).predict)
    array([[1.5, 1.5]])
    """
    if bias is None:
        return apply_primitive("matmul", (x, weight))
    return apply_primitive("dense", (x, weight, bias))


# ---- reductions --------------------------------------------------------------------------
@overload
def sum(x: Operand, axis: None = None, keepdims: Literal[False] = False) -> ScalarLayer: ...
@overload
def sum(x: Operand, axis: None = None, *, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def sum(x: Operand, axis: None, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def sum(x: Operand, axis: Axis, keepdims: bool = False) -> ArrayLayer: ...
@overload
def sum(x: Operand, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
def sum(x: Operand, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
    """Sum over ``axis``, or over everything.

    >>> import anyio, numpy as np
    >>> anyio.run(sum(np.array([[1.0, 2.0], [3.0, 4.0]]), axis=0).predict)
    array([4., 6.])
    """
    return apply_primitive("sum", (x,), (as_axis(axis, "sum"), bool(keepdims)))


@overload
def mean(x: Operand, axis: None = None, keepdims: Literal[False] = False) -> ScalarLayer: ...
@overload
def mean(x: Operand, axis: None = None, *, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def mean(x: Operand, axis: None, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def mean(x: Operand, axis: Axis, keepdims: bool = False) -> ArrayLayer: ...
@overload
def mean(x: Operand, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
def mean(x: Operand, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
    """Mean over ``axis``, or over everything.

    >>> import anyio, numpy as np
    >>> anyio.run(mean(np.array([[1.0, 2.0], [3.0, 4.0]]), axis=1).predict)
    array([1.5, 3.5])
    """
    return apply_primitive("mean", (x,), (as_axis(axis, "mean"), bool(keepdims)))


@overload
def max(x: Operand, axis: None = None, keepdims: Literal[False] = False) -> ScalarLayer: ...
@overload
def max(x: Operand, axis: None = None, *, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def max(x: Operand, axis: None, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def max(x: Operand, axis: Axis, keepdims: bool = False) -> ArrayLayer: ...
@overload
def max(x: Operand, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
def max(x: Operand, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
    """Maximum over ``axis``, or over everything; tied maxima share the delta.

    >>> import anyio, numpy as np
    >>> float(anyio.run(max(np.array([1.0, 5.0, 3.0])).predict))
    5.0
    """
    return apply_primitive("max", (x,), (as_axis(axis, "max"), bool(keepdims)))


@overload
def logsumexp(x: Operand, axis: None = None, keepdims: Literal[False] = False) -> ScalarLayer: ...
@overload
def logsumexp(x: Operand, axis: None = None, *, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def logsumexp(x: Operand, axis: None, keepdims: Literal[True]) -> ArrayLayer: ...
@overload
def logsumexp(x: Operand, axis: Axis, keepdims: bool = False) -> ArrayLayer: ...
@overload
def logsumexp(x: Operand, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
def logsumexp(x: Operand, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
    """``log(sum(exp(x)))`` computed without overflow. Over entries all
    ``-inf`` (a masked-out position of a recursion in log space: CTC's
    alpha), its value is ``-inf`` and its delta NaN, as PyTorch's: mask
    with a large finite number (-1e30), not ``-inf``, where a whole reduced
    slice may be masked out."""
    return apply_primitive("logsumexp", (x,), (as_axis(axis, "logsumexp"), bool(keepdims)))


def softmax(x: ArrayOperand, axis: Integer = -1) -> ArrayLayer:
    """``exp(x) / sum(exp(x))`` along ``axis``, without overflow.

    >>> import anyio, numpy as np
    >>> anyio.run(softmax(np.array([0.0, 0.0, 1000.0])).predict)
    array([0., 0., 1.])
    """
    return apply_primitive("softmax", (x,), (as_int(axis, "softmax", "axis"),))


def log_softmax(x: ArrayOperand, axis: Integer = -1) -> ArrayLayer:
    """``log(softmax(x))`` along ``axis``, computed stably."""
    return apply_primitive("log_softmax", (x,), (as_int(axis, "log_softmax", "axis"),))
