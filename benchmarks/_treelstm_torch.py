"""The PyTorch sides of `benchmarks.treelstm`: per node, and batched by hand by depth.

Both start from the same weights as the monadl model (`examples.tree_lstm.init_weights`)
and train with ``torch.optim.Adam``. PyTorch is optional (the bench extra):
every builder returns None without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import numpy as np

import monadl as ml
from examples.tree_lstm import Tree, labels

if TYPE_CHECKING:
    from benchmarks.treelstm import Variant, Weights


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    if not available():
        return "absent"
    import torch

    return str(torch.__version__)


def set_threads(threads: int) -> None:
    if available():
        import torch

        torch.set_num_threads(threads)


@final
class _Model:
    """The weights as PyTorch parameters, Adam, and the head shared by both schedules."""

    def __init__(self, weights: Weights, learning_rate: float = 0.01, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = device
        self.p = {k: torch.nn.Parameter(torch.from_numpy(v.copy()).to(device)) for k, v in weights.items()}
        self.hidden = int(weights["children"].shape[0]) // 2
        self.optimizer = torch.optim.Adam(self.p.values(), lr=learning_rate)

    def cell(self, gates: Any, left_c: Any = None, right_c: Any = None) -> tuple[Any, Any]:
        n, torch = self.hidden, self.torch
        c = torch.sigmoid(gates[:, :n]) * torch.tanh(gates[:, 4 * n :])
        if left_c is not None:
            c = c + torch.sigmoid(gates[:, n : 2 * n]) * left_c + torch.sigmoid(gates[:, 2 * n : 3 * n]) * right_c
        return torch.sigmoid(gates[:, 3 * n : 4 * n]) * torch.tanh(c), c

    def loss(self, roots: Any, trees: list[Tree]) -> Any:
        logits = roots @ self.p["out"] + self.p["out_bias"]
        return self.torch.nn.functional.cross_entropy(logits, self.index(labels(trees)))

    def index(self, ints: ml.Array) -> Any:
        """An index tensor on the model's device (one host-to-device copy on a GPU)."""
        return self.torch.from_numpy(ints).to(self.device)

    def variant(self, roots: Any) -> Variant:
        from benchmarks.treelstm import Variant

        torch = self.torch

        def train(trees: list[Tree]) -> float:
            loss = self.loss(roots(trees), trees)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            return float(loss.detach())

        def infer(trees: list[Tree]) -> Any:
            with torch.no_grad():
                return roots(trees) @ self.p["out"] + self.p["out_bias"]

        def loss_and_gradients(trees: list[Tree]) -> tuple[float, Weights]:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(roots(trees), trees)
            loss.backward()
            return float(loss.detach()), {k: p.grad.cpu().numpy().copy() for k, p in self.p.items()}

        return Variant(train, infer, loss_and_gradients)


def per_node(weights: Weights, device: str = "cpu") -> Variant | None:
    """PyTorch eager, one cell per node in a Python loop: the monadl model's program."""
    if not available():
        return None
    model = _Model(weights, device=device)
    torch, p = model.torch, model.p
    leaf_ids = [torch.tensor([d], device=device) for d in range(10)]
    op_ids = [torch.tensor([o], device=device) for o in range(3)]

    def encode(tree: Tree) -> Any:
        states: list[tuple[Any, Any]] = []
        for k, symbol in enumerate(tree.symbol.tolist()):
            if tree.left[k] < 0:
                states.append(model.cell(p["leaf"].index_select(0, leaf_ids[symbol])))
            else:
                (hl, cl), (hr, cr) = states[tree.left[k]], states[tree.right[k]]
                gates = torch.cat([hl, hr], dim=1) @ p["children"] + p["operator"].index_select(0, op_ids[symbol])
                states.append(model.cell(gates, cl, cr))
        return states[-1][0]

    return model.variant(lambda trees: torch.cat([encode(t) for t in trees], dim=0))


@final
@dataclass(frozen=True, slots=True)
class Schedule:
    """The by-depth schedule of a batch, in NumPy, over the batch's nodes numbered
    tree after tree.

    Attributes:
        levels: per height (leaves are 0, a node is one above its taller
            child), the numbers of its nodes.
        height, row: per node, its height and its row in its height's tensor.
        left, right: per node, its children's numbers (-1 at a leaf).
        roots: each tree's root.
    """

    levels: list[ml.Array]
    height: ml.Array
    row: ml.Array
    left: ml.Array
    right: ml.Array
    roots: ml.Array


def schedule(trees: list[Tree]) -> Schedule:
    """The by-depth schedule of ``trees``.

    >>> from examples.tree_lstm import random_tree
    >>> plan = schedule([random_tree(np.random.default_rng(0), 4, balanced=True)])
    >>> [len(level) for level in plan.levels]
    [4, 2, 1]
    """
    offsets = np.cumsum([0] + [len(t.symbol) for t in trees])
    left = np.concatenate([np.where(t.left < 0, -1, t.left + o) for t, o in zip(trees, offsets)])
    right = np.concatenate([np.where(t.right < 0, -1, t.right + o) for t, o in zip(trees, offsets)])
    internal = np.flatnonzero(left >= 0)
    height = np.zeros(len(left), np.int64)
    while True:  # one pass per level
        new = height.copy()
        new[internal] = np.maximum(height[left[internal]], height[right[internal]]) + 1
        if np.array_equal(new, height):
            break
        height = new
    levels = [np.flatnonzero(height == h) for h in range(int(height.max()) + 1)]
    row = np.zeros(len(left), np.int64)
    for nodes in levels:
        row[nodes] = np.arange(len(nodes))
    return Schedule(levels, height, row, left, right, offsets[1:] - 1)


def by_depth(weights: Weights, device: str = "cpu") -> Variant | None:
    """PyTorch batched by hand: one cell per height, children gathered with
    ``index_select`` from the per-height tensors of ``[h, c]``."""
    if not available():
        return None
    model = _Model(weights, device=device)
    torch, p = model.torch, model.p
    n = model.hidden

    def gather(states: list[Any], plan: Schedule, nodes: ml.Array) -> Any:
        """Rows ``[h, c]`` of ``nodes`` in their order: one index_select per source height."""
        sources = plan.height[nodes]
        heights = np.unique(sources)
        if len(heights) == 1:
            return states[heights[0]].index_select(0, model.index(plan.row[nodes]))
        picks = [np.flatnonzero(sources == h) for h in heights]
        parts = [states[h].index_select(0, model.index(plan.row[nodes[i]])) for h, i in zip(heights, picks)]
        back = np.argsort(np.concatenate(picks))
        return torch.cat(parts, dim=0).index_select(0, model.index(back))

    def roots(trees: list[Tree]) -> Any:
        plan = schedule(trees)
        symbols = np.concatenate([t.symbol for t in trees])
        states = [torch.cat(model.cell(p["leaf"].index_select(0, model.index(symbols[plan.levels[0]]))), dim=1)]
        for nodes in plan.levels[1:]:
            k = len(nodes)
            children = gather(states, plan, np.concatenate([plan.left[nodes], plan.right[nodes]]))
            gates = torch.cat([children[:k, :n], children[k:, :n]], dim=1) @ p["children"]
            gates = gates + p["operator"].index_select(0, model.index(symbols[nodes]))
            states.append(torch.cat(model.cell(gates, children[:k, n:], children[k:, n:]), dim=1))
        return gather(states, plan, plan.roots)[:, :n]

    return model.variant(roots)
