"""The binary Tree-LSTM benchmark of TF Fold's Table 1, training and inference.

Random binary trees with 128 leaves (random shapes, Fold's "full dynamic"
column, and balanced trees), the Tree-LSTM of `examples.tree_lstm` (leaves
are embedding lookups, internal nodes the N-ary cell), in one run:

* **monadl**: the example's model, built node by node (every op a layer);
  **monadl batching**: the same under ``ml.settings(batching=True)``;
* **monadl cell**: the same with each node's cell marked as one
  `ml.operation`, batching on; **monadl loom**: the marked cells of a batch
  recorded in one ``ml.loom()`` block (one node, run by depth); **monadl cell off**: batching off (node by
  node, an operation node each: within-tree batching of the cell, like for
  like);
* **monadl fold**: the Fold-block version (`examples.tree_lstm_fold`);
* **torch per-node**: PyTorch eager with the same per-node loop;
* **torch by depth**: PyTorch batched by hand, as DGL and hand-written code
  do: nodes grouped by height, each level's children gathered with
  ``index_select`` from the per-level state tensors, one matmul per level;
* **numpy by depth**: the limit: the same schedule in NumPy, its backward by
  hand (`benchmarks._treelstm_numpy`), with the kernels monadl calls.

More variants plug in through
`VARIANTS`: a name and a function from the initial weights to a `Variant`.
Before timing, every variant's loss and gradients from the same float64
weights must agree with a NumPy per-node reference. Rounds alternate between
the variants (forwards, then backwards); each figure is the best round, in
trees per second, with its ratio to the hand-batched PyTorch of the same cell.
The graph-build cost of the per-node model is measured too: layers, seconds
per layer, and the share of Python's cyclic garbage collector (``gc.callbacks``).

Run: ``python benchmarks/treelstm.py`` (``--help``; a quick run:
``--hidden 128 --batch 8 --threads 1 --shapes random --seconds 2``).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import platform
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np
from threadpoolctl import ThreadpoolController

import monadl as ml
from benchmarks import _treelstm_numpy, _treelstm_torch
from examples.tree_lstm import Tree, TreeLSTM, init_weights, labels, random_tree

CORES = len(os.sched_getaffinity(0))
LEAVES = 128
Weights = dict[str, ml.Array]


@final
@dataclass(frozen=True, slots=True)
class Variant:
    """One implementation, set up from a set of initial weights.

    Attributes:
        train: one training step on a batch of trees (may return an awaitable).
        infer: the root logits of a batch of trees (may return an awaitable).
        loss_and_gradients: the loss of a batch and each weight's gradient
            (by the names of `init_weights`), without a step; for the check.
        context: entered around every call (a setting such as batching).
    """

    train: Callable[[list[Tree]], Any]
    infer: Callable[[list[Tree]], Any]
    loss_and_gradients: Callable[[list[Tree]], Any]
    context: Callable[[], AbstractContextManager[Any]] = nullcontext


Builder = Callable[[Weights], Variant | None]
"""None where the variant cannot run here (no PyTorch, no batching setting)."""


def _monadl(
    weights: Weights,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    operation: bool = False,
    loom: bool = False,
) -> Variant:
    model = TreeLSTM(weights, operation=operation, loom=loom)
    names = list(model.w)

    async def loss_and_gradients(trees: list[Tree]) -> tuple[float, Weights]:
        loss = model.loss(trees)
        grads = await ml.gradients(loss, [model.w[k] for k in names])
        return float(await loss.predict()), dict(zip(names, grads))

    return Variant(
        lambda trees: model.loss(trees).train(),
        lambda trees: model.logits(trees).predict(),
        loss_and_gradients,
        context,
    )


def batching_available() -> bool:
    """Whether the runtime has automatic batching (``ml.settings(batching=...)``)."""
    return "batching" in inspect.signature(ml.settings).parameters


def _monadl_batching(weights: Weights) -> Variant | None:
    if not batching_available():
        return None
    on: dict[str, Any] = {"batching": True}  # a keyword the installed runtime may lack: passed by name
    return _monadl(weights, lambda: ml.settings(**on))


def _monadl_unbatched(weights: Weights) -> Variant:
    """Node by node: batching off where the runtime has the setting (its default may batch)."""
    if not batching_available():
        return _monadl(weights)
    off: dict[str, Any] = {"batching": False}
    return _monadl(weights, lambda: ml.settings(**off))


def _monadl_cell(weights: Weights) -> Variant | None:
    """The natural recursion with each node's cell marked as one `ml.operation`, batching on."""
    if not batching_available():
        return None
    on: dict[str, Any] = {"batching": True}
    return _monadl(weights, lambda: ml.settings(**on), operation=True)


def _monadl_loom(weights: Weights) -> Variant | None:
    """The marked cell's calls of a batch recorded in one ``ml.loom()`` block, batching on."""
    if not batching_available() or not hasattr(ml, "loom"):
        return None
    on: dict[str, Any] = {"batching": True}
    return _monadl(weights, lambda: ml.settings(**on), operation=True, loom=True)


def _monadl_cell_off(weights: Weights) -> Variant | None:
    """The marked cell with batching off: node by node, one operation node
    each; beside "monadl cell", what batching buys the cell like for like."""
    if not batching_available():
        return None
    off: dict[str, Any] = {"batching": False}
    return _monadl(weights, lambda: ml.settings(**off), operation=True)


def _monadl_fold(weights: Weights) -> Variant:
    """The Tree-LSTM as Fold blocks (`examples.tree_lstm_fold`), batching on where the runtime has it."""
    from examples.tree_lstm_fold import FoldTreeLSTM

    model = FoldTreeLSTM(weights)
    names = list(model.w)

    async def loss_and_gradients(trees: list[Tree]) -> tuple[float, Weights]:
        loss = model.loss(trees)
        grads = await ml.gradients(loss, [model.w[k] for k in names])
        return float(await loss.predict()), dict(zip(names, grads))

    on: dict[str, Any] = {"batching": True} if batching_available() else {}
    return Variant(
        lambda trees: model.loss(trees).train(),
        lambda trees: model.logits(trees).predict(),
        loss_and_gradients,
        lambda: ml.settings(**on),
    )


VARIANTS: dict[str, Builder] = {
    "monadl": _monadl_unbatched,
    "monadl batching": _monadl_batching,
    "monadl cell": _monadl_cell,
    "monadl loom": _monadl_loom,
    "monadl cell off": _monadl_cell_off,
    "monadl fold": _monadl_fold,
    "torch per-node": _treelstm_torch.per_node,
    "torch by depth": _treelstm_torch.by_depth,
    "numpy by depth": _treelstm_numpy.by_depth,
}
"""Every implementation timed and checked, by name, in the order of the table.
A variant plugs in as one more entry (``VARIANTS["monadl fold"] = builder``)."""
REFERENCE = "torch by depth"  # the ratios' denominator


def make_batches(batch: int, count: int, balanced: bool, seed: int = 1) -> list[list[Tree]]:
    rng = np.random.default_rng(seed)
    return [[random_tree(rng, LEAVES, balanced) for _ in range(batch)] for _ in range(count)]


# ---- the check --------------------------------------------------------------------------------
def reference_loss(weights: Weights, trees: list[Tree]) -> float:
    """The mean cross-entropy, computed node by node in NumPy (forward only)."""
    n = int(weights["children"].shape[0]) // 2

    def sigmoid(x: ml.Array) -> ml.Array:
        return 1.0 / (1.0 + np.exp(-x))

    roots = []
    for tree in trees:
        h: list[ml.Array] = []
        c: list[ml.Array] = []
        for k, symbol in enumerate(tree.symbol):
            leaf = tree.left[k] < 0
            if leaf:
                z = weights["leaf"][symbol]
            else:
                a, b = tree.left[k], tree.right[k]
                z = np.concatenate([h[a], h[b]]) @ weights["children"] + weights["operator"][symbol]
            cell = sigmoid(z[:n]) * np.tanh(z[4 * n :])
            if not leaf:
                cell = cell + sigmoid(z[n : 2 * n]) * c[a] + sigmoid(z[2 * n : 3 * n]) * c[b]
            c.append(cell)
            h.append(sigmoid(z[3 * n : 4 * n]) * np.tanh(cell))
        roots.append(h[-1])
    logits = np.stack(roots) @ weights["out"] + weights["out_bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-np.mean(log_p[np.arange(len(trees)), labels(trees)]))


async def _resolve(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def check_equivalence(
    hidden: int, batch: int, leaves: int = LEAVES, balanced: bool = False, variants: dict[str, Builder] | None = None
) -> dict[str, float]:
    """Loss and gradients of every available variant from the same float64
    weights: each one's largest relative difference from the NumPy loss and
    from the first variant's gradients. Raises above 1e-9.

    >>> worst = check_equivalence(hidden=2, batch=2, leaves=3)
    >>> worst["monadl"] < 1e-9
    True
    """
    weights = init_weights(hidden, seed=3, dtype=np.float64)
    rng = np.random.default_rng(4)
    trees = [random_tree(rng, leaves, balanced) for _ in range(batch)]
    expected_loss = reference_loss(weights, trees)
    first: Weights | None = None
    worst: dict[str, float] = {}
    for name, build in (variants or VARIANTS).items():
        variant = build(weights)
        if variant is None:
            continue
        with variant.context():
            loss, grads = anyio.run(_resolve, variant.loss_and_gradients(trees))
        first = grads if first is None else first
        errors = [abs(loss - expected_loss) / abs(expected_loss)]
        errors += [float(np.max(np.abs(grads[k] - g)) / (np.max(np.abs(g)) + 1e-300)) for k, g in first.items()]
        worst[name] = max(errors)
        if worst[name] > 1e-9:
            raise AssertionError(f"{name} disagrees by {worst[name]:.1e} (hidden {hidden}, batch {batch})")
    return worst


# ---- the build cost -------------------------------------------------------------------------------
@final
@dataclass(frozen=True, slots=True)
class BuildCost:
    layers: int
    seconds: float
    gc_seconds: float
    collections: int


def count_layers(root: ml.Layer[Any, Any]) -> int:
    """Layers reachable from ``root`` (walks the private ``_inputs``; iterative)."""
    seen, todo = {id(root)}, [root]
    while todo:
        for x in todo.pop()._inputs:
            if isinstance(x, ml.Layer) and id(x) not in seen:
                seen.add(id(x))
                todo.append(x)
    return len(seen)


def build_cost(weights: Weights, trees: list[Tree], operation: bool = False, loom: bool = False) -> BuildCost:
    """Building one batch's training graph, with the collector as a training
    loop has it after its first step (one evaluation of such a graph fits the
    collector's threshold to it; ``operation``: the cell marked as one
    operation; ``loom``: its calls recorded in one ``ml.loom()`` block)."""
    model = TreeLSTM(weights, operation=operation, loom=loom)
    with ml.settings(batching=True) if batching_available() else nullcontext():
        anyio.run(model.loss(trees).predict)
    collecting: list[float] = []
    spent = [0.0, 0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            spent[0] += time.perf_counter() - collecting.pop()
            spent[1] += 1

    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        started = time.perf_counter()
        loss = model.loss(trees)
        seconds = time.perf_counter() - started
    finally:
        gc.callbacks.remove(on_gc)
    return BuildCost(count_layers(loss), seconds, spent[0], int(spent[1]))


# ---- timing -------------------------------------------------------------------------------------
async def _race(
    variants: dict[str, Variant], batches: list[list[Tree]], mode: str, threads: int, seconds: float, rounds: int
) -> dict[str, float]:
    """Best-of-rounds trees per second of each variant; rounds alternate the
    order of the variants so that all see the same machine noise."""
    controller = ThreadpoolController()
    best = dict.fromkeys(variants, 0.0)
    names = list(variants)
    cursor = iter(range(10**9))
    _treelstm_torch.set_threads(min(threads, CORES))
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            variant = variants[name]
            step = variant.train if mode == "train" else variant.infer
            with ml.settings(workers=threads), controller.limit(limits=min(threads, CORES), user_api="blas"):
                trees, started = 0, time.perf_counter()
                while True:
                    batch = batches[next(cursor) % len(batches)]
                    with variant.context():
                        await _resolve(step(batch))
                    trees += len(batch)
                    elapsed = time.perf_counter() - started
                    if elapsed >= seconds / rounds:
                        break
            if r:  # round 0 warms up
                best[name] = max(best[name], trees / elapsed)
    return best


def run_grid(args: argparse.Namespace) -> None:
    if not _treelstm_torch.available():
        print("torch not installed: pip install torch==2.13.0 (the bench extra); timing monadl only")
    for shape in args.shapes:
        for hidden in args.hidden:
            agree = check_equivalence(min(hidden, 8), 2, balanced=shape == "balanced")
            print(f"# check ({shape}, float64): " + ", ".join(f"{k} {v:.0e}" for k, v in agree.items()), flush=True)
            for batch in args.batch:
                batches = make_batches(batch, 3, shape == "balanced")
                weights = init_weights(hidden)
                builds = [(False, False, ""), (True, False, " (cell as operation)")]
                builds += [(True, True, " (cells in an ml.loom() block)")] if hasattr(ml, "loom") else []
                for operation, loom, label in builds:
                    cost = min(
                        (build_cost(weights, batches[0], operation, loom) for _ in range(3)), key=lambda c: c.seconds
                    )
                    nodes = sum(len(t.symbol) for t in batches[0])
                    print(
                        f"# build{label} ({shape}, H={hidden}, batch {batch}): "
                        f"{cost.layers} layers in {cost.seconds:.3f} s, {1e6 * cost.seconds / cost.layers:.2f} us/layer, "
                        f"{1e6 * cost.seconds / nodes:.2f} us/tree node ({1e6 * (cost.seconds - cost.gc_seconds) / cost.layers:.2f} "
                        f"us/layer without GC); cyclic GC {cost.gc_seconds:.3f} s = {100 * cost.gc_seconds / cost.seconds:.0f}% "
                        f"in {cost.collections} collections",
                        flush=True,
                    )
                for threads in args.threads:
                    chosen = {name: build for name, build in VARIANTS.items() if name in args.variants}
                    variants = {name: v for name, build in chosen.items() if (v := build(weights)) is not None}
                    rates = {
                        mode: anyio.run(_race, variants, batches, mode, threads, args.seconds, args.rounds)
                        for mode in ("train", "infer")
                    }
                    for name in chosen:
                        print(_format(shape, hidden, batch, threads, name, rates), flush=True)


HEADER = (
    f"{'shape':8} {'H':>5} {'batch':>5} {'thr':>3} {'variant':16} {'train/s':>9} {'vs hand':>8} "
    f"{'infer/s':>9} {'vs hand':>8}"
)


def _format(shape: str, hidden: int, batch: int, threads: int, name: str, rates: dict[str, dict[str, float]]) -> str:
    cells = []
    for mode in ("train", "infer"):
        rate, reference = rates[mode].get(name), rates[mode].get(REFERENCE)
        cells.append(f"{rate:9.1f}" if rate else f"{'n/a':>9}")
        cells.append(f"{rate / reference:7.3f}x" if rate and reference else f"{'-':>8}")
    return f"{shape:8} {hidden:5d} {batch:5d} {threads:3d} {name:16} " + " ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Fold's Tree-LSTM benchmark: trees per second, training and inference."
    )
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256], help="state sizes (Fold's: 1024)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=["random", "balanced"], default=["random", "balanced"])
    parser.add_argument("--seconds", type=float, default=6.0, help="timing per variant and cell, over all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="which to time (the ratios need 'torch by depth'; node by node at H = 1024 takes minutes a step)",
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {CORES} cores, python {platform.python_version()}, numpy {np.__version__}, "
        f"torch {_treelstm_torch.version()}; {LEAVES}-leaf trees, float32, Adam; trees per second (best round), "
        f"ratios to '{REFERENCE}'; batching setting: {'yes' if batching_available() else 'n/a'}"
    )
    print(HEADER)
    run_grid(args)


if __name__ == "__main__":
    main()
