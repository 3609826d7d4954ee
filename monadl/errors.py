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
    """Base class of monadl's own errors."""


class ShapeError(MonadlError, ValueError):
    """Operands whose shapes an operation cannot combine."""


class DTypeError(MonadlError, TypeError):
    """Operands whose dtypes an operation refuses to mix silently."""


class NonFiniteError(MonadlError, FloatingPointError):
    """A NaN or infinity appeared (raised only with ``check_finite=True``)."""


class OperandError(MonadlError, TypeError):
    """An operand that is not a layer, a weight or plain numeric data."""


class DeviceError(MonadlError, TypeError):
    """Operands from two array libraries (or devices), such as NumPy and CuPy, in one operation."""


class CheckpointError(MonadlError, ValueError):
    """A checkpoint that does not fit the model it is loaded into (names,
    shapes, dtypes, optimizer state), or a file that is not a monadl checkpoint."""
