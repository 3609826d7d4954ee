"""The limit of `benchmarks.gated_routing` in NumPy: the routed mixture of
experts batched by hand across its examples' choices, its backward written
by hand, and Adam, with the kernels monadl calls (NumPy's OpenBLAS, each
product by `monadl.layers._products.product`) and no graph at all.

At each routed layer the gates of all examples are one product; then the
examples are grouped by the expert their own scores chose, and each
expert's group is one product (and one for its weight's delta, one for the
delta to its input). `Model.example` is the same model written plainly for
one example: a step per example with it against one batched step is what
batching by hand buys with these kernels, the limit of monadl's fibers
against one ``train()`` per example. As monadl, Adam steps only the weights
that a step reached (an expert no example chose keeps its weights, its
moments and its step count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import numpy as np

from benchmarks._adam_numpy import adam
from benchmarks._shift_reduce_numpy import _cross_entropy
from monadl.layers._products import product

if TYPE_CHECKING:
    from benchmarks.gated_routing import Router

Array = Any  # (NumPy arrays of the weights' dtype)


def names(layers: int, experts: int) -> list[str]:
    """The weights' names in the order of `benchmarks.gated_routing.Router.weights`."""
    found: list[str] = []
    for layer in range(layers):
        found += [f"gate{layer}", f"gate{layer}_bias"]
        for e in range(experts):
            found += [f"expert{layer}_{e}", f"expert{layer}_{e}_bias"]
    return [*found, "head", "head_bias"]


def weights_of(router: Router) -> dict[str, Array]:
    """A copy of a monadl router's weights, by name."""
    weights = router.weights()
    return {
        name: np.array(w.data)
        for name, w in zip(names(len(router.gates), len(router.experts[0])), weights, strict=True)
    }


@dataclass(frozen=True, slots=True)
class _Layer:
    """What one routed layer's forward keeps for its backward: its input,
    the gates' scores, and per expert chosen, its examples' rows and tanh."""

    h: Array
    scores: Array
    groups: list[tuple[int, Array, Array]]


@final
class Model:
    """The weights, their Adam moments, and a batch's forward and backward by hand."""

    def __init__(self, weights: dict[str, Array], learning_rate: float = 0.0) -> None:
        self.w = {k: v.copy() for k, v in weights.items()}
        self.layers = sum(k.startswith("gate") and not k.endswith("_bias") for k in self.w)
        self.experts = sum(k.startswith("expert0_") and not k.endswith("_bias") for k in self.w)
        self.rate = learning_rate
        self.moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in self.w.items()}
        self.steps = dict.fromkeys(self.w, 0)

    def loss_and_gradients(self, x: Array, labels: Array) -> tuple[float, dict[str, Array]]:
        """The batch's mean loss, and the gradients of the weights it reached."""
        w, b = self.w, len(labels)
        h = x
        tape: list[_Layer] = []
        for layer in range(self.layers):
            scores = _softmax(product(h, w[f"gate{layer}"]) + w[f"gate{layer}_bias"])
            chosen = scores.argmax(axis=1)
            out = np.empty((b, w[f"expert{layer}_0"].shape[1]), dtype=h.dtype)
            groups = []
            for e in range(self.experts):
                rows = np.flatnonzero(chosen == e)
                if len(rows):
                    name = f"expert{layer}_{e}"
                    t = np.tanh(product(h[rows], w[name]) + w[f"{name}_bias"])
                    out[rows] = scores[rows, e : e + 1] * t
                    groups.append((e, rows, t))
            tape.append(_Layer(h, scores, groups))
            h = out
        nll, d_logits = _cross_entropy(product(h, w["head"]) + w["head_bias"], labels)
        d_logits /= b
        grads = {"head": product(h.T, d_logits), "head_bias": d_logits.sum(axis=0)}
        delta = product(d_logits, w["head"].T)
        for layer in reversed(range(self.layers)):
            step = tape[layer]
            d_in = np.zeros_like(step.h) if layer else None  # (the digits need no delta)
            d_scores = np.zeros_like(step.scores)
            for e, rows, t in step.groups:
                name = f"expert{layer}_{e}"
                d = delta[rows]
                d_scores[rows, e] = (d * t).sum(axis=1)
                d_pre = d * step.scores[rows, e : e + 1] * (1.0 - t * t)
                grads[name] = product(step.h[rows].T, d_pre)
                grads[f"{name}_bias"] = d_pre.sum(axis=0)
                if d_in is not None:
                    d_in[rows] = product(d_pre, w[name].T)  # (the groups' rows are disjoint)
            d_z = step.scores * (d_scores - (d_scores * step.scores).sum(axis=1, keepdims=True))
            grads[f"gate{layer}"] = product(step.h.T, d_z)
            grads[f"gate{layer}_bias"] = d_z.sum(axis=0)
            if d_in is not None:
                d_in += product(d_z, w[f"gate{layer}"].T)
                delta = d_in
        return float(nll.sum() / b), grads

    def example(self, x: Array, label: int) -> tuple[float, dict[str, Array]]:
        """One example's loss and gradients, written plainly: a row through
        each layer's gate and its chosen expert, no groups, no index arrays.
        (`loss_and_gradients` of a batch of one computes the same, paying a
        batch's bookkeeping.)"""
        w = self.w
        h = x[None]
        tape: list[tuple[Array, Array, int, Array]] = []
        for layer in range(self.layers):
            scores = _softmax(product(h, w[f"gate{layer}"]) + w[f"gate{layer}_bias"])
            e = int(scores[0].argmax())
            name = f"expert{layer}_{e}"
            t = np.tanh(product(h, w[name]) + w[f"{name}_bias"])
            tape.append((h, scores, e, t))
            h = scores[0, e] * t
        nll, d_logits = _cross_entropy(product(h, w["head"]) + w["head_bias"], np.array([label]))
        grads = {"head": product(h.T, d_logits), "head_bias": d_logits[0]}
        delta = product(d_logits, w["head"].T)
        for layer in reversed(range(self.layers)):
            h, scores, e, t = tape[layer]
            name = f"expert{layer}_{e}"
            d_scores = np.zeros_like(scores)
            d_scores[0, e] = (delta * t).sum()
            d_pre = delta * scores[0, e] * (1.0 - t * t)
            grads[name] = product(h.T, d_pre)
            grads[f"{name}_bias"] = d_pre[0]
            d_z = scores * (d_scores - (d_scores * scores).sum())
            grads[f"gate{layer}"] = product(h.T, d_z)
            grads[f"gate{layer}_bias"] = d_z[0]
            if layer:
                delta = product(d_pre, w[name].T) + product(d_z, w[f"gate{layer}"].T)
        return float(nll[0]), grads

    def step(self, grads: dict[str, Array]) -> None:
        """Adam as ``torch.optim.Adam`` takes it (betas 0.9, 0.999; eps 1e-8),
        on the weights in ``grads`` only, each with its own step count."""
        for k, g in grads.items():
            self.steps[k] += 1
            adam(self.w[k], *self.moments[k], g, self.rate, self.steps[k])

    def train(self, x: Array, labels: Array) -> float:
        """One step: the batch's loss and gradients, then Adam."""
        loss, grads = self.loss_and_gradients(x, labels)
        self.step(grads)
        return loss

    def train_example(self, x: Array, label: int) -> float:
        """One step on one example, by `example`."""
        loss, grads = self.example(x, label)
        self.step(grads)
        return loss


def _softmax(z: Array) -> Array:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    e /= e.sum(axis=1, keepdims=True)
    return e


def check(router: Router, x: Array, labels: Array) -> float:
    """The largest relative difference of loss and gradients between this
    model (on the router's weights) and monadl's batch; a weight that one
    reaches and the other does not is an infinite difference."""
    import anyio

    from monadl.runtime import entry

    model = Model(weights_of(router))
    loss, grads = model.loss_and_gradients(x, labels)
    value, got = anyio.run(entry.gradients, router.loss(x, labels))
    worst = abs(float(value) - loss) / abs(loss)
    for name, weight in zip(names(model.layers, model.experts), router.weights(), strict=True):
        g, want = got.get(weight), grads.get(name)
        if g is None or want is None:
            worst = max(worst, 0.0 if g is None and want is None else float("inf"))
            continue
        g = np.asarray(g.to_dense() if hasattr(g, "to_dense") else g)
        worst = float(np.maximum(worst, np.max(np.abs(g - want)) / (np.max(np.abs(want)) + 1e-30)))  # (NaN stays)
    return worst


__all__ = ["Model", "check", "names", "weights_of"]
