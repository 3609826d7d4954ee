"""Applying gradients to weights: one optimizer step each, all or none.

`apply_gradients` is where a ``train()`` commits. Every step is computed
before any is written, so a failing update (or a refused one) changes
nothing; the whole commit holds one lock, so two threads training the same
weight never lose an update (each reads the state the other wrote).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from monadl._blas import add_product, can_add_product
from monadl._namespace import all_finite, is_array, namespace
from monadl.deltas import Outer, SparseRows
from monadl.errors import NonFiniteError
from monadl.layers._layer import site_text
from monadl.layers._products import product
from monadl.layers._weight import COMMIT_LOCK, Weight
from monadl.optim.transforms import Scale

__all__ = ["apply_gradients", "consume_gradients", "step"]


def apply_gradients(gradients: Mapping[Weight[Any, Any], Any], *, finite: bool = True) -> None:
    """Give each weight one optimizer step along its gradient, atomically.

    Args:
        gradients: by weight, a dense gradient (an array or a number) or a
            `SparseRows` delta (only those rows step). They are only read.
        finite: refuse to write a NaN or an infinity into a weight: raise
            `NonFiniteError` naming the weight and the line that built it,
            and change no weight.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.5))
    >>> apply_gradients({w: np.array([2.0, -2.0])})
    >>> w.data
    array([0., 3.])
    """
    _commit(gradients, finite, False)


def consume_gradients(gradients: dict[Weight[Any, Any], Any], *, finite: bool = True) -> None:
    """`apply_gradients` for the runtime's own gradients, which nobody else sees.

    A gradient that nothing but ``gradients`` refers to may become its
    weight's new data: the step writes into it instead of into a fresh array
    (plain SGD with a constant rate), one weight-sized allocation and pass
    less. After a refused step (non-finite), such gradients are overwritten.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.zeros(3, np.float32), optimizer=ml.optim.sgd(0.5))
    >>> consume_gradients({w: np.ones(3, np.float32)})
    >>> w.data
    array([-0.5, -0.5, -0.5], dtype=float32)
    """
    _commit(gradients, finite, True)


def _commit(gradients: Mapping[Weight[Any, Any], Any], finite: bool, owned: bool) -> None:
    with COMMIT_LOCK:
        steps: list[tuple[Weight[Any, Any], Any, Any, float | None]] = []
        in_place: list[tuple[Any, float, Any, Any]] = []  # (data, factor, left, right): after every check
        if owned:
            norms: dict[int, float] = {}
            pools: dict[tuple[Any, float], list[tuple[Weight[Any, Any], Any]]] = {}
            for weight in gradients:
                # Read by key, not bound to a name or taken from items() (whose
                # iterator keeps the last pair): `_owned_step` counts references.
                update = weight._optimizer.update
                if type(update) is Scale and _poolable(gradients[weight], weight._data):
                    pools.setdefault((weight._data.dtype, update.factor), []).append((weight, gradients[weight]))
                    continue
                steps.append((weight, *_owned_step(weight, gradients[weight], finite, norms, in_place)))
            for (_, factor), members in pools.items():
                if len(members) > 1:
                    steps += _pooled_steps(members, factor, finite)
                else:  # (a pool of one costs more than its own step)
                    weight = members.pop()[0]
                    steps.append((weight, *_owned_step(weight, gradients[weight], finite, norms, in_place)))
        else:
            steps = [(weight, *step(weight, grad), None) for weight, grad in gradients.items()]
        if finite:
            for weight, data, _, _ in _non_finite(steps):
                raise NonFiniteError(
                    f"the optimizer step would write a NaN or an infinity into the weight built at "
                    f"{site_text(weight._site)} (shape {list(getattr(data, 'shape', ()))}); no weight was changed. "
                    "ml.settings(check_finite=True) finds the operation that made it"
                )
        for data, factor, left, right in in_place:
            add_product(data, factor, left, right)
        for weight, data, state, bound in steps:
            weight._data = data
            weight._state = state
            weight._bound = None if bound is None else (data, bound)


def _non_finite(
    steps: list[tuple[Weight[Any, Any], Any, Any, float | None]],
) -> list[tuple[Weight[Any, Any], Any, Any, float | None]]:
    """The steps whose new data holds a NaN or an infinity.

    A step with a bound (`_factored_step` proved its data finite) is not
    read. A float NumPy array is checked with one BLAS pass, its dot product
    with itself (NaN and infinity reach it; about half the cost of
    ``isfinite(x).all()``), under one error state for the whole commit; the
    small ones (biases, scalars) are checked
    together, as one concatenation, since for them a call costs more than its
    pass (24 weights' checks took 75 us one by one). A dot product may also
    overflow on finite values past 1e154, so a non-finite one is confirmed
    element by element.
    """
    suspects = []
    foreign = []
    small = []
    with np.errstate(over="ignore", invalid="ignore"):
        for entry in steps:
            if entry[3] is not None:
                continue
            x = entry[1]
            if type(x) is np.ndarray:
                if x.dtype.kind == "f":
                    if x.size < _SMALL:
                        small.append(entry)
                    else:
                        flat = x.reshape(-1)
                        if not np.isfinite(np.dot(flat, flat)):
                            suspects.append(entry)
            elif isinstance(x, (float, np.floating)):
                if not np.isfinite(x):
                    suspects.append(entry)
            else:
                foreign.append(entry)
        if small:
            flat = np.concatenate([entry[1] for entry in small], axis=None)
            if not np.isfinite(np.dot(flat, flat)):
                suspects += small
    by_library: dict[int, list[tuple[Weight[Any, Any], Any, Any, float | None]]] = {}
    for entry in foreign:
        by_library.setdefault(id(namespace(entry[1])), []).append(entry)
    for entries in by_library.values():
        # Another library's arrays (a GPU's): one flag each on the device, one wait for them all.
        xp = namespace(entries[0][1])
        if not bool(xp.all(xp.stack([xp.all(xp.isfinite(entry[1])) for entry in entries]))):
            suspects += entries
    return [entry for entry in suspects if not all_finite(entry[1])]


_SMALL: Final = 1 << 14
"""Float arrays below this many elements are checked together."""


def _poolable(grad: Any, old: Any) -> bool:
    """Whether plain SGD may step this weight in a pool: a small NumPy array
    typed and shaped like its NumPy data."""
    return (
        type(grad) is np.ndarray
        and grad.size < _SMALL
        and type(old) is np.ndarray
        and grad.dtype == old.dtype
        and grad.shape == old.shape
    )


def _pooled_steps(
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
            bound = _norm_bound(flat)  # (a bound on every part's norm, NaN if any entry is not finite)
        if not bound < math.inf:
            bound = None  # (the commit's check reads each part, to name the weight)
    steps = []
    start = 0
    for weight, grad in members:
        stop = start + grad.size
        steps.append((weight, flat[start:stop].reshape(grad.shape), weight._state, bound))
        start = stop
    return steps


def _owned_step(
    weight: Weight[Any, Any],
    grad: Any,
    finite: bool,
    norms: dict[int, float],
    in_place: list[tuple[Any, float, Any, Any]],
) -> tuple[Any, Any, float | None]:
    """`step`, and a bound on the new data's norm if it is proven finite.

    Plain SGD with a constant rate writes into a buffer nobody else sees:
    from a gradient kept as factors (`_factored_step`), or into ``grad``'s
    own buffer when ``grad`` is a NumPy array typed and shaped like the
    weight's data, owning its writeable buffer, and referred to only by the
    gradients' dict (not by another weight's entry, an array viewing it, a
    user's rule that returned an array it keeps)."""
    update = weight._optimizer.update
    old = weight._data
    if type(grad) is Outer:
        if type(update) is Scale:
            factored = _factored_step(weight, grad, update.factor, finite, norms, in_place)
            if factored is not None:
                return factored
        grad = grad.dense()
        if type(update) is Scale and _private(grad, old, 1):
            np.multiply(grad, update.factor, out=grad)
            return np.add(grad, old, out=grad), weight._state, None
    elif type(update) is Scale and _private(grad, old, 2):  # (held by the dict and our parameter)
        # The gradient becomes the new weight. The same two passes as ``g *
        # factor`` then ``+ old``, but no fresh array to allocate and no
        # generic path (transformation, temporary test, dtype cast) per
        # weight, small ones too: the columns model's step (24 weights) ran
        # about 100 us faster in an in-process A/B.
        np.multiply(grad, update.factor, out=grad)
        return np.add(grad, old, out=grad), weight._state, None
    return (*step(weight, grad), None)


def _factored_step(
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
    old = weight._data
    if grad.others or type(old) is not np.ndarray:
        return None
    if len(grad.lefts) == 1:
        left, right = grad.lefts[0], grad.rights[0]
    else:  # (merged runs of fibers: their rows, stacked)
        left, right = np.concatenate(grad.lefts), np.concatenate(grad.rights)
    dtype = old.dtype
    if type(left) is not np.ndarray or type(right) is not np.ndarray or left.dtype != dtype or right.dtype != dtype:
        return None
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
                left_norm = _norm_bound(left)
                if shared:
                    norms[id(left)] = left_norm
            rounding = 1 + 2 * (left.shape[0] + 2) * float(np.finfo(dtype).eps)
            bound = (known[1] + abs(factor) * left_norm * _norm_bound(right)) * rounding
    proven = bound < limit  # (not NaN either: a factor that is not finite)
    # Held by the weight, its bound when carried, this frame and the caller's (`_owned_step`).
    if (proven or not finite) and _private(old, old, 4 + carried):  # (and `_private`'s second parameter)
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
            bound = _norm_bound(new)
        proven = bound < limit
    return new, weight._state, bound if proven else None


def _norm_bound(x: np.ndarray[Any, Any]) -> float:
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


def step(weight: Weight[Any, Any], grad: Any) -> tuple[Any, Any]:
    """A weight's new data and optimizer state after one step; nothing is written."""
    if type(grad) is SparseRows:
        return _sparse_step(weight, grad)
    old = weight._data
    update, state = weight._optimizer.update(grad, weight._state, old)
    if type(update) is np.ndarray and update.nbytes >= _ELIDE_BYTES and _private(update, old, 1):
        new = np.add(update, old, out=update)  # one weight-sized array less to allocate and fill
    else:
        new = old + update
    return _like(new, old), state


def _like(new: Any, old: Any) -> Any:
    """``new`` as the same kind of value as ``old``: its dtype, and a 0-d
    array stays a 0-d array (NumPy arithmetic turns one into a scalar)."""
    dtype = old.dtype
    if isinstance(new, np.ndarray):
        return new.astype(dtype, copy=False)
    if isinstance(new, (np.generic, float, int)):
        return np.asarray(new, dtype=dtype) if type(old) is np.ndarray else dtype.type(new)
    return namespace(new).astype(new, dtype, copy=False)  # an array of another library


def _private(x: Any, like: Any, held: int) -> bool:
    """Whether ``x`` is a NumPy array that nothing refers to but the caller's
    ``held`` references (its names, a dict's entry: not optimizer state, not
    another weight's gradient, not a view), shaped and typed like ``like``:
    then writing into it is safe. This is NumPy's own test for eliding
    temporaries, which a name defeats."""
    return (
        _COUNTS_EVERY_REFERENCE
        and type(x) is np.ndarray
        and sys.getrefcount(x) == held + 2  # and our parameter, and getrefcount's argument
        and type(like) is np.ndarray
        and x.dtype == like.dtype
        and x.shape == like.shape
        and x.flags.owndata
        and x.flags.writeable
    )


_ELIDE_BYTES: Final = 1 << 16  # below this, checking costs about what it saves
# From CPython 3.14 the interpreter may hold borrowed references that
# getrefcount does not count, so a count no longer proves an array private.
_COUNTS_EVERY_REFERENCE: Final = sys.implementation.name == "cpython" and sys.version_info < (3, 14)


def _sparse_step(weight: Weight[Any, Any], grad: SparseRows) -> tuple[Any, Any]:
    """Step only the rows a sparse delta touches.

    Equal indices are summed first, so a row looked up twice steps once with
    both deltas. The optimizer sees those rows of the weight and of every state
    leaf shaped like the weight (moments, velocities), and the other rows keep
    theirs ("lazy" updates, as TensorFlow's lazy Adam); state that is not per
    row, such as a step count, is shared.
    """
    old = weight._data
    xp = namespace(old)
    if not hasattr(getattr(xp, "add", None), "at"):
        # No scatter in this library: step densely (every row, every row's state).
        update, state = weight._optimizer.update(grad.to_dense(), weight._state, old)
        return xp.astype(old + update, old.dtype, copy=False), state
    rows, summed = grad.summed()
    state_rows = _state_rows(weight._state, old.shape, rows)
    update, new_state_rows = weight._optimizer.update(summed, state_rows, old[rows])
    new = xp.asarray(old, copy=True)
    new[rows] = xp.astype(old[rows] + update, old.dtype, copy=False)
    return new, _put_state_rows(weight._state, new_state_rows, old.shape, rows)


def _state_rows(state: Any, shape: tuple[int, ...], rows: Any) -> Any:
    if is_array(state) and state.shape == shape:
        return state[rows]
    if isinstance(state, tuple):
        parts = [_state_rows(s, shape, rows) for s in state]
        return type(state)(*parts) if hasattr(state, "_fields") else tuple(parts)
    return state


def _put_state_rows(old: Any, new: Any, shape: tuple[int, ...], rows: Any) -> Any:
    if is_array(old) and old.shape == shape:
        full = namespace(old).asarray(old, copy=True)
        full[rows] = new
        return full
    if isinstance(old, tuple):
        parts = [_put_state_rows(o, n, shape, rows) for o, n in zip(old, new)]
        return type(old)(*parts) if hasattr(old, "_fields") else tuple(parts)
    return new
