"""The adaptive scalings: per-entry step sizes from running statistics of
the gradients, each with the state it keeps: Adagrad's summed squares
(`scale_by_adagrad`), RMSprop's moving mean square (`scale_by_rms`) and
Adam's bias-corrected moments (`scale_by_adam`). The optimizers of
`monadl.optim.transforms` (``adagrad``, ``rmsprop``, ``adam``, ``adamw``)
chain them with a learning rate. (Re-exported from `monadl.optim.transforms`
and `monadl.optim`.)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from monadl._namespace import namespace
from monadl.optim._hyper import checked
from monadl.optim._torch_names import refuses_torch_names
from monadl.optim._transformation import GradientTransformation, Tensor

__all__ = ["AdagradState", "AdamState", "RmsState", "scale_by_adagrad", "scale_by_adam", "scale_by_rms"]


class AdagradState(NamedTuple):
    sum_of_squares: Tensor


@refuses_torch_names
def scale_by_adagrad(initial_accumulator: float = 0.1, eps: float = 1e-7) -> GradientTransformation:
    """Divide by the root of the summed squared gradients (Duchi et al.,
    2011): ``s <- s + g**2``, then ``g / (sqrt(s) + eps)``, ``eps`` outside
    the root as in PyTorch's ``Adagrad`` (optax's ``scale_by_rss`` puts it
    inside, ``g / sqrt(s + eps)``)."""
    initial_accumulator = checked("initial_accumulator", initial_accumulator)
    eps = checked("eps", eps)

    def update(g: Tensor, state: AdagradState, p: Tensor) -> tuple[Tensor, AdagradState]:
        total = state.sum_of_squares + g * g
        return g / (namespace(total).sqrt(total) + eps), AdagradState(total)

    return GradientTransformation(lambda p: AdagradState(namespace(p).full_like(p, initial_accumulator)), update)


class RmsState(NamedTuple):
    mean_square: Tensor


@refuses_torch_names
def scale_by_rms(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """Divide by a moving root mean square of gradients (Tieleman & Hinton, 2012)."""
    decay = checked("decay", decay, 1.0)
    eps = checked("eps", eps)

    def update(g: Tensor, state: RmsState, p: Tensor) -> tuple[Tensor, RmsState]:
        ms = decay * state.mean_square + (1 - decay) * g * g
        return g / (namespace(ms).sqrt(ms) + eps), RmsState(ms)

    return GradientTransformation(lambda p: RmsState(namespace(p).zeros_like(p)), update)


class AdamState(NamedTuple):
    step: int
    mu: Tensor
    nu: Tensor


@refuses_torch_names
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's moment estimates with bias correction (Kingma & Ba, 2015, Algorithm 1).

    ``mu <- b1 * mu + (1 - b1) * g``, ``nu <- b2 * nu + (1 - b2) * g**2``,
    and the update ``mu_hat / (sqrt(nu_hat) + eps)``, with ``mu_hat = mu /
    (1 - b1**t)`` and ``nu_hat = nu / (1 - b2**t)`` at step ``t``: ``eps``
    is added after the bias correction, as in ``torch.optim.Adam`` and
    Algorithm 1. ``torch.optim.SparseAdam`` adds it before (to ``sqrt(nu)``,
    the paper's "epsilon hat"), which is this update with ``eps /
    sqrt(1 - b2**t)`` in place of ``eps``: about 32 times ``eps`` at the
    first step, 3 times at step 100, ``eps`` again after a few thousand.
    An embedding's looked-up rows step as SparseAdam's do otherwise (the
    other rows keep their moments; the step count is the table's): to
    rounding, as SparseAdam with its ``eps`` set to ``eps * sqrt(1 -
    b2**t)`` before step ``t``. At one fixed ``eps`` the two differ where
    ``sqrt(nu_hat)`` (about ``|g|``) is not much larger than ``eps /
    sqrt(1 - b2**t)``, 3e-7 at the first step for the default: a table's
    small gradients early in training (a loss averaged over a large batch)
    can make that most of a step.

    The second moment's correction divides its root, as PyTorch's does:
    ``nu / (1 - b2 ** t)`` itself is 1,000 times ``nu`` at the first step and
    would overflow float16 from a gradient of about 256 (and float32 from
    2e19), an infinite denominator, a step of 0. ``nu`` itself still
    overflows where ``(1 - b2) * g**2`` passes the dtype's largest number: a
    gradient entry above about 8,100 in float16, 5.8e20 in float32, 4e155
    in float64 (at ``b2 = 0.999``). That entry's ``nu`` is then infinite for
    good and its step 0 at every later step, the weight finite, so no step
    is refused: it stops learning, silently, as in ``torch.optim.Adam`` and
    optax. (Refusing it would cost a pass over ``nu`` at every step of every
    weight.) ``numpy.isinf(w.state[0].nu).any()`` finds it (``adam``'s state);
    keep such gradients from float16 weights (a loss scale undone before the
    step).

    ``eps`` is added in the weight's dtype: the default 1e-8 is 0 in float16
    (its smallest normal number is 6.1e-5), and a gradient entry that is 0
    at every step so far (a dead unit) then makes 0/0, a step that is
    refused; give a float16 weight an eps it holds, such as 1e-4.

    >>> import numpy as np
    >>> opt = scale_by_adam()
    >>> u, _ = opt.update(np.float16([300.0]), opt.init(np.zeros(1, np.float16)), None)
    >>> u  # (the first step's size is 1: mu_hat / sqrt(nu_hat) = g / |g|)
    array([1.], dtype=float16)
    >>> with np.errstate(over="ignore"):
    ...     _, state = opt.update(np.float16([9000.0]), opt.init(np.zeros(1, np.float16)), None)
    >>> state.nu, opt.update(np.float16([1.0]), state, None)[0]  # (frozen: nu stays infinite)
    (array([inf], dtype=float16), array([0.], dtype=float16))
    """
    b1 = checked("b1", b1, 1.0)
    b2 = checked("b2", b2, 1.0)
    eps = checked("eps", eps)

    def update(g: Tensor, state: AdamState, p: Tensor) -> tuple[Tensor, AdamState]:
        count = state.step + 1
        if _alike(g, state.mu, state.nu):
            # The same arithmetic, in place into arrays made here: 6 weight-sized
            # arrays a step, not 12 (bit for bit the same: no cast, no broadcast).
            mu = state.mu * b1
            t = g * (1 - b1)
            mu += t
            nu = state.nu * b2
            t = g * (1 - b2)
            t *= g
            nu += t
            denominator = np.sqrt(nu)
            denominator /= math.sqrt(1 - b2**count)
            denominator += eps
            out = mu / (1 - b1**count)
            out /= denominator
            return out, AdamState(count, mu, nu)
        mu = b1 * state.mu + (1 - b1) * g
        nu = b2 * state.nu + (1 - b2) * g * g  # (in this order: (1 - b2) * g first keeps g * g from overflowing)
        mu_hat = mu / (1 - b1**count)
        denominator = namespace(nu).sqrt(nu) / math.sqrt(1 - b2**count) + eps
        return mu_hat / denominator, AdamState(count, mu, nu)

    return GradientTransformation(
        lambda p: AdamState(0, namespace(p).zeros_like(p), namespace(p).zeros_like(p)), update
    )


def _alike(g: Any, mu: Any, nu: Any) -> bool:
    """Whether ``g`` and the moments are NumPy arrays of one dtype and shape
    (and not 0-d: arithmetic makes a 0-d array a scalar, which is no buffer)."""
    return (
        type(g) is np.ndarray
        and type(mu) is np.ndarray
        and type(nu) is np.ndarray
        and g.ndim > 0
        and g.dtype == mu.dtype == nu.dtype
        and g.shape == mu.shape == nu.shape
    )
