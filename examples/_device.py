"""Where an example's weights live: the host (NumPy) or a GPU (CuPy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import monadl as ml

DEVICES = ("cpu", "cuda")


def on_device(device: str) -> Callable[[ml.Array], Any]:
    """How an array goes to ``device``: ``"cpu"`` (as it is) or ``"cuda"`` (CuPy).

    >>> on_device("cpu")(np.ones(2))
    array([1., 1.])
    """
    if device == "cpu":
        return lambda a: a
    if device != "cuda":
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    try:
        import cupy
    except ImportError:
        raise ImportError(
            "device 'cuda' needs CuPy: pip install -e '.[cuda]' (CUDA 12 drivers; cupy-cuda13x on CUDA 13)"
        ) from None
    return cupy.asarray


def host(a: Any) -> ml.Array:
    """An array on the host (a CuPy array copied back; a NumPy one as it is)."""
    return a if isinstance(a, np.ndarray) else a.get()
