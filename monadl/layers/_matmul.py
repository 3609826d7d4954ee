"""The rules of the matrix products: ``matmul``, and ``dense`` (``a @ b +
bias`` as one node).

Their products of matrices go through `product` and `outer_rule`
(`_products` picks the NumPy call for shapes OpenBLAS serves badly), and
each rule tries the common case first: 2-D NumPy operands, a layer of rows.
Other ranks follow ``@``'s rules for 1-D operands and stacks of matrices.
``dense`` adds its bias in place into the product's fresh array and sums the
bias's delta over the rows itself.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, Final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import unbroadcast
from monadl.layers._elementwise import _identity
from monadl.layers._products import outer_rule, product

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]


# ---- linear algebra -----------------------------------------------------------
_MT: Final = attrgetter("mT")  # NumPy's matrix transpose without np.matrix_transpose's Python checks


def _matmul(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = product(a, b)
    if type(out) is np.ndarray and a.ndim == 2 and b.ndim == 2:  # the common case, first
        return out, (lambda g: product(g, b.mT), outer_rule(a, b))
    if a.ndim == 1 and b.ndim == 1:
        return out, (lambda g: g * b, lambda g: g * a)
    xp = namespace(out)
    mt = _MT if xp is np else xp.matrix_transpose
    if a.ndim == 1:  # (k,) @ (..., k, n) -> (..., n)
        return out, (
            lambda g: unbroadcast(g[..., None, :] @ mt(b), (1, a.shape[0]))[0, ...],
            lambda g: a[:, None] * g[..., None, :],
        )
    if b.ndim == 1:  # (..., m, k) @ (k,) -> (..., m)
        return out, (
            lambda g: g[..., :, None] * b,
            lambda g: unbroadcast(mt(a) @ g[..., :, None], (b.shape[0], 1))[:, 0],
        )
    return out, (lambda g: product(g, mt(b)), lambda g: product(mt(a), g))


def _dense(a: Value, b: Value, bias: Value) -> tuple[Value, tuple[Vjp, ...]]:
    """``a @ b + bias`` as one node: the bias is added in place into the
    product's fresh array, and its delta is summed over the rows here."""
    if (
        type(a) is np.ndarray
        and type(b) is np.ndarray
        and type(bias) is np.ndarray
        and a.ndim == 2
        and b.ndim == 2
        and bias.ndim == 1
        and a.dtype is b.dtype is bias.dtype
        and b.shape[1] == bias.shape[0]
    ):
        # The common case (a layer of rows, NumPy, one dtype) in one call: it runs for every layer.
        out = product(a, b)
        np.add(out, bias, out=out)
        shape = bias.shape
        return out, (
            lambda g: product(g, b.mT),
            outer_rule(a, b),
            lambda g: np.add.reduce(g, axis=0) if type(g) is np.ndarray and g.ndim == 2 else unbroadcast(g, shape),
        )
    out, (da, db) = _matmul(a, b)
    shape = getattr(bias, "shape", ())
    if (
        type(out) is np.ndarray
        and type(bias) is np.ndarray
        and bias.dtype is out.dtype
        and out.shape[out.ndim - len(shape) :] == shape
    ):
        np.add(out, bias, out=out)
    else:
        out = out + bias
    if shape == getattr(out, "shape", ()):
        return out, (da, db, _identity)
    return out, (da, db, lambda g: unbroadcast(g, shape))
