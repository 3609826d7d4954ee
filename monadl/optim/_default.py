"""The optimizer a `Weight` built without ``optimizer=`` gets, and `using_default` to choose it for a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from monadl._scope import entered_only
from monadl.optim.transforms import GradientTransformation, refusal, sgd

__all__ = ["DEFAULT_LEARNING_RATE", "default_optimizer", "using_default"]

DEFAULT_LEARNING_RATE = 0.0005
"""The learning rate of the default optimizer, plain SGD (the paper's first listing)."""

_default: ContextVar[GradientTransformation | None] = ContextVar("monadl_default_optimizer", default=None)


def default_optimizer() -> GradientTransformation:
    """What a `Weight` built without ``optimizer=`` gets: ``sgd(0.0005)``,
    unless `using_default` says otherwise."""
    chosen = _default.get()
    return sgd(DEFAULT_LEARNING_RATE) if chosen is None else chosen


@entered_only("ml.optim.using_default(...)")
@contextmanager
def using_default(optimizer: GradientTransformation) -> Iterator[None]:
    """Weights built inside the block default to ``optimizer``.

    >>> import numpy as np, monadl as ml
    >>> with using_default(ml.optim.adam(1e-3)):
    ...     w = ml.Weight(np.zeros(3))
    >>> len(w.optimizer.init(np.zeros(3)))  # adam's chain: two states
    2
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"ml.optim.using_default: {refusal(optimizer, 'the optimizer')}")
    token = _default.set(optimizer)
    try:
        yield
    finally:
        _default.reset(token)
