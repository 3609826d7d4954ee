"""The limit of `benchmarks.control_flow` in NumPy: the shift-reduce parser of
`examples.shift_reduce` batched by hand across its sentences' decisions, its
backward written by hand, and Adam, with the kernels monadl calls (NumPy's
OpenBLAS, each product by `monadl.layers._products.product`, a weight's delta
one product over all its calls, as the fibers' factored deltas) and no graph
at all.

The sentences run in lock step: each round, every sentence does its forced
moves (shifts while its stack holds fewer than two entries); then the
reductions of all sentences (forced once a buffer is empty, or decided the
round before) run as one product, the trackers of all sentences that must
decide as another, and each sentence does what its own scores predict. The
task heads run together at the end. `Model.sentence` is the same parser
written plainly for one sentence (a list of rows, no lock step): a step per
sentence with it against one batched step is what batching by hand buys
with these kernels, the limit of monadl's fibers against one ``train()``
per sentence. Adam steps the embedding table lazily (the rows looked up),
as monadl steps an embedding's sparse delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, final

import numpy as np

from benchmarks._adam_numpy import adam
from examples.shift_reduce import REDUCE, SHIFT, Parser, Sentence
from monadl.layers._products import product

Array = Any  # (NumPy arrays of the weights' dtype)

NAMES = ("table", "tracker", "tracker_bias", "action", "action_bias", "compose", "compose_bias", "head", "head_bias")
"""The weights in the order of `examples.shift_reduce.Parser.weights`."""


def weights_of(parser: Parser) -> dict[str, Array]:
    """A copy of a monadl parser's weights, by name."""
    return {name: np.array(w.data) for name, w in zip(NAMES, parser.weights(), strict=True)}


@dataclass
class _Fiber:
    """One sentence's parse: its stack (rows of the value store, with the
    token spans they cover), its buffer position, and its finished flag."""

    sentence: Sentence
    first: int  # the value-store row of its first token's leaf
    stack: list[tuple[int, int, int]] = field(default_factory=list)
    i: int = 0
    reducing: bool = False  # it decided to reduce: its composition joins the next round's

    def forced(self) -> str:
        """Do the moves that need no decision; say what comes next:
        ``"compose"``, ``"decide"`` or ``"done"``."""
        if self.reducing:
            self.reducing = False
            return "compose"
        n = len(self.sentence.tokens)
        while len(self.stack) < 2 and self.i < n:
            self.stack.append((self.first + self.i, self.i, self.i + 1))
            self.i += 1
        if len(self.stack) == 1:
            return "done"
        return "compose" if self.i == n else "decide"


@final
class Model:
    """The weights, their Adam moments, and a batch's forward and backward by hand."""

    def __init__(self, weights: dict[str, Array], learning_rate: float = 0.0) -> None:
        self.w = {k: v.copy() for k, v in weights.items()}
        self.hidden = int(self.w["table"].shape[1])
        self.rate = learning_rate
        self.moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in self.w.items()}
        self.steps = 0

    def loss_and_gradients(self, sentences: Sequence[Sentence]) -> tuple[float, dict[str, Array]]:
        """The batch's mean loss (each sentence's task and action cross-entropies), and its gradients."""
        w, h, b = self.w, self.hidden, len(sentences)
        tokens = np.concatenate([np.asarray(s.tokens) for s in sentences])
        # The value store: every token's leaf, then each composition's row as it is made.
        capacity = 2 * len(tokens)
        store = np.empty((capacity, h), dtype=w["table"].dtype)
        store[: len(tokens)] = np.tanh(w["table"][tokens])
        size = len(tokens)
        fibers, start = [], 0
        for s in sentences:
            fibers.append(_Fiber(s, start))
            start += len(s.tokens)
        calls: list[tuple[Any, ...]] = []
        active = list(fibers)
        while active:
            compose: list[_Fiber] = []
            decide: list[_Fiber] = []
            for f in active:
                what = f.forced()
                if what == "compose":
                    compose.append(f)
                elif what == "decide":
                    decide.append(f)
            if compose:  # the round's reductions, forced or decided the round before: one product
                size = self._compose(store, size, compose, calls)
            if decide:
                for f, action in zip(decide, self._track(store, decide, calls).argmax(axis=1), strict=True):
                    if action == REDUCE:
                        f.reducing = True
                    else:
                        f.stack.append((f.first + f.i, f.i, f.i + 1))
                        f.i += 1
            active = [f for f in active if not (len(f.stack) == 1 and f.i == len(f.sentence.tokens))]
        roots = np.array([f.stack[0][0] for f in fibers])
        labels = np.array([s.label for s in sentences])
        root_rows = store[roots]
        task = _cross_entropy(root_rows @ w["head"] + w["head_bias"], labels)
        loss = (task[0].sum() + sum(float(c[-1][0].sum()) for c in calls if c[0] == "track")) / b
        grads = self._backward(store, size, tokens, roots, root_rows, task[1], calls, b)
        return float(loss), grads

    def _compose(self, store: Array, size: int, fibers: list[_Fiber], calls: list[tuple[Any, ...]]) -> int:
        w = self.w
        left = np.array([f.stack[-2][0] for f in fibers])
        right = np.array([f.stack[-1][0] for f in fibers])
        x = np.concatenate([store[left], store[right]], axis=1)
        out = np.tanh(product(x, w["compose"]) + w["compose_bias"])
        rows = np.arange(size, size + len(fibers))
        store[rows] = out
        for f, row in zip(fibers, rows, strict=True):
            (_, a, _), (_, _, e) = f.stack[-2], f.stack[-1]
            f.stack[-2:] = [(int(row), a, e)]
        calls.append(("compose", left, right, rows, x, out))
        return size + len(fibers)

    def _track(self, store: Array, fibers: list[_Fiber], calls: list[tuple[Any, ...]]) -> Array:
        """The trackers' scores of the fibers that must decide."""
        w = self.w
        top = np.array([f.stack[-1][0] for f in fibers])
        second = np.array([f.stack[-2][0] for f in fibers])
        head = np.array([f.first + f.i for f in fibers])
        gold = np.array([REDUCE if (f.stack[-2][1], f.stack[-1][2]) in f.sentence.spans else SHIFT for f in fibers])
        x = np.concatenate([store[top], store[second], store[head]], axis=1)
        state = np.tanh(product(x, w["tracker"]) + w["tracker_bias"])
        scores = product(state, w["action"]) + w["action_bias"]
        calls.append(("track", top, second, head, x, state, _cross_entropy(scores, gold)))
        return scores

    def _backward(
        self,
        store: Array,
        size: int,
        tokens: Array,
        roots: Array,
        root_rows: Array,
        d_task: Array,
        calls: list[tuple[Any, ...]],
        b: int,
    ) -> dict[str, Array]:
        w, h = self.w, self.hidden
        grads = {k: np.zeros_like(v) for k, v in w.items()}
        delta = np.zeros((size, h), dtype=store.dtype)
        d_logits = d_task / b
        grads["head"] += root_rows.T @ d_logits
        grads["head_bias"] += d_logits.sum(axis=0)
        delta[roots] += product(d_logits, w["head"].T)
        self._back(calls, delta, grads, b)  # (each call's rows are unique per operand: `+=` by index is exact)
        leaves = store[: len(tokens)]
        d_leaves = delta[: len(tokens)] * (1.0 - leaves * leaves)
        # (the lookup's delta: one one-hot product, as in `benchmarks._treelstm_numpy`)
        grads["table"] += np.eye(len(w["table"]), dtype=d_leaves.dtype)[tokens].T @ d_leaves
        return grads

    def sentence(self, sentence: Sentence) -> tuple[float, dict[str, Array]]:
        """One sentence's loss and gradients, written plainly: its values a
        list of rows, no lock step, no index arrays. (`loss_and_gradients` of
        a single sentence computes the same, paying a batch's bookkeeping.)"""
        w = self.w
        tokens = np.asarray(sentence.tokens)
        n = len(tokens)
        leaves = np.tanh(w["table"][tokens])
        rows = [leaves[i : i + 1] for i in range(n)]  # each entry's (1, h) value: the leaves, then each composition
        stack: list[tuple[int, int, int]] = []  # (its row, the span it covers)
        tape: list[tuple[Any, ...]] = []
        loss, i = 0.0, 0
        while True:
            while len(stack) < 2 and i < n:
                stack.append((i, i, i + 1))
                i += 1
            if len(stack) == 1:
                break
            (left, a, _), (right, _, e) = stack[-2], stack[-1]
            if i < n:  # a decision
                x = np.concatenate([rows[right], rows[left], rows[i]], axis=1)
                state = np.tanh(product(x, w["tracker"]) + w["tracker_bias"])
                scores = product(state, w["action"]) + w["action_bias"]
                nll, d_scores = _cross_entropy(scores, np.array([REDUCE if (a, e) in sentence.spans else SHIFT]))
                loss += float(nll[0])
                tape.append(("track", right, left, i, x, state, (nll, d_scores)))
                if scores[0].argmax() != REDUCE:
                    stack.append((i, i, i + 1))
                    i += 1
                    continue
            x = np.concatenate([rows[left], rows[right]], axis=1)
            rows.append(np.tanh(product(x, w["compose"]) + w["compose_bias"]))
            stack[-2:] = [(len(rows) - 1, a, e)]
            tape.append(("compose", left, right, len(rows) - 1, x, rows[-1]))
        root = rows[stack[0][0]]
        nll, d_logits = _cross_entropy(root @ w["head"] + w["head_bias"], np.array([sentence.label]))
        grads = {k: np.zeros_like(v) for k, v in w.items()}
        grads["head"] += root.T @ d_logits
        grads["head_bias"] += d_logits[0]
        delta: list[Array] = [np.zeros_like(leaves[:1]) for _ in rows]
        delta[stack[0][0]] += product(d_logits, w["head"].T)
        self._back(tape, delta, grads, 1)
        d_leaves = np.concatenate(delta[:n]) * (1.0 - leaves * leaves)
        grads["table"] += np.eye(len(w["table"]), dtype=d_leaves.dtype)[tokens].T @ d_leaves
        return loss + float(nll[0]), grads

    def _back(self, calls: list[tuple[Any, ...]], delta: Any, grads: dict[str, Array], b: int) -> None:
        """Back through the forward's ``calls``, the last first: into ``delta``
        (the values' deltas, indexed by the calls' rows: an array or a list)
        and ``grads``; the action losses' deltas divided by the batch ``b``.
        A weight's delta from all its calls is one product of their rows,
        made at the end."""
        w, h = self.w, self.hidden
        factors: dict[str, tuple[list[Array], list[Array]]] = {k: ([], []) for k in ("action", "tracker", "compose")}
        for call in reversed(calls):
            if call[0] == "track":
                _, top, second, head, x, state, (_, d_scores) = call
                if b != 1:
                    d_scores = d_scores / b
                factors["action"][0].append(state)
                factors["action"][1].append(d_scores)
                grads["action_bias"] += d_scores.sum(axis=0)
                d_pre = product(d_scores, w["action"].T) * (1.0 - state * state)
                factors["tracker"][0].append(x)
                factors["tracker"][1].append(d_pre)
                grads["tracker_bias"] += d_pre.sum(axis=0)
                d_x = product(d_pre, w["tracker"].T)
                delta[top] += d_x[:, :h]
                delta[second] += d_x[:, h : 2 * h]
                delta[head] += d_x[:, 2 * h :]
            else:
                _, left, right, rows, x, out = call
                d_pre = delta[rows] * (1.0 - out * out)
                factors["compose"][0].append(x)
                factors["compose"][1].append(d_pre)
                grads["compose_bias"] += d_pre.sum(axis=0)
                d_x = product(d_pre, w["compose"].T)
                delta[left] += d_x[:, :h]
                delta[right] += d_x[:, h:]
        for name, (xs, ds) in factors.items():
            if xs:
                grads[name] += product(np.concatenate(xs).T, np.concatenate(ds))

    def step(self, grads: dict[str, Array], tokens: Array) -> None:
        """Adam as ``torch.optim.Adam`` takes it (betas 0.9, 0.999; eps 1e-8),
        the table lazily, as monadl steps an embedding's sparse delta: only
        the rows of ``tokens`` (the ones looked up) and their moments."""
        self.steps += 1
        for k, g in grads.items():
            m, v = self.moments[k]
            if k == "table":
                rows = np.unique(tokens)
                weight, m, v, g = self.w[k][rows], m[rows], v[rows], g[rows]
            else:
                weight = self.w[k]
            adam(weight, m, v, g, self.rate, self.steps)
            if k == "table":
                self.w[k][rows], self.moments[k][0][rows], self.moments[k][1][rows] = weight, m, v

    def train(self, sentences: Sequence[Sentence]) -> float:
        """One step: the batch's loss and gradients, then Adam."""
        loss, grads = self.loss_and_gradients(sentences)
        self.step(grads, np.concatenate([np.asarray(s.tokens) for s in sentences]))
        return loss

    def train_sentence(self, sentence: Sentence) -> float:
        """One step on one sentence, by `sentence`."""
        loss, grads = self.sentence(sentence)
        self.step(grads, np.asarray(sentence.tokens))
        return loss


def _cross_entropy(logits: Array, labels: Array) -> tuple[Array, Array]:
    """Per row: the negative log-likelihood of its label, and its delta
    ``softmax - one_hot`` (not yet divided by the batch)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    d = np.exp(log_p)
    d[rows, labels] -= 1.0
    return -log_p[rows, labels], d


def check(parser: Parser, sentences: Sequence[Sentence]) -> float:
    """The largest relative difference of loss and gradients between this
    model (on the parser's weights) and monadl's batch."""
    import anyio

    from monadl.runtime import entry

    model = Model(weights_of(parser))
    loss, grads = model.loss_and_gradients(sentences)
    value, got = anyio.run(entry.gradients, parser.loss(sentences, []))
    worst = abs(float(value) - loss) / abs(loss)
    for name, weight in zip(NAMES, parser.weights(), strict=True):
        g = got.get(weight)
        g = np.zeros_like(grads[name]) if g is None else (g.to_dense() if hasattr(g, "to_dense") else g)
        want = grads[name]
        worst = max(worst, float(np.max(np.abs(np.asarray(g) - want)) / (np.max(np.abs(want)) + 1e-30)))
    return worst


__all__ = ["NAMES", "Model", "check", "weights_of"]
