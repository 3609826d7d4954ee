"""The rules that reduce over axes: ``sum``, ``mean``, ``max``,
``logsumexp``, the softmax pair (``softmax``, ``log_softmax``) and the losses
built on them, ``cross_entropy`` and ``binary_cross_entropy`` (of logits).

A reduced delta gets its axes back in one helper (`_expand`) before it
broadcasts to the operand's shape; tied maxima share their delta evenly.
``cross_entropy`` is one rule, not a composition: its delta is ``(softmax -
one_hot) / n``, with no scatter, and its labels are checked as `embedding`'s
indices are (`_checked_indices`). With PyTorch's options (class weights, a
label ignored, label smoothing) it is the same rule over a weighted target,
`_weighted_cross_entropy`, which also computes a batched group's losses.
``binary_cross_entropy`` is one rule for the same reason (its delta is
``(sigmoid - targets) / n``), with its value written with ``softplus``, so
that no score overflows it.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np

from monadl._namespace import namespace
from monadl.errors import DTypeError
from monadl.layers._elementwise import _clipped, _mask, _scalar
from monadl.layers._indexing import PLAIN, _checked_indices
from monadl.layers._operands import dtype_name

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]


# ---- reductions -----------------------------------------------------------------
def _expand(xp: Any, g: Value, shape: tuple[int, ...], axis: Any, keepdims: bool) -> Value:
    """Give a reduced delta back the reduced axes, ready to broadcast."""
    if axis is None or keepdims:
        return g if keepdims or axis is not None else xp.broadcast_to(xp.asarray(g), shape)
    if not shape:  # (NumPy's sum and max of a 0-d array over axis 0 or -1: the array itself, no axis to give back)
        return g
    axes = axis if isinstance(axis, tuple) else (axis,)  # (an int, or any integer a rule was called with)
    return xp.expand_dims(g, axis=tuple(ax % len(shape) for ax in axes))


def _sum(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp, shape = namespace(a), a.shape
    return xp.sum(a, axis=axis, keepdims=keepdims), (
        lambda g: xp.broadcast_to(_expand(xp, g, shape, axis, keepdims), shape),
    )


def _mean(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp, shape = namespace(a), a.shape
    out = xp.mean(a, axis=axis, keepdims=keepdims)
    scale = prod(out.shape) / max(prod(shape), 1)
    return out, (lambda g: xp.broadcast_to(_expand(xp, g, shape, axis, keepdims) * scale, shape),)


def _max(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp, shape = namespace(a), a.shape
    out = xp.max(a, axis=axis, keepdims=keepdims)
    winners = _mask(xp, a == _expand(xp, out, shape, axis, keepdims), a)
    # Tied maxima share the delta evenly.
    share = winners / xp.sum(winners, axis=axis, keepdims=True)
    return out, (lambda g: _expand(xp, g, shape, axis, keepdims) * share,)


def _peak(xp: Any, a: Value, axis: Any) -> Value:
    """``max(a, axis, keepdims=True)``, the shift of a stable softmax; zeros
    where the axis is empty (no maximum to shift by: the sums of an empty
    axis are 0, so logsumexp is -inf and a softmax empty, as PyTorch's)."""
    return xp.sum(a, axis=axis, keepdims=True) if a.size == 0 else xp.max(a, axis=axis, keepdims=True)


def _logsumexp(a: Value, axis: Any, keepdims: bool) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp, shape = namespace(a), a.shape
    peak = _peak(xp, a, axis)
    peak = xp.where(xp.isfinite(peak), peak, xp.zeros_like(peak))
    e = xp.exp(a - peak)
    total = xp.sum(e, axis=axis, keepdims=True)
    if a.size == 0:  # (log of an empty sum: -inf, without NumPy's warning)
        out_keep = xp.full_like(total, -xp.inf)
    else:
        with np.errstate(divide="ignore"):  # (a row of -inf only: its -inf, as PyTorch's, without a warning)
            out_keep = xp.log(total) + peak
    if keepdims:
        out = out_keep
    elif axis is None:  # (NumPy's scalar, as its sum's)
        out = _scalar(xp, xp.reshape(out_keep, ()))
    else:
        out = xp.squeeze(out_keep, axis=axis)
    with np.errstate(invalid="ignore"):  # (that row's delta: NaN, 0 / 0, as PyTorch's)
        soft = e / total
    return out, (lambda g: _expand(xp, g, shape, axis, keepdims) * soft,)


def _softmax(a: Value, axis: int) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp = namespace(a)
    if a.size == 0:  # (nothing to normalise: empty, as PyTorch's)
        return xp.zeros_like(a), (lambda g: xp.zeros_like(a),)
    e = xp.exp(a - xp.max(a, axis=axis, keepdims=True))
    out = e / xp.sum(e, axis=axis, keepdims=True)
    return out, (lambda g: out * (g - xp.sum(g * out, axis=axis, keepdims=True)),)


def _log_softmax(a: Value, axis: int) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) in PLAIN:
        a = np.asarray(a)
    xp = namespace(a)
    if a.size == 0:  # (nothing to normalise: empty, as PyTorch's)
        return xp.zeros_like(a), (lambda g: xp.zeros_like(a),)
    amax, total = _reductions(xp)
    with np.errstate(invalid="ignore"):  # (a row of -inf only, a padding row: NaN, as PyTorch's, without a warning)
        shifted = a - amax(a, axis=axis, keepdims=True)
    out = shifted - xp.log(total(xp.exp(shifted), axis=axis, keepdims=True))
    return out, (lambda g: g - xp.exp(out) * total(g, axis=axis, keepdims=True),)


def _reductions(xp: Any) -> tuple[Callable[..., Value], Callable[..., Value]]:
    """``xp.max`` and ``xp.sum``; for NumPy its ufuncs' ``reduce``, the same
    sums without ``np.max``'s and ``np.sum``'s Python wrappers (a few us a
    call, on the small arrays of a loss)."""
    return (np.maximum.reduce, np.add.reduce) if xp is np else (xp.max, xp.sum)


def _cross_entropy(
    a: Value, rows: Value, labels: Value, weight: Value = None, ignore: int | None = None, smoothing: float = 0.0
) -> tuple[Value, tuple[Vjp, ...]]:
    # -mean(log_softmax(a)[rows, labels]) as one rule: its delta is
    # (softmax(a) - one_hot(labels)) / n, with no scatter and a quarter of the nodes.
    xp = namespace(a)
    if a.ndim != 2:
        raise ValueError(f"logits must have the shape (batch, classes), got {list(a.shape)}")
    n, classes = a.shape
    if labels.shape[0] != n:  # else a wrong mean, or a broadcasting error in the backward
        raise ValueError(f"{labels.shape[0]} labels for {n} rows of logits")
    if weight is not None or ignore is not None or smoothing:
        out, weighted = _weighted_cross_entropy(xp, a, labels, weight, ignore, smoothing)
        return _scalar(xp, out), (weighted,)
    labels = _checked_indices(xp, labels, classes, "labels", "label", "{} classes", a)
    if type(rows) is not type(labels):  # (host labels copied over: their host rows too)
        rows = xp.arange(n, device=a.device)
    log_p, _ = _log_softmax(a, -1)
    out = -_reductions(xp)[1](log_p[rows, labels]) / n

    def vjp(g: Value) -> Value:
        classes = xp.arange(a.shape[-1], device=a.device)
        one_hot = xp.astype(labels[:, None] == classes[None, :], a.dtype)
        return (xp.exp(log_p) - one_hot) * (g / n)

    return out, (vjp,)


def _weighted_cross_entropy(
    xp: Any, a: Value, labels: Value, weight: Value, ignore: int | None, smoothing: float
) -> tuple[Value, Vjp]:
    """``cross_entropy`` with PyTorch's options, over logits ``(..., rows,
    classes)`` and labels ``(..., rows)`` (one loss, or a batched group's
    stack of them, each member's weight ``(classes,)`` shared or stacked
    ``(..., classes)``).

    Row ``i`` counts with ``w_i = weight[labels[i]]`` (0 where its label is
    ``ignore``); with smoothing ``e`` its target is ``t_i = (1 - e) w_i
    one_hot_i + (e / classes) weight`` (0 for a row ignored), and the loss
    is ``-sum(t * log_p) / sum(w_i)``: PyTorch's weighted mean, whose
    smoothed part PyTorch divides by the same sum. Its delta is ``(sum(t_i)
    p_i - t_i) / sum(w_i)``.
    Where no row counts (every label ignored, or weighted 0), the loss is
    0 / 0, NaN, as PyTorch's; the delta of an ignored row stays 0, as
    PyTorch's backward leaves it."""
    classes = a.shape[-1]
    if weight is not None:
        if weight.shape[-1] != classes:
            raise ValueError(f"weight holds {weight.shape[-1]} class weights for logits of {classes} classes")
        given = weight
        if type(weight) is not type(a):  # (host weights for logits on a device: copied over, as labels are)
            weight = xp.asarray(weight, device=a.device)  # (of their dtype: compared in one library below)
        if weight.dtype != a.dtype:
            name = dtype_name(a.dtype)
            cast = (
                f"weight.astype(np.{name}) in NumPy"
                if isinstance(given, np.ndarray)
                else f"xp.astype(weight, xp.{name}), xp = weight.__array_namespace__()"
            )
            raise DTypeError(
                f"cross_entropy: weight {dtype_name(weight.dtype)}[{weight.shape[-1]}] for {name} logits;"
                f" cast it first ({cast}), as PyTorch refuses it too"
            )
    shape, keep = labels.shape, None
    if ignore is not None:
        lx = namespace(labels)
        kept = labels != ignore
        labels = lx.where(kept, labels, lx.zeros_like(labels))  # (an ignored row reads class 0, then counts 0)
        keep = xp.reshape(kept if lx is xp else xp.asarray(kept, device=a.device), (-1,))
    # Every member's rows as one column of m rows: fancy indices and ufunc sums, a few us where
    # take_along_axis and xp.sum cost 5 and 4 (a loss a member is small).
    labels = _checked_indices(xp, labels, classes, "labels", "label", "{} classes", a)
    m = labels.shape[0]
    rows = xp.arange(m, device=a.device)
    log_p, _ = _log_softmax(a, -1)
    add = _reductions(xp)[1]
    stacked = len(shape) > 1  # (a batched group's: its members' losses)
    if stacked:
        log_p = xp.reshape(log_p, (m, classes))

    def per_member(v: Value) -> Value:
        return add(xp.reshape(v, shape) if stacked else v, axis=-1)

    table = None  # each row's class weights, where members have their own
    if weight is None:
        picked_w = None if keep is None else xp.astype(keep, a.dtype)
    elif weight.ndim == 1:
        picked_w = weight[labels]
    else:
        table = xp.reshape(xp.broadcast_to(weight[..., None, :], (*shape, classes)), (m, classes))
        picked_w = table[rows, labels]
    if keep is not None and weight is not None:
        picked_w = xp.where(keep, picked_w, xp.zeros_like(picked_w))
    coef: Value = 1.0 - smoothing if picked_w is None else picked_w * (1.0 - smoothing)
    picked = log_p[rows, labels]
    if keep is not None:  # (a padding row's logits masked to -inf, or NaN: 0, not 0 * NaN, as PyTorch's)
        picked = xp.where(keep, picked, xp.zeros_like(picked))
    log_lik = picked * coef
    spread = None
    if smoothing:  # each class's log-probability, weighted, over the rows counted
        if weight is None:
            spread = add(log_p, axis=-1)
        else:
            spread = log_p @ weight if table is None else add(log_p * table, axis=-1)
        if keep is not None:
            spread = xp.where(keep, spread, xp.zeros_like(spread))
    total = shape[-1] if picked_w is None else per_member(picked_w)
    # PyTorch's loss is two means, the smoothed one added to the other: where no row counts, the
    # first is 0 / 0, NaN, in the value and the delta (one sum over both would be x / 0: inf).
    with np.errstate(divide="ignore", invalid="ignore"):
        out = -per_member(log_lik) / total
        if spread is not None:
            out = out - per_member(spread) * (smoothing / classes) / total

    def vjp(g: Value) -> Value:
        p = xp.exp(log_p)
        one_hot = xp.astype(labels[:, None] == xp.arange(classes, device=a.device), a.dtype)
        d = (p - one_hot) * (coef if picked_w is None else coef[:, None])
        smoothed = None
        if smoothing:  # (sum(weight) p - weight) e / classes, in the rows counted
            share = smoothing / classes if keep is None else xp.astype(keep, a.dtype)[:, None] * (smoothing / classes)
            if weight is None:
                smoothed = (p * classes - 1.0) * share
            elif table is None:
                smoothed = (p * add(weight, axis=-1) - weight) * share
            else:
                smoothed = (p * add(table, axis=-1)[:, None] - table) * share
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = g / total
            if getattr(scale, "ndim", 0):
                scale = scale[..., None, None]
            d = (xp.reshape(d, a.shape) if stacked else d) * scale
            if smoothed is not None:
                d = d + (xp.reshape(smoothed, a.shape) if stacked else smoothed) * scale
        return d if keep is None else xp.where(xp.reshape(keep, shape)[..., None], d, xp.zeros_like(d))

    return out, vjp


def _binary_cross_entropy(a: Value, t: Value, pos_weight: Value = None) -> tuple[Value, tuple[Vjp, ...]]:
    # mean((1 - t) * a + (1 + (pos_weight - 1) * t) * softplus(-a)) as one rule, PyTorch's
    # binary_cross_entropy_with_logits: softplus(-a) = -log(sigmoid(a)) never overflows.
    if type(a) in PLAIN:
        a = np.asarray(a)
    shape = getattr(t, "shape", ())
    if shape != a.shape:  # (PyTorch's rule: a (batch, 1) score against (batch,) targets broadcast to (batch, batch))
        raise ValueError(
            f"targets must be shaped as the logits, got {list(shape)} for {list(a.shape)}; reshape one: "
            "broadcast, a (batch, 1) score against (batch,) targets would give a (batch, batch) loss"
        )
    misfit = pos_weight_misfit(a.shape, getattr(pos_weight, "shape", ()))
    if misfit:
        raise ValueError(misfit)
    return binary_cross_entropy_of(a, t, pos_weight, None)


def pos_weight_misfit(logits: tuple[int, ...], weight: tuple[int, ...]) -> str | None:
    """Why a ``pos_weight`` of shape ``weight`` does not fit logits of shape
    ``logits`` (None where it fits): it must broadcast to them without
    enlarging them, as PyTorch requires, since the mean divides by the
    logits' count (a ``(4, 2, 3)`` one for ``(2, 3)`` logits gave a loss 4
    times too large, and ``(N, 1)`` for ``(N,)`` N times)."""
    try:
        if np.broadcast_shapes(logits, weight) == tuple(logits):
            return None
    except ValueError:
        pass
    return (
        f"pos_weight must broadcast to the logits' shape {list(logits)} without enlarging it, got {list(weight)}"
        " (as PyTorch requires: a loss broadcast larger would be divided by the logits' count alone);"
        " one weight per class is shaped as the logits' last axis"
    )


def binary_cross_entropy_of(a: Value, t: Value, pos_weight: Value, axes: Any) -> tuple[Value, tuple[Vjp, ...]]:
    """`_binary_cross_entropy`'s mean over ``axes`` (None: over all; a
    batching rule's: over each member's), and its deltas, one per operand."""
    xp = namespace(a)
    e = xp.exp(-xp.abs(a))
    below = _clipped(xp, -a, xp.maximum) + xp.log1p(e)  # softplus(-a), as `_softplus` computes it
    weighted = below if pos_weight is None else (1 + (pos_weight - 1) * t) * below
    loss = (1 - t) * a + weighted
    count = prod(a.shape) if axes is None else prod(a.shape[1:])
    out = _reductions(xp)[1](loss, axis=axes) / count

    def share(g: Value) -> Value:  # (a member's delta over its own elements)
        return g / count if axes is None else xp.reshape(g, (-1, *(1,) * (a.ndim - 1))) / count

    def vjp_a(g: Value) -> Value:
        # (1 - t) * sigmoid(a) - pos_weight * t * sigmoid(-a): sigmoid(a) - t (PyTorch's, without
        # pos_weight) rounds to 0 where t = 1 and a is past 37 (float64), and 1 - w * sigmoid(-a)
        # where t = 0 and a is below -37; this keeps each term's tail.
        one = 1 / (1 + e)
        up, down = xp.where(a >= 0, one, e * one), xp.where(a >= 0, e * one, one)  # sigmoid(a), sigmoid(-a)
        positive = t * down if pos_weight is None else pos_weight * t * down
        return share(g) * ((1 - t) * up - positive)

    def vjp_t(g: Value) -> Value:
        return share(g) * (-a if pos_weight is None else (pos_weight - 1) * below - a)

    vjps = (vjp_a, vjp_t) if pos_weight is None else (vjp_a, vjp_t, lambda g: share(g) * t * below)
    return out, vjps
