"""The rules of ``conv2d`` and ``max_pool2d``, on NCHW arrays like PyTorch's.

Both read the input through strided slices, one per kernel position. The
convolution lays the batch out last, (C, H, W, N), so that its im2col matrix
is (C*KH*KW, OH*OW*N) and the forward and both deltas are each one matrix
product over the whole batch (a product per sample, with the weight's parts
summed afterwards, was several times slower), and so that every slice's rows
are long (OW*N, where NCHW's are OW: NumPy pays per row, 1.6 to 8 times more
for the im2col and the delta's scatter of small images). Its output is an
NCHW view of the product's (O, OH, OW, N): elementwise operations keep that
layout, and the next convolution's batch-last view of it is then contiguous.
The pooling is the elementwise maximum of its slices. Input deltas add each
position's slice back into an array of zeros; in a pool the first maximum of
a window takes the whole delta, as in PyTorch (a window holding NaN has NaN
for its maximum, and its first NaN takes the delta, as NumPy's argmax would
pick).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from monadl._namespace import namespace

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]

_BATCH_LAST = (1, 2, 3, 0)  # (N, C, H, W) -> (C, H, W, N)
_BATCH_FIRST = (3, 0, 1, 2)  # and back


# ---- convolution and pooling (NCHW, like PyTorch) -------------------------------------------
def _window(i: int, j: int, stride: int, oh: int, ow: int) -> tuple[slice, slice]:
    """The rows and columns of the inputs that meet kernel position (i, j): strided slices."""
    return slice(i, i + stride * (oh - 1) + 1, stride), slice(j, j + stride * (ow - 1) + 1, stride)


def _conv2d(x: Value, w: Value, stride: int, padding: int) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(x)
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise ValueError(
            f"conv2d: an NCHW input (4-D) and an (out, in, kh, kw) kernel (4-D), got shapes {tuple(x.shape)} and "
            f"{tuple(w.shape)}; one image of CHW is x[None], a kernel of one channel in and out w[None, None]"
        )
    n, c, h, wd = x.shape
    o, c2, kh, kw = w.shape
    if c != c2:
        layout = f" (NCHW: is it an NHWC image of {wd} channels?)" if wd == c2 else ""
        raise ValueError(f"conv2d: input has {c} channels, kernel expects {c2}{layout}")
    hp, wp = h + 2 * padding, wd + 2 * padding
    oh, ow = (hp - kh) // stride + 1, (wp - kw) // stride + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"conv2d: kernel {kh}x{kw} is larger than the padded input {hp}x{wp}")
    inner = (slice(None), slice(padding, padding + h), slice(padding, padding + wd), ...)
    if padding:
        padded = xp.zeros((c, hp, wp, n), dtype=x.dtype, device=x.device)
        padded[inner] = xp.permute_dims(x, _BATCH_LAST)
    else:
        padded = xp.permute_dims(x, _BATCH_LAST)
    # im2col: (C*KH*KW, OH*OW*N), rows ordered like the kernel's (O, C*KH*KW).
    positions = [(slice(None), *_window(i, j, stride, oh, ow), ...) for i in range(kh) for j in range(kw)]
    cols = xp.reshape(xp.stack([padded[at] for at in positions], axis=1), (c * kh * kw, oh * ow * n))
    w2 = xp.reshape(w, (o, c * kh * kw))
    out = xp.permute_dims(xp.reshape(w2 @ cols, (o, oh, ow, n)), _BATCH_FIRST)

    def delta(g: Value) -> Value:
        """(O, OH*OW*N): a copy only where ``g`` is not laid out like the output."""
        return xp.reshape(xp.permute_dims(g, _BATCH_LAST), (o, oh * ow * n))

    def vjp_x(g: Value) -> Value:
        dcols = xp.reshape(xp.matrix_transpose(w2) @ delta(g), (c, kh * kw, oh, ow, n))
        dpadded = xp.zeros((c, hp, wp, n), dtype=dcols.dtype, device=x.device)
        # NumPy's and CuPy's slices are views: each position's rows added into in place (13% of this delta)
        viewed = type(dpadded) is np.ndarray or type(dpadded).__module__.partition(".")[0] == "cupy"
        for k, at in enumerate(positions):
            if viewed:
                part = dpadded[at]
                part += dcols[:, k, ...]
            else:
                dpadded[at] = dpadded[at] + dcols[:, k, ...]
        return xp.permute_dims(dpadded[inner] if padding else dpadded, _BATCH_FIRST)

    def vjp_w(g: Value) -> Value:
        # (C*KH*KW, M) @ (M, O), transposed: OpenBLAS runs it 1.1-1.7x faster than (O, M) @ (M, C*KH*KW);
        # copied to the kernel's own layout (it is small): a plain SGD step writes into its gradient and keeps it.
        return xp.reshape(xp.matrix_transpose(cols @ xp.matrix_transpose(delta(g))), w.shape, copy=True)

    return out, (vjp_x, vjp_w)


def _max_pool2d(x: Value, kernel: int, stride: int) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(x)
    if len(x.shape) != 4:
        raise ValueError(f"max_pool2d: an NCHW input (4-D), got shape {tuple(x.shape)}; one image of CHW is x[None]")
    h, w = x.shape[2:]
    oh, ow = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"max_pool2d: kernel {kernel} is larger than the input {h}x{w}")
    # Elementwise over the strided slices: a max or argmax along a stacked axis
    # of kernel*kernel elements costs NumPy a loop per window, ten times slower.
    indices = [(slice(None), slice(None), *_window(i, j, stride, oh, ow)) for i in range(kernel) for j in range(kernel)]
    out = x[indices[0]]
    for index in indices[1:]:
        out = xp.maximum(out, x[index])

    def vjp(g: Value) -> Value:
        dx = xp.zeros_like(x, dtype=g.dtype)  # in x's layout (NumPy's and PyTorch's keep it)
        zero = xp.zeros((), dtype=g.dtype, device=x.device)
        rest = g  # the delta of the windows whose maximum no earlier position was
        for k, index in enumerate(indices):
            seen = x[index]
            taken = xp.logical_or(seen == out, xp.isnan(seen))
            # (chosen, not multiplied by a mask: a NaN or an infinity of the delta goes to the maximum alone)
            share = xp.where(taken, rest, zero)
            dx[index] = share if stride >= kernel else dx[index] + share
            if k + 1 < len(indices):
                rest = xp.where(taken, zero, rest)
        return dx

    return out, (vjp,)
