"""``c += alpha * a.T @ b`` written into ``c``, by the BLAS that NumPy calls.

NumPy has no product that adds into an array: ``c + a.T @ b`` writes the
product into a fresh array and reads it again to add. BLAS's ``gemm`` does
it in one pass over ``c`` (``beta = 1``), and NumPy's wheels carry OpenBLAS,
which exports it under a known name. This module finds that one function
(through threadpoolctl, which already knows NumPy's BLAS), checks it on a
small product against NumPy before it is trusted, and otherwise says it is
not there (`add_product` returns False and the caller computes as before).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Final

import numpy as np

__all__ = ["add_product", "can_add_product"]

_ROW_MAJOR: Final = 101
_NO_TRANS: Final = 111
_TRANS: Final = 112
_NAMES: Final = (
    ("scipy_cblas_{}gemm64_", ctypes.c_int64),
    ("cblas_{}gemm64_", ctypes.c_int64),
    ("cblas_{}gemm", ctypes.c_int),
)
"""Where NumPy's OpenBLAS keeps cblas gemm: the ILP64 builds of NumPy's
wheels (64-bit sizes, a suffix) first, then a plain 32-bit build."""

_found: dict[str, Any] = {}
_lock: Final = threading.Lock()


def add_product(c: np.ndarray[Any, Any], alpha: float, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """``c += alpha * (a.T @ b)`` in place, if NumPy's BLAS can: ``c`` a
    C-contiguous writeable float32 or float64 matrix, ``a`` and ``b``
    C-contiguous matrices of its dtype with as many rows as each other.
    Returns False, and changes nothing, where it cannot.

    >>> c, a, b = np.ones((3, 2)), np.ones((4, 3)), np.ones((4, 2))
    >>> if not add_product(c, 0.5, a, b):
    ...     c += 0.5 * (a.T @ b)
    >>> c[0]
    array([3., 3.])
    """
    if not can_add_product(c, a, b):
        return False
    _call(_gemm(_KINDS[c.dtype]), c, alpha, a, b)
    return True


def can_add_product(c: np.ndarray[Any, Any], a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Whether `add_product` can add ``a.T @ b`` into ``c``.

    >>> can_add_product(np.ones((3, 2)), np.ones((4, 3)), np.ones((4, 1)))
    False
    """
    dtype = c.dtype
    return (
        dtype in _KINDS
        and a.dtype == dtype
        and b.dtype == dtype
        and c.ndim == 2
        and a.ndim == 2
        and b.ndim == 2
        and c.flags.c_contiguous
        and c.flags.writeable
        and a.flags.c_contiguous
        and b.flags.c_contiguous
        and a.shape[0] == b.shape[0]
        and c.shape == (a.shape[1], b.shape[1])
        and _gemm(_KINDS[dtype]) is not None
    )


_KINDS: Final = {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}


def _call(gemm: Any, c: np.ndarray[Any, Any], alpha: float, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
    k, m = a.shape
    n = b.shape[1]
    gemm(_ROW_MAJOR, _TRANS, _NO_TRANS, m, n, k, alpha, a.ctypes.data, m, b.ctypes.data, n, 1.0, c.ctypes.data, n)


def _gemm(kind: str) -> Any:
    """The checked gemm of NumPy's BLAS for ``kind`` ("s", "d"), or None."""
    try:
        return _found[kind]
    except KeyError:
        pass
    with _lock:
        if kind not in _found:
            _found[kind] = _find(kind)
    return _found[kind]


def _find(kind: str) -> Any:
    try:
        from threadpoolctl import threadpool_info

        paths = [
            info["filepath"]
            for info in threadpool_info()
            if info.get("internal_api") == "openblas" and "numpy" in str(info.get("filepath", ""))
        ]
    except Exception:  # (threadpoolctl could not look: no fast path, nothing else changes)
        return None
    real = ctypes.c_float if kind == "s" else ctypes.c_double
    for path in paths:
        try:
            library = ctypes.PyDLL(path)  # (holding the GIL: see `monadl.optim.apply`)
        except OSError:
            continue
        for name, size in _NAMES:
            gemm = getattr(library, name.format(kind), None)
            if gemm is None:
                continue
            gemm.restype = None
            gemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, size, size, size, real, ctypes.c_void_p, size]
            gemm.argtypes += [ctypes.c_void_p, size, real, ctypes.c_void_p, size]
            if _agrees(gemm, kind):
                return gemm
    return None


def _agrees(gemm: Any, kind: str) -> bool:
    """Whether ``gemm`` adds a small product as NumPy computes it (a wrong size type would not)."""
    dtype = np.float32 if kind == "s" else np.float64
    rng = np.random.default_rng(0)
    a: np.ndarray[Any, Any] = rng.standard_normal((3, 5)).astype(dtype)
    b: np.ndarray[Any, Any] = rng.standard_normal((3, 4)).astype(dtype)
    c: np.ndarray[Any, Any] = rng.standard_normal((5, 4)).astype(dtype)
    expected = c + 0.5 * (a.T @ b)
    _call(gemm, c, 0.5, a, b)
    return bool(np.allclose(c, expected, rtol=1e-5, atol=1e-6))
