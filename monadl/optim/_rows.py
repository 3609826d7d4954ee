"""A sparse step (a table's looked-up rows, `SparseRows`): its new rows,
computed apart from the table (`Rows`), and where the commit writes them
(`rows_written`): into the table and its state's arrays where nothing else
holds them, else into copies. `monadl.optim.apply` checks the rows, then
writes them, after every other step is computed and checked."""

from __future__ import annotations

from typing import Any, final

from monadl._namespace import is_array, namespace
from monadl.deltas import SparseRows
from monadl.layers._weight import Weight
from monadl.optim._refusals import checked_update
from monadl.optim._sgd import alone, private

__all__ = ["Rows", "rows_written", "sparse_step"]


@final
class Rows:
    """A sparse step's new data, not yet written: the rows it steps, each
    once, and their new values. The commit checks the values, then writes
    them (`rows_written`); the step's state beside it holds the same rows
    of each state array shaped like the weight."""

    __slots__ = ("indices", "values")

    def __init__(self, indices: Any, values: Any) -> None:
        self.indices = indices
        self.values = values


def sparse_step(weight: Weight[Any, Any], grad: SparseRows) -> tuple[Any, Any]:
    """Step only the rows a sparse delta touches.

    Equal indices are summed first, so a row looked up twice steps once with
    both deltas. The optimizer sees those rows of the weight and of every state
    leaf shaped like the weight (moments, velocities), and the other rows keep
    theirs ("lazy" updates, as TensorFlow's lazy Adam and
    ``torch.optim.SparseAdam``); state that is not per row, such as a step
    count, is shared. (SparseAdam adds Adam's ``eps`` before the bias
    correction, this library's Adam after, as ``torch.optim.Adam``: for
    small gradients early in training that is much of a step,
    `monadl.optim._adaptive.scale_by_adam`.)

    Where the library scatters, the step is its rows (`Rows`, and the state
    with its rows), which the commit writes: what it costs, and what its
    finite check reads, is the rows. A NaN already in a row not looked up
    (data assigned so) is not refused: the step does not write it.
    """
    old = weight._data
    xp = namespace(old)
    if not hasattr(getattr(xp, "add", None), "at"):
        # No scatter in this library (the array API has none): step densely, then keep
        # the rows not looked up, and their state, as they were (a mask of the rows).
        update, state = checked_update(weight, weight._optimizer.update(grad.to_dense(), weight._state, old), old)
        n = old.shape[0]
        rows = xp.asarray(grad.indices, device=old.device)  # (the table's device, not the default one)
        used = xp.any(xp.arange(n, device=old.device)[:, None] == rows[None, :], axis=1)
        used = xp.reshape(used, (n, *([1] * (old.ndim - 1))))
        new = xp.where(used, xp.astype(old + update, old.dtype, copy=False), old)
        return new, _keep_state_rows(weight._state, state, old.shape, used)
    rows, summed = grad.summed()
    state_rows = _state_rows(weight._state, old.shape, rows)
    stepped = old[rows]
    update, new_state_rows = checked_update(weight, weight._optimizer.update(summed, state_rows, stepped), stepped)
    return Rows(rows, xp.astype(stepped + update, old.dtype, copy=False)), new_state_rows


def rows_written(
    weight: Weight[Any, Any], new: Rows, state: Any, writes: list[tuple[Any, Any, Any]]
) -> tuple[Any, Any]:
    """A sparse step's data and state: the weight's own arrays where nothing
    else refers to them (no user's ``w.data``, no running evaluation's pin,
    no user's ``w.state`` or part of it), else copies, as the step's own;
    either way their rows are to be written (``writes``), after every check
    and every copy."""
    old = weight._data
    # (held by the weight, `old`, and `private`'s second parameter)
    data = old if private(old, old, 3) else namespace(old).asarray(old, copy=True)
    writes.append((data, new.indices, new.values))
    top = weight._state
    sole = alone(top, 2)  # (held by the weight and `top`; asked before `top` is an argument too)
    return data, _put_state_rows(top, state, data.shape, new.indices, writes, sole)


def _keep_state_rows(old: Any, new: Any, shape: tuple[int, ...], used: Any) -> Any:
    """``new`` state where its leaves shaped like the weight take ``old``'s
    rows outside ``used`` (a mask)."""
    if is_array(old) and old.shape == shape:
        return namespace(old).where(used, new, old)
    if isinstance(old, tuple):
        parts = [_keep_state_rows(o, n, shape, used) for o, n in zip(old, new)]
        return type(old)(*parts) if hasattr(old, "_fields") else tuple(parts)
    return new


def _state_rows(state: Any, shape: tuple[int, ...], rows: Any) -> Any:
    if is_array(state) and state.shape == shape:
        return state[rows]
    if isinstance(state, tuple):
        parts = [_state_rows(s, shape, rows) for s in state]
        return type(state)(*parts) if hasattr(state, "_fields") else tuple(parts)
    return state


def _put_state_rows(
    old: Any, new: Any, shape: tuple[int, ...], rows: Any, writes: list[tuple[Any, Any, Any]], sole: bool
) -> Any:
    """``old`` state with ``new``'s rows (`_state_rows`', stepped) in its
    leaves shaped like the weight, to be written (``writes``) into the leaves
    themselves where ``sole`` (nothing but the weight's state refers to
    ``old``, nor to a container of it) and they are private, else into copies.
    Its containers are new ones, and its other leaves ``new``'s (a count)."""
    if is_array(old) and old.shape == shape:
        # (held by its container, the caller's name, `old`, and `private`'s second parameter)
        full = old if sole and private(old, old, 4) else namespace(old).asarray(old, copy=True)
        writes.append((full, rows, new))
        return full
    if isinstance(old, tuple):
        parts = []
        for i in range(len(old)):
            part = old[i]
            alone_too = sole and alone(part, 2)  # (held by its container and `part`)
            parts.append(_put_state_rows(part, new[i], shape, rows, writes, alone_too))
        return type(old)(*parts) if hasattr(old, "_fields") else tuple(parts)
    return new
