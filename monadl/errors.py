"""The errors monadl raises. Each names the operation and where the user built it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "DTypeError",
    "DeviceError",
    "IndexRangeError",
    "MonadlError",
    "NoGradientError",
    "NonFiniteError",
    "OperandError",
    "ShapeError",
]


class MonadlError(Exception):
    """Base class of monadl's own errors.

    Each also derives from the built-in error a NumPy user would catch
    (`ValueError` for shapes, `IndexError` too for an index out of range,
    `TypeError` for dtypes and operands), so ``except ValueError`` keeps
    working.

    >>> issubclass(ShapeError, ValueError) and issubclass(DTypeError, TypeError)
    True
    """


class ShapeError(MonadlError, ValueError):
    """Operands whose shapes an operation cannot combine.

    Raised when the layer is evaluated, naming the operation, the operands'
    dtypes and shapes, and the line that built the layer.

    >>> import anyio, numpy as np, monadl as ml
    >>> wrong = ml.Weight(np.zeros(2)) + np.zeros(3)  # built: nothing runs yet
    >>> try:
    ...     anyio.run(wrong.predict)
    ... except ml.ShapeError as error:
    ...     print(str(error).split(" (")[0])
    add: operands float64[2], float64[3] do not fit together
    """


class IndexRangeError(ShapeError, IndexError):
    """An index outside the rows it looks up: an embedding's index, a
    segment id, a class label, an integer (or an integer array's) in a
    layer's index (``h[src]``, ``h[7]``: outside ``[-length, length)`` of
    its axis, a negative one counting from the end as in NumPy).

    The shapes fit; a value does not. It is an `IndexError`, as NumPy and
    PyTorch raise for one, and a `ShapeError` (which monadl raised for it
    before), so ``except ml.ShapeError`` still catches it. The message names
    the value, its place in the indices when they hold several, the range,
    and the line that built the lookup (inside an operation: the step's
    line, the operation's name and the line that called it). A single index
    into a weight's rows (a tree's word) is checked where the layer is built,
    so the traceback shows the Python code that chose it; the rest when the
    layer runs.

    A layer's index (``h[src]``) is checked by its array library, as NumPy
    checks it. CuPy does not check an integer array in an index: there
    ``h[src]`` with ``src`` out of range reads wrapped or undefined rows,
    and no error is raised (an embedding's indices and segment ids are
    checked on every library).

    >>> import anyio, numpy as np, monadl as ml
    >>> table = ml.Weight(np.zeros((20, 8)))
    >>> try:
    ...     anyio.run(ml.embedding(table, np.array([3, 25])).predict)
    ... except ml.IndexRangeError as error:
    ...     print(str(error).split(";")[0])
    embedding: index 25 at indices[1] out of range for a table of 20 rows (indices must lie in [0, 20))
    """


class DTypeError(MonadlError, TypeError):
    """Operands whose dtypes an operation refuses to mix silently."""


class NonFiniteError(MonadlError, FloatingPointError):
    """A NaN or an infinity where it must not be.

    By default ``train()`` raises it instead of writing one into a weight
    (``Settings.finite_steps``), naming the weight's line, with no weight
    changed; with ``ml.settings(check_finite=True)`` the first operation whose
    forward value or backward delta holds one raises it, naming that
    operation and the user's line that built it.
    """


class NoGradientError(MonadlError, ValueError):
    """A ``train()`` whose loss sends a gradient to no weight: a constant.

    Such a loss has nothing to train (an empty batch, a batch with no
    targets, every weight behind ``stop_gradient``), and a step of nothing,
    returned as if it had trained, would hide it: a data loader that sends
    only empty batches would "train" for ever. PyTorch's ``backward()``
    raises on the same loss (``element 0 of tensors does not require
    grad``), as Keras's ``apply_gradients`` does (``No gradients provided
    for any variable``). The message names the line that built the loss and
    the weights its forward read, if any; no weight changed, as none would
    have. A loss that reaches some weights steps those, silently: a weight
    that a step does not reach (an unread branch, a frozen trunk) takes no
    step, by design. ``ml.gradients`` and ``ml.value_and_gradients`` do not
    raise it: their answer (zeros, or no entry) says the same thing.

    Attributes:
        value: the loss's value, what ``train()`` would have returned: a
            loop whose batches may have nothing to train may catch this
            error and go on with it.

    >>> import anyio, numpy as np, monadl as ml
    >>> empty = ml.sum(ml.as_layer(np.zeros(0)) ** 2.0)  # a batch of nothing: no weight in it
    >>> try:
    ...     anyio.run(empty.train)
    ... except ml.NoGradientError as error:
    ...     print(error.value, "|", str(error).split("; ")[1].split(":")[0])
    0.0 | its forward read no weight at all
    """

    def __init__(self, message: str, value: Any) -> None:
        super().__init__(message)
        self.value = value


class OperandError(MonadlError, TypeError):
    """An operand that is not a layer, a weight or plain numeric data.

    >>> import monadl as ml
    >>> try:
    ...     ml.exp("2.0")
    ... except ml.OperandError as error:
    ...     print(error)
    exp: operand of type str is not a Layer, a Weight, an array or a number
    """


class DeviceError(MonadlError, TypeError):
    """Operands from two array libraries (or devices), such as NumPy and CuPy, in one operation."""


class CheckpointError(MonadlError, ValueError):
    """A checkpoint that does not fit the model it is loaded into (names,
    shapes, dtypes, optimizer state), a file that is not a monadl checkpoint,
    or a model with no weight to save."""
