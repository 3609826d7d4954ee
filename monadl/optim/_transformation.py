"""What an optimizer is: a `GradientTransformation`, the pair of pure
functions ``(init, update)`` (optax's ``base.py``) that every transformation
of `monadl.optim.transforms` builds and `chain` composes. (Re-exported from
`monadl.optim.transforms` and `monadl.optim`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

from monadl.optim._spec import spec

__all__ = ["GradientTransformation", "State", "Tensor"]

Tensor: TypeAlias = Any  # an ndarray or a NumPy scalar
State: TypeAlias = Any


class GradientTransformation(NamedTuple):
    """An optimizer: ``init(param) -> state`` and
    ``update(grad, state, param) -> (update, state)``.

    The state is what a checkpoint stores: None, a number, an array, or a
    tuple or NamedTuple of these (not a dict, a list, a dataclass or a str,
    as optax's pytrees may be); a weight refuses another when ``init`` makes
    it, and a step when ``update`` returns one, not at the first ``ml.save``.
    For an embedding's looked-up rows, ``update`` gets the rows' gradient and
    those rows of the weight and of each state array shaped like the weight
    (the other rows keep theirs), and any other part of the state whole (a
    step count). The update is an array shaped like ``param`` (those rows),
    or a number, added to it.
    """

    init: Callable[[Tensor], State]
    update: Callable[[Tensor, State, Tensor], tuple[Tensor, State]]

    def __repr__(self) -> str:
        """What it does and its hyperparameters (`monadl.optim._spec`)::

        GradientTransformation(chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), scale(-0.1)))
        """
        return f"GradientTransformation({spec(self)})"
