"""The Tree-LSTM benchmark (`benchmarks.treelstm`) on a GPU: monadl on CuPy against PyTorch CUDA.

The same trees, weights and model as the CPU benchmark, on one CUDA device:

* **monadl**: every op a layer, batching off (node by node) and on;
* **monadl cell**: each node's cell marked as one `ml.operation`, batching
  on and off, its embedding lookups outside the operation (a node's symbol
  is host data: a lookup checks it on the host and copies it over). This is
  the form measured on the H200 in `BENCHMARKS.md` before 2026-11-27;
* **monadl cell inside**: the example's own marked cells, the lookups inside
  them (one node a tree node: an operation's integer data arguments are
  indices, copied over by its lookups);
* **monadl loom**: those cells of a batch recorded in one ``ml.loom()``
  block (one node, run by depth: each depth's calls of a cell one call of
  its batching rule, over rows gathered from arenas on the device);
* **monadl fold**: the Fold-block version (`examples.tree_lstm_fold`), whose
  batch is recorded in a loom too;
* **torch per-node** and **torch by depth**: PyTorch CUDA eager, as on the CPU.

Every step reads its loss back to the host, so the GPU's work is inside the
time. Before timing, each variant's loss and gradients from the same weights
must agree with PyTorch by depth (float32 on the device: to 1e-3). Needs CuPy
and a CUDA build of PyTorch. Run: ``python -m benchmarks.treelstm_cuda``
(``--help``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml
from benchmarks import _treelstm_torch
from benchmarks.treelstm import Variant, Weights, make_batches
from examples.tree_lstm import Cells, State, Tree, cell, encode, init_weights, labels

REFERENCE = "torch by depth"


def _device_cells(params: Any, hidden: int) -> Cells:
    """The cells marked as operations, over gates looked up outside them."""

    def leaf(gates: ml.ArrayLayer) -> State:
        return cell(gates, hidden, None)

    def internal(op_gates: ml.ArrayLayer, left: State, right: State) -> State:
        gates = ml.dense(ml.concatenate([left.h, right.h], axis=1), params["children"]) + op_gates
        return cell(gates, hidden, (left, right))

    leaf_op, internal_op = ml.operation(leaf), ml.operation(internal)
    return Cells(
        lambda symbol: leaf_op(ml.embedding(params["leaf"], symbol)),
        lambda symbol, left, right: internal_op(ml.embedding(params["operator"], symbol), left, right),
    )


def _monadl(weights: Weights, batching: bool, operation: bool, inside: bool = False, loom: bool = False) -> Variant:
    """``inside``: the example's own marked cells, their lookups inside them (one node a tree node);
    ``loom``: those cells recorded in one ``ml.loom()`` block."""
    import cupy

    hidden = int(weights["children"].shape[0]) // 2
    w = {k: ml.Weight(cupy.asarray(v), optimizer=ml.optim.adam(0.01)) for k, v in weights.items()}
    names = list(w)
    if inside or loom:
        cells = Cells.of(w, hidden, operation=True)
    else:
        cells = _device_cells(w, hidden) if operation else Cells.of(w, hidden)

    def loss(trees: list[Tree]) -> ml.ScalarLayer:
        return ml.cross_entropy(logits(trees), labels(trees))  # host labels: checked there, copied over

    def logits(trees: list[Tree]) -> ml.ArrayLayer:
        # The example's loop: a node's symbol is a host view (a lookup checks it there and copies it over).
        with ml.loom() if loom else nullcontext():
            roots = ml.concatenate([encode(cells, t) for t in trees], axis=0)
        return ml.dense(roots, w["out"], w["out_bias"])

    async def train(trees: list[Tree]) -> float:
        with ml.settings(batching=batching):
            return float(await loss(trees).train())

    async def infer(trees: list[Tree]) -> Any:
        with ml.settings(batching=batching):
            out = await logits(trees).predict()
        cupy.cuda.get_current_stream().synchronize()
        return out

    async def loss_and_gradients(trees: list[Tree]) -> tuple[float, Weights]:
        with ml.settings(batching=batching):
            value = loss(trees)
            grads = await ml.gradients(value, [w[k] for k in names])
            return float(await value.predict()), {k: cupy.asnumpy(g) for k, g in zip(names, grads)}

    return Variant(train, infer, loss_and_gradients)


def _monadl_fold(weights: Weights) -> Variant:
    """The Fold-block version, its weights on the device."""
    import cupy

    from examples.tree_lstm_fold import FoldTreeLSTM

    model = FoldTreeLSTM(weights, device="cuda")
    names = list(model.w)

    async def train(trees: list[Tree]) -> float:
        with ml.settings(batching=True):
            return float(await model.loss(trees).train())

    async def infer(trees: list[Tree]) -> Any:
        with ml.settings(batching=True):
            out = await model.logits(trees).predict()
        cupy.cuda.get_current_stream().synchronize()
        return out

    async def loss_and_gradients(trees: list[Tree]) -> tuple[float, Weights]:
        with ml.settings(batching=True):
            value = model.loss(trees)
            grads = await ml.gradients(value, [model.w[k] for k in names])
            return float(await value.predict()), {k: cupy.asnumpy(g) for k, g in zip(names, grads)}

    return Variant(train, infer, loss_and_gradients)


def _torch(build: Callable[..., Variant | None]) -> Callable[[Weights], Variant | None]:
    def variant(weights: Weights) -> Variant | None:
        import torch

        made = build(weights, device="cuda")
        if made is None:
            return None

        def infer(trees: list[Tree]) -> Any:
            out = made.infer(trees)
            torch.cuda.synchronize()
            return out

        return Variant(made.train, infer, made.loss_and_gradients)

    return variant


VARIANTS: dict[str, Callable[[Weights], Variant | None]] = {
    "monadl": lambda w: _monadl(w, batching=False, operation=False),
    "monadl batching": lambda w: _monadl(w, batching=True, operation=False),
    "monadl cell off": lambda w: _monadl(w, batching=False, operation=True),
    "monadl cell": lambda w: _monadl(w, batching=True, operation=True),
    "monadl cell inside": lambda w: _monadl(w, batching=True, operation=True, inside=True),
    "monadl loom": lambda w: _monadl(w, batching=True, operation=True, loom=True),
    "monadl fold": _monadl_fold,
    "torch per-node": _torch(_treelstm_torch.per_node),
    "torch by depth": _torch(_treelstm_torch.by_depth),
}


async def _call(f: Callable[[list[Tree]], Any], trees: list[Tree]) -> Any:
    result = f(trees)
    return await result if hasattr(result, "__await__") else result


def check(variants: dict[str, Variant], trees: list[Tree]) -> dict[str, float]:
    """Each variant's largest relative difference from the reference's loss and gradients."""
    results = {name: anyio.run(_call, v.loss_and_gradients, trees) for name, v in variants.items()}
    loss, grads = results[REFERENCE]
    worst = {}
    for name, (other_loss, other_grads) in results.items():
        errors = [abs(other_loss - loss) / abs(loss)]
        errors += [float(np.max(np.abs(other_grads[k] - g)) / (np.max(np.abs(g)) + 1e-30)) for k, g in grads.items()]
        worst[name] = max(errors)
    return worst


async def _race(
    variants: dict[str, Variant], batches: list[list[Tree]], mode: str, seconds: float, rounds: int
) -> dict[str, float]:
    """Best-of-rounds trees per second; rounds alternate the order; round 0 warms up."""
    best = dict.fromkeys(variants, 0.0)
    names = list(variants)
    cursor = 0
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            step = variants[name].train if mode == "train" else variants[name].infer
            trees, started = 0, time.perf_counter()
            while True:
                batch = batches[cursor % len(batches)]
                cursor += 1
                await _call(step, batch)
                trees += len(batch)
                elapsed = time.perf_counter() - started
                if elapsed >= seconds / rounds or (r == 0 and elapsed >= 0.5):
                    break
            if r:
                best[name] = max(best[name], trees / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description="The Tree-LSTM benchmark on a GPU: monadl on CuPy, PyTorch CUDA.")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--shapes", nargs="+", choices=["random", "balanced"], default=["random"])
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per variant and cell, over all rounds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    import cupy
    import torch

    print(
        f"device: {torch.cuda.get_device_name()}, cupy {cupy.__version__}, torch {torch.__version__}, "
        f"python {platform.python_version()}, numpy {np.__version__}; 128-leaf trees, float32, Adam; "
        f"trees per second (best round), ratios to '{REFERENCE}'",
        flush=True,
    )
    print(
        f"{'shape':8} {'H':>5} {'batch':>5} {'variant':16} {'train/s':>9} {'vs hand':>8} {'infer/s':>9} {'vs hand':>8}"
    )
    for shape in args.shapes:
        for hidden in args.hidden:
            weights = init_weights(hidden)
            chosen = dict.fromkeys([*args.variants, REFERENCE])
            variants = {n: v for n in chosen if (v := VARIANTS[n](weights)) is not None}
            agree = check(variants, make_batches(2, 1, shape == "balanced", seed=5)[0])
            print(f"# check ({shape}, H={hidden}, float32): " + ", ".join(f"{k} {v:.0e}" for k, v in agree.items()))
            bad = {k: v for k, v in agree.items() if v > 1e-3}
            if bad:
                raise AssertionError(f"variants disagree with {REFERENCE}: {bad}")
            for batch in args.batch:
                batches = make_batches(batch, 3, shape == "balanced")
                rates = {
                    mode: anyio.run(_race, variants, batches, mode, args.seconds, args.rounds)
                    for mode in ("train", "infer")
                }
                for name in variants:
                    cells = []
                    for mode in ("train", "infer"):
                        rate, ref = rates[mode][name], rates[mode][REFERENCE]
                        cells += [f"{rate:9.1f}", f"{rate / ref:7.3f}x"]
                    print(f"{shape:8} {hidden:5d} {batch:5d} {name:16} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
