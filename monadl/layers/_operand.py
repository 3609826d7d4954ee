"""An operand checked where a layer is built, while the user's line is still on the stack."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import OperandError
from monadl.layers._unvalued import Unvalued

__all__ = ["numbers_given", "operand"]

_NUMERIC_KINDS: Final = frozenset("fiub")
_REAL: Final = (
    "monadl computes with real numbers (booleans, integers and floats; not complex ones, nor objects or strings)"
)
_JOIN: Final = " (join its layers with ml.stack or ml.concatenate)"
_ITEMS: Final = "_monadl_items"
"""Where a refused list of layers keeps its items on the error: in a traced
cell they may be the placeholders of numbers (`numbers_given`)."""


def operand(x: object, op: str) -> Any:
    """Check an operand early, where the user's line is still on the stack."""
    kind = type(x)
    if kind is float or isinstance(x, Unvalued):  # (a layer or a weight)
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in _NUMERIC_KINDS:
            raise OperandError(f"{op}: array operand has dtype {x.dtype}; {_REAL}")
        return x
    if isinstance(x, (float, int, np.number, np.bool_)):
        return x
    if is_array(x):  # an array of another library (CuPy, array API ...)
        dtype = getattr(x, "dtype", None)
        if not namespace(x).isdtype(dtype, ("bool", "integral", "real floating")):
            raise OperandError(f"{op}: array operand has dtype {dtype}; {_REAL}")
        return x
    hint = ""
    if isinstance(x, (list, tuple)):  # (layers in it: a join, not an array of objects)
        if any(isinstance(y, Unvalued) for y in x):
            error = OperandError(
                f"{op}: operand of type {type(x).__name__} is not a Layer, a Weight, an array or a number{_JOIN}"
            )
            error.__dict__[_ITEMS] = tuple(x)  # (kept for `numbers_given`; its type stays OperandError)
            raise error
        hint = " (wrap it with np.asarray first)"
    elif callable(getattr(x, "forward", None)):  # (a DeepLearning instance of one's own)
        hint = " (an object with a forward(): lift it with ml.as_layer(x))"
    raise OperandError(f"{op}: operand of type {type(x).__name__} is not a Layer, a Weight, an array or a number{hint}")


def numbers_given(error: OperandError, numbers: Collection[int]) -> None:
    """Where a traced cell's list operand holds only the placeholders of
    numbers it was given (``numbers``: their ids), say so in ``error``: the
    list was of floats, not layers to join, and wants to be one array (in
    `monadl.fold`, a row made by ``Vector(n)`` before the `Function`)."""
    items = error.__dict__.get(_ITEMS)
    if items is None:
        return
    layers = [y for y in items if isinstance(y, Unvalued)]
    if all(id(y) in numbers for y in layers):
        text = error.args[0].replace(
            _JOIN,
            " (inside the cell, a list of the numbers it was given: pass them as one array, np.asarray(xs); "
            "in monadl.fold, put Vector(n) before the Function)",
        )
        error.args = (text, *error.args[1:])
