"""Differentiable functions of structure: table lookups and segment sums,
shapes and convolutions (the losses: `monadl.layers._losses`). Each accepts
plain data, weights and layers alike."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import numpy as np

from monadl._namespace import is_array, namespace
from monadl.errors import IndexRangeError, OperandError, ShapeError
from monadl.layers._axes import Integer, as_int, as_ints, is_sizes
from monadl.layers._functions import apply_primitive
from monadl.layers._indexing import out_of_range
from monadl.layers._layer import (
    Array,
    ArrayLayer,
    ArrayOperand,
    DeviceArray,
    Layer,
    Operand,
    _build,
)
from monadl.layers._primitives import PRIMITIVES
from monadl.layers._unvalued import Unvalued
from monadl.layers._weight import Weight, weight_sites

__all__ = [
    "concatenate",
    "conv2d",
    "embedding",
    "max_pool2d",
    "reshape",
    "roll",
    "segment_sum",
    "split",
    "stack",
    "transpose",
]


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


def segment_sum(data: ArrayOperand, segment_ids: Array | DeviceArray, num_segments: Integer) -> ArrayLayer:
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
def reshape(x: Operand, shape: Sequence[Integer] | Array) -> ArrayLayer:
    """The same values in another shape (one axis may be ``-1``).

    >>> import anyio, numpy as np
    >>> anyio.run(reshape(np.arange(4.0), (2, -1)).predict)
    array([[0., 1.],
           [2., 3.]])
    """
    return apply_primitive("reshape", (x,), (as_ints(shape, "reshape", "shape"),))


def transpose(x: ArrayOperand | DeviceArray, axes: Sequence[Integer] | Array | None = None) -> ArrayLayer:
    """Permute axes (reverse them by default). An array's: a scalar's transpose is the scalar, no array."""
    return apply_primitive("transpose", (x,), (None if axes is None else as_ints(axes, "transpose", "axes"),))


def roll(x: ArrayOperand | DeviceArray, shift: Integer, axis: Integer = -1) -> ArrayLayer:
    """``x``'s entries moved ``shift`` places along ``axis`` (the last by
    default), those past the end coming round to the front (NumPy's
    ``roll``, ``torch.roll``): a Neural Turing Machine's circular shift of
    its weighting. It batches, where an index array after a slice
    (``w[:, idx]``) runs call by call (a new user's NTM cell: 5x the time).
    ``shift`` and ``axis`` are integers, Python's or NumPy's: a bool or an
    array is refused (`OperandError`), and mypy refuses them too.

    >>> import anyio, numpy as np
    >>> anyio.run(roll(np.arange(4.0), 1).predict)
    array([3., 0., 1., 2.])
    """
    return apply_primitive("roll", (x,), (as_int(shift, "roll", "shift"), as_int(axis, "roll", "axis")))


def concatenate(xs: Sequence[ArrayOperand | DeviceArray], axis: Integer = 0) -> ArrayLayer:
    """Join along an existing axis: of arrays (scalars have none; `stack` joins them).

    >>> import anyio, numpy as np, monadl as ml
    >>> anyio.run(concatenate([np.zeros(2), ml.Weight(np.ones(1))]).predict)
    array([0., 0., 1.])
    """
    return apply_primitive("concatenate", _joined(xs, "concatenate"), (as_int(axis, "concatenate", "axis"),))


def stack(xs: Sequence[Operand], axis: Integer = 0) -> ArrayLayer:
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


def split(x: ArrayOperand, sections: Integer | Sequence[Integer] | Array, axis: Integer = -1) -> tuple[ArrayLayer, ...]:
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
