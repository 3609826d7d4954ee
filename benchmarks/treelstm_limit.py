"""The floor under the Tree-LSTM's targets: what a runtime that keeps every op
(or every marked cell) a lazy node must pay in CPython, beside the same work
batched by hand.

Issue 15 asks the fully unannotated recursion (`examples.tree_lstm`'s model,
every op its own layer: about 15.5 layers a tree node; "ops" here) to train
at >= 0.35x PyTorch batched by hand by depth at H = 128 and >= 0.6x at
H = 256, and the same recursion with its cell marked as one operation (one
node a tree node; "cell") at >= 0.9x at both (batch 32, one thread).
Whatever the scheduler, a step of such a runtime contains, per batch of
trees:

* **build**: the user's recursion building its nodes; at least what the
  same recursion costs building bare nodes (`Bare`: an object per op, or per
  marked cell's call, with its op, operands, parameters and the user's line,
  which errors must name), less than monadl's own build ("mbuild");
* **walk**: finding the graph from the loss: one visit per node and per
  edge, a set of the nodes seen (no sort, no records). A lazy runtime (as
  monadl is: layers built once may be evaluated in many steps, shared, or
  dropped unevaluated) pays it; one that records each node as it is built,
  as DyNet does, does not;
* **group**: putting each node in a group: one pass in topological order,
  its depth from its operands' and one dictionary append by (depth, op):
  coarser than any correct signature, which must read operand shapes too;
* **free**: dropping the graph (a bare node and its tuples each);
* **compute**: the arithmetic, at best the hand-batched NumPy step of
  `benchmarks._treelstm_numpy` (the kernels monadl calls), less its own
  analysis of the trees' structure ("sched": what walk and group replace).

Their sum is a floor: it leaves out placing each result, the backward's
bookkeeping and every check. The ratio ``torch by depth / floor`` is then the
most such a runtime can reach: "floor/t" for a lazy runtime, "eager/t"
without the walk. "mbuild/t" keeps monadl's own build and gives it a runtime
that costs nothing (no walk, grouping, records or freeing: the hand
kernels alone): the most monadl can reach with its build as it is. The
table prints them beside monadl's own step. Each
figure is the least of ``--steps`` repetitions, in one run; what a timed
call returns is freed after its clock stops (freeing is its own part).

Run: ``python -m benchmarks.treelstm_limit`` (``--help``).
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np
from threadpoolctl import ThreadpoolController

import monadl as ml
from benchmarks import _treelstm_numpy, _treelstm_torch
from benchmarks._treelstm_torch import schedule
from benchmarks.treelstm import make_batches
from examples.tree_lstm import Cells, State, Tree, TreeLSTM, encode, init_weights
from monadl.layers._layer import Layer

TARGETS = {("ops", 128): 0.35, ("ops", 256): 0.6, ("cell", 128): 0.9, ("cell", 256): 0.9}
MODELS = {"ops": False, "cell": True}  # every op a layer; the cell marked as one operation


class Bare:
    """The least a lazy op can be: its op, operands, parameters and the user's line."""

    __slots__ = ("_inputs", "_op", "_params", "_site")  # (a layer's names: `walk` takes either)

    def __init__(self, op: str, inputs: tuple[Any, ...], params: tuple[Any, ...] = ()) -> None:
        self._op, self._inputs, self._params = op, inputs, params
        frame = sys._getframe(2)  # the user's line (the caller of the operator or function)
        self._site = (frame.f_code, frame.f_lasti)

    def __add__(self, other: Any) -> Bare:
        return Bare("add", (self, other))

    def __mul__(self, other: Any) -> Bare:
        return Bare("multiply", (self, other))

    def __getitem__(self, index: Any) -> Bare:
        return Bare("getitem", (self,), (index,))


def _op(name: str) -> Callable[..., Bare]:
    return lambda *inputs: Bare(name, inputs)


sigmoid, tanh, matmul, dense, embedding = map(_op, ["sigmoid", "tanh", "matmul", "dense", "embedding"])


def concatenate(xs: list[Any]) -> Bare:
    return Bare("concatenate", tuple(xs))


def bare_cells(params: dict[str, Any], n: int) -> Cells:
    """`examples.tree_lstm`'s leaf and internal cells, op for op, building `Bare` nodes."""

    def cell(gates: Any, children: tuple[State, State] | None) -> State:
        c = sigmoid(gates[:, :n]) * tanh(gates[:, 4 * n :])
        if children is not None:
            left, right = children
            c = c + sigmoid(gates[:, n : 2 * n]) * left.c + sigmoid(gates[:, 2 * n : 3 * n]) * right.c
        h = sigmoid(gates[:, 3 * n : 4 * n]) * tanh(c)
        return State(*cast(Any, (h, c)))  # (the example's State, holding bare nodes)

    def leaf(symbol: Any) -> State:
        return cell(embedding(params["leaf"], symbol), None)

    def internal(symbol: Any, left: State, right: State) -> State:
        gates = matmul(concatenate([left.h, right.h]), params["children"])  # (ml.dense without a bias)
        return cell(gates + embedding(params["operator"], symbol), (left, right))

    return Cells(leaf, internal)


def bare_marked_cells() -> Cells:
    """The marked cells, bare: one node a call, its operands the symbol and the children's states."""

    def leaf(symbol: Any) -> State:
        node = Bare("leaf cell", (symbol,))
        return State(*cast(Any, (node, node)))

    def internal(symbol: Any, left: State, right: State) -> State:
        node = Bare("internal cell", (symbol, left.h, left.c, right.h, right.c))
        return State(*cast(Any, (node, node)))

    return Cells(leaf, internal)


def bare_loss(cells: Cells, params: dict[str, Any], trees: list[Tree]) -> Bare:
    roots = concatenate([encode(cells, t) for t in trees])
    return Bare("cross_entropy", (dense(roots, params["out"], params["out_bias"]),))


def walk(root: Any, kind: type = Layer) -> list[Any]:
    """Every node of ``kind`` under ``root``, breadth first: the least a runtime does to find its graph."""
    order, seen = [root], {root}
    for node in order:
        for x in node._inputs:
            if type(x) is kind and x not in seen:
                seen.add(x)
                order.append(x)
    return order


def bare_ops(root: Bare) -> Counter[str]:
    """The ops of the bare nodes under ``root``, counted."""
    return Counter(node._op for node in walk(root, Bare))


def layer_ops(root: Any) -> Counter[str]:
    """The ops of the layers under ``root``, counted."""
    return Counter(layer._op.name for layer in walk(root))


def group(order: list[Any]) -> dict[tuple[int, Any], list[Any]]:
    """Each layer of ``order`` (topological) in a group by its depth and op, in one pass."""
    depth: dict[Any, int] = {}
    get = depth.get
    groups: dict[tuple[int, Any], list[Any]] = {}
    add = groups.setdefault
    for node in order:
        d = 0
        for x in node._inputs:
            if type(x) is Layer:
                dx = get(x)
                if dx is not None and dx >= d:
                    d = dx + 1
        depth[node] = d
        add((d, node._op), []).append(node)
    return groups


def analysis(loss: Any, steps: int) -> dict[str, float]:
    """The walk and the grouping of one graph, and its layers."""
    order = sorted(walk(loss), key=lambda layer: layer._serial)
    return {"walk": best(lambda: walk(loss), steps), "group": best(lambda: group(order), steps), "layers": len(order)}


def best(run: Callable[[], Any], steps: int) -> float:
    """The least seconds of ``steps`` calls of ``run``; what a call returns is
    freed after its clock stops."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
        del result
    return min(times)


def measure(hidden: int, balanced: bool, batch: int, steps: int, operation: bool) -> dict[str, float]:
    """Seconds a step, per part and per variant, for one state size and tree
    shape (``operation``: the cell marked as one operation, one node a tree node)."""
    trees = make_batches(batch, 1, balanced)[0]
    weights = init_weights(hidden)
    model = TreeLSTM({k: v.copy() for k, v in weights.items()}, operation=operation)
    parts: dict[str, float] = {}

    async def train(trees: list[Tree]) -> None:
        with ml.settings(batching=True):
            await model.loss(trees).train()

    anyio.run(train, trees)  # warm up: the collector's threshold fits the graph, as in a training loop
    parts["monadl"] = best(lambda: anyio.run(train, trees), steps)
    parts["monadl build"] = best(lambda: model.loss(trees), steps)
    cells = bare_marked_cells() if operation else bare_cells(model.w, model.hidden)
    parts["build"] = best(lambda: bare_loss(cells, model.w, trees), steps)
    if not operation:
        bare, layers = bare_ops(bare_loss(cells, model.w, trees)), layer_ops(model.loss(trees))
        if bare != layers:
            raise AssertionError(f"the bare build is not the model's, op for op: {bare} against {layers}")
    parts.update(analysis(model.loss(trees), steps))

    def free() -> float:
        graph = bare_loss(cells, model.w, trees)
        started = time.perf_counter()
        del graph
        return time.perf_counter() - started

    parts["free"] = min(free() for _ in range(steps))
    numpy_by_depth = _treelstm_numpy.by_depth({k: v.copy() for k, v in weights.items()})
    parts["numpy"] = best(lambda: numpy_by_depth.train(trees), steps)
    parts["sched"] = best(lambda: (schedule(trees), np.concatenate([t.symbol for t in trees])), steps)
    torch_by_depth = (
        _treelstm_torch.by_depth({k: v.copy() for k, v in weights.items()}) if _treelstm_torch.available() else None
    )
    parts["torch"] = best(lambda: torch_by_depth.train(trees), steps) if torch_by_depth is not None else float("nan")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--shapes", nargs="+", choices=["random", "balanced"], default=["random", "balanced"])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=7, help="repetitions of each part; the least counts")
    args = parser.parse_args()
    print(
        f"# {platform.machine()}, Python {platform.python_version()}, NumPy {np.__version__}, one BLAS thread; ms a step"
    )
    print(
        f"{'shape':8} {'H':>5} {'model':5} {'nodes':>7} {'mbuild':>7} {'build':>7} {'walk':>7} {'group':>7} "
        f"{'free':>7} {'numpy':>7} {'sched':>7} {'floor':>7} {'monadl':>7} {'torch':>7} "
        f"{'floor/t':>8} {'eager/t':>8} {'mbuild/t':>8} {'monadl/t':>8} {'target':>7}"
    )
    _treelstm_torch.set_threads(1)
    gc.collect()
    with ThreadpoolController().limit(limits=1, user_api="blas"), ml.settings(workers=1):
        for shape in args.shapes:
            for hidden, model in [(h, m) for h in args.hidden for m in args.models]:
                p = measure(hidden, shape == "balanced", args.batch, args.steps, MODELS[model])
                eager = p["build"] + p["group"] + p["free"] + p["numpy"] - p["sched"]
                floor = eager + p["walk"]
                built = p["monadl build"] + p["numpy"] - p["sched"]  # (monadl's build, then nothing but the kernels)
                ms = {k: 1e3 * v for k, v in p.items()}
                target = TARGETS.get((model, hidden))
                print(
                    f"{shape:8} {hidden:5d} {model:5} {int(p['layers']):7d} {ms['monadl build']:7.1f} "
                    f"{ms['build']:7.1f} {ms['walk']:7.1f} {ms['group']:7.1f} {ms['free']:7.1f} {ms['numpy']:7.1f} "
                    f"{ms['sched']:7.1f} {1e3 * floor:7.1f} {ms['monadl']:7.1f} {ms['torch']:7.1f} "
                    f"{p['torch'] / floor:7.3f}x {p['torch'] / eager:7.3f}x {p['torch'] / built:7.3f}x "
                    f"{p['torch'] / p['monadl']:7.3f}x " + (f"{target:6.2f}x" if target else f"{'-':>7}"),
                    flush=True,
                )


if __name__ == "__main__":
    main()
