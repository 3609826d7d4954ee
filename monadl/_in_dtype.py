"""A weight's gradient in the weight's own dtype (`in_dtype_of`), as PyTorch
gives it, and the comparison of the two dtypes that decides it
(`dtype_differs`): the evaluation casts each weight's gradient so, and a
step casts what it writes."""

from __future__ import annotations

from typing import Any

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.deltas import Outer, SparseRows

__all__ = ["dtype_differs", "in_dtype_of"]

Value = Any


def dtype_differs(grad: Value, data: Value) -> bool:
    """Whether ``grad`` has a dtype other than ``data``'s (neither without
    one). A NumPy dtype and another library's are never compared: they
    never are equal, and array_api_strict warns where it is asked.

    >>> dtype_differs(np.ones(2), np.zeros(2, np.float32)), dtype_differs(np.ones(2), 1.0)
    (True, False)
    """
    g, d = getattr(grad, "dtype", None), getattr(data, "dtype", None)
    if g is None or d is None or g is d:
        return False
    if isinstance(g, np.dtype) is not isinstance(d, np.dtype):
        return True
    return bool(g != d)


def in_dtype_of(grad: Value, data: Value) -> Value:
    """A weight's gradient in the dtype of the weight's ``data``, as PyTorch
    gives it. A float32 model whose loss met a float64 number (a NumPy
    float64 divisor, a scalar ``Weight(2.0)``) back-propagated float64
    deltas into its float32 weights: Adam's moments became float64 (twice
    their memory, and a checkpoint that its own model refused to load).
    ``grad`` a dense array, a number or `SparseRows`; a product kept as
    factors (`Outer`) is left as it is (its step casts what it writes).

    >>> in_dtype_of(np.ones(2), np.zeros(2, np.float32)).dtype
    dtype('float32')
    """
    dtype = getattr(data, "dtype", None)
    if dtype is None or type(grad) is Outer or not dtype_differs(grad, data):
        return grad
    if type(grad) is SparseRows:
        return SparseRows(grad.indices, in_dtype_of(grad.rows, data), grad.table_shape)
    if not isinstance(data, (np.ndarray, np.generic)):  # (another library's weight: its own arrays, else as given)
        xp = namespace(data)
        return xp.astype(grad, dtype) if is_array(grad) and namespace(grad) is xp else grad
    if type(grad) is np.ndarray:
        return grad.astype(dtype)
    if isinstance(grad, np.generic):
        return dtype.type(grad)
    return grad
