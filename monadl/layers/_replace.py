"""Checked replacement of a weight's data and optimizer state (the setters of
`Weight`, and what `monadl.checkpoint.load` goes through).

A replacement must look exactly like what it replaces: same shape, dtype and
array library for the data; the same tree of tuples, NamedTuples, numbers and
arrays for the optimizer state. Arrays are copied, so the caller may go on
mutating its own. The data keeps the type the weight holds in memory (a NumPy
scalar stays a NumPy scalar, a 0-d array stays a 0-d array).

>>> import numpy as np
>>> replace_data(np.zeros(2), [1.0, 2.0], "Weight.data")
Traceback (most recent call last):
...
monadl.errors.OperandError: Weight.data: expected an array or a number, got list
"""

from __future__ import annotations

from typing import Any

import numpy as np

from monadl._namespace import is_array, library_name, namespace
from monadl.errors import DeviceError, DTypeError, OperandError, ShapeError

__all__ = ["replace_data", "replace_state"]


def _is_leaf_array(x: object) -> bool:
    return isinstance(x, np.generic) or is_array(x)


def _library(x: object) -> str:
    # Python numbers live on the host, as NumPy's do.
    return "numpy" if isinstance(x, (float, int, np.generic, np.ndarray)) else library_name(x)


def _byte_order_apart(a: Any, b: Any) -> bool:
    """Whether two NumPy dtypes differ in byte order alone (a big-endian
    array read from a file, given to a weight: its values convert)."""
    return isinstance(a, np.dtype) and isinstance(b, np.dtype) and a.newbyteorder("=") == b.newbyteorder("=")


def _check_array(old: Any, new: Any, where: str) -> None:
    if _library(new) != _library(old):
        raise DeviceError(
            f"{where}: the weight holds a {_library(old)} array, got a {_library(new)} array; "
            "monadl never moves data between libraries or devices by itself: move it explicitly"
        )
    shape = tuple(getattr(new, "shape", ()))
    if shape != tuple(old.shape):
        raise ShapeError(f"{where}: expected shape {tuple(old.shape)}, got {shape}")
    if isinstance(new, (float, int)):
        return  # a Python number has no dtype of its own: it takes the weight's
    if new.dtype != old.dtype and not _byte_order_apart(new.dtype, old.dtype):
        raise DTypeError(
            f"{where}: expected dtype {old.dtype}, got {new.dtype} (convert it first: x.astype(dtype) in NumPy, xp.astype(x, dtype) in the array API)"
        )


def replace_data(old: Any, new: Any, where: str) -> Any:
    """A copy of ``new`` in the form of ``old`` (a weight's data), or an error
    that says what differs, prefixed with ``where``.

    >>> import numpy as np
    >>> replace_data(np.float32(0.0), np.array(2.5, np.float32), "Weight.data")
    np.float32(2.5)
    """
    if isinstance(new, (bool, np.bool_)) or not (isinstance(new, (float, int, np.generic)) or is_array(new)):
        raise OperandError(f"{where}: expected an array or a number, got {type(new).__name__}")
    _check_array(old, new, where)
    if isinstance(old, np.generic):
        return old.dtype.type(new)
    if isinstance(old, np.ndarray):
        return np.array(new, dtype=old.dtype, copy=True)
    return namespace(old).asarray(new, copy=True)


def replace_state(old: Any, new: Any, where: str) -> Any:
    """A copy of ``new`` (optimizer state) checked against ``old``: the same
    tree of tuples and NamedTuples, numbers where ``old`` has numbers, arrays
    of the same shape, dtype and library where ``old`` has arrays.

    >>> import numpy as np
    >>> replace_state((0, np.zeros(2)), (3, np.ones(3)), "Weight.state")
    Traceback (most recent call last):
    ...
    monadl.errors.ShapeError: Weight.state[1]: expected shape (2,), got (3,)
    """
    if _is_leaf_array(old):
        if not _is_leaf_array(new):
            raise OperandError(f"{where}: expected an array, got {type(new).__name__}")
        _check_array(old, new, where)
        if isinstance(new, np.generic):
            return new  # immutable
        if isinstance(new, np.ndarray):  # (in the old's byte order: the native one)
            return np.array(new, dtype=old.dtype, copy=True)
        return namespace(new).asarray(new, copy=True)
    if isinstance(old, tuple):
        if type(new) is not type(old) or len(new) != len(old):
            raise OperandError(f"{where}: expected {_describe(old)}, got {_describe(new)}")
        fields = getattr(old, "_fields", None)
        labels = [f".{f}" for f in fields] if fields is not None else [f"[{i}]" for i in range(len(old))]
        parts = [replace_state(o, n, where + label) for o, n, label in zip(old, new, labels)]
        return type(old)(*parts) if fields is not None else tuple(parts)
    if old is None or isinstance(old, (bool, int, float)):
        # A step count stays an int (not a bool, not a float): the schedules index by it.
        if type(new) is not type(old):
            raise OperandError(f"{where}: expected {_describe(old)}, got {_describe(new)}")
        return new
    if type(new) is not type(old):
        raise OperandError(f"{where}: expected {_describe(old)}, got {_describe(new)}")
    return new  # an optimizer's own state type: trusted as it is


def _describe(x: object) -> str:
    if isinstance(x, tuple):
        return f"{type(x).__name__} of {len(x)}"
    return "None" if x is None else type(x).__name__
