"""The paper's gated network, written the four ways of its "Dynamic Neural
Networks" section.

A gate gives two scores; the subnet whose score is larger runs, and its output
is multiplied by its score (so the gate learns too). Only the chosen subnet is
evaluated. The four ways give identical losses and identical weight updates;
they differ in what they evaluate and when:

1. eager (bad): ``await score.predict()`` inside the model: the gate and the
   input are evaluated again, in evaluations of their own;
2. monadic (good): ``forward().bind``: one evaluation, the two scores one
   after the other;
3. applicative + monadic (better): ``Do.zip`` of the two scores, then ``bind``;
4. direct style (best): an ``@ml.direct`` coroutine that ``await``s the
   scores; it reads like (1) and runs like (3).

Run: ``python examples/gated_network.py`` prints, for each way, its losses
over 500 steps, how often it evaluated the gate, and its time per step.
``--dot PATH`` also draws both branches, the input and the gate they share
(`ml.render_graph`): ``PATH.svg`` or ``.png`` where Graphviz is installed,
else the DOT text. (The dynamic layer itself is opaque in a picture: which
branch runs is decided while it runs.)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml
from examples._common import positive
from monadl.layers._layer import Layer
from monadl.layers._primitives import Primitive

FEATURES = 8
HIDDEN = 16


@dataclass
class Counter:
    """An identity layer that counts its forward evaluations."""

    name: str
    count: int = 0
    primitive: Primitive = field(init=False)

    def __post_init__(self) -> None:
        self.primitive = Primitive(f"count {self.name}", self._rule)

    def _rule(self, a: Any) -> tuple[Any, tuple[Callable[[Any], Any], ...]]:
        self.count += 1
        return a, (lambda g: g,)

    def __call__(self, x: ml.ArrayLayer) -> ml.ArrayLayer:
        return Layer._make(self.primitive, (x,))


class GatedNetwork:
    """Weights of the input layer, the gate and the two subnets."""

    def __init__(self, seed: int = 0, learning_rate: float = 0.01) -> None:
        rng = np.random.default_rng(seed)

        def weight(*shape: int) -> ml.ArrayWeight:
            return ml.Weight(rng.standard_normal(shape) / np.sqrt(shape[0]), optimizer=ml.optim.sgd(learning_rate))

        self.input_weight = weight(FEATURES, FEATURES)
        self.gate_weight = weight(FEATURES, 2)
        self.left = (weight(FEATURES, HIDDEN), weight(HIDDEN, FEATURES))
        self.right = (weight(FEATURES, HIDDEN), weight(HIDDEN, FEATURES))
        self.input_count = Counter("input")
        self.gate_count = Counter("gate")

    def weights(self) -> list[ml.ArrayWeight]:
        return [self.input_weight, self.gate_weight, *self.left, *self.right]

    def input(self, x: ml.Array) -> ml.ArrayLayer:
        return self.input_count(ml.tanh(x @ self.input_weight))

    def gate(self, features: ml.ArrayLayer) -> tuple[ml.ScalarLayer, ml.ScalarLayer]:
        scores = self.gate_count(ml.sigmoid(features @ self.gate_weight))
        return scores[0], scores[1]

    def left_subnet(self, features: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.relu(features @ self.left[0]) @ self.left[1]

    def right_subnet(self, features: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.relu(features @ self.right[0]) @ self.right[1]

    # ---- the four ways ---------------------------------------------------------------
    async def eager(self, x: ml.Array) -> ml.ArrayLayer:
        """(bad) Values by predict(): the gate and the input are evaluated again."""
        features = self.input(x)
        left, right = self.gate(features)
        if await left.predict() > await right.predict():
            return left * self.left_subnet(features)
        return right * self.right_subnet(features)

    def monadic(self, x: ml.Array) -> ml.ArrayLayer:
        """(good) forward().bind: one evaluation, scores one after the other."""
        features = self.input(x)
        left, right = self.gate(features)
        gated: ml.Do[ml.Tape[ml.Array, ml.Array]] = left.forward().bind(
            lambda l_tape: right.forward().bind(
                lambda r_tape: (
                    (left * self.left_subnet(features)).forward()
                    if l_tape.data > r_tape.data
                    else (right * self.right_subnet(features)).forward()
                )
            )
        )
        return ml.Layer(gated)

    def applicative(self, x: ml.Array) -> ml.ArrayLayer:
        """(better) Do.zip of the two scores (may run in parallel), then bind."""
        features = self.input(x)
        left, right = self.gate(features)

        def stage2(tapes: tuple[ml.Tape[float, float], ml.Tape[float, float]]) -> ml.Do[ml.Tape[ml.Array, ml.Array]]:
            if tapes[0].data > tapes[1].data:
                return (left * self.left_subnet(features)).forward()
            return (right * self.right_subnet(features)).forward()

        return ml.Layer(ml.Do.zip(left.forward(), right.forward()).bind(stage2))

    def direct(self, x: ml.Array) -> ml.ArrayLayer:
        """(best) Direct style: await the scores; written like eager, run like applicative."""
        return self._direct(self.input(x))

    @ml.direct
    async def _direct(self, features: ml.ArrayLayer) -> ml.ArrayLayer:
        left, right = self.gate(features)
        left_score, right_score = await ml.values(left, right)
        if left_score > right_score:
            return left * self.left_subnet(features)
        return right * self.right_subnet(features)


def square_loss(output: ml.ArrayLayer, target: ml.Array) -> ml.ScalarLayer:
    return ml.sum((output - target) ** 2.0)


WAYS = ("eager", "monadic", "applicative", "direct")


async def train(way: str, steps: int, seed: int = 0) -> tuple[list[float], GatedNetwork]:
    """Train one way on a fixed stream of samples; returns the losses and the network."""
    net = GatedNetwork(seed)
    rng = np.random.default_rng(seed + 1)
    losses = []
    for _ in range(steps):
        x = rng.standard_normal(FEATURES)
        target = np.tanh(x[::-1])
        if way == "eager":
            output = await net.eager(x)
        else:
            output = getattr(net, way)(x)
        losses.append(float(await square_loss(output, target).train()))
    return losses, net


async def main(steps: int = 500) -> None:
    print(
        f"{'way':12} {'first loss':>11} {'mean of last 50':>16} {'gate evaluations':>17} {'per step':>9} {'us/step':>8}"
    )
    for way in WAYS:
        started = time.perf_counter()
        losses, net = await train(way, steps)
        per_step = (time.perf_counter() - started) / steps
        print(
            f"{way:12} {losses[0]:11.4f} {np.mean(losses[-50:]):16.4f} "
            f"{net.gate_count.count:17d} {net.gate_count.count / steps:9.1f} {per_step * 1e6:8.0f}"
        )


def both_branches(net: GatedNetwork, x: ml.Array) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
    """The two candidates that the gate chooses from, built side by side."""
    features = net.input(x)
    left, right = net.gate(features)
    return left * net.left_subnet(features), right * net.right_subnet(features)


def weight_names(net: GatedNetwork) -> dict[ml.Weight[Any, Any], str]:
    return {
        net.input_weight: "input",
        net.gate_weight: "gate",
        net.left[0]: "left 1",
        net.left[1]: "left 2",
        net.right[0]: "right 1",
        net.right[1]: "right 2",
    }


def draw(path: Path, seed: int = 0) -> Path:
    """Draw both branches to ``path``; without Graphviz, write the DOT text
    beside it instead. Returns the file written."""
    net = GatedNetwork(seed)
    left, right = both_branches(net, np.random.default_rng(seed + 1).standard_normal(FEATURES))
    try:
        return ml.render_graph(left, right, path=path, names=weight_names(net))
    except FileNotFoundError as exc:  # no Graphviz: the text still opens in any DOT viewer
        print(f"{exc}; writing the DOT text")
        return ml.render_graph(left, right, path=path.with_suffix(".dot"), names=weight_names(net))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The paper's gated network, four ways.")
    parser.add_argument("--steps", type=positive, default=500)
    parser.add_argument("--dot", type=Path, metavar="PATH", help="also draw both branches (.svg, .png, .pdf or .dot)")
    args = parser.parse_args()
    anyio.run(main, args.steps)
    if args.dot is not None:
        print(f"both branches drawn in {draw(args.dot)}")
