"""The differentiable primitives: one table, forward and backward side by side.

Each primitive is a function ``f(*operands, *params) -> (value, vjps)``.
``vjps`` holds one closure per operand that maps the delta of ``value`` to the
delta of that operand (a vector-Jacobian product). The runtime calls only the
closures whose operand leads to a trainable weight, and undoes broadcasting
afterwards with `unbroadcast`, so no rule handles broadcasting itself. A
closure captures only what its rule needs, so the rest can be freed early.

Everything else in monadl (``cross_entropy``, ``dense`` ...) is composed from
these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, final

import numpy as np

__all__ = ["Primitive", "unbroadcast", "PRIMITIVES"]

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]
Rule = Callable[..., tuple[Value, tuple[Vjp, ...]]]


@final
@dataclass(frozen=True, slots=True)
class Primitive:
    """A named rule. ``same_dtype``: refuse to mix float32 and float64 arrays."""

    name: str
    rule: Rule
    same_dtype: bool = False


def unbroadcast(delta: Value, shape: tuple[int, ...]) -> Value:
    """Sum ``delta`` over the axes that broadcasting added or stretched.

    >>> unbroadcast(np.ones((2, 3)), (3,))
    array([2., 2., 2.])
    >>> unbroadcast(np.ones((2, 3)), (2, 1)).shape
    (2, 1)
    >>> float(unbroadcast(np.ones((2, 3)), ()))
    6.0
    """
    extra = delta.ndim - len(shape)
    if extra:
        delta = delta.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and delta.shape[i] != 1)
    if stretched:
        delta = delta.sum(axis=stretched, keepdims=True)
    return delta


# ---- elementwise, binary ----------------------------------------------------
def _add(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a + b, (_identity, _identity)


def _sub(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a - b, (_identity, np.negative)


def _mul(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a * b, (lambda g: g * b, lambda g: g * a)


def _div(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = a / b
    return out, (lambda g: g / b, lambda g: -g * out / b)


def _pow(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = a**b
    return out, (
        lambda g: g * b * a ** (b - 1),
        # d(a**b)/db = a**b * log(a); defined as 0 where a == 0 (the limit for b > 0).
        lambda g: g * out * np.log(np.where(a == 0, 1, a)),
    )


def _maximum(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # Ties split the delta evenly, so the rule is symmetric and sums to g.
    take_a = (a > b) + 0.5 * (a == b)
    return np.maximum(a, b), (lambda g: g * take_a, lambda g: g * (1 - take_a))


def _minimum(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    take_a = (a < b) + 0.5 * (a == b)
    return np.minimum(a, b), (lambda g: g * take_a, lambda g: g * (1 - take_a))


# ---- elementwise, unary -----------------------------------------------------
def _neg(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return -a, (np.negative,)


def _exp(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = np.exp(a)
    return out, (lambda g: g * out,)


def _log(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return np.log(a), (lambda g: g / a,)


def _sqrt(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = np.sqrt(a)
    return out, (lambda g: g * 0.5 / out,)


def _abs(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return np.abs(a), (lambda g: g * np.sign(a),)


def _tanh(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = np.tanh(a)
    return out, (lambda g: g * (1 - out * out),)


def _sigmoid(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # exp(-|a|) never overflows; the two branches are the same function.
    e = np.exp(-np.abs(a))
    out = np.where(a >= 0, 1 / (1 + e), e / (1 + e))
    return out, (lambda g: g * out * (1 - out),)


def _relu(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    mask = a > 0
    return a * mask, (lambda g: g * mask,)


# ---- linear algebra -----------------------------------------------------------
def _matmul(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = a @ b
    if a.ndim == 1 and b.ndim == 1:
        return out, (lambda g: g * b, lambda g: g * a)
    if a.ndim == 1:  # (k,) @ (..., k, n) -> (..., n)
        return out, (
            lambda g: unbroadcast(g[..., None, :] @ np.swapaxes(b, -1, -2), (1, a.shape[0]))[0],
            lambda g: a[:, None] * g[..., None, :],
        )
    if b.ndim == 1:  # (..., m, k) @ (k,) -> (..., m)
        return out, (
            lambda g: g[..., :, None] * b,
            lambda g: unbroadcast(np.swapaxes(a, -1, -2) @ g[..., :, None], (b.shape[0], 1))[:, 0],
        )
    return out, (
        lambda g: g @ np.swapaxes(b, -1, -2),
        lambda g: np.swapaxes(a, -1, -2) @ g,
    )


# ---- reductions -----------------------------------------------------------------
def _expand(g: Value, shape: tuple[int, ...], axis: Any, keepdims: bool) -> Value:
    """Give a reduced delta back the reduced axes, ready to broadcast."""
    if axis is None or keepdims:
        return g if keepdims or axis is not None else np.broadcast_to(g, shape)
    axes = (axis,) if isinstance(axis, int) else axis
    return np.expand_dims(g, tuple(ax % len(shape) for ax in axes))


def _sum(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    shape = np.shape(a)
    return np.sum(a, axis=axis, keepdims=keepdims), (
        lambda g: np.broadcast_to(_expand(g, shape, axis, keepdims), shape),
    )


def _mean(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    shape = np.shape(a)
    out = np.mean(a, axis=axis, keepdims=keepdims)
    scale = np.size(out) / max(np.size(a), 1)
    return out, (
        lambda g: np.broadcast_to(_expand(g, shape, axis, keepdims) * scale, shape),
    )


def _max(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    shape = np.shape(a)
    out = np.max(a, axis=axis, keepdims=keepdims)
    full = _expand(out, shape, axis, keepdims)
    winners = a == full
    # Tied maxima share the delta evenly.
    share = winners / np.sum(winners, axis=axis, keepdims=True)
    return out, (lambda g: _expand(g, shape, axis, keepdims) * share,)


def _logsumexp(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    shape = np.shape(a)
    peak = np.max(a, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0)
    e = np.exp(a - peak)
    total = np.sum(e, axis=axis, keepdims=True)
    out_keep = np.log(total) + peak
    out = out_keep if keepdims else (np.squeeze(out_keep, axis=axis) if axis is not None else out_keep.reshape(()))
    soft = e / total
    return out, (lambda g: _expand(g, shape, axis, keepdims) * soft,)


def _softmax(a: Value, axis: int) -> tuple[Value, tuple[Vjp, ...]]:
    e = np.exp(a - np.max(a, axis=axis, keepdims=True))
    out = e / np.sum(e, axis=axis, keepdims=True)
    return out, (lambda g: out * (g - np.sum(g * out, axis=axis, keepdims=True)),)


def _log_softmax(a: Value, axis: int) -> tuple[Value, tuple[Vjp, ...]]:
    shifted = a - np.max(a, axis=axis, keepdims=True)
    out = shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    return out, (lambda g: g - np.exp(out) * np.sum(g, axis=axis, keepdims=True),)


# ---- shape and indexing -------------------------------------------------------------
def _reshape(a: Value, shape: tuple[int, ...]) -> tuple[Value, tuple[Vjp, ...]]:
    old = np.shape(a)
    return np.reshape(a, shape), (lambda g: np.reshape(g, old),)


def _transpose(a: Value, axes: tuple[int, ...] | None) -> tuple[Value, tuple[Vjp, ...]]:
    inverse = None if axes is None else tuple(np.argsort(axes))
    return np.transpose(a, axes), (lambda g: np.transpose(g, inverse),)


def _getitem(a: Value, index: Any) -> tuple[Value, tuple[Vjp, ...]]:
    shape, dtype = a.shape, a.dtype

    def vjp(g: Value) -> Value:
        out = np.zeros(shape, dtype)
        if _is_basic(index):
            out[index] = g
        else:  # fancy indices may repeat: scatter-add
            np.add.at(out, index, g)
        return out

    return a[index], (vjp,)


def _is_basic(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in items)


def _embedding(table: Value, indices: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # The delta of the table is sparse: only the rows looked up (the paper's
    # Data != Delta example). A weight's step then touches only those rows.
    from monadl.typeclasses.monoid import SparseRows

    shape = table.shape
    return table[indices], (lambda g: SparseRows(indices.ravel(), g.reshape(-1, *shape[1:]), shape),)


def _concatenate(*args: Any) -> tuple[Value, tuple[Vjp, ...]]:
    *arrays, axis = args
    ends = np.cumsum([np.shape(x)[axis] for x in arrays])
    starts = ends - np.asarray([np.shape(x)[axis] for x in arrays])

    def piece(lo: int, hi: int) -> Vjp:
        return lambda g: np.take(g, np.arange(lo, hi), axis=axis)

    return np.concatenate(arrays, axis=axis), tuple(piece(lo, hi) for lo, hi in zip(starts, ends))


def _stack(*args: Any) -> tuple[Value, tuple[Vjp, ...]]:
    *arrays, axis = args

    def piece(i: int) -> Vjp:
        return lambda g: np.take(g, i, axis=axis)

    return np.stack(arrays, axis=axis), tuple(piece(i) for i in range(len(arrays)))


# ---- convolution and pooling (NCHW, like PyTorch) -------------------------------------------
def _windows(x: Value, kh: int, kw: int, stride: int) -> Value:
    """(N, C, H, W) -> (N, C, OH, OW, KH, KW), a view."""
    view = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))
    return view[:, :, ::stride, ::stride]


def _conv2d(x: Value, w: Value, stride: int, padding: int) -> tuple[Value, tuple[Vjp, ...]]:
    n, c, h, wd = x.shape
    o, c2, kh, kw = w.shape
    if c != c2:
        raise ValueError(f"conv2d: input has {c} channels, kernel expects {c2}")
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding))) if padding else x
    cols = _windows(xp, kh, kw, stride)  # N C OH OW KH KW
    out = np.einsum("ncpqij,ocij->nopq", cols, w, optimize=True)
    oh, ow = out.shape[2], out.shape[3]

    def vjp_x(g: Value) -> Value:
        dxp = np.zeros(xp.shape, dtype=np.result_type(g, w))
        for i in range(kh):
            for j in range(kw):
                dxp[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += np.einsum(
                    "nopq,oc->ncpq", g, w[:, :, i, j], optimize=True
                )
        return dxp[:, :, padding : padding + h, padding : padding + wd] if padding else dxp

    return out, (vjp_x, lambda g: np.einsum("nopq,ncpqij->ocij", g, cols, optimize=True))


def _max_pool2d(x: Value, kernel: int, stride: int) -> tuple[Value, tuple[Vjp, ...]]:
    n, c, h, w = x.shape
    cols = _windows(x, kernel, kernel, stride)
    oh, ow = cols.shape[2], cols.shape[3]
    flat = cols.reshape(n, c, oh, ow, kernel * kernel)
    winner = np.argmax(flat, axis=-1)  # the first maximum takes the whole delta, like PyTorch
    out = np.take_along_axis(flat, winner[..., None], axis=-1)[..., 0]

    def vjp(g: Value) -> Value:
        dx = np.zeros(x.shape, dtype=g.dtype)
        for k in range(kernel * kernel):
            i, j = divmod(k, kernel)
            dx[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride] += g * (winner == k)
        return dx

    return out, (vjp,)


def _stop_gradient(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a, ()  # no rule: the operand gets no delta


def _identity(g: Value) -> Value:
    return g


PRIMITIVES: Final[dict[str, Primitive]] = {
    p.name: p
    for p in (
        Primitive("add", _add, same_dtype=True),
        Primitive("subtract", _sub, same_dtype=True),
        Primitive("multiply", _mul, same_dtype=True),
        Primitive("divide", _div, same_dtype=True),
        Primitive("power", _pow, same_dtype=True),
        Primitive("maximum", _maximum, same_dtype=True),
        Primitive("minimum", _minimum, same_dtype=True),
        Primitive("negative", _neg),
        Primitive("stop_gradient", _stop_gradient),
        Primitive("exp", _exp),
        Primitive("log", _log),
        Primitive("sqrt", _sqrt),
        Primitive("abs", _abs),
        Primitive("tanh", _tanh),
        Primitive("sigmoid", _sigmoid),
        Primitive("relu", _relu),
        Primitive("matmul", _matmul, same_dtype=True),
        Primitive("sum", _sum),
        Primitive("mean", _mean),
        Primitive("max", _max),
        Primitive("logsumexp", _logsumexp),
        Primitive("softmax", _softmax),
        Primitive("log_softmax", _log_softmax),
        Primitive("reshape", _reshape),
        Primitive("transpose", _transpose),
        Primitive("getitem", _getitem),
        Primitive("embedding", _embedding),
        Primitive("concatenate", _concatenate, same_dtype=True),
        Primitive("stack", _stack, same_dtype=True),
        Primitive("conv2d", _conv2d, same_dtype=True),
        Primitive("max_pool2d", _max_pool2d),
    )
}
