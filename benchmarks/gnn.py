"""A message-passing graph network's training step, batched by hand: monadl
with `ml.segment_sum`, monadl with one-hot matrix products, PyTorch with
``index_add``.

The model is a user's (small random molecule-like graphs, 5 to 30 nodes, a
spanning tree plus a few rings; each graph's target a number):

    h_v  = tanh(x_v W_in + b_in)
    m_v  = sum over edges u -> v of relu([h_u ; h_v] W_msg + b_msg)
    h_v <- tanh([h_v ; m_v] W_upd + b_upd)                  (2 rounds)
    y_g  = (sum over v in g of h_v) W_out + b_out

with the mean squared error over a batch of graphs and an Adam step. A
batch's graphs are put side by side (node numbers offset), so a round is a
gather of both ends of every edge, one dense layer over all edges, a sum of
the messages into their target nodes, and one dense layer over all nodes:

* **segment_sum**: the sums by `ml.segment_sum` (messages into nodes, nodes
  into graphs);
* **one-hot**: the same sums as products with one-hot ``(nodes, edges)`` and
  ``(graphs, nodes)`` matrices, what the user wrote before ``segment_sum``:
  ``nodes x edges x hidden`` multiply-adds a round where a scatter has
  ``edges x hidden``;
* **torch**: PyTorch eager, ``zeros(...).index_add(0, ids, rows)`` for both
  sums, ``torch.optim.Adam``.

A step includes putting the batch together (the one-hot matrices too).
Before timing, the three must give the same loss and gradients (float64).
Steps alternate between the variants, batch by batch; each figure is the
median CPU time of a step (``time.process_time``), with the ratio to
PyTorch's, in float64 on one thread (PyTorch's and BLAS's).

Run: ``python benchmarks/gnn.py`` (``--help``; a quick run: ``--hidden 32 --rounds 1``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np
from threadpoolctl import ThreadpoolController

import monadl as ml

FEATURES = 4
ROUNDS = 2
LEARNING_RATE = 1e-2
Weights = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class Graph:
    x: np.ndarray  # (nodes, FEATURES)
    edges: np.ndarray  # (undirected edges, 2), u < v
    target: float


def random_graph(rng: np.random.Generator, min_n: int = 5, max_n: int = 30) -> Graph:
    n = int(rng.integers(min_n, max_n + 1))
    edges = {(int(rng.integers(0, v)), v) for v in range(1, n)}  # a random spanning tree: connected
    for _ in range(int(rng.integers(1, max(2, n // 3)))):  # a few more edges: rings
        u, v = sorted(int(a) for a in rng.choice(n, 2, replace=False))
        edges.add((u, v))
    e = np.array(sorted(edges), dtype=np.int64)
    x = rng.normal(size=(n, FEATURES))
    degree = np.bincount(e.ravel(), minlength=n)
    return Graph(x, e, float(len(e) - n + 1 + 0.1 * np.sum(x[:, 0] * degree)))


def make_graphs(count: int, seed: int) -> list[Graph]:
    rng = np.random.default_rng(seed)
    return [random_graph(rng) for _ in range(count)]


def init_weights(hidden: int, seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    return {
        "w_in": rng.normal(size=(FEATURES, hidden)) / np.sqrt(FEATURES),
        "b_in": np.zeros(hidden),
        "w_msg": rng.normal(size=(2 * hidden, hidden)) / np.sqrt(2 * hidden),
        "b_msg": np.full(hidden, 0.1),
        "w_upd": rng.normal(size=(2 * hidden, hidden)) / np.sqrt(2 * hidden),
        "b_upd": np.zeros(hidden),
        "w_out": rng.normal(size=(hidden, 1)) / np.sqrt(hidden),
        "b_out": np.zeros(1),
    }


@dataclass(frozen=True, slots=True)
class Batch:
    """Graphs side by side: node features, each directed edge's ends, each node's graph."""

    x: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    graph: np.ndarray
    target: np.ndarray  # (graphs, 1)


def collate(graphs: Sequence[Graph]) -> Batch:
    xs, srcs, dsts, ids = [], [], [], []
    offset = 0
    for i, g in enumerate(graphs):
        u, v = g.edges[:, 0] + offset, g.edges[:, 1] + offset
        xs.append(g.x)
        srcs += [u, v]
        dsts += [v, u]
        ids.append(np.full(len(g.x), i))
        offset += len(g.x)
    target = np.array([[g.target] for g in graphs])
    return Batch(np.concatenate(xs), np.concatenate(srcs), np.concatenate(dsts), np.concatenate(ids), target)


# ---- monadl ---------------------------------------------------------------------------------------
def segment_sum_loss(w: dict[str, ml.ArrayWeight], b: Batch) -> ml.ScalarLayer:
    nodes, graphs = len(b.x), len(b.target)
    h: ml.ArrayLayer = ml.tanh(ml.dense(b.x, w["w_in"], w["b_in"]))
    for _ in range(ROUNDS):
        messages = ml.relu(ml.dense(ml.concatenate([h[b.src], h[b.dst]], axis=-1), w["w_msg"], w["b_msg"]))
        summed = ml.segment_sum(messages, b.dst, nodes)
        h = ml.tanh(ml.dense(ml.concatenate([h, summed], axis=-1), w["w_upd"], w["b_upd"]))
    predictions = ml.dense(ml.segment_sum(h, b.graph, graphs), w["w_out"], w["b_out"])
    return ml.mean((predictions - b.target) ** 2.0)


def one_hot_loss(w: dict[str, ml.ArrayWeight], b: Batch) -> ml.ScalarLayer:
    nodes, graphs = len(b.x), len(b.target)
    into_nodes = np.zeros((nodes, len(b.dst)))
    into_nodes[b.dst, np.arange(len(b.dst))] = 1.0
    into_graphs = np.zeros((graphs, nodes))
    into_graphs[b.graph, np.arange(nodes)] = 1.0
    h: ml.ArrayLayer = ml.tanh(ml.dense(b.x, w["w_in"], w["b_in"]))
    for _ in range(ROUNDS):
        messages = ml.relu(ml.dense(ml.concatenate([h[b.src], h[b.dst]], axis=-1), w["w_msg"], w["b_msg"]))
        h = ml.tanh(ml.dense(ml.concatenate([h, ml.matmul(into_nodes, messages)], axis=-1), w["w_upd"], w["b_upd"]))
    predictions = ml.dense(ml.matmul(into_graphs, h), w["w_out"], w["b_out"])
    return ml.mean((predictions - b.target) ** 2.0)


Loss = Callable[[dict[str, ml.ArrayWeight], Batch], ml.ScalarLayer]


def monadl_step(loss: Loss, weights: Weights) -> Callable[[Sequence[Graph]], Any]:
    w = {k: ml.Weight(v.copy(), optimizer=ml.optim.adam(LEARNING_RATE)) for k, v in weights.items()}
    return lambda graphs: anyio.run(loss(w, collate(graphs)).train)


def monadl_gradients(loss: Loss, weights: Weights, graphs: Sequence[Graph]) -> tuple[float, Weights]:
    w = {k: ml.Weight(v.copy()) for k, v in weights.items()}
    layer = loss(w, collate(graphs))
    value, grads = anyio.run(ml.value_and_gradients, layer)
    return float(value), {k: np.asarray(grads[w[k]]) for k in w}


# ---- PyTorch --------------------------------------------------------------------------------------
def torch_loss(p: dict[str, Any], b: Batch) -> Any:
    import torch

    src, dst, graph = torch.from_numpy(b.src), torch.from_numpy(b.dst), torch.from_numpy(b.graph)
    h = torch.tanh(torch.from_numpy(b.x) @ p["w_in"] + p["b_in"])
    for _ in range(ROUNDS):
        messages = torch.relu(torch.cat([h[src], h[dst]], -1) @ p["w_msg"] + p["b_msg"])
        summed = torch.zeros_like(h).index_add(0, dst, messages)
        h = torch.tanh(torch.cat([h, summed], -1) @ p["w_upd"] + p["b_upd"])
    pooled = torch.zeros(len(b.target), h.shape[1], dtype=h.dtype).index_add(0, graph, h)
    return torch.mean((pooled @ p["w_out"] + p["b_out"] - torch.from_numpy(b.target)) ** 2)


def torch_step(weights: Weights) -> Callable[[Sequence[Graph]], Any]:
    import torch

    p = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    optimizer = torch.optim.Adam(p.values(), lr=LEARNING_RATE)

    def step(graphs: Sequence[Graph]) -> None:
        optimizer.zero_grad()
        torch_loss(p, collate(graphs)).backward()
        optimizer.step()

    return step


def torch_gradients(weights: Weights, graphs: Sequence[Graph]) -> tuple[float, Weights]:
    import torch

    p = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    loss = torch_loss(p, collate(graphs))
    loss.backward()
    return float(loss.detach()), {k: v.grad.numpy() for k, v in p.items()}


VARIANTS: dict[str, Callable[[Weights], Callable[[Sequence[Graph]], Any]]] = {
    "segment_sum": lambda weights: monadl_step(segment_sum_loss, weights),
    "one-hot": lambda weights: monadl_step(one_hot_loss, weights),
    "torch": torch_step,
}


# ---- checking and timing --------------------------------------------------------------------------
def check(hidden: int, names: Sequence[str]) -> float:
    """The largest difference of loss and gradients between the variants, on 8 graphs."""
    weights, graphs = init_weights(hidden), make_graphs(8, 3)
    results = [monadl_gradients(segment_sum_loss, weights, graphs), monadl_gradients(one_hot_loss, weights, graphs)]
    if "torch" in names:
        results.append(torch_gradients(weights, graphs))
    (loss, grads), worst = results[0], 0.0
    for other_loss, other in results[1:]:
        worst = max(worst, abs(loss - other_loss), *(float(np.max(np.abs(grads[k] - other[k]))) for k in grads))
    return worst


def timing(names: Sequence[str], hidden: int, graphs: int, batches: int, rounds: int) -> dict[str, float]:
    """Median CPU seconds a step of each variant; every batch runs each variant in turn."""
    data = make_graphs(graphs * batches, 7)
    chunks = [data[i : i + graphs] for i in range(0, len(data), graphs)]
    weights = init_weights(hidden)
    steps = {name: VARIANTS[name](weights) for name in names}
    for step in steps.values():
        step(chunks[0])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for chunk in chunks:
            for name in names if r % 2 == 0 else names[::-1]:
                started = time.process_time()
                steps[name](chunk)
                seconds[name].append(time.process_time() - started)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--graphs", type=int, default=32, help="graphs a batch")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    versions = f"numpy {np.__version__}"
    if "torch" in args.variants:
        import torch

        torch.set_num_threads(1)
        versions += f", torch {torch.__version__}"
    print(f"# {platform.processor() or platform.machine()}, {versions}")
    print(f"# float64, one thread, {args.graphs} graphs a step, median of {args.rounds} x {args.batches} steps")
    print(f"{'hidden':>6} " + " ".join(f"{n + ' ms':>14}" for n in args.variants) + "  time / torch's")
    with ThreadpoolController().limit(limits=1, user_api="blas"), ml.settings(workers=1):
        for hidden in args.hidden:
            print(f"# check (float64): largest difference {check(hidden, args.variants):.1e}", flush=True)
            median = timing(args.variants, hidden, args.graphs, args.batches, args.rounds)
            ms = " ".join(f"{median[n] * 1e3:14.2f}" for n in args.variants)
            ratios = ", ".join(f"{n} {median[n] / median['torch']:.2f}" for n in args.variants if "torch" in median)
            print(f"{hidden:>6} {ms}  {ratios}", flush=True)


if __name__ == "__main__":
    main()
