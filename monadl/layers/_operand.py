"""An operand checked where a layer is built, while the user's line is still on the stack."""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import OperandError
from monadl.layers._unvalued import Unvalued

__all__ = ["operand"]

_NUMERIC_KINDS: Final = frozenset("fiub")


def operand(x: object, op: str) -> Any:
    """Check an operand early, where the user's line is still on the stack."""
    kind = type(x)
    if kind is float or isinstance(x, Unvalued):  # (a layer or a weight)
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in _NUMERIC_KINDS:
            raise OperandError(f"{op}: array operand has dtype {x.dtype}; monadl computes with numbers")
        return x
    if isinstance(x, (float, int, np.number, np.bool_)):
        return x
    if is_array(x):  # an array of another library (CuPy, array API ...)
        dtype = getattr(x, "dtype", None)
        if not namespace(x).isdtype(dtype, ("numeric", "bool")):
            raise OperandError(f"{op}: array operand has dtype {dtype}; monadl computes with numbers")
        return x
    hint = ""
    if isinstance(x, (list, tuple)):  # (layers in it: a join, not an array of objects)
        joined = any(isinstance(y, Unvalued) for y in x)
        hint = " (join its layers with ml.stack or ml.concatenate)" if joined else " (wrap it with np.asarray first)"
    elif callable(getattr(x, "forward", None)):  # (a DeepLearning instance of one's own)
        hint = " (an object with a forward(): lift it with ml.as_layer(x))"
    raise OperandError(f"{op}: operand of type {type(x).__name__} is not a Layer, a Weight, an array or a number{hint}")
