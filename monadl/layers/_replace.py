"""Checked replacement of a weight's data and optimizer state (the setters of
`Weight`, and what `monadl.checkpoint.load` goes through).

A replacement must look exactly like what it replaces: same shape, dtype and
array library for the data; the same tree of tuples, NamedTuples, numbers and
arrays for the optimizer state. Arrays are copied, so the caller may go on
mutating its own, unless it gives them away (``copy=False``: a checkpoint's
arrays, read for the weight). The data keeps the type the weight holds in memory (a NumPy
scalar stays a NumPy scalar, a 0-d array stays a 0-d array).

>>> import numpy as np
>>> replace_data(np.zeros(2), [1.0, 2.0], "Weight.data")
Traceback (most recent call last):
...
monadl.errors.OperandError: Weight.data: expected an array or a number, got list
"""

from __future__ import annotations

from typing import Any, final

import numpy as np

from monadl._namespace import is_array, library_name, namespace
from monadl.errors import DeviceError, DTypeError, OperandError, ShapeError

__all__ = ["replace_data", "replace_state", "structure"]


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


def _taken(old: Any, new: Any) -> bool:
    """Whether ``new``, an array the caller gives away (a checkpoint's, read
    for the weight), can be the weight's as it is: in the form a weight's
    NumPy array has (C order, NumPy's own dtype object, that of ``old``,
    writeable, owning its memory, so that a step may write into it)."""
    return (
        type(new) is np.ndarray
        and type(old) is np.ndarray
        and new.dtype is old.dtype
        and new.flags.c_contiguous
        and new.flags.writeable
        and new.flags.owndata
        and new.flags.aligned
    )


def replace_data(old: Any, new: Any, where: str, *, copy: bool = True) -> Any:
    """A copy of ``new`` in the form of ``old`` (a weight's data), or an error
    that says what differs, prefixed with ``where``. With ``copy=False`` the
    caller gives ``new`` away (nothing else holds it): a NumPy array already
    in that form is taken as it is, not copied.

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
        return new if not copy and _taken(old, new) else np.array(new, dtype=old.dtype, copy=True)
    return namespace(old).asarray(new, copy=True)


def replace_state(old: Any, new: Any, where: str, hint: str = "", *, copy: bool = True) -> Any:
    """A copy of ``new`` (optimizer state) checked against ``old``: the same
    tree of tuples and NamedTuples, numbers where ``old`` has numbers, arrays
    of the same shape, dtype and library where ``old`` has arrays. With
    ``copy=False``, its arrays are the caller's to give away, as in
    `replace_data`.

    Where the trees differ (another optimizer's state: a tuple of another
    length, a None where a step count is), the error shows both trees
    (`structure`), not just the first part that differs, and ends with
    ``hint``: the parts' order is what tells which is which.

    >>> import numpy as np
    >>> replace_state((0, np.zeros(2)), (3, np.ones(3)), "Weight.state")
    Traceback (most recent call last):
    ...
    monadl.errors.ShapeError: Weight.state[1]: expected shape (2,), got (3,)
    >>> replace_state((0, None, None), (3, None), "Weight.state")
    Traceback (most recent call last):
    ...
    monadl.errors.OperandError: Weight.state: expected (int, None, None), got (int, None)
    """
    try:
        return _replace(old, new, where, copy)
    except _Apart as apart:
        whole = f"expected {structure(old)}, got {structure(new)}"
        if apart.where != where:
            whole = f"expected {structure(apart.old)}, got {structure(apart.new)} (the whole state: {whole})"
        raise OperandError(f"{apart.where}: {whole}{hint}") from None


@final
class _Apart(Exception):
    """Where two states' trees differ (a tuple against another, a None
    against a number), for `replace_state` to show both trees whole."""

    def __init__(self, old: object, new: object, where: str) -> None:
        super().__init__(where)
        self.old, self.new, self.where = old, new, where


def _replace(old: Any, new: Any, where: str, copy: bool) -> Any:
    if _is_leaf_array(old):
        if not _is_leaf_array(new):
            raise OperandError(f"{where}: expected an array, got {type(new).__name__}")
        _check_array(old, new, where)
        if isinstance(new, np.generic):
            return new  # immutable
        if isinstance(new, np.ndarray):  # (in the old's byte order: the native one)
            return new if not copy and _taken(old, new) else np.array(new, dtype=old.dtype, copy=True)
        return namespace(new).asarray(new, copy=True)
    if isinstance(old, tuple):
        if type(new) is not type(old) or len(new) != len(old):
            raise _Apart(old, new, where)
        fields = getattr(old, "_fields", None)
        labels = [f".{f}" for f in fields] if fields is not None else [f"[{i}]" for i in range(len(old))]
        parts = [_replace(o, n, where + label, copy) for o, n, label in zip(old, new, labels)]
        return type(old)(*parts) if fields is not None else tuple(parts)
    if type(new) is not type(old):
        if old is None or new is None or isinstance(new, tuple):
            raise _Apart(old, new, where)
        # A step count stays an int (not a bool, not a float): the schedules index by it.
        raise OperandError(f"{where}: expected {type(old).__name__}, got {type(new).__name__}")
    return new  # a number, None, or an optimizer's own state type: trusted as it is


def structure(state: Any) -> str:
    """An optimizer state's tree of tuples, its arrays' dtypes and shapes, and its leaves' types.

    >>> import numpy as np
    >>> from typing import NamedTuple
    >>> class Moments(NamedTuple):
    ...     step: int
    ...     mu: Any
    >>> structure((Moments(0, np.zeros(3, np.float32)), None))
    '(Moments(int, float32[3]), None)'
    """
    if hasattr(state, "shape") and hasattr(state, "dtype"):
        return f"{state.dtype}{list(state.shape)}"
    if isinstance(state, tuple):
        kind = "" if type(state) is tuple else type(state).__name__
        return f"{kind}({', '.join([structure(x) for x in state])})"
    return "None" if state is None else type(state).__name__
