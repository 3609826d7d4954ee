"""Dynamic batching: a Tree-LSTM written node by node, batching off and on.

Workloads, measured in one run, rounds alternating between the contenders:

* treelstm: a binary Tree-LSTM (Tai et al. 2015, N-ary form) over random
  binary trees with 128 leaves (Fold's Table 1), batch 32, hidden 128 and
  256, the natural per-node recursion, one ``train()`` per batch; batching
  off, and on grouped by depth and by agenda;
* chain: `benchmarks/overhead.py`'s 1,000-op elementwise chain, batching
  automatic against off (nothing there batches: the rule must see it cheaply).

Times are CPU seconds of this process (``time.process_time``, BLAS limited
to one thread), best of the rounds: on a shared machine whose CPU quota
throttles processes, wall time measures the neighbours (a 0.4 ms matrix
product was seen to take 20 ms of wall time there).

Also prints the scheduler's analysis cost per node (depths, signatures) and
how many kernels the batched graph ran. Run: ``python -m benchmarks.batching``
(``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import anyio
import numpy as np

import monadl as ml
from benchmarks.overhead import monadl_chain
from monadl.runtime.evaluation import Evaluation, Record
from monadl.runtime.node import collect, compute
from monadl.runtime.schedule import batched as _batching

Tree: TypeAlias = "int | tuple[Tree, Tree]"
VOCABULARY = 64
CLASSES = 5


def random_tree(rng: np.random.Generator, leaves: int) -> Tree:
    """A uniformly split random binary tree (Fold's "full dynamic" shapes)."""
    if leaves == 1:
        return int(rng.integers(VOCABULARY))
    left = int(rng.integers(1, leaves))
    return (random_tree(rng, left), random_tree(rng, leaves - left))


class TreeLSTM:
    """The N-ary Tree-LSTM, every op a layer, one recursive call per node."""

    def __init__(self, hidden: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        h = hidden
        self.hidden = h
        scale = 1 / np.sqrt(h)
        sgd = ml.optim.sgd(0.01)
        self.table = ml.Weight((rng.standard_normal((VOCABULARY, h)) * scale).astype(np.float32), optimizer=sgd)
        self.w_leaf = ml.Weight((rng.standard_normal((h, 3 * h)) * scale).astype(np.float32), optimizer=sgd)
        self.b_leaf = ml.Weight(np.zeros(3 * h, np.float32), optimizer=sgd)
        self.u = ml.Weight((rng.standard_normal((2 * h, 5 * h)) * scale).astype(np.float32), optimizer=sgd)
        self.b = ml.Weight(np.zeros(5 * h, np.float32), optimizer=sgd)
        self.out = ml.Weight((rng.standard_normal((h, CLASSES)) * scale).astype(np.float32), optimizer=sgd)

    def node(self, tree: Tree) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        h = self.hidden
        if isinstance(tree, int):
            x = ml.embedding(self.table, np.array([tree]))[0]
            gates = x @ self.w_leaf + self.b_leaf
            c = ml.sigmoid(gates[:h]) * ml.tanh(gates[2 * h :])
            return ml.sigmoid(gates[h : 2 * h]) * ml.tanh(c), c
        (hl, cl), (hr, cr) = self.node(tree[0]), self.node(tree[1])
        gates = ml.concatenate([hl, hr]) @ self.u + self.b
        i, fl, fr, o = (ml.sigmoid(gates[k * h : (k + 1) * h]) for k in range(4))
        c = i * ml.tanh(gates[4 * h :]) + fl * cl + fr * cr
        return o * ml.tanh(c), c

    def loss(self, trees: list[Tree], labels: np.ndarray[Any, Any]) -> ml.ScalarLayer:
        roots = [self.node(t)[0] for t in trees]
        return ml.cross_entropy(ml.stack(roots) @ self.out, labels)


_clock = time.process_time


def _timed(step: Callable[[], object]) -> float:
    t0 = _clock()
    step()
    return _clock() - t0


def treelstm(hidden: int, batch: int, leaves: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, leaves) for _ in range(batch)]
    labels = rng.integers(0, CLASSES, batch)
    modes: list[tuple[str, bool | None, str]] = [
        ("off", False, "depth"),
        ("depth", None, "depth"),
        ("agenda", None, "agenda"),
    ]
    models = {name: TreeLSTM(hidden) for name, _, _ in modes}
    build = {name: 0.0 for name, _, _ in modes}
    best = {name: float("inf") for name, _, _ in modes}
    losses: dict[str, list[float]] = {name: [] for name, _, _ in modes}

    def step(name: str, batching: bool | None, strategy: str) -> None:
        model = models[name]
        t0 = _clock()
        gc.disable()  # building 100k layers must not pay for the cyclic collector
        try:
            loss = model.loss(trees, labels)
        finally:
            gc.enable()
        t1 = _clock()
        _batching.STRATEGY = strategy  # type: ignore[misc]  # the benchmark compares both
        with ml.settings(batching=batching):
            losses[name].append(float(anyio.run(loss.train)))
        elapsed = _clock() - t0
        if elapsed < best[name]:
            best[name], build[name] = elapsed, t1 - t0

    for r in range(rounds):
        for name, batching, strategy in modes if r % 2 else modes[::-1]:
            step(name, batching, strategy)
    _batching.STRATEGY = "depth"  # type: ignore[misc]
    same = all(np.allclose(losses[name], losses["off"], rtol=1e-5) for name in losses)
    nodes = _count_nodes(models["off"], trees, labels)
    print(f"\ntreelstm H={hidden} batch={batch} leaves={leaves}: {nodes} layers; same losses: {same}")
    print(f"{'batching':10s} {'s/batch':>9s} {'trees/s':>9s} {'build s':>9s} {'speedup':>8s}")
    for name, _, _ in modes:
        print(
            f"{name:10s} {best[name]:9.3f} {batch / best[name]:9.1f} {build[name]:9.3f} {best['off'] / best[name]:8.2f}x"
        )
    _analysis(models["off"], trees, labels)


def _count_nodes(model: TreeLSTM, trees: list[Tree], labels: Any) -> int:
    ev = Evaluation(train=True)
    return len(collect(ev, [model.loss(trees, labels)]))


def _analysis(model: TreeLSTM, trees: list[Tree], labels: Any) -> None:
    """Per node: the depth pass, the signatures, and the forward batched and not
    (with the cyclic collector paused, as the runtime pauses it)."""
    gc.disable()
    try:
        _analysed(model, trees, labels)
    finally:
        gc.enable()


def _analysed(model: TreeLSTM, trees: list[Tree], labels: Any) -> None:
    order: list[Any] = []
    forward_s = {False: float("inf"), None: float("inf")}
    for batching in (False, None, False, None):
        ev = Evaluation(train=True)
        order = collect(ev, [model.loss(trees, labels)])
        with ml.settings(batching=batching):
            t0 = _clock()
            if batching is None:
                _batching.forward(ev, order)
            else:
                for x in order:
                    ev.records[x] = compute(ev, x, True)
            seconds = _clock() - t0
        forward_s[batching] = min(forward_s[batching], seconds)
    n = len(order)
    levels_s = min(_timed(lambda: list(_batching._levels(ev, order))) for _ in range(3))  # (its turns: none here)
    records = ev.records
    signature = _batching.signature
    sig_s = min(_timed(lambda: [signature(records, node) for node in order]) for _ in range(3))
    added = sum(1 for key in records if type(key) is Record)
    print(
        f"analysis per node: depths {levels_s / n * 1e6:.2f} us, signature {sig_s / n * 1e6:.2f} us; "
        f"forward {forward_s[None] / n * 1e6:.2f} us/node batched ({added} stack and group records), "
        f"{forward_s[False] / n * 1e6:.2f} us/node not"
    )


def chain(rounds: int, repeats: int) -> None:
    x = ml.Weight(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32), optimizer=ml.optim.sgd(1e-4))
    best: dict[str, float] = {"automatic": float("inf"), "off": float("inf")}
    settings: dict[str, bool | None] = {"automatic": None, "off": False}

    async def run(name: str) -> None:
        with ml.settings(batching=settings[name]):
            t0 = _clock()
            for _ in range(repeats):
                await monadl_chain(x).train()
            best[name] = min(best[name], (_clock() - t0) / repeats)

    for name in best:
        anyio.run(run, name)  # warm up
    for r in range(rounds):
        for name in list(best) if r % 2 else list(best)[::-1]:
            anyio.run(run, name)
    print(
        f"\nchain (benchmarks/overhead.py, 1,000 ops, train): {'  '.join(f'{k} {v * 1e3:.2f} ms' for k, v in best.items())}"
    )
    print(f"automatic / off: {best['automatic'] / best['off']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small trees, one round")
    parser.add_argument("--hidden", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().limit(limits=1)  # one thread, BLAS included (numpy is loaded by now)
    print(f"monadl dynamic batching; {os.cpu_count()} cores, 1 thread (MONADL_WORKERS unset)")
    if args.quick:
        treelstm(16, 4, 8, 1)
        chain(1, 2)
        return
    for hidden in args.hidden:
        treelstm(hidden, 32, 128, args.rounds)
    chain(args.rounds * 3, 20)


if __name__ == "__main__":
    main()
