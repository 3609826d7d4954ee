"""Why a step is refused: the messages of `monadl.optim.apply`'s checks, which
name the weight and say where the fault lies (a gradient given by hand, the
weight's own data, the optimizer's state or update), and why a clipping is
(the weights whose gradients are not finite)."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from monadl._namespace import all_finite, is_array, library_name, namespace
from monadl._state_file import STATE_RULE, unstorable
from monadl.deltas import Outer, SparseRows
from monadl.errors import DeviceError, ShapeError
from monadl.layers._layer import Expr, Layer
from monadl.layers._site import site_text
from monadl.layers._weight import Weight
from monadl.optim._spec import closure, maker, ours
from monadl.runtime.settings import current_settings

__all__ = [
    "checked_update",
    "not_an_update",
    "not_clipped",
    "refuse_unless_a_gradient",
    "refuse_unless_by_weight",
    "refused",
]


def refuse_unless_by_weight(gradients: object, name: str) -> None:
    """Raise a TypeError where ``gradients`` are not given by weight: a list
    of them (`monadl.gradients`' result, or a dict's values) raised a bare
    ``AttributeError: 'list' object has no attribute 'values'``. A list
    could not be stepped nor clipped into something `apply_gradients`
    takes: it does not say whose each gradient is."""
    if type(gradients) is dict or isinstance(gradients, Mapping):
        for key in gradients:
            if not isinstance(key, Weight):
                raise TypeError(f"{name} takes the gradients by weight, got {_not_a_weight(key)}")
        return
    raise TypeError(
        f"{name} takes the gradients by weight, a {{weight: gradient}} dict as ml.value_and_gradients gives "
        f"them, got a {type(gradients).__name__}; for gradients in the order of their weights, as "
        "ml.gradients(loss, weights) gives them, pass dict(zip(weights, gradients))"
    )


def _not_a_weight(key: object) -> str:
    """What a key that is not a weight is, and what to give instead. A layer
    (a hypernetwork's generated matrix) raised an AttributeError about lazy
    shapes, read for the shape check."""
    if isinstance(key, Expr):
        built = f" (built at {site_text(key._site)})" if isinstance(key, Layer) else ""
        return (
            f"a {type(key).__name__} as a key{built}: only a weight takes a step. A layer "
            "computed from weights takes none; give the gradients of the weights it is computed from "
            "(ml.value_and_gradients(loss) keys them by weight)"
        )
    return (
        f"a {type(key).__name__} as a key; key each gradient by its Weight (for a model's dict of weights by "
        "name: {model[name]: g})"
    )


def refuse_unless_a_gradient(weight: Weight[Any, Any], gradient: Any) -> None:
    """Raise where ``gradient`` is not one `apply_gradients` can step
    ``weight`` along, naming the weight: not an array of its weight's library
    (NumPy's for a weight on the host), a real number nor a delta of
    `monadl.deltas`; not of real values; not of the weight's shape. A PyTorch
    tensor for a NumPy weight passed the checks of dtype and shape and raised
    NumPy's "Concatenation operation is not implemented" from inside the
    optimizer; a complex gradient stepped with its imaginary part dropped."""
    where = f"the weight built at {site_text(weight._site)}"
    if is_array(gradient) and namespace(gradient) is not namespace(weight._data):
        ours, theirs = library_name(weight._data), library_name(gradient)
        convert = " (a PyTorch tensor t: t.detach().cpu().numpy())" if ours == "numpy" and theirs == "torch" else ""
        raise DeviceError(
            f"apply_gradients: a gradient is an array of its weight's library, a number or a SparseRows, got "
            f"{theirs}.{type(gradient).__name__} for {where}, whose data is a {ours} array; monadl "
            f"never copies between array libraries by itself: convert it to {ours}{convert}; no weight changed"
        )
    kind = getattr(gradient, "dtype", None)
    known = is_array(gradient) or isinstance(gradient, (int, float, np.generic, SparseRows, Outer))
    real = known and (getattr(kind, "kind", "f") in "iuf" if kind is not None else isinstance(gradient, (int, float)))
    if isinstance(gradient, bool) or not real:  # (a complex gradient lost its imaginary part; a bool, a list passed)
        what = f"dtype {kind}" if known and kind is not None else type(gradient).__name__
        raise TypeError(
            f"apply_gradients: a gradient is an array or a number of real values, got {what} for {where}: give a "
            f"{library_name(weight._data)} array (its weight's library), a number or a SparseRows; no weight changed"
        )
    shape = tuple(getattr(gradient, "shape", ()))
    if shape != weight.shape:
        raise ShapeError(
            f"apply_gradients: a gradient of shape {shape} for a weight of shape {weight.shape} "
            f"(built at {site_text(weight._site)}); no weight changed"
        )


def refused(weight: Weight[Any, Any], gradient: Any, owned: bool) -> str:
    """Why a step is refused: its gradient (one given to `apply_gradients`,
    or one a model's operation made, which ``check_finite`` finds), or, the
    gradient finite, the step itself (an optimizer's state, a learning rate,
    an ``eps`` that the weight's dtype rounds to 0)."""
    where = f"the weight built at {site_text(weight._site)} (shape {list(weight.shape)})"
    if not all_finite(weight._data):  # (a LOG_REAL rule mask of -inf, the semiring's zero: was sent to check_finite)
        return (
            f"the optimizer step would write a NaN or an infinity into {where}, which already holds one (a mask "
            "of -inf, a log semiring's zero?); no weight was changed. ml.settings(finite_steps=False) lets steps "
            "write such values; or keep the weight finite and mask elsewhere"
        )
    # (Under check_finite, the runtime's gradients were found finite already. Plain SGD may
    # have stepped into its gradient's own buffer: a refused step's gradient is then its data.)
    given = gradient.rows if type(gradient) is SparseRows else gradient.dense() if type(gradient) is Outer else gradient
    if not (owned and current_settings().check_finite) and not all_finite(given):
        if owned:
            return (
                f"the optimizer step would write a NaN or an infinity into {where}; no weight was changed. "
                "ml.settings(check_finite=True) finds the operation that made it (it runs node by node: a NaN "
                "that it does not find, and ml.settings(batching=False) does not make, came from batching, a "
                "fault of monadl's to report)"
            )
        return (
            f"apply_gradients: the gradient given for {where} holds a NaN or an infinity; no weight was changed "
            "(where it came from ml.value_and_gradients, ml.settings(check_finite=True) finds the operation "
            "that made it)"
        )
    return (
        f"{'' if owned else 'apply_gradients: '}the optimizer step would write a NaN or an infinity into {where}, "
        "its gradient finite: the optimizer's state or its settings made it (a learning rate, a schedule, an eps); "
        f"no weight was changed{_underflowing_eps(weight)}"
    )


def not_clipped(culprits: list[Weight[Any, Any]], norm: float, count: int) -> str:
    """Why `clip_by_global_norm` refuses: the weights whose gradients hold a
    NaN or an infinity (the first three), which made the norm ``norm``.
    Scaled by it, every gradient was NaN and `apply_gradients` named the
    first weight it read, whose own gradient may have been finite."""
    named = [f"the weight built at {site_text(w._site)} (shape {list(w.shape)})" for w in culprits[:_SHOWN_CULPRITS]]
    if len(culprits) > _SHOWN_CULPRITS:
        named.append(f"{len(culprits) - _SHOWN_CULPRITS} more")
    listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
    one = len(culprits) == 1
    scaled = "every gradient would be NaN" if math.isnan(norm) else "the other entries would be 0, the infinities NaN"
    return (
        f"clip_by_global_norm: the gradients' norm is {norm}: the gradient{'' if one else 's'} given for {listed} "
        f"({len(culprits)} of {count} weights) hold{'s' if one else ''} a NaN or an infinity, and scaled by it "
        f"{scaled}; skip this batch, or find where it came from: for gradients of ml.value_and_gradients, "
        "ml.settings(check_finite=True) finds the operation that made it (finite=False clips them all the same, "
        "as PyTorch's clip_grad_norm_ does by default)"
    )


_SHOWN_CULPRITS = 3


def _underflowing_eps(weight: Weight[Any, Any]) -> str:
    """Where an ``eps`` of the weight's optimizer is 0 in the weight's dtype
    (Adam's default 1e-8 in float16): why that refuses a step, and the fix.
    A gradient entry of 0 where every one before it was 0 too (a dead unit, a
    class missing from the batches) then divides 0 by 0."""
    dtype = weight.dtype
    if not (isinstance(dtype, np.dtype) and dtype.kind == "f"):
        return ""
    for made_by, eps in _epsilons(weight._optimizer):
        if eps > 0 and dtype.type(eps) == 0:
            smallest = float(np.finfo(dtype).smallest_normal)
            fit = f"{10.0 ** math.ceil(math.log10(smallest)):.0e}"
            example = {"scale_by_adam": "adam", "scale_by_rms": "rmsprop", "scale_by_adagrad": "adagrad"}.get(made_by)
            return (
                f". The optimizer's eps={eps!r} (of {made_by}) is 0 in {dtype}, whose smallest normal number is "
                f"{smallest:.2g}: where a gradient entry and every one before it were 0 (a dead unit, a class missing "
                "from the batches), the step divides 0 by 0. Give it an eps that "
                f"{dtype} holds: eps={fit}" + (f", as in ml.optim.{example}(1e-3, eps={fit})" if example else "")
            )
    return ""


def _epsilons(optimizer: Any) -> list[tuple[str, float]]:
    """The ``eps`` of each of monadl's transformations in ``optimizer`` (its
    chains opened), by the function that made it (``scale_by_adam``)."""
    found = []
    pending = [optimizer]
    while pending:
        update = getattr(pending.pop(), "update", None)
        if not (isinstance(update, types.FunctionType) and ours(update)):
            continue
        values = closure(update)
        if isinstance(values.get("transforms"), tuple):  # (a chain's)
            pending.extend(reversed(values["transforms"]))
        if isinstance(values.get("eps"), float):
            found.append((maker(update), values["eps"]))
    return found


def not_an_update(weight: Weight[Any, Any], what: str) -> str:
    """An optimizer's update refused (a transformation of one's own; the
    weight's shape changed, in silence, where it broadcast)."""
    return f"the optimizer of the weight built at {site_text(weight._site)} {what}; no weight was changed"


def checked_update(weight: Weight[Any, Any], stepped: object, like: Any) -> tuple[Any, Any]:
    """An optimizer's ``(update, state)``, refused where the update is not of
    the shape of ``like`` (the weight's data, or a sparse step's rows) nor a
    number, or is complex: broadcast, it changed the weight's shape or added a
    row to every row, and a complex one lost its imaginary part, each in
    silence; and where the update is no array nor number (a str), or the
    state is one a checkpoint cannot store (`monadl._state_file.unstorable`:
    its init's was refused when the weight was made, this is the one a step
    made). A pair is any tuple or list of two (a NamedTuple of one's own)."""
    if not isinstance(stepped, (tuple, list)) or len(stepped) != 2:  # ('too many values to unpack')
        raise TypeError(not_an_update(weight, f"returned {type(stepped).__name__}, not (update, state)"))
    update, state = stepped
    dtype = getattr(update, "dtype", None)
    numeric = getattr(dtype, "kind", "f") in "iufc"
    if isinstance(update, bool) or not (numeric and (is_array(update) or isinstance(update, (int, float, np.number)))):
        shown = type(update).__name__ if numeric else f"{type(update).__name__} of dtype {dtype}"
        raise TypeError(not_an_update(weight, f"returned an update of type {shown}, not an array or a number"))
    found = unstorable(state, "state")
    if found is not None:
        raise TypeError(
            not_an_update(weight, f"returned a state that a checkpoint cannot store ({found}): {STATE_RULE}")
        )
    shape = tuple(getattr(update, "shape", ()))
    if (shape != tuple(like.shape) and shape != ()) or getattr(getattr(update, "dtype", None), "kind", "f") == "c":
        kind = getattr(update, "dtype", type(update).__name__)
        raise ShapeError(
            not_an_update(weight, f"returned an update of shape {shape} and dtype {kind}, for {tuple(like.shape)}")
        )
    return update, state
