"""Gradient transformations: optimizers as `(init, update)` pairs, composed with `chain` (after optax).

A `GradientTransformation` is ``(init, update)``: ``init(param)`` makes the
state for one weight; ``update(grad, state, param)`` returns the update to add
to the parameter and the new state. Nothing is mutated, so a failed step can
be thrown away whole. ``adam`` is ``chain(scale_by_adam(...),
scale_by_learning_rate(lr))``.

Here: `chain`, the building blocks (a rate, momentum, weight decay) and the
usual optimizers built from them. The type itself is in
`monadl.optim._transformation`, the adaptive scalings (Adagrad's, RMSprop's,
Adam's, with their states) in `monadl.optim._adaptive`; both re-exported here.

>>> import numpy as np
>>> opt = sgd(0.1)
>>> state = opt.init(np.zeros(2))
>>> update, state = opt.update(np.array([1.0, -2.0]), state, np.zeros(2))
>>> update
array([-0.1,  0.2])
"""

from __future__ import annotations

import inspect
from typing import Final, final

from monadl._namespace import namespace
from monadl.optim._adaptive import AdagradState, AdamState, RmsState, scale_by_adagrad, scale_by_adam, scale_by_rms
from monadl.optim._hyper import Rate, checked, finite, valid_rate
from monadl.optim._schedules import Schedule
from monadl.optim._torch_names import refuses_torch_names
from monadl.optim._transformation import GradientTransformation, State, Tensor

__all__ = [
    "AdagradState",
    "AdamState",
    "GradientTransformation",
    "RmsState",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "add_l1_decay",
    "chain",
    "momentum",
    "nesterov",
    "rmsprop",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "sgd",
    "trace",
]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations one after another; the state is their tuple.

    >>> opt = chain(trace(0.9), scale_by_learning_rate(0.1))
    >>> len(opt.init(0.0))
    2
    """
    if not transforms:  # (its update is the gradient, which a step adds: w went 0 -> 2, up the gradient)
        raise TypeError(
            "chain() of no transformations would add the gradient to the weight (an ascent): give at least one, "
            "a rate last (chain(trace(0.9), scale_by_learning_rate(0.1)), or sgd(0.1), adam(1e-3))"
        )
    for position, transform in enumerate(transforms, 1):  # (here, not at Weight(...): 'no attribute init')
        if not (callable(getattr(transform, "init", None)) and callable(getattr(transform, "update", None))):
            raise TypeError(f"chain: {refusal(transform, f'argument {position}')}")

    def init(param: Tensor) -> State:
        return tuple(t.init(param) for t in transforms)

    def update(grad: Tensor, state: State, param: Tensor) -> tuple[Tensor, State]:
        new_state = []
        for t, s in zip(transforms, state):
            grad, s = t.update(grad, s, param)
            new_state.append(s)
        return grad, tuple(new_state)

    return GradientTransformation(init, update)


def refusal(value: object, what: str) -> str:
    """Why ``value``, given as ``what`` (``"argument 2"``), is no optimizer, and what to write instead.

    >>> refusal(sgd, "optimizer")
    'optimizer is the function sgd, not called: call it, as in sgd(learning_rate)'
    """
    name = getattr(value, "__name__", None)
    if callable(value) and name == "clip_by_global_norm":  # (optax's habit: chain(clip_by_global_norm(1.0), adam(...)))
        return (
            f"{what} is clip_by_global_norm, which clips the gradients of all weights together, not one weight's "
            "step: clipping by the global norm is done with ml.value_and_gradients(loss), then "
            "ml.optim.clip_by_global_norm(gradients, max_norm), then ml.optim.apply_gradients(...) "
            '(the tour\'s "Coming from PyTorch")'
        )
    if callable(value) and isinstance(name, str) and str(getattr(value, "__module__", "")).startswith("monadl.optim"):
        needed = [p.name for p in inspect.signature(value).parameters.values() if p.default is p.empty]
        return f"{what} is the function {name}, not called: call it, as in {name}({', '.join(needed)})"
    kind = f"the function {name}" if callable(value) and name else f"{type(value).__name__} {value!r}"
    return (
        f"{what} is {kind}, not a GradientTransformation: an optimizer such as ml.optim.sgd(0.1), "
        "or GradientTransformation(init, update)"
    )


# ---- building blocks --------------------------------------------------------------
def scale(factor: float) -> GradientTransformation:
    """Multiply the update by a constant.

    >>> import numpy as np
    >>> scale(2.0).update(np.array([1.0, -0.5]), None, None)
    (array([ 2., -1.]), None)
    """
    if not finite(factor):
        raise ValueError(f"scale: the factor must be a finite number, got {factor!r}")
    return GradientTransformation(lambda p: None, Scale(float(factor)))


@final
class Scale:
    """The update of `scale`: ``g * factor``, stateless.

    A class rather than a closure so that the commit can tell it apart: plain
    SGD with a constant rate (the most common optimizer) then scales a
    gradient that nothing else refers to in place and adds the weight into it,
    without a temporary the size of the weight (see `monadl.optim.apply`).
    """

    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        self.factor: Final = factor

    def __call__(self, g: Tensor, state: State, p: Tensor) -> tuple[Tensor, State]:
        return g * self.factor, state


def scale_by_learning_rate(learning_rate: Rate | Schedule) -> GradientTransformation:
    """Multiply by ``-learning_rate`` (descent), a constant or a schedule of the step.

    A rate must be finite and >= 0 (0 freezes a weight, as in PyTorch and
    optax); a schedule's rates are checked at each step, so a schedule that
    goes negative fails that step (and changes no weight) instead of ascending.

    >>> scale_by_learning_rate(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: learning_rate must be a finite number >= 0, got nan
    """
    if callable(learning_rate):
        schedule = learning_rate

        def update(g: Tensor, step: int, p: Tensor) -> tuple[Tensor, int]:
            rate = schedule(step)
            if not valid_rate(rate):
                raise ValueError(
                    f"the learning-rate schedule gave {rate!r} at step {step}; a rate must be finite and >= 0"
                )
            return g * -float(rate), step + 1

        return GradientTransformation(lambda p: 0, update)
    return scale(-checked("learning_rate", learning_rate))


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: a decaying sum of past gradients (Polyak 1964; Nesterov 1983
    in the form of Sutskever et al. 2013 when ``nesterov``)."""
    decay = checked("decay", decay, 1.0)

    def update(g: Tensor, velocity: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        velocity = g + decay * velocity
        return (g + decay * velocity if nesterov else velocity), velocity

    return GradientTransformation(lambda p: namespace(p).zeros_like(p), update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """L2 decay: add ``weight_decay * param`` to the gradient (PyTorch's
    ``weight_decay=`` of SGD and Adam). A sparse gradient (an embedding's
    looked-up rows) steps those rows only, so only they decay, as in lazy
    Adam."""
    weight_decay = checked("weight_decay", weight_decay)
    return GradientTransformation(lambda p: None, lambda g, s, p: (g + weight_decay * p, s))


def add_l1_decay(l1: float) -> GradientTransformation:
    """L1 decay: add ``l1 * sign(param)`` to the gradient (a subgradient of ``l1 * |param|``)."""
    l1 = checked("l1", l1)
    return GradientTransformation(lambda p: None, lambda g, s, p: (g + l1 * namespace(p).sign(p), s))


# ---- the usual optimizers ------------------------------------------------------------
@refuses_torch_names
def sgd(learning_rate: Rate | Schedule) -> GradientTransformation:
    """Plain stochastic gradient descent: ``p <- p - lr_t * g``, ``lr_t``
    the rate, or the schedule at the weight's step count (``torch.optim.SGD``)."""
    return scale_by_learning_rate(learning_rate)


@refuses_torch_names
def momentum(learning_rate: Rate | Schedule, decay: float = 0.9) -> GradientTransformation:
    """SGD with heavy-ball momentum (Polyak), as ``torch.optim.SGD(momentum=decay)``:
    ``v <- decay * v + g``, ``p <- p - lr_t * v``, ``v`` from 0.

    The rate scales the velocity as it is spent, not as it is gathered
    (Sutskever et al.'s ``v <- decay * v - lr * g``, ``p <- p + v``): the
    same steps at a constant rate, others once a schedule changes it."""
    return chain(trace(decay), scale_by_learning_rate(learning_rate))


@refuses_torch_names
def nesterov(learning_rate: Rate | Schedule, decay: float = 0.9) -> GradientTransformation:
    """SGD with Nesterov momentum, as ``torch.optim.SGD(momentum=decay,
    nesterov=True)``: ``v <- decay * v + g``, ``p <- p - lr_t * (g + decay * v)``."""
    return chain(trace(decay, nesterov=True), scale_by_learning_rate(learning_rate))


@refuses_torch_names
def adagrad(
    learning_rate: Rate | Schedule, initial_accumulator: float = 0.1, eps: float = 1e-7
) -> GradientTransformation:
    """Adagrad (Duchi et al., 2011): ``s <- s + g**2``, ``p <- p - lr_t * g
    / (sqrt(s) + eps)``, PyTorch's update (``eps`` outside the root), with
    optax's defaults: ``s`` starts at 0.1 and ``eps`` is 1e-7 (PyTorch's
    ``Adagrad``: 0 and 1e-10; pass those to match it exactly).

    optax's ``adagrad`` puts ``eps`` inside the root, ``g / sqrt(s + eps)``:
    with the defaults the two steps differ by about 1e-7 relative, but with
    ``s`` starting at 0 and gradients near ``sqrt(eps)`` they part (a
    first step of -0.999 here, -0.30 in optax's, for a gradient of 1e-4)."""
    return chain(scale_by_adagrad(initial_accumulator, eps), scale_by_learning_rate(learning_rate))


@refuses_torch_names
def rmsprop(learning_rate: Rate | Schedule, decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """RMSprop (Tieleman & Hinton, 2012), with optax's defaults: ``decay``
    0.9 (PyTorch's ``RMSprop``: ``alpha=0.99``; pass ``decay=0.99`` to match
    it); ``eps`` is added to the root, as PyTorch adds it."""
    return chain(scale_by_rms(decay, eps), scale_by_learning_rate(learning_rate))


@refuses_torch_names
def adam(
    learning_rate: Rate | Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformation:
    """Adam (Kingma & Ba, 2015), as ``torch.optim.Adam``: ``p <- p - lr_t *
    mu_hat / (sqrt(nu_hat) + eps)``, the bias-corrected moments of `scale_by_adam`.

    >>> import numpy as np
    >>> opt = adam(0.1)
    >>> u, _ = opt.update(np.array([3.0]), opt.init(np.zeros(1)), np.zeros(1))
    >>> np.round(u, 6)  # the first bias-corrected step has size lr
    array([-0.1])
    """
    return chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate))


@refuses_torch_names
def adamw(
    learning_rate: Rate | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """Adam with decoupled weight decay (``torch.optim.AdamW``, optax's
    ``adamw``): ``p <- p - lr_t * (mu_hat / (sqrt(nu_hat) + eps) +
    weight_decay * p)``. The decay is added to Adam's scaled step, not to the
    gradient, so it is not divided by Adam's running scale;
    ``chain(add_decayed_weights(wd), adam(lr))`` is Adam with L2 instead
    (PyTorch's ``Adam(weight_decay=)``).

    >>> import numpy as np
    >>> opt = adamw(0.1, weight_decay=0.5)
    >>> u, _ = opt.update(np.array([3.0]), opt.init(np.ones(1)), np.ones(1))
    >>> np.round(u, 6)  # -lr * (Adam's first step of size 1 + wd * param)
    array([-0.15])
    """
    return chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))
