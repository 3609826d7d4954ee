"""Gradients without a step, and a finite-difference check for any function.

`check_grads` is the helper every primitive's test uses, and the one to call
on your own differentiable functions: it compares the backward pass with
central differences in float64, through a random projection of the output,
so the whole vector-Jacobian product is checked, not only its sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, overload

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import SparseRows
from monadl.errors import OperandError
from monadl.layers._layer import Array, Expr
from monadl.layers._operation import Operation
from monadl.layers._weight import ArrayWeight, ScalarWeight, Weight
from monadl.runtime import entry
from monadl.typeclasses import as_layer

__all__ = ["check_grads", "check_grads_over_shapes", "gradients", "value_and_gradients"]


D = TypeVar("D")


@overload
async def gradients(loss: Expr[Any, Any], weights: Sequence[ArrayWeight]) -> list[Array]: ...
@overload
async def gradients(loss: Expr[Any, Any], weights: Sequence[ScalarWeight]) -> list[float]: ...
@overload
async def gradients(loss: Expr[Any, Any], weights: Sequence[ScalarWeight | ArrayWeight]) -> list[float | Array]: ...
@overload
async def gradients(loss: Expr[Any, Any], weights: Sequence[Weight[Any, Any]]) -> list[Any]: ...
async def gradients(loss: Expr[Any, Any], weights: Sequence[Weight[Any, Any]]) -> list[Any]:
    """The gradient of ``loss`` (summed, if not a scalar) for each weight,
    without changing any weight, as a dense array (an embedding table's sparse
    delta is scattered into one). A weight the loss does not reach gets zeros.
    Each is of its weight's kind: a list of array weights gives arrays, of
    scalar weights floats, of both either. For a dict of a model's weights
    pass ``list(model.values())`` (its gradients come in that order), or call
    `value_and_gradients`, which keys them by weight.

    For a step of one's own (accumulating micro-batches, clipping), take
    `value_and_gradients`: given to `monadl.optim.apply_gradients`, these
    dense gradients step an embedding table's every row (under Adam, every
    row's moments: dense Adam), not the looked-up rows alone as ``train()``
    does (lazy Adam), another algorithm.

    First order only: the gradients are data, not layers, also when taken
    inside a running ``train()`` (an ``@ml.direct`` step). A loss built
    from them has the right value, but no delta flows back through them:
    WGAN-GP's penalty on an input gradient taken here trains nothing
    (PyTorch's ``create_graph=True`` has no counterpart). As data they are
    right for an adversarial input (FGSM); for a penalty, write the input
    gradient as layers (the tour's "Coming from PyTorch").

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]))
    >>> anyio.run(gradients, ml.sum(w * w), [w])
    [array([2., 4.])]
    """
    _refuse_unless_a_loss(loss, "gradients")
    given: object = weights  # (typed a sequence; a user may pass one weight all the same)
    if isinstance(given, Expr):  # (a layer is not iterated: its message would not say what to pass)
        raise TypeError(
            f"gradients(loss, weights): weights is a list of Weights ([w] for one), got a {type(given).__name__}"
        )
    if isinstance(given, Mapping) and not all(isinstance(key, Weight) for key in given):
        # (iterated, a dict of a model's weights gave its names: 'got str among them', and no hint)
        keys = sorted({type(key).__name__ for key in given if not isinstance(key, Weight)})
        raise TypeError(
            f"gradients(loss, weights): weights is a list of Weights, got a {type(given).__name__} (keyed by "
            f"{', '.join(keys)}, which is what iterating it gives); pass its weights, list(model.values()), and "
            "the gradients come in their order (dict(zip(model, grads)) keys them by name again), or call "
            "ml.value_and_gradients(loss), which keys each gradient by its Weight"
        )
    weights = list(weights)  # (read twice below: an iterator would be used up)
    others = sorted({type(w).__name__ for w in weights if not isinstance(w, Weight)})
    if others:
        raise TypeError(f"gradients(loss, weights): weights is a list of Weights, got {', '.join(others)} among them")
    _, grads = await entry.gradients(loss)
    return [_of_weight(w, _dense(grads.get(w, namespace(w._data).zeros_like(w._data)))) for w in weights]


async def value_and_gradients(loss: Expr[D, Any]) -> tuple[D, dict[Weight[Any, Any], Any]]:
    """The value of ``loss`` (as it is: an array for an array loss) and the
    gradient of each weight it reaches (of the loss's sum, if not a scalar), as ``train()`` would step them, from one forward
    and one backward pass, without changing any weight (as JAX's
    ``value_and_grad``): what a step of one's own needs (clipping by the
    global norm, `monadl.optim.clip_by_global_norm`; accumulating over
    micro-batches), which `monadl.optim.apply_gradients` then takes as
    ``train()`` would. A weight the loss does not reach (or reaches only
    through `stop_gradient`) has no entry, since a step of zeros still moves
    Adam; an embedding table's gradient is its rows (`monadl.deltas.SparseRows`,
    ``.to_dense()`` for the array), so that only they step. The value is typed
    as ``train()``'s (a float for a scalar loss); a gradient as ``Any``, since
    a weight's may be its array, its float or its rows.
    As `gradients`', they are data: nothing differentiates through them.

    >>> import anyio, numpy as np, monadl as ml
    >>> w, frozen = ml.Weight(np.array([1.0, 2.0])), ml.Weight(np.array([3.0, 4.0]))
    >>> value, grads = anyio.run(value_and_gradients, ml.sum(w * w + ml.stop_gradient(frozen)))
    >>> float(value), grads[w], frozen in grads
    (12.0, array([2., 4.]), False)
    """
    _refuse_unless_a_loss(loss, "value_and_gradients")
    value, grads = await entry.gradients(loss)
    return value, {w: _of_weight(w, g) for w, g in grads.items()}


def _refuse_unless_a_loss(loss: object, name: str) -> None:
    """A loss that is no layer nor weight, refused by its name (an array gave
    "unhashable type: 'numpy.ndarray'", a float "'float' object has no
    attribute '_inputs'")."""
    if not isinstance(loss, Expr):
        raise OperandError(
            f"{name}: the loss is a layer or a weight, computed from the weights (ml.sum(w * x)), got a "
            f"{type(loss).__name__}: plain data has no gradient"
        )


def _dense(grad: Any) -> Any:
    return grad.to_dense() if isinstance(grad, SparseRows) else grad


def _of_weight(w: Weight[Any, Any], grad: Any) -> Any:
    """A weight's gradient of its data's kind where the rules leave either:
    a scalar weight's a NumPy scalar (a sum's, a mean's, a reshape's delta
    is a 0-d array), a 0-d array weight's a 0-d array (a batched group's
    member, or NumPy's arithmetic on 0-d arrays, gives a scalar)."""
    data = w._data
    if isinstance(data, np.generic) and type(grad) is np.ndarray and not grad.ndim:
        return grad[()]
    if type(data) is np.ndarray and not data.ndim and isinstance(grad, np.generic):
        return np.asarray(grad)
    return grad


def check_grads(
    function: Callable[..., Expr[Any, Any]],
    *args: Any,
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    seed: int = 0,
) -> None:
    """Raise `AssertionError` unless ``function``'s backward pass matches
    central finite differences at ``args``.

    Args:
        function: takes one operand per arg (plain arrays, weights or layers:
            it is called both ways; a marked cell, `monadl.operation`, on
            weights and on layers of the plain arrays) and returns a layer
            built only from primitives (no awaited effects).
        args: the point, as floats or float arrays; they are converted to
            float64.
        eps: the finite-difference step.
        rtol: relative tolerance of the comparison.
        atol: absolute tolerance of the comparison.
        seed: seeds the random projection of the output.

    >>> import numpy as np, monadl as ml
    >>> check_grads(lambda a, b: ml.tanh(a * b), np.array([0.5, -1.0]), 2.0)
    """
    for a in args:
        given: object = a
        if isinstance(given, Expr):  # (NumPy said 'setting an array element with a sequence')
            raise TypeError(
                f"check_grads: the point is floats or float arrays (function is called on them and on weights "
                f"made from them), got a {type(given).__name__}; pass its value (w.data, await layer.predict())"
            )
    point = [np.asarray(a, dtype=np.float64) for a in args]
    # A marked cell refuses plain data that its operators would compute on (its trace would keep the
    # result): it gets the point as layers. Other functions get plain data, which some compute on apart.
    data = as_layer if isinstance(function, Operation) else _plain
    try:
        probe = _value(function(*map(data, point)))
    except OperandError:
        if data is as_layer:
            raise
        data = as_layer  # (a marked cell behind a wrapper: a lambda, a partial)
        probe = _value(function(*map(data, point)))
    projection = np.random.default_rng(seed).standard_normal(np.shape(probe))

    def scalar(*operands: Any) -> Any:
        out = function(*operands)
        return (out * projection).sum() if np.ndim(probe) else out * projection

    weights = [Weight(p.copy() if p.ndim else p[()]) for p in point]
    _, grads = entry.gradients_sync(scalar(*weights))
    for i, p in enumerate(point):
        analytic = np.asarray(_dense(grads.get(weights[i], np.zeros_like(p))), dtype=np.float64)
        numeric = np.zeros_like(p)
        for j in np.ndindex(p.shape):
            up, down = [q.copy() for q in point], [q.copy() for q in point]
            up[i][j] += eps
            down[i][j] -= eps
            hi = float(_value(scalar(*(data(u if u.ndim else u[()]) for u in up))))
            lo = float(_value(scalar(*(data(d if d.ndim else d[()]) for d in down))))
            numeric[j] = (hi - lo) / (2 * eps)
        if analytic.shape != p.shape or not np.allclose(analytic, numeric, rtol=rtol, atol=atol):
            raise AssertionError(
                f"gradient of argument {i} (shape {p.shape}) disagrees with finite differences:\n"
                f"backward: {analytic}\nnumeric:  {numeric}"
            )


def _plain(data: Any) -> Any:
    return data


def _value(result: Any) -> Any:
    """The forward value of a layer; plain data (a function of constants only) as is."""
    return entry.predict_sync(result) if isinstance(result, Expr) else result


def check_grads_over_shapes(
    function: Callable[..., Expr[Any, Any]],
    shapes: Iterable[Sequence[tuple[int, ...]]],
    *,
    low: float = -2.0,
    high: float = 2.0,
    seed: int = 0,
    **tolerances: float,
) -> int:
    """`check_grads` at random points for each tuple of argument shapes in a
    table (include broadcasting pairs); returns how many cases were checked.

    >>> import monadl as ml
    >>> check_grads_over_shapes(lambda a, b: a * b, [[(3,), (3,)], [(2, 3), (3,)], [(2, 1), ()]])
    3
    """
    rng = np.random.default_rng(seed)
    count = 0
    for case in shapes:
        args = [rng.uniform(low, high, size=s) for s in case]
        try:
            check_grads(function, *args, seed=seed, **tolerances)
        except AssertionError as exc:
            raise AssertionError(f"shapes {list(case)}: {exc}") from None
        count += 1
    return count
