"""Plain SGD's own steps, cheaper than the generic optimizer path.

`monadl.optim.apply` commits through them when a weight's optimizer is plain
SGD with a constant rate (`monadl.optim.transforms.Scale`):

* `pooled_steps`: small weights of one dtype and rate, as one array;
* `factored_step`: a large weight's gradient kept as factors (the rows and
  their deltas, `monadl.deltas.Outer`), proven finite from their norms and a
  bound the last step left, and added into the weight's own array when
  nothing else holds it;
* `private`: whether an array is referred to only by its caller, so that a
  step may write into it (`alone`: whether any object is).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Final

import numpy as np

from monadl._blas import can_add_product
from monadl.deltas import Outer
from monadl.layers._products import product
from monadl.layers._weight import Weight

__all__ = ["SMALL", "alone", "factored_step", "norm_bound", "poolable", "pooled_steps", "private"]

SMALL: Final = 1 << 14
"""Float arrays below this many elements are checked together."""


def poolable(grad: Any, old: Any) -> bool:
    """Whether plain SGD may step this weight in a pool: a small NumPy array
    typed and shaped like its NumPy data."""
    return (
        type(grad) is np.ndarray
        and grad.size < SMALL
        and type(old) is np.ndarray
        and grad.dtype == old.dtype
        and grad.shape == old.shape
    )


def pooled_steps(
    members: list[tuple[Weight[Any, Any], Any]], factor: float, finite: bool
) -> list[tuple[Weight[Any, Any], Any, Any, float | None]]:
    """Plain SGD on small weights of one dtype and rate, as one array: their
    gradients joined (a copy: they are only read), scaled, added to their
    data joined, checked with one dot product; each weight's new data is its
    part of the result. Per weight, a few Python calls fewer: a step of the
    columns model (20 such weights) at 8 features took 3.01 M instructions,
    not 3.11.
    """
    flat = np.concatenate([grad for _, grad in members], axis=None)
    np.multiply(flat, factor, out=flat)
    np.add(flat, np.concatenate([weight._data for weight, _ in members], axis=None), out=flat)
    bound = None
    if finite:
        with np.errstate(over="ignore", invalid="ignore"):
            bound = norm_bound(flat)  # (a bound on every part's norm, NaN if any entry is not finite)
        if not bound < math.inf:
            bound = None  # (the commit's check reads each part, to name the weight)
    steps = []
    start = 0
    for weight, grad in members:
        stop = start + grad.size
        steps.append((weight, flat[start:stop].reshape(grad.shape), weight._state, bound))
        start = stop
    return steps


def steps_from_factors(weight: Weight[Any, Any], grad: Outer) -> bool:
    """Whether plain SGD's step takes ``grad`` as its factors (`factored_step`):
    the weight's data and every factor NumPy arrays of one dtype, and no
    dense delta beside them (else the commit multiplies them first).

    >>> w = Weight(np.zeros((3, 2)))
    >>> d = Outer(np.ones((1, 3)), np.ones((1, 2)))
    >>> steps_from_factors(w, d), steps_from_factors(w, d + np.ones((3, 2)))
    (True, False)
    """
    old = weight._data
    if grad.others or type(old) is not np.ndarray:
        return False
    dtype = old.dtype
    return all(type(x) is np.ndarray and x.dtype == dtype for x in (*grad.lefts, *grad.rights))


def factored_step(
    weight: Weight[Any, Any],
    grad: Outer,
    factor: float,
    finite: bool,
    norms: dict[int, float],
    in_place: list[tuple[Any, float, Any, Any]],
) -> tuple[Any, Any, float | None] | None:
    """Plain SGD from a gradient ``left.T @ right``: ``old + factor * left.T @
    right``, the rate scaling the few rows' deltas, not the weight-sized product.

    The new data is proven finite without reading it when the last commit
    left a bound on the old data's norm: by Cauchy-Schwarz, the new norm is
    at most ``bound + |factor| * |left| * |right|`` (norms of the few rows,
    read instead; finite only if every entry is), raised for rounding. With
    no bound known (the first step, data the user assigned), one is taken
    from the new data's largest entry, which reads it once; the bound grows a
    little each step and is taken afresh once it nears the largest float.

    A proven step on data that nothing but the weight holds is written into
    that data, by one BLAS product that adds (`monadl._blas.add_product`),
    after every other step is computed and checked (``in_place``): one pass
    over the weight instead of three (a product into a fresh array, read
    again to add). Else the product goes into a fresh array.

    Returns the new data, state and bound (None: not proven, the commit's
    check reads the data), or None: not this kind of step.
    """
    if not steps_from_factors(weight, grad):
        return None
    old = weight._data
    if len(grad.lefts) == 1:
        left, right = grad.lefts[0], grad.rights[0]
    else:  # (merged runs of fibers: their rows, stacked)
        left, right = np.concatenate(grad.lefts), np.concatenate(grad.rights)
    dtype = old.dtype
    known = weight._bound
    carried = known is not None and known[0] is old
    limit = float(np.finfo(dtype).max) / 4
    bound = math.inf
    if finite and known is not None and carried:
        with np.errstate(over="ignore", invalid="ignore"):
            # The columns' first layers share their input: its norm is taken once
            # (by id: the gradients hold the rows; not stacked rows, a temporary).
            shared = len(grad.lefts) == 1
            left_norm = norms.get(id(left)) if shared else None
            if left_norm is None:
                left_norm = norm_bound(left)
                if shared:
                    norms[id(left)] = left_norm
            rounding = 1 + 2 * (left.shape[0] + 2) * float(np.finfo(dtype).eps)
            bound = (known[1] + abs(factor) * left_norm * norm_bound(right)) * rounding
    proven = bound < limit  # (not NaN either: a factor that is not finite)
    # Held by the weight, its bound when carried, this frame and the caller's (`monadl.optim.apply._owned_step`).
    if (proven or not finite) and private(old, old, 4 + carried):  # (and `private`'s second parameter)
        left, right = np.ascontiguousarray(left), np.ascontiguousarray(right)
        if can_add_product(old, left, right):
            in_place.append((old, factor, left, right))
            return old, weight._state, bound if proven else None
    scaled = np.multiply(right, factor, dtype=dtype)  # (may overflow: warned as the dense step's would be)
    with np.errstate(invalid="ignore"):  # (its infinities times zeros: the check refuses the step)
        new = product(left.mT, scaled)
        if new.shape != old.shape or not new.flags.owndata:
            return None
        np.add(new, old, out=new)
    if finite and not proven:
        with np.errstate(over="ignore", invalid="ignore"):
            bound = norm_bound(new)
        proven = bound < limit
    return new, weight._state, bound if proven else None


def norm_bound(x: np.ndarray[Any, Any]) -> float:
    """An upper bound on the norm of the float array ``x`` (``sqrt(sum(x**2))``),
    infinite or NaN if an entry is. Where the rounding of a dot product of its
    n entries by itself is small (n * eps <= 1%), that product, raised by its
    worst case (and by what squares below the smallest float lose); else
    ``sqrt(n)`` times the largest magnitude, which is exact."""
    flat = x.reshape(-1)
    n = flat.size
    info = np.finfo(x.dtype)
    if n * float(info.eps) <= 0.01:
        return math.sqrt(float(np.dot(flat, flat)) * (1 + n * float(info.eps)) + n * float(info.smallest_normal))
    return math.sqrt(n) * float(np.maximum(flat.max(), -flat.min()))


def private(x: Any, like: Any, held: int) -> bool:
    """Whether ``x`` is a NumPy array that nothing refers to but the caller's
    ``held`` references (its names, a dict's entry: not optimizer state, not
    another weight's gradient, not a view), shaped and typed like ``like``:
    then writing into it is safe. This is NumPy's own test for eliding
    temporaries, which a name defeats."""
    return (
        COUNTS_EVERY_REFERENCE
        and type(x) is np.ndarray
        and sys.getrefcount(x) == held + 2  # and our parameter, and getrefcount's argument
        and type(like) is np.ndarray
        and x.dtype == like.dtype
        and x.shape == like.shape
        and x.flags.owndata
        and x.flags.writeable
        and x.flags.c_contiguous  # (it becomes the weight's data: a transposed layout would stay the weight's)
    )


def alone(x: Any, held: int) -> bool:
    """Whether nothing refers to ``x`` but the caller's ``held`` references
    (a container whose arrays `private` may then find private)."""
    return COUNTS_EVERY_REFERENCE and sys.getrefcount(x) == held + 2  # and our parameter, and getrefcount's


# From CPython 3.14 the interpreter may hold borrowed references that
# getrefcount does not count, so a count no longer proves an array private.
COUNTS_EVERY_REFERENCE: Final = sys.implementation.name == "cpython" and sys.version_info < (3, 14)
