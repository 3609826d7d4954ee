"""The rule for one operation's operands, and how messages show them.

One float dtype per operation, by one rule (PyTorch's): two float arrays of
different precision raise `DTypeError`; an integer or boolean array beside a
float one takes the float's dtype (NumPy alone would promote ``int64 *
float32`` to float64), as does a NumPy integer or bool scalar, and so does a float scalar (a NumPy float, an array
or weight of no dimensions: ``ml.Weight(0.0)`` as a float32 model's bias),
as PyTorch's 0-d tensors do. The runtime applies it to every node
(`monadl.runtime.node.compute`), and a traced operation (`monadl.operation`)
to every step of its program, so marking a cell changes no dtype and no error.

>>> import numpy as np
>>> [a.dtype for a in one_float_dtype("mul", (np.ones(2, np.float32), np.arange(2)), "f.py:3")]
[dtype('float32'), dtype('float32')]
>>> [a.dtype for a in one_float_dtype("add", (np.ones(2, np.float32), np.float64(1.0)), "f.py:3")]
[dtype('float32'), dtype('float32')]
>>> [a.dtype for a in one_float_dtype("mul", (np.ones(2, np.float32), np.int64(2)), "f.py:3")]
[dtype('float32'), dtype('float32')]
>>> [a.dtype for a in one_float_dtype("mul", (np.array(0.5, np.float32), np.arange(2)), "f.py:3")]
[dtype('float32'), dtype('float32')]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from monadl._namespace import is_array, library_name, namespace
from monadl.errors import DTypeError

__all__ = ["describe", "one_float_dtype"]


def one_float_dtype(name: str, args: tuple[Any, ...], where: str) -> tuple[Any, ...]:
    """``args`` with integer and boolean arrays, and float scalars (NumPy
    floats, arrays of no dimensions) of another precision, cast to the float
    dtype of the others; `DTypeError` (naming ``name``, the operands and
    ``where``) if two float arrays with dimensions differ."""
    first = None
    for a in args:
        if is_array(a) and a.ndim and namespace(a).isdtype(a.dtype, "real floating"):
            if first is None:
                first = a.dtype
            elif a.dtype != first:
                raise DTypeError(
                    f"{name}: operands {describe(args)} mix {dtype_name(first)} and {dtype_name(a.dtype)} arrays; "
                    f"cast one with .astype first; layer built at {where}"
                )
    if first is None:  # no float array with dimensions: a float of none (a 0-d weight) sets it for integers
        floats = [a.dtype for a in args if isinstance(a, np.floating) or (is_array(a) and _real_float(a))]
        first = floats[0] if len(set(floats)) == 1 else None
    if first is None or not any(map(_cast, args, (first,) * len(args))):
        return args  # (the same tuple: nothing to cast)
    return tuple([_as(a, first) if _cast(a, first) else a for a in args])


def _cast(a: Any, dtype: Any) -> bool:
    """Whether operand ``a`` takes the float dtype ``dtype`` of the others: an
    integer or boolean array, or a float scalar of another precision."""
    if isinstance(a, np.floating):
        return bool(a.dtype != dtype)
    if isinstance(a, (np.integer, np.bool_)):  # (np.int64(2): as a Python 2, not a float64 promotion)
        return True
    if not is_array(a):
        return False
    xp = namespace(a)
    if xp.isdtype(a.dtype, ("integral", "bool")):
        return True
    return not a.ndim and bool(a.dtype != dtype) and bool(xp.isdtype(a.dtype, "real floating"))


def _real_float(a: Any) -> bool:
    return bool(namespace(a).isdtype(a.dtype, "real floating"))


def _as(a: Any, dtype: Any) -> Any:
    if isinstance(a, np.generic):
        return np.dtype(dtype).type(a)
    return namespace(a).astype(a, dtype)


def describe(args: Sequence[Any]) -> str:
    """Operands as a message shows them: ``float32[16, 64], float 2.0``."""
    parts = []
    for a in args:
        if isinstance(a, np.ndarray):
            parts.append(f"{a.dtype}{list(a.shape)}")
        elif isinstance(a, np.generic):
            parts.append(f"{a.dtype} scalar")
        elif is_array(a):
            parts.append(f"{library_name(a)} {dtype_name(a.dtype)}{list(a.shape)}")
        else:
            parts.append(f"{type(a).__name__} {a!r}")
    return ", ".join(parts)


def dtype_name(dtype: Any) -> str:
    """A dtype's short name: ``array_api_strict.float32`` -> ``float32``."""
    return str(dtype).rsplit(".", 1)[-1]
