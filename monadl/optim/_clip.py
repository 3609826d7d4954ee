"""Gradients clipped by their global norm, as PyTorch's ``clip_grad_norm_``:
the norm of all of a step's gradients as one vector (`global_norm`), and the
gradients scaled down to a largest norm (`clip_by_global_norm`), for a step of
one's own between ``value_and_gradients`` and `apply_gradients`. An
embedding's `SparseRows` count as its dense gradient would (a row looked up
twice summed first) and stay rows. (Re-exported from `monadl.optim.apply` and
`monadl.optim`.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from monadl._namespace import all_finite, is_array, namespace
from monadl.deltas import SparseRows
from monadl.errors import NonFiniteError
from monadl.layers._weight import Weight
from monadl.optim._refusals import not_clipped, refuse_unless_by_weight

__all__ = ["clip_by_global_norm", "global_norm"]


def global_norm(gradients: Mapping[Weight[Any, Any], Any]) -> float:
    """The norm of all of ``gradients`` as one vector (what `clip_by_global_norm`
    clips, and what PyTorch's ``clip_grad_norm_`` returns, to log); an
    embedding's rows with a row looked up twice summed first, as its dense
    gradient has them.

    >>> import numpy as np, monadl as ml
    >>> global_norm({ml.Weight(np.zeros(2)): np.array([3.0, 4.0]), ml.Weight(0.0): 12.0})
    13.0
    """
    refuse_unless_by_weight(gradients, "global_norm")
    norms = []
    for g in gradients.values():
        values = g.summed()[1] if type(g) is SparseRows else g
        norms.append(_norm(values) if is_array(values) else abs(float(values)))
    return math.hypot(*norms)  # (no overflow where each norm is finite)


def _norm(values: Any) -> float:
    """One gradient's norm. Its squares are summed in its dtype (float16's in
    float32); where that overflows and its values are finite (float32 entries
    from about 1e19), they are summed again divided by the largest (whose
    square was zero in `clip_by_global_norm`: every gradient zeroed)."""
    xp = namespace(values)
    if values.dtype == xp.float16:  # (squared in float32, as PyTorch's: below 2.4e-4 a float16 square is 0)
        values = xp.astype(values, xp.float32)
    with np.errstate(over="ignore"):  # (overflowed: summed again, below)
        squares = float(xp.sum(values * values))
    if math.isfinite(squares) or not bool(xp.all(xp.isfinite(values))):
        return math.sqrt(squares)
    largest = float(xp.max(xp.abs(values)))
    scaled = xp.astype(values, xp.float64) / largest
    return largest * math.sqrt(float(xp.sum(scaled * scaled)))


def clip_by_global_norm(
    gradients: Mapping[Weight[Any, Any], Any], max_norm: float, *, finite: bool = True
) -> dict[Weight[Any, Any], Any]:
    """``gradients`` scaled by ``max_norm / (norm + 1e-6)`` where that is
    below 1, ``norm`` being all of them as one vector's (an embedding's rows
    with a row looked up twice summed first, as its dense gradient has them),
    as PyTorch's ``clip_grad_norm_``; an embedding's stays its rows. For a
    step of one's own between ``value_and_gradients`` and `apply_gradients`.

    Args:
        gradients: by weight, as `apply_gradients` takes them. They are only read.
        max_norm: the largest norm the result may have; positive.
        finite: refuse gradients that hold a NaN or an infinity: raise
            `NonFiniteError` naming the weights whose gradients hold one (as
            PyTorch's ``error_if_nonfinite=True``). Their norm is then not
            finite, and scaling by it would make every gradient NaN, so that
            `apply_gradients` would name a weight whose own gradient was
            finite. ``finite=False`` scales them all the same, as PyTorch's
            default does.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.zeros(2))
    >>> clip_by_global_norm({w: np.array([3.0, 4.0])}, 1.0)[w].round(6)
    array([0.6, 0.8])
    """
    refuse_unless_by_weight(gradients, "clip_by_global_norm")
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be positive, got {max_norm!r}")
    norm = global_norm(gradients)
    if finite and not math.isfinite(norm):
        culprits = [w for w, g in gradients.items() if not all_finite(g.rows if type(g) is SparseRows else g)]
        if culprits:  # (else finite entries whose norm passes 1.8e308: scaled by 0, as PyTorch's)
            raise NonFiniteError(not_clipped(culprits, norm, len(gradients)))
    factor = max_norm / (norm + 1e-6)
    if factor >= 1:
        return dict(gradients)
    return {
        w: SparseRows(g.indices, g.rows * factor, g.table_shape) if type(g) is SparseRows else g * factor
        for w, g in gradients.items()
    }
