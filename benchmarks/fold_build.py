"""Building a batch of Fold blocks whose inputs are rows of data.

TF Fold's programs feed their cells rows of data (`Vector`, `Scalar`) and
start folds from `Zeros`: each is a constant row given as a layer
(``ml.as_layer(x)``). A new user's model over min/max expression trees (a
leaf's digit one-hot, a node's operator one-hot, a fold over its children
from zeros) built a batch of 32 trees in 13.7 ms as blocks, against 6.9 ms
for the same cells in an ``ml.loom()`` block given raw arrays: every call on
a row took the loom's general path (`Loom.record`), not a recorder compiled
for its structure (`monadl.fold._loom_recorders`).

Per batch of 32 random trees (about 1,400 nodes), in one run, rounds
alternating: the least time to build a batch's loss, and one training step
(build, forward, backward, Adam), for

* Fold blocks, recorders on (the default);
* Fold blocks, recorders off (every call by the general path, as before);
* the same cells in one ``ml.loom()`` block, given raw arrays.

Each variant is first checked to give the same loss and gradients (float64).
Run: ``python -m benchmarks.fold_build`` (``--rounds``, ``--batches``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml
from monadl.fold import (
    AllOf,
    Fold,
    ForwardDeclaration,
    Function,
    Identity,
    InputTransform,
    OneOf,
    Record,
    Vector,
    Zeros,
    _loom,
)
from monadl.fold._loom_recorders import MOST

D = 32
Tree: TypeAlias = dict[str, Any]  # {"digit": d} or {"op": 0 | 1, "kids": [...]}


def make_tree(rng: np.random.Generator, depth: int) -> Tree:
    if depth == 0 or rng.random() < 0.3:
        return {"digit": int(rng.integers(0, 10))}
    return {"op": int(rng.integers(0, 2)), "kids": [make_tree(rng, depth - 1) for _ in range(int(rng.integers(2, 4)))]}


def size(t: Tree) -> int:
    return 1 + sum(map(size, t.get("kids", [])))


def value(t: Tree) -> int:
    if "digit" in t:
        return int(t["digit"])
    values = [value(k) for k in t["kids"]]
    return max(values) if t["op"] else min(values)


class Model:
    """The cells, the blocks over them, and the same cells marked for a loom block."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        with ml.optim.using_default(ml.optim.adam(1e-3)):
            self.leaf_w = ml.Weight(rng.normal(size=(10, D)) * 0.3)
            self.kid_w, self.kid_b = ml.Weight(rng.normal(size=(2 * D, D)) / 8), ml.Weight(np.zeros(D))
            self.op_w, self.op_b = ml.Weight(rng.normal(size=(D + 2, D)) / 6), ml.Weight(np.zeros(D))
            self.out = ml.Weight(rng.normal(size=(D, 10)) / 6)
        self.weights = [self.leaf_w, self.kid_w, self.kid_b, self.op_w, self.op_b, self.out]
        node = ForwardDeclaration[Tree, ml.ArrayLayer](name="node")
        leaf = InputTransform(_digit) >> Vector(10, np.float64) >> Function(self.leaf)
        kids = Fold(Record(Identity[ml.ArrayLayer](), node) >> Function(self.kid), Zeros((D,), np.float64))
        inner = AllOf(InputTransform(_kids) >> kids, InputTransform(_op) >> Vector(2, np.float64)) >> Function(self.op)
        node.resolve_to(OneOf(_is_leaf, {True: leaf, False: inner}))
        self.node = node
        self.leaf_cell = ml.operation(lambda x: self.leaf(ml.as_layer(x)))
        self.kid_cell = ml.operation(lambda s, k: self.kid((s, k)))
        self.op_cell = ml.operation(lambda a, o: self.op((a, ml.as_layer(o))))

    def leaf(self, onehot: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(onehot @ self.leaf_w)

    def kid(self, state_kid: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
        return ml.tanh(ml.dense(ml.concatenate(list(state_kid), axis=1), self.kid_w, self.kid_b))

    def op(self, acc_op: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
        return ml.tanh(ml.dense(ml.concatenate(list(acc_op), axis=1), self.op_w, self.op_b))

    def encode(self, t: Tree) -> ml.ArrayLayer:
        if "digit" in t:
            return self.leaf_cell(np.array([_digit(t)]))
        acc = ml.as_layer(np.zeros((1, D)))
        for k in t["kids"]:
            acc = self.kid_cell(acc, self.encode(k))
        return self.op_cell(acc, np.array([_op(t)]))

    def fold_loss(self, trees: Sequence[Tree]) -> ml.ScalarLayer:
        return self._loss(self.node.batch(list(trees)), trees)

    def loom_loss(self, trees: Sequence[Tree]) -> ml.ScalarLayer:
        with ml.loom():
            roots = [self.encode(t) for t in trees]
        return self._loss(roots, trees)

    def _loss(self, roots: list[ml.ArrayLayer], trees: Sequence[Tree]) -> ml.ScalarLayer:
        return ml.cross_entropy(ml.concatenate(roots, axis=0) @ self.out, np.array([value(t) for t in trees]))


def _is_leaf(t: Tree) -> bool:
    return "digit" in t


def _digit(t: Tree) -> list[float]:
    return [float(i == t["digit"]) for i in range(10)]


def _op(t: Tree) -> list[float]:
    return [1.0, 0.0] if t["op"] == 0 else [0.0, 1.0]


def _kids(t: Tree) -> list[Tree]:
    return list(t["kids"])


@contextlib.contextmanager
def recorders(on: bool) -> Iterator[None]:
    """Looms that learn recorders (the default), or none: every call by the general path."""
    most = MOST
    _loom.__dict__["MOST"] = most if on else 0  # (what `Loom.record` reads; the tests patch it so too)
    try:
        yield
    finally:
        _loom.__dict__["MOST"] = most


def check(model: Model, trees: Sequence[Tree]) -> float:
    """The largest difference of loss and gradients between the variants."""
    results = []
    for loss, on in ((model.fold_loss, True), (model.fold_loss, False), (model.loom_loss, True)):
        with recorders(on):
            v, g = anyio.run(ml.value_and_gradients, loss(trees))
        results.append([np.asarray(v), *(np.asarray(g[w]) for w in model.weights)])
    return max(float(np.max(np.abs(a - b))) for r in results[1:] for a, b in zip(r, results[0]))


def timed(
    build: Callable[[Sequence[Tree]], ml.ScalarLayer], batches: list[list[Tree]], on: bool
) -> tuple[float, float]:
    """The least seconds to build a batch's loss, and to build and train one."""
    built = trained = float("inf")
    with recorders(on):
        for trees in batches:
            t0 = time.perf_counter()
            loss = build(trees)
            t1 = time.perf_counter()
            anyio.run(loss.train)
            t2 = time.perf_counter()
            built, trained = min(built, t1 - t0), min(trained, t2 - t0)
    return built, trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=6, help="batches of 32 trees a round")
    args = parser.parse_args()
    model = Model()
    rng = np.random.default_rng(9)
    batches = [[make_tree(rng, 5) for _ in range(32)] for _ in range(args.batches)]
    nodes = sum(map(size, batches[0]))
    print(f"largest difference of loss and gradients between the variants: {check(model, batches[0]):.1e}")
    variants = {
        "fold, recorders": (model.fold_loss, True),
        "fold, path only": (model.fold_loss, False),
        "loom block": (model.loom_loss, True),
    }
    best = {name: (float("inf"), float("inf")) for name in variants}
    for _ in range(args.rounds):
        for name, (build, on) in variants.items():
            b, t = timed(build, batches, on)
            best[name] = (min(best[name][0], b), min(best[name][1], t))
    print(f"32 trees a batch (the first: {nodes} nodes); least of {args.rounds} rounds of {args.batches} batches")
    print(f"{'variant':18} {'build ms':>9} {'step ms':>9}")
    for name, (b, t) in best.items():
        print(f"{name:18} {b * 1e3:9.2f} {t * 1e3:9.2f}")


if __name__ == "__main__":
    main()
