"""An optimizer's hyperparameters (rates, decays, epsilons) as Python floats,
refused where the optimizer or schedule is made when they are no finite
number >= 0, as PyTorch's optimizers refuse them."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np

from monadl.layers._arrays import NumPyScalar

__all__ = ["Rate", "checked", "finite", "valid_rate"]

Rate: TypeAlias = float | NumPyScalar
"""A constant learning rate: a Python or NumPy number (made a Python float)."""


def finite(value: object) -> bool:
    """A finite real number: a Python or NumPy int or float, or a 0-d array
    of one (not a bool, not a complex number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number, np.ndarray)):
        return False
    return np.ndim(value) == 0 and np.asarray(value).dtype.kind in "iuf" and bool(np.isfinite(value))


def valid_rate(rate: object) -> bool:
    """A finite real number >= 0."""
    return finite(rate) and bool(rate >= 0)  # type: ignore[operator]  # (a number: `finite` said so)


def checked(name: str, value: Rate, below: float | None = None) -> float:
    """A hyperparameter as a Python float, refused where it is no finite
    number >= 0 (or not below ``below``), where the optimizer is made, as
    PyTorch's optimizers do. (A NumPy float64 would make a float32 weight's
    state float64: its memory twice, and a checkpoint of another dtype.)"""
    if not valid_rate(value) or (below is not None and not value < below):
        bound = f" and < {below}" if below is not None else ""
        raise ValueError(f"{name} must be a finite number >= 0{bound}, got {value!r}")
    return float(value)
