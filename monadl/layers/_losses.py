"""The losses that are one node each, with PyTorch's options and values:
``cross_entropy`` (class weights, a label ignored, label smoothing) and
``binary_cross_entropy_with_logits`` (``pos_weight``). Their rules and
batching rules live with the reductions (`monadl.layers._reductions`); here
the options are checked where the loss is built, naming what was given."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import OperandError, ShapeError
from monadl.layers._axes import Integer, as_int
from monadl.layers._functions import apply_primitive
from monadl.layers._layer import (
    Array,
    ArrayOperand,
    DeviceArray,
    Expr,
    Operand,
    ScalarLayer,
)
from monadl.layers._reductions import pos_weight_misfit
from monadl.layers._structure import _integers
from monadl.layers._weight import Weight

__all__ = ["binary_cross_entropy_with_logits", "cross_entropy"]


def cross_entropy(
    logits: ArrayOperand,
    labels: Array | DeviceArray,
    *,
    weight: Array | DeviceArray | None = None,
    ignore_index: Integer | None = None,
    label_smoothing: float = 0.0,
) -> ScalarLayer:
    """Mean negative log-likelihood of integer ``labels`` under ``softmax(logits)``:
    ``-mean(log_softmax(logits)[rows, labels])`` as one primitive, whose delta
    is ``(softmax(logits) - one_hot(labels)) / batch``.

    The options are PyTorch's ``F.cross_entropy``'s (reduction ``'mean'``),
    with the same values and deltas: a class-weighted loss for imbalanced
    classes is one node, batched as the plain one, where written by hand
    (``log_softmax(logits)[rows, labels] * weight[labels]``) it was several.

    Args:
        logits: scores of shape ``(batch, classes)``.
        labels: integers of shape ``(batch,)``, plain data, one per row, each
            in ``[0, classes)``: one outside raises `monadl.IndexRangeError`
            (a `monadl.ShapeError`) when the layer runs, naming it and its
            place (a negative label is not counted from the end).
            NumPy labels for logits on a GPU are checked on the host and
            copied over, so the check does not wait for the device.
        weight: one weight per class, ``(classes,)``, plain data of the
            logits' float dtype (a float64 weight for float32 logits raises
            `monadl.DTypeError`, as PyTorch refuses it), finite and ``>= 0``;
            a NumPy weight for logits on a GPU is copied over, as labels are.
            Row ``i`` counts ``weight[labels[i]]`` times, and the mean
            divides by the sum of the weights of the rows counted, not by
            the number of rows: ``sum(w[y] * nll) / sum(w[y])``. No delta
            flows into it (as into PyTorch's).
        ignore_index: rows whose label is this integer count for nothing,
            in the sum and in the divisor, and get a zero delta; they are
            not checked against the classes, nor are their logits (padding
            masked to -inf, or NaN, leaves the loss finite, as PyTorch's;
            PyTorch's delta there is NaN). None (the default) ignores no
            row: PyTorch's default, -100, would be refused as out of range.
        label_smoothing: ``e`` in ``[0, 1]``: each row's target is
            ``(1 - e) one_hot + e / classes`` (each class weighted by
            ``weight``), PyTorch's formula: the loss is ``(1 - e)`` times the
            weighted mean above plus ``e / classes`` times
            ``-sum_i sum_c weight[c] log_softmax(logits)[i, c]`` over the rows
            counted, divided by the same sum of ``weight[labels[i]]``. A
            float argument of an `monadl.operation` passed here (a layer
            while the cell is traced) makes the loss ``(1 - e)`` times the
            loss of ``e = 0`` plus ``e`` times that of ``e = 1``, its value
            not checked: calls with different values batch together.

    Where no row counts (every label ignored, or all the weights picked
    are 0) the mean is 0 / 0: the loss is NaN, as PyTorch's (with
    ``label_smoothing`` too: it adds the smoothed mean to that NaN), and
    the delta of an ignored row stays 0; ``check_finite=True`` refuses it
    (`monadl.NonFiniteError`, naming the layer). A batch that may hold
    only ignored rows (padding) is best skipped before its loss is built.

    Raises:
        OperandError: labels that are no 1-D integer array; a weight that is
            no 1-D float array of finite values ``>= 0`` (a Weight or a
            layer: it is data); an ``ignore_index`` that is no integer; a
            ``label_smoothing`` outside ``[0, 1]``.

    >>> import anyio, numpy as np
    >>> loss = cross_entropy(np.zeros((2, 4)), np.array([0, 3]))
    >>> round(float(anyio.run(loss.predict)), 6)  # log(4)
    1.386294
    >>> logits = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    >>> weighted = cross_entropy(logits, np.array([0, 0, 1]), weight=np.array([1.0, 3.0]))
    >>> round(float(anyio.run(weighted.predict)), 6)  # (0.126928 + 2.126928 + 3 * 0.693147) / 5
    0.86666
    """
    classes = _integers(labels, "cross_entropy: labels")
    if classes.ndim != 1:
        raise OperandError(
            f"cross_entropy: labels must be a 1-D integer array, got {classes.dtype}{list(classes.shape)}"
        )
    rows = namespace(classes).arange(classes.shape[0], device=classes.device)
    e: Any = label_smoothing  # (typed a float; a marked cell's float argument is a layer while traced)
    if isinstance(e, Expr):  # the loss is linear in e: (1 - e) of the plain loss plus e of the fully smoothed one
        given = (rows, classes, _class_weights(weight), _ignored(ignore_index))
        plain = apply_primitive("cross_entropy", (logits,), (*given, 0.0))
        smoothed = apply_primitive("cross_entropy", (logits,), (*given, 1.0))
        return cast(ScalarLayer, (1.0 - e) * plain + e * smoothed)
    if weight is None and ignore_index is None and not label_smoothing:
        return apply_primitive("cross_entropy", (logits,), (rows, classes))
    options = (_class_weights(weight), _ignored(ignore_index), _smoothing(label_smoothing))
    return apply_primitive("cross_entropy", (logits,), (rows, classes, *options))


def _class_weights(weight: Any) -> Any:
    """``cross_entropy``'s ``weight``: a 1-D float array of finite values
    ``>= 0``, checked where the loss is built (its length and dtype against
    the logits when it runs). A negative weight, which PyTorch takes, is
    refused: the mean's divisor, a sum of weights, could then be 0 or
    negative, and the loss no mean at all."""
    if weight is None:
        return None
    if isinstance(weight, Expr):
        raise OperandError(
            f"cross_entropy: weight must be plain data (an array of one weight per class), got a"
            f" {type(weight).__name__}: no delta flows into class weights (nor in PyTorch)"
        )
    # (NumPy's: two ufunc reductions, 1 us a loss built, where np.isdtype and np.isfinite cost 4 more; NaN fails `>=`)
    if (
        type(weight) is np.ndarray
        and weight.dtype.kind == "f"
        and weight.ndim == 1
        and weight.size
        and np.minimum.reduce(weight) >= 0
        and np.maximum.reduce(weight) < np.inf
    ):
        return weight
    if not is_array(weight):
        weight = np.asarray(weight)
    xp = namespace(weight)
    if weight.ndim != 1 or not xp.isdtype(weight.dtype, "real floating"):
        floats = (
            " (cast it to the logits' dtype: weight.astype(np.float32) for float32 logits)" if weight.ndim == 1 else ""
        )
        raise OperandError(
            f"cross_entropy: weight must be a 1-D float array, one weight per class,"
            f" got {weight.dtype}{list(weight.shape)}{floats}"
        )
    bad = ~(xp.isfinite(weight) & (weight >= 0))
    if bool(xp.any(bad)):
        first = int(xp.argmax(xp.astype(bad, xp.int8)))
        raise OperandError(
            f"cross_entropy: weight must hold finite weights >= 0, got {float(weight[first])} at weight[{first}]"
        )
    return weight


def _ignored(ignore_index: object) -> int | None:
    return None if ignore_index is None else as_int(ignore_index, "cross_entropy", "ignore_index (a label)")


def _smoothing(label_smoothing: float) -> float:
    try:
        e = float(label_smoothing)
    except (TypeError, ValueError):
        e = math.nan
    if not 0.0 <= e <= 1.0:
        raise OperandError(f"cross_entropy: label_smoothing must lie in [0.0, 1.0], got {label_smoothing!r}")
    return e


def binary_cross_entropy_with_logits(
    logits: Operand, targets: Operand, pos_weight: Operand | None = None
) -> ScalarLayer:
    """Mean binary cross-entropy of ``targets`` under ``sigmoid(logits)``, as
    PyTorch's ``F.binary_cross_entropy_with_logits`` (mean reduction):
    ``mean((1 - targets) * logits + w * softplus(-logits))``, with ``w = 1 +
    (pos_weight - 1) * targets``, 1 without ``pos_weight``. One primitive,
    whose delta for the logits is ``(sigmoid(logits) - targets) / n``
    (without ``pos_weight``); no score overflows it, where
    ``-log(sigmoid(logits))`` is infinite below -745 (float64).

    Args:
        logits: scores, any shape.
        targets: probabilities (0 and 1 for labels; a boolean or integer
            array is cast), shaped exactly as ``logits``: another shape
            raises `monadl.ShapeError` when the layer runs, where
            broadcasting ``(batch, 1)`` against ``(batch,)`` would give a
            ``(batch, batch)`` loss. A layer or a weight gets its delta.
        pos_weight: the weight of positive examples, broadcast against
            ``logits`` (one per class, the last axis), a layer or a weight too.
            It must broadcast to the logits' shape without enlarging it (a
            ``(batch, 1)`` one for ``(batch,)`` logits would give a
            ``(batch, batch)`` loss), as PyTorch requires: another shape
            raises `monadl.ShapeError` where the loss is built, or where it
            runs if the logits or ``pos_weight`` are a layer.

    A GAN's discriminator loss is ``bce(d_real, ones) + bce(d_fake, zeros)``
    and its generator's non-saturating loss ``bce(d_fake, ones)``, which is
    ``mean(softplus(-d_fake))``.

    >>> import anyio, numpy as np
    >>> loss = binary_cross_entropy_with_logits(np.array([0.0, 1000.0, -1000.0]), np.array([1.0, 1.0, 1.0]))
    >>> round(float(anyio.run(loss.predict)), 6)  # (log(2) + 0 + 1000) / 3
    333.564382
    """
    shape, weight_shape = _known_shape(logits), _known_shape(pos_weight)
    if pos_weight is not None and shape is not None and weight_shape is not None:  # (a layer's: at the run)
        misfit = pos_weight_misfit(shape, weight_shape)
        if misfit:
            raise ShapeError(f"binary_cross_entropy_with_logits: {misfit}")
    operands = (logits, targets) if pos_weight is None else (logits, targets, pos_weight)
    return apply_primitive("binary_cross_entropy_with_logits", operands)


def _known_shape(x: object) -> tuple[int, ...] | None:
    """The shape of data, a weight or a number, where a layer is built; None for a layer's."""
    if isinstance(x, Weight) or is_array(x):
        return tuple(cast(Any, x).shape)
    return () if isinstance(x, (int, float, np.generic)) else None
