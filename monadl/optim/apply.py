"""Applying gradients to weights: one optimizer step each, all or none.

`apply_gradients` is where a ``train()`` commits. Every step is computed
before any is written, so a failing update (or a refused one) changes
nothing; the whole commit holds one lock, so two threads training the same
weight never lose an update (each reads the state the other wrote).

A sparse step (a table's looked-up rows, `SparseRows`) costs its rows, not
its table: it computes the new rows (`Rows`), the check reads them alone,
and they are written into the table and its state's arrays themselves where
nothing else refers to those (`private`), else into copies, as any step
whose old arrays someone holds.

Clipping gradients by their global norm before a step of one's own
(`clip_by_global_norm`, `global_norm`) lives in `monadl.optim._clip`,
re-exported here and from `monadl.optim`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, Final

import numpy as np

from monadl._blas import add_product
from monadl._in_dtype import in_dtype_of
from monadl._namespace import all_finite, namespace
from monadl.deltas import Outer, SparseRows
from monadl.errors import NonFiniteError
from monadl.layers._commits import COMMIT_LOCK, READERS, pin_for_readers
from monadl.layers._traced_now import refuse_while_tracing
from monadl.layers._weight import Weight
from monadl.optim._clip import clip_by_global_norm, global_norm
from monadl.optim._refusals import checked_update, refuse_unless_a_gradient, refuse_unless_by_weight, refused
from monadl.optim._rows import Rows, rows_written, sparse_step
from monadl.optim._sgd import SMALL, factored_step, poolable, pooled_steps, private
from monadl.optim.transforms import Scale
from monadl.runtime.nested import refuse_inside_evaluation
from monadl.runtime.process import Held, hold, release

__all__ = [
    "Prepared",
    "apply_gradients",
    "clip_by_global_norm",
    "consume_gradients",
    "current",
    "global_norm",
    "prepare",
    "stateful",
    "step",
]


def apply_gradients(gradients: Mapping[Weight[Any, Any], Any], *, finite: bool = True) -> None:
    """Give each weight one optimizer step along its gradient, atomically.

    Args:
        gradients: by weight, a dense gradient (an array of the weight's
            library or a number: every entry steps) or a `SparseRows` delta
            (only those rows step, as ``train()`` steps an embedding's:
            `monadl.value_and_gradients` gives them so, `monadl.gradients`
            dense). They are only read.
        finite: refuse to write a NaN or an infinity into a weight: raise
            `NonFiniteError` naming the weight and the line that built it,
            and change no weight.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.5))
    >>> apply_gradients({w: np.array([2.0, -2.0])})
    >>> w.data
    array([0., 3.])
    """
    refuse_while_tracing("apply_gradients")
    refuse_inside_evaluation("apply_gradients")  # (a step inside a train(): as a train() there)
    refuse_unless_by_weight(gradients, "apply_gradients")
    for w, g in gradients.items():  # (the runtime's own gradients have their weights' shapes)
        refuse_unless_a_gradient(w, g)
    _commit(gradients, finite, False)


def consume_gradients(
    gradients: dict[Weight[Any, Any], Any],
    *,
    finite: bool = True,
    ready: Mapping[Weight[Any, Any], Prepared] | None = None,
) -> None:
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

    ``ready``: steps computed before (`prepare`), taken as they are where
    their weight is unchanged since, computed again where another commit
    wrote it meanwhile.
    """
    _commit(gradients, finite, True, ready)


Prepared = tuple[Any, Any, Any, Any, Any]
"""A step computed ahead of its commit: the weight's data, state and
optimizer it read, and the new data and state."""


def stateful(weight: Weight[Any, Any]) -> bool:
    """Whether a weight's step is more than plain SGD's scaled add: an
    optimizer with state (moments, a velocity, a schedule's count), which
    costs several passes over the weight (Adam's: about 8 ns an element)."""
    return type(weight._optimizer.update) is not Scale


def prepare(weight: Weight[Any, Any], grad: Any) -> Prepared:
    """``weight``'s step along ``grad``, computed now and written by a later
    commit (``consume_gradients(..., ready=...)``), so that a long commit
    can be computed a few weights at a time with the event loop's turns in
    between, and still be written all at once."""
    if type(grad) is SparseRows:
        return IN_COMMIT
    if type(grad) is Outer:
        grad = grad.dense()
    with COMMIT_LOCK, np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # (the commit's check refuses it)
        return (weight._data, weight._state, weight._optimizer, *step(weight, grad))


IN_COMMIT: Final[Prepared] = (None, None, None, None, None)
"""What `prepare` leaves of a sparse step: nothing. It is computed in the
commit, which may write its rows in place: a step computed ahead could not
tell whether another commit wrote them since, and the entry would hold the
table (a reference: never private). It costs its rows, not its table."""


def current(weight: Weight[Any, Any], done: Prepared) -> bool:
    """Whether a step computed ahead is still the one to take: nothing wrote
    its weight since (a step leaves new data and state objects; an in-place
    one is plain SGD's or a sparse one's, never computed ahead: `IN_COMMIT`),
    nor changed its optimizer (a fresh state may be the very same object: a
    count of 0)."""
    return done is IN_COMMIT or (done[0] is weight._data and done[1] is weight._state and done[2] is weight._optimizer)


def _commit(
    gradients: Mapping[Weight[Any, Any], Any],
    finite: bool,
    owned: bool,
    ready: Mapping[Weight[Any, Any], Prepared] | None = None,
) -> None:
    held: Held = None
    try:
        with COMMIT_LOCK:
            if READERS:  # (first: data a running evaluation keeps is no step's to write into)
                pin_for_readers(gradients)
            steps: list[tuple[Weight[Any, Any], Any, Any, float | None]] = []
            in_place: list[tuple[Any, float, Any, Any]] = []  # (data, factor, left, right): after every check
            if owned:
                # (NumPy's warnings quiet where the check below refuses the step, naming the weight, as
                # apply_gradients' are: they pointed into transforms.py before the refusal itself)
                quiet = np.errstate(over="ignore", invalid="ignore", divide="ignore") if finite else nullcontext()
                try:
                    with quiet:
                        _owned_steps(gradients, finite, ready, steps, in_place)
                except RuntimeWarning as warning:  # (python -W error: a warning not NumPy's, or finite_steps off)
                    if not finite:
                        raise
                    raise NonFiniteError(
                        "the optimizer step would write a NaN or an infinity into a weight (NumPy warned of its "
                        f"arithmetic: {warning}); no weight was changed"
                    ) from warning
            elif finite:  # (NumPy's warnings quiet: the check below refuses the step, naming the weight)
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    steps = [(weight, *step(weight, grad), None) for weight, grad in gradients.items()]
            else:
                steps = [(weight, *step(weight, grad), None) for weight, grad in gradients.items()]
            if finite:
                for weight, _, _, _ in _non_finite(steps):
                    raise NonFiniteError(refused(weight, gradients[weight], owned))
            writes: list[tuple[Any, Any, Any]] = []  # (array, rows, values): after every check and every copy
            for i, (weight, data, state, bound) in enumerate(steps):
                if type(data) is Rows:
                    steps[i] = (weight, *rows_written(weight, data, state, writes), bound)
            held = hold()  # (a Ctrl-C from here on acts after the last write: every weight stepped, or none)
            for data, factor, left, right in in_place:
                add_product(data, factor, left, right)
            for data, rows, values in writes:
                data[rows] = values
            for weight, data, state, bound in steps:
                weight._data = data
                weight._state = state
                weight._bound = None if bound is None else (data, bound)
    finally:
        release(held)  # (after the lock: a handler may save a checkpoint, which takes it)


def _owned_steps(
    gradients: Mapping[Weight[Any, Any], Any],
    finite: bool,
    ready: Mapping[Weight[Any, Any], Prepared] | None,
    steps: list[tuple[Weight[Any, Any], Any, Any, float | None]],
    in_place: list[tuple[Any, float, Any, Any]],
) -> None:
    """The steps of the runtime's own gradients (`consume_gradients`), into
    ``steps`` and ``in_place``: those computed ahead where still current, plain
    SGD's pooled, the rest one by one (`_owned_step`)."""
    norms: dict[int, float] = {}
    pools: dict[tuple[Any, float], list[tuple[Weight[Any, Any], Any]]] = {}
    for weight in gradients:
        done = ready.get(weight) if ready else None
        if done is not None and done is not IN_COMMIT and current(weight, done):
            steps.append((weight, done[3], done[4], None))
            continue
        # Read by key, not bound to a name or taken from items() (whose
        # iterator keeps the last pair): `_owned_step` counts references.
        update = weight._optimizer.update
        if type(update) is Scale and poolable(gradients[weight], weight._data):
            pools.setdefault((weight._data.dtype, update.factor), []).append((weight, gradients[weight]))
            continue
        steps.append((weight, *_owned_step(weight, gradients[weight], finite, norms, in_place)))
    for (_, factor), members in pools.items():
        if len(members) > 1:
            steps += pooled_steps(members, factor, finite)
        else:  # (a pool of one costs more than its own step)
            weight = members.pop()[0]
            steps.append((weight, *_owned_step(weight, gradients[weight], finite, norms, in_place)))


def _non_finite(
    steps: list[tuple[Weight[Any, Any], Any, Any, float | None]],
) -> list[tuple[Weight[Any, Any], Any, Any, float | None]]:
    """The steps whose new data holds a NaN or an infinity.

    A step with a bound (`_factored_step` proved its data finite) is not
    read; of a sparse step, its new rows are (`Rows`), not its table. A
    float NumPy array is checked with one BLAS pass, its dot product with
    itself (NaN and infinity reach it; about half the cost of
    ``isfinite(x).all()``), under one error state for the whole commit; the
    small ones (biases, scalars) are checked together, as one concatenation,
    since for them a call costs more than its pass (24 weights' checks took
    75 us one by one). A dot product may also overflow on finite values past
    1e154, so a non-finite one is confirmed element by element.
    """
    suspects = []
    foreign = []
    small = []
    with np.errstate(over="ignore", invalid="ignore"):
        for entry in steps:
            if entry[3] is not None:
                continue
            x = _written(entry[1])
            if type(x) is np.ndarray:
                if x.dtype.kind == "f":
                    if x.size < SMALL:
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
            flat = np.concatenate([_written(entry[1]) for entry in small], axis=None)
            if not np.isfinite(np.dot(flat, flat)):
                suspects += small
    by_library: dict[int, list[tuple[Weight[Any, Any], Any, Any, float | None]]] = {}
    for entry in foreign:
        by_library.setdefault(id(namespace(_written(entry[1]))), []).append(entry)
    for entries in by_library.values():
        # Another library's arrays (a GPU's): one flag each on the device, one wait for them all.
        xp = namespace(_written(entries[0][1]))
        if not bool(xp.all(xp.stack([xp.all(xp.isfinite(_written(entry[1]))) for entry in entries]))):
            suspects += entries
    return [entry for entry in suspects if not all_finite(_written(entry[1]))]


def _written(data: Any) -> Any:
    """What a step writes: its new data, or a sparse step's new rows."""
    return data.values if type(data) is Rows else data


def _owned_step(
    weight: Weight[Any, Any],
    grad: Any,
    finite: bool,
    norms: dict[int, float],
    in_place: list[tuple[Any, float, Any, Any]],
) -> tuple[Any, Any, float | None]:
    """`step`, and a bound on the new data's norm if it is proven finite.

    Plain SGD with a constant rate writes into a buffer nobody else sees:
    from a gradient kept as factors (`factored_step`), or into ``grad``'s own
    buffer when ``grad`` is a NumPy array typed and shaped like the weight's
    data, owning its writeable buffer, and referred to only by the gradients'
    dict (not by another weight's entry, an array viewing it, a user's rule
    that returned an array it keeps). The same two passes as ``g * factor``
    then ``+ old``, but no fresh array to allocate and no generic path
    (transformation, temporary test, dtype cast) per weight: the columns
    model's step (24 weights) ran about 100 us faster in an in-process A/B."""
    update = weight._optimizer.update
    old = weight._data
    held = 2  # (the dict and our parameter)
    if type(grad) is Outer:
        if type(update) is Scale:
            factored = factored_step(weight, grad, update.factor, finite, norms, in_place)
            if factored is not None:
                return factored
        grad, held = grad.dense(), 1  # (the product: ours alone)
    if type(update) is Scale and private(grad, old, held):
        np.multiply(grad, update.factor, out=grad)
        return np.add(grad, old, out=grad), weight._state, None
    return (*step(weight, grad), None)


def step(weight: Weight[Any, Any], grad: Any) -> tuple[Any, Any]:
    """A weight's new data and optimizer state after one step; nothing is written."""
    old = weight._data
    if getattr(grad, "dtype", None) != getattr(old, "dtype", None):  # (a float64 gradient given for a float32 weight)
        grad = in_dtype_of(grad, old)
    if type(grad) is SparseRows:
        return sparse_step(weight, grad)
    update, state = checked_update(weight, weight._optimizer.update(grad, weight._state, old), old)
    if type(update) is np.ndarray and update.nbytes >= _ELIDE_BYTES and private(update, old, 1):
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


_ELIDE_BYTES: Final = 1 << 16  # below this, checking costs about what it saves
