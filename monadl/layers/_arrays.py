"""The arrays operands may be: NumPy's (`Array`), or any array API library's (`DeviceArray`)."""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import numpy.typing as npt

__all__ = ["Array", "DeviceArray"]

Array: TypeAlias = npt.NDArray[Any]
"""A NumPy array (any dtype monadl computes with: float32 or float64)."""


class DeviceArray(Protocol):
    """An array of any library of the Python array API standard: a CuPy array
    on a GPU, an ``array_api_strict`` array ... Weights and layers of such
    arrays compute in their own library; their types are not tracked as
    precisely as NumPy's (a weight of one is a ``Weight[Any, Any]``)."""

    def __array_namespace__(self, /, *, api_version: str | None = None) -> Any: ...
