"""The errors monadl raises. Each names the operation and where the user built it."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DTypeError",
    "DeviceError",
    "MonadlError",
    "NonFiniteError",
    "OperandError",
    "ShapeError",
]


class MonadlError(Exception):
    """Base class of monadl's own errors.

    Each also derives from the built-in error a NumPy user would catch
    (`ValueError` for shapes, `TypeError` for dtypes and operands), so
    ``except ValueError`` keeps working.

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
