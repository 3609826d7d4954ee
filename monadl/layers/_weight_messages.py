"""What a weight's refusals say: the user's line that copied it (a deep copy
reaches it several calls deep), how to freeze a weight where an optimizer
looks like an attempt to, what to do with another optimizer's state, and a
weight's dtype and shape as messages write them (`monadl.layers._weight`)."""

from __future__ import annotations

import copy
import copyreg
import sys
from typing import TYPE_CHECKING, Any, Final

from monadl.layers._site import PACKAGE_DIR, Site

if TYPE_CHECKING:
    from monadl.optim import GradientTransformation

__all__ = ["another_optimizer", "copier_site", "not_frozen", "shape_text"]

_COPYING: Final = frozenset({copy.__file__, copyreg.__file__})


def copier_site() -> Site:
    """The line of the user's code that copied a weight: the first frame
    outside monadl and the ``copy`` module (a deepcopy of a model reaches
    its weights several calls deep)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(PACKAGE_DIR) or frame.f_code.co_filename in _COPYING
    ):
        frame = frame.f_back
    return frame.f_code, frame.f_lasti


def not_frozen(optimizer: object) -> str:
    """How to freeze a weight, where a refused optimizer looks like an attempt
    to (None, False: PyTorch's ``requires_grad_(False)``, Keras'
    ``trainable = False``). ``Weight(x, optimizer=None)`` is the default
    optimizer, and a user freezing a teacher so got one that trained."""
    if optimizer is not None and optimizer is not False:
        return ""
    return (
        f"; {optimizer} does not freeze a weight: to freeze it, read it through ml.stop_gradient(w) where the model "
        "uses it (it then takes no step and its optimizer state stays as it is); for the default optimizer, "
        "ml.optim.default_optimizer()"
    )


def another_optimizer(optimizer: GradientTransformation) -> str:
    """What to do with a state of another structure, as `Weight.state`'s
    error ends: it is most often the state of the optimizer the weight had
    before (Adam's, kept across a change to AdamW), whose parts are still
    wanted, in this optimizer's places."""
    from monadl.optim._spec import spec

    return (
        f"; the expected one is what the weight's optimizer, {spec(optimizer)}, makes (a chain's state holds one "
        "part per transformation, in its order), and another optimizer's state does not fit as it is: start from "
        "this optimizer's fresh state (w.state right after assigning w.optimizer) and put the old state's parts in "
        "their places, e.g. w.state = (old[0], *w.state[1:]) keeps the moments and step count of an old Adam "
        "state, old"
    )


def shape_text(data: Any) -> str:
    """A weight's dtype and shape, as messages write an operand's (``float32[4, 8] ``;
    none for a number): weights built on one line (a dict of them) told apart."""
    shape = getattr(data, "shape", None)
    return "" if shape is None else f"{str(data.dtype).rsplit('.', 1)[-1]}{list(shape)} "
