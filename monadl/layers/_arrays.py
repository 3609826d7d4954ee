"""The arrays operands may be: NumPy's (`Array`), or any array API library's (`DeviceArray`); and NumPy's scalars."""

from __future__ import annotations

from collections.abc import Sequence
from types import EllipsisType
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["Array", "DeviceArray", "Gathering", "IndexArray", "Indexing", "NumPyScalar", "Parts", "Slicing"]

Array: TypeAlias = npt.NDArray[Any]
"""A NumPy array (any dtype monadl computes with: float32 or float64)."""


class DeviceArray(Protocol):
    """An array of any library of the Python array API standard: a CuPy array
    on a GPU, an ``array_api_strict`` array ... Weights and layers of such
    arrays compute in their own library; their types are not tracked as
    precisely as NumPy's (a weight of one is a ``Weight[Any, Any]``).

    NumPy's own arrays and scalars do not match it (their ``api_version`` is
    a ``Literal`` of versions, narrower than ``str``): they are `Array` and
    `NumPyScalar`, and a NumPy string does not pass as an array. A mypy note
    "Following member(s) of ... have conflicts: ... __array_namespace__" on a
    NumPy operand says that it is neither a number nor an array of numbers."""

    def __array_namespace__(self, /, *, api_version: str | None = None) -> Any: ...


NumPyScalar: TypeAlias = np.floating[Any] | np.integer[Any]
"""A NumPy number that is no Python ``float`` (``np.float32(0.5)``, ``np.int64(2)``,
``np.mean(x)``'s ``floating[Any]``; ``np.float64`` is a ``float``): an operand
as a Python number is, taking the dtype of the arrays beside it."""

# The indices of a layer (`monadl.layers._layer.Expr.__getitem__`), by what they give an array. mypy
# takes the first overload that fits, except where an argument holding Any (an index array of a dtype
# it does not know, ``np.array([0, 2])``) fits several: then it gives up for ``Layer[Any, Any]``. So
# `Indexing` takes no NumPy array, nor a tuple of one or two places that holds one; and `Parts`, a
# tuple of any length that may hold one, comes after it (a tuple of ints and slices fits `Indexing`
# first) and gives an array as `Gathering` does (no overload giving ``Layer[Any, Any]`` can take it:
# ``h[src, 0]`` fits it too, and would be ambiguous).
Slicing: TypeAlias = "slice | EllipsisType | tuple[slice | EllipsisType | None, ...]"
"""Slices alone (with ``...`` and ``None``): an array stays an array."""
IndexArray: TypeAlias = "np.ndarray[Any, Any] | DeviceArray | list[int] | range"
"""An index array (a GNN's ``h[sources]``, a mask; a CuPy array) or a list of
ints or a range. Any NumPy array: an index array's dtype is often unknown to
mypy (``np.array([0, 2])``), and one of floats raises anyway."""
_Ints: TypeAlias = "int | np.integer[Any]"
_Part: TypeAlias = "IndexArray | Sequence[_Ints] | Sequence[Sequence[_Ints]] | slice | EllipsisType | _Ints | None"
Gathering: TypeAlias = (
    "IndexArray | tuple[IndexArray, ...] | tuple[IndexArray, *tuple[_Part, ...]]"
    " | tuple[_Part, IndexArray, *tuple[_Part, ...]]"
)
"""An index array, index arrays alone, or a tuple with one in its first or
second place (``log_p[rows, labels]``, ``h[src, 0]``, ``h[:, src]``): its
result is an array, of the index arrays' broadcast shape and the axes left (a
0-d index array's element too, as NumPy's). Beside it a sequence (a tuple, a
list of bools, nested lists) is an index array as well, as in NumPy. A tuple
of ints is an element's index."""
_Element: TypeAlias = "int | np.integer[Any] | slice | EllipsisType | Sequence[Any] | None"
Indexing: TypeAlias = (
    "int | np.integer[Any] | slice | EllipsisType | Sequence[_Element] | tuple[Any, Any, Any, *tuple[Any, ...]] | None"
)
"""The other indices, whose result may be an element or a row: an int, a
slice, a sequence of them (a tuple), and any tuple of three places or more
(``x[:, :, src]`` too, not known to gather). No NumPy array alone, nor in a
tuple of one or two places (see above)."""
Parts: TypeAlias = "tuple[_Part, ...]"
"""A tuple of a length mypy does not know that may hold index arrays
(``tuple[int | ml.Array, ...]``, built at run time): typed as a gather (an
array), where `Indexing` has not taken it (a tuple of ints and slices alone)."""
