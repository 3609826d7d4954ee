"""Differentiable functions of structure: losses, table lookups and segment
sums, shapes and convolutions. Each accepts plain data, weights and layers alike."""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Sequence
from typing import Any, NoReturn, SupportsIndex, cast

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import IndexRangeError, OperandError, ShapeError
from monadl.layers._axes import as_int, as_ints, is_sizes
from monadl.layers._functions import apply_primitive
from monadl.layers._indexing import out_of_range
from monadl.layers._layer import (
    Array,
    ArrayLayer,
    ArrayOperand,
    DeviceArray,
    Expr,
    Layer,
    Operand,
    ScalarLayer,
    _build,
)
from monadl.layers._primitives import PRIMITIVES
from monadl.layers._reductions import pos_weight_misfit
from monadl.layers._unvalued import Unvalued
from monadl.layers._weight import Weight, weight_sites

__all__ = [
    "binary_cross_entropy_with_logits",
    "concatenate",
    "conv2d",
    "cross_entropy",
    "embedding",
    "max_pool2d",
    "reshape",
    "segment_sum",
    "split",
    "stack",
    "transpose",
]


def cross_entropy(
    logits: ArrayOperand,
    labels: Array | DeviceArray,
    *,
    weight: Array | DeviceArray | None = None,
    ignore_index: SupportsIndex | None = None,
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
            counted, divided by the same sum of ``weight[labels[i]]``.

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


def _ignored(ignore_index: SupportsIndex | None) -> int | None:
    if ignore_index is None:
        return None
    try:
        return operator.index(ignore_index)
    except TypeError:
        raise OperandError(f"cross_entropy: ignore_index must be an integer (a label), got {ignore_index!r}") from None


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


def embedding(table: ArrayOperand, indices: Array | DeviceArray) -> ArrayLayer:
    """Rows ``table[indices]`` of an embedding table.

    The table's delta is sparse (`monadl.typeclasses.SparseRows`): when the
    table is a `Weight`, a training step changes only the rows looked up (a
    row looked up several times steps once, with the sum of its deltas), and
    the optimizer's per-row state of the other rows stays as it was. With
    Adam that is lazy Adam (``torch.optim.SparseAdam``'s), another
    algorithm than the dense Adam that ``table[indices]`` steps with (its
    delta is dense: every row's moments, and every row, move at every
    step), and the choice can decide how well a model trains: in a user's
    recommender dense Adam reached a held-out AUC of 0.77 and lazy Adam
    0.60, as in PyTorch. The lazy step costs the rows looked up, the dense
    one the whole table.

    Indices must lie in ``[0, rows)``; others, negative ones included, raise
    `monadl.IndexRangeError` (a `monadl.ShapeError` and an `IndexError`)
    when the layer runs (as PyTorch's ``embedding``; NumPy would count a
    negative index from the end), naming the first one out of range and its
    place in ``indices``. A single index into a weight's rows (a tree's
    word, ``np.array([w])``) is checked here, where the layer is built, so
    the traceback shows the code that chose it. For a table on a GPU the
    indices may be NumPy integers (a tree's symbols: host data): they are
    checked on the host and copied over (device indices are checked on the
    device, which waits for it).

    >>> import anyio, numpy as np, monadl as ml
    >>> table = ml.Weight(np.arange(6.0).reshape(3, 2))
    >>> anyio.run(embedding(table, np.array([2, 0])).predict)
    array([[4., 5.],
           [0., 1.]])
    """
    indices = _integers(indices, "embedding: indices")
    if type(table) is Weight and type(indices) is np.ndarray and indices.size == 1:
        rows = table._data.shape  # (a weight's shape is fixed: its ``data`` takes only its shape)
        if rows and not 0 <= indices.item() < rows[0]:
            _refuse_word(table, indices)
    return apply_primitive("embedding", (table,), (indices,))


def _refuse_word(table: Weight[Any, Any], index: Array) -> NoReturn:
    """A single index into a weight's rows (a tree's word) out of range,
    refused where the lookup is built, so that the traceback shows the code
    that chose it (the recursion over a tree, where the runtime's error has
    only the lookup's line). The check costs about 0.1 us a lookup; the
    minimum and maximum of a larger array would cost 2 us, 4 times the
    lookup's build, so those wait for the run (`_indexing._check_range`)."""
    rows = table._data.shape[0]
    text = out_of_range(np, np.reshape(index, (-1,)), rows, index.shape, "indices", "index", "a table of {} rows")
    raise IndexRangeError(f"embedding: {text}" + weight_sites((table,)))


def segment_sum(data: ArrayOperand, segment_ids: Array | DeviceArray, num_segments: SupportsIndex) -> ArrayLayer:
    """The rows of ``data`` summed by segment: row ``i`` is added into row
    ``segment_ids[i]`` of ``num_segments`` rows of zeros, as JAX's
    ``jax.ops.segment_sum``, TensorFlow's ``unsorted_segment_sum`` and
    PyTorch's ``zeros(...).index_add_(0, segment_ids, data)``. A segment no
    row goes to stays zero. The delta of row ``i`` is its segment's delta
    (a gather). It is how a graph network batched by hand sums each edge's
    message into its node: a one-hot ``(nodes, edges)`` matrix product does
    the same in ``nodes x edges x features`` multiply-adds, this in
    ``edges x features``.

    Args:
        data: ``(rows, ...)``: one row per item (a message per edge).
        segment_ids: integers of shape ``(rows,)``, plain data, in any order.
            An id outside ``[0, num_segments)`` raises
            `monadl.IndexRangeError` (a `monadl.ShapeError`) when the layer
            runs, naming it and its place (a negative one is not counted
            from the end, nor dropped as JAX drops it).
        num_segments: the number of rows of the result, an int ``>= 0``.

    Raises:
        OperandError: ids that are no 1-D integer array, or a count that is
            no int ``>= 0``.
        ShapeError: not one id per row of ``data`` (plain data or a
            weight; a layer's rows are checked when it runs).

    Returns:
        ``(num_segments, ...)``, in ``data``'s dtype.

    With batching on, the segment sums of several graphs that have the same
    ``num_segments`` (and data of one shape) run as one scatter.

    >>> import anyio, numpy as np
    >>> messages = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    >>> anyio.run(segment_sum(messages, np.array([2, 0, 2]), 4).predict)
    array([[3., 4.],
           [0., 0.],
           [6., 8.],
           [0., 0.]])
    """
    ids = _integers(segment_ids, "segment_sum: segment_ids")
    if ids.ndim != 1:
        raise OperandError(
            f"segment_sum: segment_ids must be a 1-D integer array, one per row of data, got {ids.dtype}{list(ids.shape)}"
        )
    count = as_int(num_segments, "segment_sum", "num_segments")
    if count < 0:
        raise OperandError(f"segment_sum: num_segments must be >= 0, got {count}")
    shape: tuple[int, ...] | None = (
        None if isinstance(data, Layer) else getattr(data, "shape", ())
    )  # (a layer's: at the run)
    if shape is not None and (len(shape) == 0 or shape[0] != ids.shape[0]):
        raise ShapeError(
            f"segment_sum: segment_ids must hold one id per row of the data, got {ids.shape[0]} ids"
            f" for data of shape {tuple(shape)}"
        )
    return apply_primitive("segment_sum", (data,), (ids, count))


def _integers(x: Any, what: str) -> Any:
    """Integer data as an array of its own library (lists become NumPy arrays)."""
    if type(x) is np.ndarray and x.dtype.kind in "iu":  # (per lookup built: np.isdtype costs 2 us a call)
        return x
    if not is_array(x):
        x = np.asarray(x)
    if not namespace(x).isdtype(x.dtype, "integral"):
        raise OperandError(f"{what} must be integers, got {x.dtype}{list(x.shape)}")
    return x


# ---- shapes ----------------------------------------------------------------------------------
def reshape(x: Operand, shape: Sequence[SupportsIndex] | Array) -> ArrayLayer:
    """The same values in another shape (one axis may be ``-1``).

    >>> import anyio, numpy as np
    >>> anyio.run(reshape(np.arange(4.0), (2, -1)).predict)
    array([[0., 1.],
           [2., 3.]])
    """
    return apply_primitive("reshape", (x,), (as_ints(shape, "reshape", "shape"),))


def transpose(x: ArrayOperand | DeviceArray, axes: Sequence[SupportsIndex] | Array | None = None) -> ArrayLayer:
    """Permute axes (reverse them by default). An array's: a scalar's transpose is the scalar, no array."""
    return apply_primitive("transpose", (x,), (None if axes is None else as_ints(axes, "transpose", "axes"),))


def concatenate(xs: Sequence[ArrayOperand | DeviceArray], axis: SupportsIndex = 0) -> ArrayLayer:
    """Join along an existing axis: of arrays (scalars have none; `stack` joins them).

    >>> import anyio, numpy as np, monadl as ml
    >>> anyio.run(concatenate([np.zeros(2), ml.Weight(np.ones(1))]).predict)
    array([0., 0., 1.])
    """
    return apply_primitive("concatenate", _joined(xs, "concatenate"), (as_int(axis, "concatenate", "axis"),))


def stack(xs: Sequence[Operand], axis: SupportsIndex = 0) -> ArrayLayer:
    """Join along a new axis.

    >>> import anyio, numpy as np, monadl as ml
    >>> anyio.run(stack([np.zeros(2), ml.Weight(np.ones(2))], axis=1).predict)
    array([[0., 1.],
           [0., 1.]])
    """
    return apply_primitive("stack", _joined(xs, "stack"), (as_int(axis, "stack", "axis"),))


def _joined(xs: object, name: str) -> tuple[Any, ...]:
    """The operands of a join, refused where they are no sequence of them
    (a generator gave "object of type 'generator' has no len()"; a single
    layer, the same of a Layer). A NumPy array is a sequence of its rows, as
    NumPy's joins read it."""
    if isinstance(xs, Unvalued) or not (isinstance(xs, Sequence) or is_array(xs)):  # (a deque, an array: taken)
        what = "a generator" if inspect.isgenerator(xs) else f"a {type(xs).__name__}"
        raise OperandError(f"{name}: takes a list or tuple of operands ({name}([a, b])), got {what}")
    parts = tuple(cast(Sequence[Any], xs))
    if not parts:
        raise OperandError(f"{name}: needs at least one operand")
    return parts


def split(
    x: ArrayOperand, sections: SupportsIndex | Sequence[SupportsIndex] | Array, axis: SupportsIndex = -1
) -> tuple[ArrayLayer, ...]:
    """Cut ``x`` along ``axis`` (the last by default, where ``np.split``'s is
    the first) into parts: ``sections`` equal ones (it must divide the axis,
    as in ``np.split``), or parts of the given sizes (as in ``torch.split``).

    The backward builds the delta of ``x`` once, from the parts' deltas (zeros
    only for parts that got none), in time linear in the parts, where a slice
    per part would build an ``x``-sized array each: cut an LSTM's gate vector with it when it runs
    node by node, or inside a marked cell (`monadl.operation`). Outside a
    cell with batching on, slices batch and splits run one by one: there
    slices are faster (a GRU, every op a layer: 68 against 104 ms a step).

    >>> import anyio, numpy as np
    >>> gates = np.arange(6.0)
    >>> i, f = split(gates, 2)
    >>> anyio.run(f.predict)
    array([3., 4., 5.])
    >>> [anyio.run(p.predict).shape for p in split(np.zeros((2, 5)), [1, 4])]
    [(2, 1), (2, 4)]
    """
    params: int | tuple[int, ...]
    try:
        params = as_ints(sections, "split", "sizes") if is_sizes(sections) else as_int(sections, "split", "count")
    except OperandError:
        raise OperandError(f"split: sections must be a count or a sequence of sizes, got {sections!r}") from None
    if isinstance(params, int):
        count = params
        if count < 1:
            raise OperandError(f"split: needs at least one part, got {count}")
    else:
        count = len(params)
        if count == 0 or min(params) < 0:
            raise OperandError(f"split: sizes must be a non-empty list of sizes >= 0, got {list(params)}")
    axis = as_int(axis, "split", "axis")
    whole = apply_primitive("split", (x,), (params, axis))
    # Each part's site is the user's line too (_build walks out of monadl's frames).
    return tuple(_build(PRIMITIVES["split_part"], (whole,), (params, axis, i), 2) for i in range(count))


# ---- convolution ------------------------------------------------------------------------------
def conv2d(x: ArrayOperand, kernel: ArrayOperand, stride: int = 1, padding: int = 0) -> ArrayLayer:
    """2-D cross-correlation, as PyTorch's ``conv2d`` without bias.

    Args:
        x: NCHW input, ``(batch, channels, height, width)``.
        kernel: ``(out_channels, channels, kernel_height, kernel_width)``.
        stride: the step between windows, in both directions.
        padding: zeros added on each side of both spatial axes.

    Returns:
        ``(batch, out_channels, out_height, out_width)``, where ``out_height``
        is ``(height + 2 * padding - kernel_height) // stride + 1``.

    >>> import anyio, numpy as np, monadl as ml
    >>> kernel = ml.Weight(np.ones((1, 1, 2, 2)))  # sums each 2x2 window
    >>> anyio.run(conv2d(np.arange(9.0).reshape(1, 1, 3, 3), kernel).predict)[0, 0]
    array([[ 8., 12.],
           [20., 24.]])
    """
    stride, padding = _whole_numbers("conv2d", stride=stride, padding=padding)
    if stride < 1 or padding < 0:
        raise OperandError(f"conv2d: stride must be >= 1 and padding >= 0, got {stride} and {padding}")
    return apply_primitive("conv2d", (x, kernel), (stride, padding))


def _whole_numbers(name: str, **given: object) -> tuple[int, ...]:
    """A window's arguments as Python ints, or an `OperandError` for one that
    is no int: one step or padding for both axes (PyTorch's ``(sh, sw)`` and
    ``'same'`` are not taken; a tuple failed comparing it, a float at the
    run, with no line)."""
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            same = "; the padding that keeps the size at stride 1 is (k - 1) // 2 for an odd kernel k"
            raise OperandError(
                f"{name}: {key} is an int, the same on both spatial axes (a pair is not taken), got {value!r}"
                + (same if value == "same" else "")
            )
    return tuple(as_int(value, name, key) for key, value in given.items())


def max_pool2d(x: ArrayOperand, kernel: int, stride: int | None = None) -> ArrayLayer:
    """Max pooling over ``kernel x kernel`` windows of NCHW input.

    Args:
        x: NCHW input, ``(batch, channels, height, width)``.
        kernel: the side of the square window.
        stride: the step between windows; ``kernel`` by default (no overlap).

    A window's delta goes to its maximum; where several entries tie, to the
    first of them in row-major order, as PyTorch's (`monadl.max` shares it
    among ties, `monadl.maximum` halves it).

    >>> import anyio, numpy as np
    >>> anyio.run(max_pool2d(np.arange(16.0).reshape(1, 1, 4, 4), 2).predict)[0, 0]
    array([[ 5.,  7.],
           [13., 15.]])
    """
    stride = kernel if stride is None else stride
    kernel, stride = _whole_numbers("max_pool2d", kernel=kernel, stride=stride)
    if kernel < 1 or stride < 1:
        raise OperandError(f"max_pool2d: kernel and stride must be >= 1, got {kernel} and {stride}")
    return apply_primitive("max_pool2d", (x,), (kernel, stride))
