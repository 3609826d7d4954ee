"""Estimate and replace (Jacovi et al., 2019, "Estimate and Replace", EstiNet):
train through a differentiable estimator of a black-box function, call the
real black box at inference.

`estimate_and_replace` is the layer combinator: in training mode it is the
estimator applied to the arguments (so the argument extractor learns through
it); in inference mode it awaits the arguments' values (hardened: argmax one-
hots for discrete arguments), calls the black box, and gives its result as a
constant. `gumbel_softmax` makes discrete arguments: one-hot in the forward
pass, the softmax's gradient in the backward pass (straight-through).
`entropy_penalty` keeps the extractor's distributions confident;
`diversity_penalty` keeps a batch of them from collapsing onto a few
classes. The two losses of the method, one for the estimator's parameters
(fit the black box's own outputs) and one for the extractor's (the task),
stay on disjoint parameter sets: build the task loss with `frozen` estimator
weights.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from monadl.direct import direct, values
from monadl.errors import ShapeError
from monadl.layers._axis_functions import mean, softmax, sum
from monadl.layers._functions import apply_primitive, log, relu, stop_gradient
from monadl.layers._layer import Array, ArrayLayer, ArrayOperand, Expr, Layer, ScalarLayer
from monadl.layers._site import caller_site, site_text
from monadl.layers._weight import Weight
from monadl.typeclasses.deep_learning import as_layer

D = TypeVar("D")
G = TypeVar("G")

__all__ = [
    "Sampling",
    "diversity_penalty",
    "entropy_penalty",
    "estimate_and_replace",
    "estimator_loss",
    "frozen",
    "gumbel_softmax",
    "harden",
    "label_smoothing",
    "squared_error",
]


def gumbel_softmax(
    logits: ArrayOperand, temperature: float, rng: np.random.Generator, *, hard: bool = True, axis: int = -1
) -> ArrayLayer:
    """A sample from the Gumbel-softmax relaxation of ``softmax(logits)``.

    With ``hard``, the forward value is the one-hot argmax of the sample and
    the backward pass is the relaxed sample's (straight-through).

    >>> import anyio, numpy as np
    >>> sample = gumbel_softmax(np.array([[0.0, 9.0, 0.0]]), 1.0, np.random.default_rng(0))
    >>> anyio.run(sample.predict)  # one-hot, almost surely the largest logit
    array([[0., 1., 0.]])
    """
    if not temperature > 0:  # (NaN too: every sample would be NaN)
        raise ValueError(f"temperature must be positive, got {temperature}")

    @direct
    async def sample(logits: ArrayLayer) -> ArrayLayer:
        (scores,) = await values(logits)
        noise = -np.log(-np.log(rng.uniform(1e-12, 1.0, np.shape(scores))))
        soft = softmax((logits + noise.astype(np.asarray(scores).dtype)) * (1.0 / temperature), axis=axis)
        if not hard:
            return soft
        (soft_value,) = await values(soft)
        one_hot = harden(soft_value, axis)
        return soft - stop_gradient(soft) + one_hot

    return sample(as_layer(logits))


def harden(probabilities: Array, axis: int = -1) -> Array:
    """One-hot of the argmax along ``axis``.

    >>> import numpy as np
    >>> harden(np.array([[0.2, 0.7, 0.1]]))
    array([[0., 1., 0.]])
    """
    if np.ndim(probabilities) == 0:
        raise ValueError(
            f"harden: a one-hot needs a distribution over classes along an axis; got a scalar "
            f"({type(probabilities).__name__}): a discrete argument is a probability vector"
        )
    index = np.argmax(probabilities, axis=axis)
    one_hot: Array = np.moveaxis(np.eye(probabilities.shape[axis], dtype=probabilities.dtype)[index], -1, axis)
    return one_hot


def entropy_penalty(probabilities: ArrayOperand, threshold: float, axis: int = -1) -> ScalarLayer:
    """Mean of ``max(entropy - threshold, 0)`` over the distributions along ``axis``:
    a confidence regulariser that leaves already-confident outputs alone.

    >>> import anyio, numpy as np
    >>> uniform, certain = np.full((1, 4), 0.25), np.array([[1.0, 0.0, 0.0, 0.0]])
    >>> round(float(anyio.run(entropy_penalty(uniform, 0.5).predict)), 4)  # log(4) - 0.5
    0.8863
    >>> float(anyio.run(entropy_penalty(certain, 0.5).predict))
    0.0
    """
    p = as_layer(probabilities)

    entropy = -sum(p * log(p + 1e-12), axis=axis)
    return mean(relu(entropy - threshold))


def diversity_penalty(probabilities: ArrayOperand, axis: int = -1) -> ScalarLayer:
    """``log(n) - entropy(mean distribution)``, the mean taken over every axis
    but ``axis`` (the n classes): zero when a batch of distributions uses the
    classes equally, ``log(n)`` when all of them pick one class. The diversity
    half of regularised information maximisation (Krause et al., 2010).

    Why: trained through an estimator alone, an argument extractor can stop
    choosing some classes; the softmax's gradient for a class vanishes with its
    probability, so nothing brings a dead class back. Where the arguments are
    known to be spread over the classes (the estimator was pre-trained on
    uniformly drawn ones), a small weight of this term keeps every class alive.

    >>> import anyio, numpy as np
    >>> spread, collapsed = np.eye(4), np.tile([1.0, 0.0, 0.0, 0.0], (4, 1))
    >>> round(float(anyio.run(diversity_penalty(spread).predict)), 4)
    0.0
    >>> round(float(anyio.run(diversity_penalty(collapsed).predict)), 4)  # log(4)
    1.3863
    """

    @direct
    async def penalty(p: ArrayLayer) -> ScalarLayer:
        (value,) = await values(p)
        shape = np.shape(value)
        if not shape or 0 in shape:  # (log(n) minus the entropy of a mean of nothing: NaN)
            raise ShapeError(
                f"diversity_penalty: the distributions have shape {shape}; it needs at least one, over classes"
            )
        classes, others = shape[axis], tuple(a for a in range(len(shape)) if a != axis % len(shape))
        marginal = mean(p, axis=others) if others else p
        return float(np.log(classes)) + sum(marginal * log(marginal + 1e-12))

    return penalty(as_layer(probabilities))


def label_smoothing(targets: Array, amount: float, axis: int = -1) -> Array:
    """Move ``amount`` of each target distribution's mass to the uniform one.

    >>> import numpy as np
    >>> label_smoothing(np.array([[1.0, 0.0]]), 0.2)
    array([[0.9, 0.1]])
    """
    if not 0 <= amount < 1:
        raise ValueError(f"amount must be in [0, 1), got {amount}")
    classes = targets.shape[axis]
    smoothed: Array = targets * (1 - amount) + amount / classes
    return smoothed


def frozen(weights: Sequence[Weight[D, G]]) -> list[Layer[D, G]]:
    """The weights' values as layers through which no delta flows: use them to
    build the task loss, so only the extractor's parameters learn from it.

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]))
    >>> (still,) = frozen([w])
    >>> anyio.run(ml.gradients, ml.sum(still * w), [w])  # only the unfrozen use
    [array([1., 2.])]
    """
    layers: list[Layer[D, G]] = [
        apply_primitive("stop_gradient", (w,)) for w in weights
    ]  # stop_gradient, typed generically
    return layers


def estimate_and_replace(
    black_box: Callable[..., Any],
    estimator: Callable[..., Expr[Any, Any]],
    arguments: Sequence[Expr[Any, Any]],
    *,
    training: bool,
    harden_arguments: bool = True,
) -> Layer[Any, Any]:
    """The estimator in training, the black box at inference.

    Args:
        black_box: a plain function of the arguments' values (arrays), or
            an async one (a remote service: the examples' calls overlap);
            one that blocks holds the event loop, so wrap a slow one with
            ``anyio.to_thread.run_sync``.
        estimator: a differentiable function of the argument layers.
        arguments: the layers that produce the black box's arguments
            (probability vectors for discrete arguments).
        training: which of the two to use. At inference the black box's
            answer (numbers: booleans, integers or floats) is taken in the
            arguments' float dtype, as the estimator's would be, and in the
            shape it comes in: give the estimator's (an ``(n, 1)`` column
            where the estimator gives ``(n,)`` broadcasts in what follows).
        harden_arguments: at inference, turn each argument (a probability
            vector along its last axis; another is refused) into the one-hot
            of its argmax before calling the black box; False passes the
            arguments' values as they are (a real-valued argument), NumPy
            arrays as read-only views, as `monadl.values` gives them.

    >>> import anyio, numpy as np, monadl as ml
    >>> digit = ml.as_layer(np.array([0.1, 0.7, 0.2]))  # probabilities of 0, 1, 2
    >>> value = lambda p: p @ np.array([0.0, 1.0, 2.0])
    >>> float(anyio.run(estimate_and_replace(value, value, [digit], training=True).predict))  # the estimate
    1.1
    >>> float(anyio.run(estimate_and_replace(value, value, [digit], training=False).predict))  # the black box
    1.0
    """
    if training:
        return as_layer(estimator(*arguments))
    layers = [a if isinstance(a, Expr) else as_layer(a) for a in arguments]  # (data: an array read as it is)

    @direct
    async def replaced() -> Layer[Any, Any]:
        given = await values(*layers)
        if harden_arguments:
            given = tuple(harden(_distribution(i, np.asarray(v))) for i, v in enumerate(given))
        result = black_box(*given)
        if inspect.isawaitable(result):
            result = await result
        return as_layer(_as_float(_numbers(black_box, result), given))

    return replaced()


def _distribution(i: int, p: Array) -> Array:
    """``p`` where its rows (along the last axis) are probability vectors,
    as `harden` takes: finite, in [0, 1], each summing to 1 (to 1e-3, a
    float32 softmax's rounding); else a ValueError that says what to pass
    (a real-valued argument hardened to a one-hot was a wrong answer, and a
    NaN one looked valid)."""
    if p.ndim and p.dtype.kind in "fciub":  # (integers and booleans too: labels are no distribution)
        with np.errstate(invalid="ignore"):
            ok = bool(np.all(np.isfinite(p)) and np.all((p >= 0) & (p <= 1)))
            ok = ok and bool(np.all(np.abs(np.sum(p, axis=-1) - 1) <= 1e-3))
        if not ok:
            raise ValueError(
                f"estimate_and_replace: argument {i} is no probability vector along its last axis (values "
                f"finite, in [0, 1], each row summing to 1), so harden_arguments cannot make it a one-hot; a "
                f"real-valued argument goes to the black box as it is with harden_arguments=False"
            )
    return p


def _as_float(value: Array, given: tuple[Any, ...]) -> Array:
    """A black box's numbers in the arguments' float dtype, the estimator's
    (float32 arguments give float32: the layers after it take no float64);
    without float arguments, its own float dtype, or float64."""
    floats = [np.asarray(v).dtype for v in given if np.asarray(v).dtype.kind == "f"]
    if floats:
        return value.astype(np.result_type(*floats), copy=False)
    return value if value.dtype.kind == "f" else value.astype(np.float64)


def _numbers(black_box: Callable[..., Any], result: Any) -> Array:
    """A black box's result as an array of numbers (booleans, integers or
    floats); a TypeError naming the black box where it gave none (None, from
    a missing return, became a NaN; a string of digits became its number)."""
    try:
        value = None if result is None or isinstance(result, (str, bytes)) else np.asarray(result)
        if value is not None and value.dtype.kind == "O":  # (Decimal, Fraction, an int past 64 bits: as floats)
            value = np.asarray(result, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or value.dtype.kind not in "biuf":
        what = "a coroutine (an async function's result, not awaited)" if inspect.iscoroutine(result) else ""
        if value is not None:  # (complex, dates, ...: say which)
            what = f"{type(result).__name__} of dtype {value.dtype}"
        if inspect.iscoroutine(result):
            result.close()  # (no 'never awaited' warning besides the error)
        raise TypeError(
            f"the black box {getattr(black_box, '__qualname__', black_box)!r} returned "
            f"{what or type(result).__name__}, not numbers" + (" (a missing return?)" if result is None else "")
        )
    return value


# ---- training the estimator ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sampling:
    """Where the black-box estimator's training inputs come from (the paper's
    three training procedures, section 3.1.2).

    * ``offline``: fit the estimator first on samples of a given input
      distribution, then freeze it while the argument extractor trains;
    * ``online``: no pre-training; the estimator learns alongside the
      extractor, from the extractor's own (hardened) outputs, labelled by the
      black box (the cold start: early outputs are poor inputs to learn from);
    * ``hybrid``: offline first, then online, without freezing.

    >>> [(s.pretrain, s.online_updates) for s in (Sampling.offline(), Sampling.online(), Sampling.hybrid())]
    [(True, False), (False, True), (True, True)]
    """

    pretrain: bool
    online_updates: bool

    @classmethod
    def offline(cls) -> Sampling:
        return cls(pretrain=True, online_updates=False)

    @classmethod
    def online(cls) -> Sampling:
        return cls(pretrain=False, online_updates=True)

    @classmethod
    def hybrid(cls) -> Sampling:
        return cls(pretrain=True, online_updates=True)

    @property
    def name(self) -> str:
        return {(True, False): "offline", (False, True): "online", (True, True): "hybrid"}.get(
            (self.pretrain, self.online_updates), "none"
        )


def squared_error(prediction: ArrayOperand, target: Array) -> ScalarLayer:
    """Mean squared difference: the default black-box loss, for regression outputs.

    The prediction must have the target's shape: an estimator's ``(n, 1)``
    column against a black box's ``(n,)`` outputs would broadcast to ``(n,
    n)`` pairs and fit the wrong numbers, so it raises `monadl.ShapeError`
    when the layer runs (reshape one of them).

    >>> import anyio, numpy as np
    >>> float(anyio.run(squared_error(np.array([1.0, 3.0]), np.array([0.0, 1.0])).predict))
    2.5
    """
    wanted = tuple(getattr(target, "shape", np.shape(target)))  # (a CuPy target keeps its device)
    site = caller_site()  # (its text only for the error)

    @direct
    async def difference(prediction: ArrayLayer) -> ArrayLayer:
        (value,) = await values(prediction)
        if tuple(np.shape(value)) != wanted:
            raise ShapeError(
                f"squared_error at {site_text(site)}: the prediction has shape {tuple(np.shape(value))}, the target "
                f"{wanted}; they must be equal (reshape one: broadcasting them would pair every prediction with "
                "every target)"
            )
        return prediction - target

    d = difference(as_layer(prediction))
    return mean(d * d)


def estimator_loss(
    black_box: Callable[..., Any],
    estimator: Callable[..., Expr[Any, Any]],
    arguments: Sequence[Array],
    loss: Callable[[Any, Array], ScalarLayer] = squared_error,
) -> ScalarLayer:
    """The black-box loss: ``loss(estimator(*arguments), black_box(*arguments))``
    on plain ``arguments`` (batched along the first axis). It reaches only the
    estimator's weights: the arguments are data, whether sampled offline or
    taken from the extractor (online). ``loss`` is `squared_error` for a
    regression, `monadl.cross_entropy` for a black box that gives class labels.
    An async black box is awaited when the loss is evaluated.

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.zeros(3), optimizer=ml.optim.sgd(0.5))
    >>> one_hots = np.eye(3)
    >>> for _ in range(50):
    ...     _ = anyio.run(estimator_loss(lambda p: p @ [1.0, 2.0, 3.0], lambda p: p @ w, [one_hots]).train)
    >>> np.round(w.data, 3)
    array([1., 2., 3.])
    """
    if inspect.iscoroutinefunction(black_box):  # called, and awaited, in each evaluation of the loss

        @direct
        async def called() -> ScalarLayer:
            return loss(estimator(*arguments), _numbers(black_box, await black_box(*arguments)))

        return called()
    result = black_box(*arguments)
    if inspect.iscoroutine(result):  # (a plain function that makes one, `anyio.to_thread.run_sync`'s): one each run
        result.close()  # (a coroutine is awaited once: the loss trained twice raised "cannot reuse")

        @direct
        async def again() -> ScalarLayer:
            return loss(estimator(*arguments), _numbers(black_box, await black_box(*arguments)))

        return again()
    if inspect.isawaitable(result):  # (a Future, a Task: awaited once, its result kept)

        @direct
        async def awaited() -> ScalarLayer:
            return loss(estimator(*arguments), _numbers(black_box, await result))

        return awaited()
    return loss(estimator(*arguments), _numbers(black_box, result))
