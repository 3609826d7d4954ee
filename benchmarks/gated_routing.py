"""Batching across data-dependent control flow: a gated network that routes
each example by its own gate, examples one by one against a batch as one ``train()``.

The model is a routed mixture of experts on scikit-learn's digits (64
features in [0, 1], 10 classes): two routed layers in sequence, then a linear
readout and cross-entropy. At each routed layer a gate ``softmax(h @ Wg +
bg)`` scores ``EXPERTS`` experts; the example reads its scores (``bind``, or
``await`` in direct style) and runs only the expert of largest score, its
output ``score[e] * tanh(h @ W_e + b_e)`` (so the gate learns too). The
second layer's gate reads the first layer's output, so the second choice
depends on the first: no graph of the batch is known before it runs. One
training step over a batch of digits, in one run, rounds alternating
between the contenders:

* one by one: a ``train()`` per example (nothing to batch across);
* fibers off: one ``train()`` over the batch, ``Settings.batching=False``
  (the examples are fibers that park and merge as with batching on; each
  merged graph runs node by node);
* fibers on: the same with batching automatic (`monadl.runtime.schedule.fibers`):
  the gates of all examples run as one product, then each expert's chosen
  examples as one product;
* direct on: the same model in direct style (`Router.example_direct`),
  batching automatic;
* cells on: fibers on with each expert marked as one operation
  (``Router(cells=True)``);
* hand 1-by-1, hand batched: the limit, the same model by hand in NumPy
  (`benchmarks._gated_routing_numpy`: the product kernel monadl calls, no
  graph), a step per example (written plainly for one example) and the
  batch grouped by chosen expert, one product per expert.

Ratios are of times, the slower over the faster as named ("1-by-1/on": one
by one's step time over fibers on's).

The weights do not move (learning rate 0), so every round routes the same
way. Before timing, the batch's loss and gradients with fibers on are
checked in float64 against fibers off, direct style, the marked experts and
the mean of the examples' own gradients; and the hand version's against
monadl's (float64 and float32).

Times are CPU seconds of this process (``time.process_time``, BLAS limited
to one thread) of one training step, the least of all steps of all rounds.
Run: ``python -m benchmarks.gated_routing`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import anyio
import numpy as np

import monadl as ml
from benchmarks.control_flow import alternating
from monadl.runtime import entry

DTYPE: type[np.floating[Any]] = np.float32

FEATURES = 64
CLASSES = 10
EXPERTS = 4
LAYERS = 2

GATE_SCALE = 4.0
"""The gates' weights, this many times the experts' scale: sharp enough
that an example's route depends on the digit."""

TIMED_SEED = 10
"""Which digits make the timed batch (`digits`' seed)."""


@cache
def _digits() -> tuple[ml.Array, ml.Array]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data / 16.0, data.target.astype(np.int64)


def digits(count: int, seed: int, dtype: type[np.floating[Any]] = DTYPE) -> tuple[ml.Array, ml.Array]:
    """``count`` digits drawn without replacement: their features, shape
    ``(count, 64)`` in [0, 1], and their labels."""
    x, y = _digits()
    rows = np.random.default_rng(seed).choice(len(x), size=count, replace=False)
    return x[rows].astype(dtype), y[rows]


class Router:
    """The weights: per routed layer a gate (n_in -> EXPERTS) and EXPERTS
    experts (n_in -> hidden); the readout (hidden -> 10). ``cells``: each
    expert marked as an operation (`ml.operation`: one node per call,
    batched as a unit); the same values and gradients either way.

    Each gate's bias is set so that its logits average zero over all the
    digits (routed as the model routes them): the digits' features are all
    positive, and a gate of random weights alone sends most examples to one
    expert."""

    def __init__(
        self,
        hidden: int,
        seed: int = 0,
        learning_rate: float = 0.01,
        dtype: type[np.floating[Any]] = np.float64,
        cells: bool = False,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.hidden = hidden

        def weight(value: ml.Array) -> ml.ArrayWeight:
            return ml.Weight(value.astype(dtype), optimizer=ml.optim.adam(learning_rate))

        def matrix(n_in: int, n_out: int) -> ml.Array:
            return np.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in))

        h = _digits()[0]  # all the digits, routed as the model routes them
        self.gates: list[tuple[ml.ArrayWeight, ml.ArrayWeight]] = []
        self.experts: list[list[tuple[ml.ArrayWeight, ml.ArrayWeight]]] = []
        for n_in in (FEATURES, hidden)[:LAYERS]:
            experts = [(matrix(n_in, hidden), np.zeros(hidden)) for _ in range(EXPERTS)]
            gate = matrix(n_in, EXPERTS) * GATE_SCALE
            bias = -(h @ gate).mean(axis=0)
            self.gates.append((weight(gate), weight(bias)))
            self.experts.append([(weight(w), weight(b)) for w, b in experts])
            z = h @ gate + bias
            scores = np.exp(z - z.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
            chosen = scores.argmax(axis=1)
            h = np.stack([scores[i, e] * np.tanh(h[i] @ experts[e][0] + experts[e][1]) for i, e in enumerate(chosen)])
        self.head = (weight(matrix(hidden, CLASSES)), weight(np.zeros(CLASSES)))
        self._expert: list[list[Callable[[ml.ArrayLayer, ml.ArrayLayer], ml.ArrayLayer]]] = [
            [ml.operation(self._unit(layer, e)) if cells else self._unit(layer, e) for e in range(EXPERTS)]
            for layer in range(LAYERS)
        ]

    def weights(self) -> list[ml.ArrayWeight]:
        """All weights: per layer the gate's two, then each expert's two; the readout's."""
        found: list[ml.ArrayWeight] = []
        for gate, experts in zip(self.gates, self.experts):
            found += [*gate, *(w for expert in experts for w in expert)]
        return [*found, *self.head]

    def _unit(self, layer: int, e: int) -> Callable[[ml.ArrayLayer, ml.ArrayLayer], ml.ArrayLayer]:
        weight, bias = self.experts[layer][e]

        def expert(h: ml.ArrayLayer, score: ml.ArrayLayer) -> ml.ArrayLayer:
            return score * ml.tanh(ml.dense(h, weight, bias))

        return expert

    def scores(self, layer: int, h: ml.ArrayOperand) -> ml.ArrayLayer:
        """The gate's scores of the experts, shape (1, EXPERTS)."""
        return ml.softmax(ml.dense(h, *self.gates[layer]))

    def expert(self, layer: int, e: int, h: ml.ArrayOperand, scores: ml.ArrayLayer) -> ml.ArrayLayer:
        """Expert ``e``'s output, times its score."""
        return self._expert[layer][e](ml.as_layer(h), scores[:, e : e + 1])

    def example(self, x: ml.Array, label: int, route: list[int]) -> ml.ScalarLayer:
        """One example's loss, as a layer whose experts are chosen while it
        runs, each by the gate's scores read with ``bind``; the choices are
        appended to ``route``."""

        def routed(layer: int, h: ml.ArrayOperand) -> ml.Do[ml.Tape[Any, Any]]:
            if layer == LAYERS:
                logits = ml.dense(h, *self.head)
                return ml.cross_entropy(logits, np.array([label])).forward()
            scores = self.scores(layer, h)

            def choose(tape: ml.Tape[ml.Array, ml.Array]) -> ml.Do[ml.Tape[Any, Any]]:
                e = int(tape.data[0].argmax())
                route.append(e)
                return routed(layer + 1, self.expert(layer, e, h, scores))

            return scores.forward().bind(choose)

        return ml.Layer(routed(0, x[None]))

    @ml.direct
    async def example_direct(self, x: ml.Array, label: int, route: list[int]) -> ml.ScalarLayer:
        """`example` in direct style: the same layers, each choice an ``await``."""
        h: ml.ArrayOperand = x[None]
        for layer in range(LAYERS):
            scores = self.scores(layer, h)
            e = int((await scores)[0].argmax())
            route.append(e)
            h = self.expert(layer, e, h, scores)
        return ml.cross_entropy(ml.dense(h, *self.head), np.array([label]))

    def loss(
        self, x: ml.Array, labels: ml.Array, routes: list[list[int]] | None = None, direct: bool = False
    ) -> ml.ScalarLayer:
        """The mean loss of a batch: one example (one fiber) per row, by
        `example` or, if ``direct``, `example_direct`. ``routes``: filled
        with each example's chosen experts, one per layer."""
        if routes is None:
            routes = []
        routes[:] = [[] for _ in labels]
        example = self.example_direct if direct else self.example
        return ml.mean(ml.stack([example(x[i], int(labels[i]), routes[i]) for i in range(len(labels))]))


def histogram(routes: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per layer, how many examples chose each expert."""
    return [np.bincount([r[layer] for r in routes], minlength=EXPERTS).tolist() for layer in range(LAYERS)]


def _router(hidden: int, dtype: type[np.floating[Any]] = DTYPE, cells: bool = False) -> Router:
    return Router(hidden, seed=0, learning_rate=0.0, dtype=dtype, cells=cells)


def _dense(g: Any) -> Any:
    return g.to_dense() if hasattr(g, "to_dense") else g


def difference(a: tuple[float, list[Any]], b: tuple[float, list[Any]]) -> float:
    """The largest relative difference of two (loss, gradients) pairs, each
    gradient relative to ``b``'s largest entry; a weight left unreached
    (None) must be unreached in both."""
    worst = abs(a[0] - b[0]) / abs(b[0])
    for x, y in zip(a[1], b[1], strict=True):
        if x is None or y is None:
            if not (x is None and y is None):
                return float("inf")
            continue
        x, y = np.asarray(_dense(x)), np.asarray(_dense(y))
        worst = float(np.maximum(worst, np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))  # (NaN stays)
    return worst


def check(hidden: int, batch: int, dtype: type[np.floating[Any]] = np.float64, seed: int = 1) -> float:
    """The largest relative difference of the batch's loss and gradients:
    fibers on against off, direct style, the marked experts, and the mean of
    the examples' own gradients."""
    router = _router(hidden, dtype)
    x, labels = digits(batch, seed, dtype)

    def gradients(model: Router, loss: ml.ScalarLayer) -> tuple[float, list[Any]]:
        value, grads = anyio.run(entry.gradients, loss)
        return float(value), [grads.get(w) for w in model.weights()]

    on = gradients(router, router.loss(x, labels))
    with ml.settings(batching=False):
        off = gradients(router, router.loss(x, labels))
    direct = gradients(router, router.loss(x, labels, direct=True))
    marked = _router(hidden, dtype, cells=True)  # the same weights, its experts marked as operations
    cells = gradients(marked, marked.loss(x, labels))
    singles = [gradients(router, router.loss(x[i : i + 1], labels[i : i + 1])) for i in range(batch)]
    mean_grads: list[Any] = []
    for k in range(len(router.weights())):
        parts = [np.asarray(_dense(g[k])) for _, g in singles if g[k] is not None]
        mean_grads.append(sum(parts) / batch if parts else None)
    mean = (float(np.mean([v for v, _ in singles])), mean_grads)
    return float(np.max([difference(on, other) for other in (off, direct, cells, mean)]))  # (NaN stays)


def timing(hidden: int, batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Best CPU seconds of one training step on one batch, for each
    contender: the least of ``steps`` steps in each of ``rounds`` rounds."""
    from benchmarks import _gated_routing_numpy

    router = _router(hidden)
    marked = _router(hidden, cells=True)
    x, labels = digits(batch, TIMED_SEED)
    by_hand = _gated_routing_numpy.Model(_gated_routing_numpy.weights_of(router))

    async def one_by_one() -> None:
        for i in range(batch):
            await router.loss(x[i : i + 1], labels[i : i + 1]).train()

    async def together() -> None:
        await router.loss(x, labels).train()

    async def together_direct() -> None:
        await router.loss(x, labels, direct=True).train()

    async def cells_together() -> None:
        await marked.loss(x, labels).train()

    async def hand_one_by_one() -> None:
        for i in range(batch):
            by_hand.train_example(x[i], int(labels[i]))

    async def hand_together() -> None:
        by_hand.train(x, labels)

    contenders: dict[str, tuple[Callable[[], Any], bool | None]] = {
        "one by one": (one_by_one, None),
        "fibers off": (together, False),
        "fibers on": (together, None),
        "direct on": (together_direct, None),
        "cells on": (cells_together, None),
        "hand 1-by-1": (hand_one_by_one, None),
        "hand batched": (hand_together, None),
    }
    return alternating(contenders, rounds, steps)


def main() -> None:
    from benchmarks import _gated_routing_numpy

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one round")
    parser.add_argument("--hidden", type=int, nargs="*", default=[128, 512, 1024])
    parser.add_argument("--batch", type=int, nargs="*", default=[32])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().limit(limits=1)  # one thread, BLAS included (numpy is loaded by now)
    print(f"monadl batching across control flow (gated routing, {EXPERTS} experts x {LAYERS} layers); ", end="")
    print(f"{os.cpu_count()} cores, 1 thread")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    hiddens, sizes, rounds, steps = (args.hidden, args.batch, args.rounds, args.steps)
    if args.quick:
        hiddens, sizes, rounds, steps = [16], [4, 8], 1, 1
    for hidden in hiddens:
        worst = check(hidden, max(sizes))
        worst32 = check(hidden, max(sizes), np.float32)
        timed = digits(max(sizes), TIMED_SEED, np.float64)
        hand = _gated_routing_numpy.check(_router(hidden, np.float64), *timed)
        hand32 = _gated_routing_numpy.check(_router(hidden), *digits(max(sizes), TIMED_SEED))
        print(
            f"\nhidden {hidden}: largest relative difference of loss and gradients (on vs off, vs direct, "
            f"vs cells, vs one by one): {worst:.1e} in float64, {worst32:.1e} in float32 (timed in "
            f"{np.dtype(DTYPE).name}); by hand vs on: {hand:.1e} in float64, {hand32:.1e} in float32"
        )
        routes: list[list[int]] = []
        entry.gradients_sync(_router(hidden).loss(*digits(max(sizes), TIMED_SEED), routes))
        print(f"the timed batch of {max(sizes)}: examples per expert, layer by layer: {histogram(routes)}")
        if not (worst <= 1e-12 and hand <= 1e-12 and hand32 <= 1e-5):  # (a NaN fails too)
            raise AssertionError(f"results disagree: {worst:.1e}, by hand {hand:.1e}, {hand32:.1e} in float32")
        print(
            f"{'batch':>5s} {'one by one':>11s} {'fibers off':>11s} {'fibers on':>11s} {'1-by-1/on':>10s} "
            f"{'direct on':>11s} {'1-by-1/direct':>14s} {'cells on':>10s} {'1-by-1/cells':>13s} "
            f"{'hand 1-by-1':>12s} {'hand batched':>13s} {'hand ratio':>11s}"
        )
        for b in sizes:
            best = timing(hidden, b, rounds, steps)
            one = best["one by one"]
            print(
                f"{b:5d} {one * 1e3:9.2f}ms {best['fibers off'] * 1e3:9.2f}ms {best['fibers on'] * 1e3:9.2f}ms "
                f"{one / best['fibers on']:9.2f}x {best['direct on'] * 1e3:9.2f}ms "
                f"{one / best['direct on']:13.2f}x {best['cells on'] * 1e3:8.2f}ms {one / best['cells on']:12.2f}x "
                f"{best['hand 1-by-1'] * 1e3:10.2f}ms {best['hand batched'] * 1e3:11.2f}ms "
                f"{best['hand 1-by-1'] / best['hand batched']:10.2f}x"
            )
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
