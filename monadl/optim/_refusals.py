"""Why a step is refused: the messages of `monadl.optim.apply`'s checks, which
name the weight and say where the fault lies (a gradient given by hand, the
weight's own data, the optimizer's state or update)."""

from __future__ import annotations

from typing import Any

from monadl._namespace import all_finite
from monadl.deltas import Outer, SparseRows
from monadl.errors import ShapeError
from monadl.layers._site import site_text
from monadl.layers._weight import Weight
from monadl.runtime.settings import current_settings

__all__ = ["checked_update", "not_an_update", "refused"]


def refused(weight: Weight[Any, Any], gradient: Any, owned: bool) -> str:
    """Why a step is refused: its gradient (one given to `apply_gradients`
    that holds a NaN or an infinity was blamed on an operation of a model),
    or the step itself (an optimizer's state, a learning rate)."""
    where = f"the weight built at {site_text(weight._site)} (shape {list(weight.shape)})"
    if not all_finite(weight._data):  # (a LOG_REAL rule mask of -inf, the semiring's zero: was sent to check_finite)
        return (
            f"the optimizer step would write a NaN or an infinity into {where}, which already holds one (a mask "
            "of -inf, a log semiring's zero?); no weight was changed. ml.settings(finite_steps=False) lets steps "
            "write such values; or keep the weight finite and mask elsewhere"
        )
    given = gradient.rows if type(gradient) is SparseRows else gradient.dense() if type(gradient) is Outer else gradient
    if not owned and not all_finite(given):
        return (
            f"apply_gradients: the gradient given for {where} holds a NaN or an infinity; no weight was changed "
            "(where it came from ml.value_and_gradients, ml.settings(check_finite=True) finds the operation "
            "that made it)"
        )
    if not owned:
        return (
            f"apply_gradients: the optimizer step would write a NaN or an infinity into {where}, its gradient "
            "finite (the optimizer's state or its settings: a learning rate, a schedule); no weight was changed"
        )
    if current_settings().check_finite:  # (it found no operation that made one: the step did)
        return (
            f"the optimizer step would write a NaN or an infinity into {where}, its gradient finite (the "
            "optimizer's state or its settings: a learning rate, a schedule); no weight was changed"
        )
    return (
        f"the optimizer step would write a NaN or an infinity into {where}; no weight was changed. "
        "ml.settings(check_finite=True) finds the operation that made it"
    )


def not_an_update(weight: Weight[Any, Any], what: str) -> str:
    """An optimizer's update refused (a transformation of one's own; the
    weight's shape changed, in silence, where it broadcast)."""
    return f"the optimizer of the weight built at {site_text(weight._site)} {what}; no weight was changed"


def checked_update(weight: Weight[Any, Any], stepped: object, like: Any) -> tuple[Any, Any]:
    """An optimizer's ``(update, state)``, refused where the update is not of
    the shape of ``like`` (the weight's data, or a sparse step's rows) nor a
    number, or is complex: broadcast, it changed the weight's shape or added a
    row to every row, and a complex one lost its imaginary part, each in
    silence. A pair is any tuple or list of two (a NamedTuple of one's own)."""
    if not isinstance(stepped, (tuple, list)) or len(stepped) != 2:  # ('too many values to unpack')
        raise TypeError(not_an_update(weight, f"returned {type(stepped).__name__}, not (update, state)"))
    update, state = stepped
    shape = tuple(getattr(update, "shape", ()))
    if (shape != tuple(like.shape) and shape != ()) or getattr(getattr(update, "dtype", None), "kind", "f") == "c":
        kind = getattr(update, "dtype", type(update).__name__)
        raise ShapeError(
            not_an_update(weight, f"returned an update of shape {shape} and dtype {kind}, for {tuple(like.shape)}")
        )
    return update, state
