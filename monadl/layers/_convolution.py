"""The rules of ``conv2d`` and ``max_pool2d``, on NCHW arrays like PyTorch's.

Both read the input through strided slices, one per kernel position
(`_window`): the convolution as one product with the im2col matrix, the
pooling as the elementwise maximum of the slices. Their input deltas add
each position's slice back into an array of zeros; in a pool the first
maximum of a window takes the whole delta, as in PyTorch (a window holding
NaN has NaN for its maximum, and its first NaN takes the delta, as NumPy's
argmax would pick).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monadl._namespace import namespace
from monadl.layers._elementwise import _mask

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]


# ---- convolution and pooling (NCHW, like PyTorch) -------------------------------------------
def _window(i: int, j: int, stride: int, oh: int, ow: int) -> tuple[slice, ...]:
    """The index of the (N, C, OH, OW) inputs that meet kernel position (i, j): a strided slice."""
    return (
        slice(None),
        slice(None),
        slice(i, i + stride * (oh - 1) + 1, stride),
        slice(j, j + stride * (ow - 1) + 1, stride),
    )


def _conv2d(x: Value, w: Value, stride: int, padding: int) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(x)
    n, c, h, wd = x.shape
    o, c2, kh, kw = w.shape
    if c != c2:
        raise ValueError(f"conv2d: input has {c} channels, kernel expects {c2}")
    if padding:
        padded = xp.zeros((n, c, h + 2 * padding, wd + 2 * padding), dtype=x.dtype, device=x.device)
        padded[:, :, padding : padding + h, padding : padding + wd] = x
    else:
        padded = x
    oh, ow = (padded.shape[2] - kh) // stride + 1, (padded.shape[3] - kw) // stride + 1
    if oh < 1 or ow < 1:
        raise ValueError(
            f"conv2d: kernel {kh}x{kw} is larger than the padded input {padded.shape[2]}x{padded.shape[3]}"
        )
    # im2col: (N, C*KH*KW, OH*OW), ordered like the kernel's (O, C*KH*KW).
    windows = [padded[_window(i, j, stride, oh, ow)] for i in range(kh) for j in range(kw)]
    cols = xp.reshape(xp.stack(windows, axis=2), (n, c * kh * kw, oh * ow))
    w2 = xp.reshape(w, (o, c * kh * kw))
    out = xp.reshape(w2 @ cols, (n, o, oh, ow))

    def vjp_x(g: Value) -> Value:
        dcols = xp.reshape(xp.matrix_transpose(w2) @ xp.reshape(g, (n, o, oh * ow)), (n, c, kh * kw, oh, ow))
        dpadded = xp.zeros(padded.shape, dtype=dcols.dtype, device=x.device)
        for k in range(kh * kw):
            i, j = divmod(k, kw)
            index = _window(i, j, stride, oh, ow)
            dpadded[index] = dpadded[index] + dcols[:, :, k, :, :]
        return dpadded[:, :, padding : padding + h, padding : padding + wd] if padding else dpadded

    def vjp_w(g: Value) -> Value:
        per_sample = xp.reshape(g, (n, o, oh * ow)) @ xp.matrix_transpose(cols)
        return xp.reshape(xp.sum(per_sample, axis=0), w.shape)

    return out, (vjp_x, vjp_w)


def _max_pool2d(x: Value, kernel: int, stride: int) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(x)
    h, w = x.shape[2:]
    oh, ow = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"max_pool2d: kernel {kernel} is larger than the input {h}x{w}")
    # Elementwise over the strided slices: a max or argmax along a stacked axis
    # of kernel*kernel elements costs NumPy a loop per window, ten times slower.
    indices = [_window(i, j, stride, oh, ow) for i in range(kernel) for j in range(kernel)]
    out = x[indices[0]]
    for index in indices[1:]:
        out = xp.maximum(out, x[index])

    def vjp(g: Value) -> Value:
        dx = xp.zeros_like(x, dtype=g.dtype)  # in x's layout (NumPy's and PyTorch's keep it)
        rest = g  # the delta of the windows whose maximum no earlier position was
        for k, index in enumerate(indices):
            seen = x[index]
            share = rest * _mask(xp, xp.logical_or(seen == out, xp.isnan(seen)), rest)
            dx[index] = share if stride >= kernel else dx[index] + share
            if k + 1 < len(indices):
                rest = rest - share
        return dx

    return out, (vjp,)
