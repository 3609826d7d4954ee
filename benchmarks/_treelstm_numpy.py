"""The limit of `benchmarks.treelstm` in NumPy: the Tree-LSTM batched by hand
by depth, its backward written by hand, and Adam, with the kernels monadl
calls (NumPy's OpenBLAS) and no graph at all.

"torch by depth" is the peer; this is what monadl's own kernels allow for the
same schedule: a marked cell's step is this one's plus monadl's per-node
work (building the graph, grouping it, the records of each member).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import numpy as np

import monadl as ml
from benchmarks._adam_numpy import adam
from benchmarks._treelstm_torch import Schedule, schedule
from examples.tree_lstm import Tree, labels

if TYPE_CHECKING:
    from benchmarks.treelstm import Variant, Weights


def _sigmoid(x: ml.Array) -> ml.Array:
    # (through tanh: one transcendental pass, in place, and no overflow for large |x|)
    y = np.tanh(0.5 * x)
    y *= 0.5
    y += 0.5
    return y


def _rows_summed(symbols: ml.Array, deltas: ml.Array, table: ml.Array) -> ml.Array:
    """The lookup's delta to its table: ``deltas`` summed per symbol, as one
    one-hot product (``np.add.at`` took a third of the step)."""
    return np.eye(len(table), dtype=deltas.dtype)[symbols].T @ deltas


@final
class _Level:
    """What one height's forward keeps for its backward."""

    __slots__ = ("c", "c_children", "gates", "nodes", "tanh_c", "x")

    def __init__(
        self, nodes: ml.Array, x: ml.Array | None, gates: ml.Array, c_children: ml.Array | None, c: ml.Array
    ) -> None:
        self.nodes, self.x, self.gates, self.c_children, self.c = nodes, x, gates, c_children, c
        self.tanh_c = np.tanh(c)


@final
class _Model:
    """The weights, their Adam moments, and one batch's forward and backward by hand."""

    def __init__(self, weights: Weights, learning_rate: float = 0.01) -> None:
        self.w = {k: v.copy() for k, v in weights.items()}
        self.hidden = int(weights["children"].shape[0]) // 2
        self.rate = learning_rate
        self.moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in self.w.items()}
        self.steps = 0

    def _cell(self, gates: ml.Array, children: ml.Array | None) -> tuple[ml.Array, ml.Array]:
        """``(activated gates, c)``: gates ``i f_l f_r o u`` activated in place of a copy."""
        n = self.hidden
        act = _sigmoid(gates)
        act[:, 4 * n :] = np.tanh(gates[:, 4 * n :])
        c = act[:, :n] * act[:, 4 * n :]
        if children is not None:
            c += act[:, n : 2 * n] * children[:, n : 2 * n] + act[:, 2 * n : 3 * n] * children[:, 3 * n :]
        return act, c

    def forward(self, trees: list[Tree]) -> tuple[Schedule, ml.Array, list[_Level], list[ml.Array]]:
        """The roots' hidden rows, each height's saved values, and the states ``[h, c]`` per height."""
        n, w = self.hidden, self.w
        plan = schedule(trees)
        symbols = np.concatenate([t.symbol for t in trees])
        levels: list[_Level] = []
        states: list[ml.Array] = []
        for depth, nodes in enumerate(plan.levels):
            if depth == 0:
                x, children = None, None
                gates = w["leaf"][symbols[nodes]]
            else:
                k = len(nodes)
                children = _gather(states, plan, np.concatenate([plan.left[nodes], plan.right[nodes]]))
                # (rows [h_l, c_l] over [h_r, c_r] -> k rows [h_l, c_l, h_r, c_r])
                children = np.concatenate([children[:k], children[k:]], axis=1)
                x = np.concatenate([children[:, :n], children[:, 2 * n : 3 * n]], axis=1)
                gates = x @ w["children"] + w["operator"][symbols[nodes]]
            act, c = self._cell(gates, children)
            level = _Level(nodes, x, act, children, c)
            levels.append(level)
            states.append(np.concatenate([act[:, 3 * n : 4 * n] * level.tanh_c, c], axis=1))
        return plan, _gather(states, plan, plan.roots)[:, :n], levels, states

    def loss_and_gradients(self, trees: list[Tree]) -> tuple[float, Weights]:
        n, w = self.hidden, self.w
        plan, roots, levels, states = self.forward(trees)
        logits = roots @ w["out"] + w["out_bias"]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        y = labels(trees)
        rows = np.arange(len(trees))
        loss = float(-log_p[rows, y].mean())
        d_logits = np.exp(log_p)
        d_logits[rows, y] -= 1.0
        d_logits /= len(trees)
        grads = {k: np.zeros_like(v) for k, v in w.items()}
        grads["out"] = roots.T @ d_logits
        grads["out_bias"] = d_logits.sum(axis=0)
        # Per height, the delta of its rows [h, c]; the roots' h first.
        deltas = [np.zeros_like(s) for s in states]
        _scatter(deltas, plan, plan.roots, np.concatenate([d_logits @ w["out"].T, np.zeros_like(roots)], axis=1))
        symbols = np.concatenate([t.symbol for t in trees])
        for depth in range(len(levels) - 1, -1, -1):
            level, d = levels[depth], deltas[depth]
            act, tanh_c = level.gates, level.tanh_c
            i, o, u = act[:, :n], act[:, 3 * n : 4 * n], act[:, 4 * n :]
            d_h = d[:, :n]
            d_c = d[:, n:] + d_h * o * (1.0 - tanh_c * tanh_c)
            d_gates = np.empty_like(act)
            d_gates[:, :n] = d_c * u * i * (1.0 - i)
            d_gates[:, 3 * n : 4 * n] = d_h * tanh_c * o * (1.0 - o)
            d_gates[:, 4 * n :] = d_c * i * (1.0 - u * u)
            if depth == 0:
                d_gates[:, n : 3 * n] = 0.0
                grads["leaf"] += _rows_summed(symbols[level.nodes], d_gates, w["leaf"])
                continue
            children = level.c_children
            assert children is not None and level.x is not None
            f_l, f_r = act[:, n : 2 * n], act[:, 2 * n : 3 * n]
            d_gates[:, n : 2 * n] = d_c * children[:, n : 2 * n] * f_l * (1.0 - f_l)
            d_gates[:, 2 * n : 3 * n] = d_c * children[:, 3 * n :] * f_r * (1.0 - f_r)
            grads["children"] += level.x.T @ d_gates
            grads["operator"] += _rows_summed(symbols[level.nodes], d_gates, w["operator"])
            d_x = d_gates @ w["children"].T
            d_left = np.concatenate([d_x[:, :n], d_c * f_l], axis=1)
            d_right = np.concatenate([d_x[:, n:], d_c * f_r], axis=1)
            _scatter(deltas, plan, plan.left[level.nodes], d_left)
            _scatter(deltas, plan, plan.right[level.nodes], d_right)
        return loss, grads

    def step(self, grads: Weights) -> None:
        """Adam as ``torch.optim.Adam`` takes it (betas 0.9, 0.999; eps 1e-8)."""
        self.steps += 1
        for k, g in grads.items():
            adam(self.w[k], *self.moments[k], g, self.rate, self.steps)


def _gather(states: list[ml.Array], plan: Schedule, nodes: ml.Array) -> ml.Array:
    """Rows ``[h, c]`` of ``nodes`` in their order: one take per source height."""
    sources = plan.height[nodes]
    heights = np.unique(sources)
    if len(heights) == 1:
        rows: ml.Array = states[heights[0]][plan.row[nodes]]
        return rows
    out = np.empty((len(nodes), states[0].shape[1]), states[0].dtype)
    for h in heights:
        pick = np.flatnonzero(sources == h)
        out[pick] = states[h][plan.row[nodes[pick]]]
    return out


def _scatter(deltas: list[ml.Array], plan: Schedule, nodes: ml.Array, rows: ml.Array) -> None:
    """Add ``rows`` to the deltas of ``nodes`` (each node has one parent: no two rows meet)."""
    sources = plan.height[nodes]
    for h in np.unique(sources):
        pick = np.flatnonzero(sources == h)
        deltas[h][plan.row[nodes[pick]]] += rows[pick]


def by_depth(weights: Weights) -> Variant:
    """NumPy batched by hand by depth: the same schedule as "torch by depth"."""
    from benchmarks.treelstm import Variant

    model = _Model(weights)

    def train(trees: list[Tree]) -> float:
        loss, grads = model.loss_and_gradients(trees)
        model.step(grads)
        return loss

    def infer(trees: list[Tree]) -> Any:
        _, roots, _, _ = model.forward(trees)
        return roots @ model.w["out"] + model.w["out_bias"]

    return Variant(train, infer, model.loss_and_gradients)
