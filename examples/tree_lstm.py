"""A binary Tree-LSTM on arithmetic expression trees, against a bag-of-symbols baseline.

The task needs the structure: each tree is a random expression over the digits
0-9 with ``+``, ``-`` and ``*`` at its internal nodes, and its label is the
expression's value modulo 10. ``(3 - 5) * 7`` and ``3 - 5 * 7`` hold the same
symbols and have different labels, so a model that only counts symbols is
capped well below a model that reads the tree. The data is generated here,
from a seed: nothing to download, the same trees on every machine.

The model is the N-ary Tree-LSTM of Tai et al. (2015, section 3.2) with N = 2:
at a node with input x and children (h_l, c_l), (h_r, c_r),

    i, f_l, f_r, o, u = W x + U [h_l; h_r] + b   (five slices of one product)
    c = sigmoid(i) * tanh(u) + sigmoid(f_l) * c_l + sigmoid(f_r) * c_r
    h = sigmoid(o) * tanh(c)

where x is a digit at a leaf (which has no children) and an operator at an
internal node; ``W x + b`` is an embedding lookup, since x is one of a few
symbols. It is written the natural way: a Python loop over each tree's nodes
that builds monadl layers node by node, then one ``await loss.train()`` per
mini-batch of trees. The loop visits nodes children first (trees are stored
in that order), so building never recurses and any depth builds. Each node's
cell is marked as one ``ml.operation``, and the batch's trees are built in
one ``with ml.loom():`` block, so their cells' calls run by depth, one
batched call per depth and cell for the whole batch (`tree_logits`).

Run: ``python examples/tree_lstm.py`` (or ``python -m examples.tree_lstm``;
``--help`` for the sizes). Shows a progress bar, prints both models' test
accuracy and writes the training curves to ``tree_lstm.png``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, final

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml
from examples._common import BagOfSymbols as Bag
from examples._common import Curve, Labelled
from examples._device import DEVICES, on_device

DIGITS = 10
OPERATORS = "+-*"
SYMBOLS = DIGITS + len(OPERATORS)  # the bag-of-symbols baseline counts both kinds


# ---- data -----------------------------------------------------------------------------------------
@final
@dataclass(frozen=True, slots=True)
class Tree:
    """A binary tree whose nodes are numbered children first (a node's
    children have smaller numbers than it; the root is the last node).

    Attributes:
        symbol: per node, its digit at a leaf, its operator's index into
            `OPERATORS` at an internal node.
        left, right: per node, its children's numbers; -1 at a leaf.
        label: the expression's value modulo 10.
    """

    symbol: ml.Array
    left: ml.Array
    right: ml.Array
    label: int

    @property
    def leaves(self) -> int:
        return int(np.count_nonzero(self.left < 0))

    def text(self) -> str:
        """The expression, fully parenthesised (for reading, and for tests).

        >>> Tree(np.array([3, 5, 1]), np.array([-1, -1, 0]), np.array([-1, -1, 1]), 8).text()
        '(3 - 5)'
        """
        parts: list[str] = []
        for k in range(len(self.symbol)):
            if self.left[k] < 0:
                parts.append(str(self.symbol[k]))
            else:
                parts.append(f"({parts[self.left[k]]} {OPERATORS[self.symbol[k]]} {parts[self.right[k]]})")
        return parts[-1]


def random_tree(rng: np.random.Generator, leaves: int, balanced: bool = False) -> Tree:
    """A random expression tree over ``leaves`` random digits.

    Its shape comes from merging adjacent subtrees at random until one is
    left (random shapes, as in Fold's "full dynamic" column); ``balanced``
    merges neighbours level by level instead (a perfect tree when ``leaves``
    is a power of two).

    >>> tree = random_tree(np.random.default_rng(0), 4)
    >>> tree.leaves, len(tree.symbol), eval(tree.text()) % 10 == tree.label
    (4, 7, True)
    """
    symbol = list(rng.integers(0, DIGITS, leaves))
    left, right = [-1] * leaves, [-1] * leaves
    value = [int(s) for s in symbol]
    frontier = list(range(leaves))  # the roots of the subtrees still to be joined, left to right

    def join(a: int, b: int) -> int:
        op = int(rng.integers(0, len(OPERATORS)))
        symbol.append(op)
        left.append(a)
        right.append(b)
        x, y = value[a], value[b]
        value.append((x + y, x - y, x * y)[op] % DIGITS)  # mod 10 commutes with +, -, *
        return len(symbol) - 1

    while len(frontier) > 1:
        if balanced:
            pairs = [join(frontier[i], frontier[i + 1]) for i in range(0, len(frontier) - 1, 2)]
            frontier = pairs + frontier[len(frontier) - len(frontier) % 2 :]
        else:
            i = int(rng.integers(0, len(frontier) - 1))
            frontier[i : i + 2] = [join(frontier[i], frontier[i + 1])]
    return Tree(np.array(symbol), np.array(left), np.array(right), value[-1])


def make_trees(count: int, min_leaves: int, max_leaves: int, seed: int) -> list[Tree]:
    """``count`` random trees with a uniform number of leaves in ``[min_leaves, max_leaves]``.

    >>> [t.text() for t in make_trees(2, 2, 3, seed=0)]
    ['((6 + 5) + 2)', '(1 - 8)']
    """
    rng = np.random.default_rng(seed)
    return [random_tree(rng, int(rng.integers(min_leaves, max_leaves + 1))) for _ in range(count)]


def labels(trees: Sequence[Tree]) -> ml.Array:
    return np.array([t.label for t in trees])


# ---- the Tree-LSTM --------------------------------------------------------------------------------
@final
@dataclass(frozen=True, slots=True)
class State:
    """A node's hidden and memory vectors, each of shape ``(1, hidden)``."""

    h: ml.ArrayLayer
    c: ml.ArrayLayer


def init_weights(hidden: int, seed: int = 0, dtype: type[np.floating[Any]] = np.float32) -> dict[str, ml.Array]:
    """One set of initial weights (shared by the benchmark's implementations).

    ``leaf`` and ``operator`` are ``W x + b`` of each symbol (five gate
    slices, i f_l f_r o u), ``children`` is U, ``out``/``out_bias`` classify
    the root. The forget slices start at +1 so memory flows up at first.
    """
    rng = np.random.default_rng(seed)
    g = 5 * hidden
    forget = np.zeros(g)
    forget[hidden : 3 * hidden] = 1.0
    weights = {
        "leaf": rng.normal(0.0, 0.5, (DIGITS, g)) + forget,
        "operator": rng.normal(0.0, 0.5, (len(OPERATORS), g)) + forget,
        "children": rng.normal(0.0, 1.0, (2 * hidden, g)) / np.sqrt(2 * hidden),
        "out": rng.normal(0.0, 1.0, (hidden, DIGITS)) / np.sqrt(hidden),
        "out_bias": np.zeros(DIGITS),
    }
    return {k: v.astype(dtype) for k, v in weights.items()}


Params = Mapping[str, ml.ArrayOperand]
"""The parameters by the names of `init_weights`: weights when training, or
any operands (a gradient check passes its own)."""


def cell(gates: ml.ArrayLayer, hidden: int, children: tuple[State, State] | None) -> State:
    """One node of the N-ary Tree-LSTM (Tai et al. 2015): gates from ``gates``, children' cells if any."""
    n = hidden
    c = ml.sigmoid(gates[:, :n]) * ml.tanh(gates[:, 4 * n :])
    if children is not None:
        left, right = children
        c = c + ml.sigmoid(gates[:, n : 2 * n]) * left.c + ml.sigmoid(gates[:, 2 * n : 3 * n]) * right.c
    return State(ml.sigmoid(gates[:, 3 * n : 4 * n]) * ml.tanh(c), c)


def leaf_node(params: Params, hidden: int, symbol: ml.Array) -> State:
    """A leaf's state: the cell over its digit's gates (``W x + b``, an embedding lookup)."""
    return cell(ml.embedding(params["leaf"], symbol), hidden, None)


def internal_node(params: Params, hidden: int, symbol: ml.Array, left: State, right: State) -> State:
    """An internal node's state: the cell over its operator and its children's states."""
    gates = ml.dense(ml.concatenate([left.h, right.h], axis=1), params["children"])
    gates = gates + ml.embedding(params["operator"], symbol)
    return cell(gates, hidden, (left, right))


@final
@dataclass(frozen=True, slots=True)
class Cells:
    """The two cells over one set of parameters: ``leaf(symbol)`` and
    ``internal(symbol, left, right)``, each either a plain function (every op
    its own layer) or marked as one `ml.operation` (traced once, then ONE node
    of the graph per tree node, batched as a unit by the runtime; the same
    values and gradients). The parameters are bound, not passed per call: an
    operation then reads them from its trace instead of flattening a dict at
    every node."""

    leaf: Callable[[ml.Array], State]
    internal: Callable[[ml.Array, State, State], State]

    @staticmethod
    def of(params: Params, hidden: int, operation: bool = False) -> Cells:
        leaf = functools.partial(leaf_node, params, hidden)
        internal = functools.partial(internal_node, params, hidden)
        if operation:
            return Cells(ml.operation(leaf), ml.operation(internal))
        return Cells(leaf, internal)


def encode(cells: Cells, tree: Tree) -> ml.ArrayLayer:
    """The root's hidden vector, ``(1, hidden)``: one cell per node, children first.

    >>> tree = random_tree(np.random.default_rng(0), 3)
    >>> anyio.run(encode(Cells.of(init_weights(4), 4), tree).predict).shape
    (1, 4)
    """
    states: list[State] = []
    # Per node: its symbol as a one-element view (the lookup's index array),
    # its children as Python ints (NumPy scalars cost more to index with).
    symbols = list(tree.symbol[:, None])
    for symbol, left, right in zip(symbols, tree.left.tolist(), tree.right.tolist()):
        if left < 0:
            states.append(cells.leaf(symbol))
        else:
            states.append(cells.internal(symbol, states[left], states[right]))
    return states[-1].h


def tree_logits(
    params: Params, hidden: int, trees: Sequence[Tree], cells: Cells | None = None, loom: bool = False
) -> ml.ArrayLayer:
    """``(trees, 10)``: the scores of each tree's value mod 10, read from its root.
    ``loom``: the trees' cells (marked operations) recorded in one ``ml.loom()``
    block, computed by depth as one node (the same values and gradients).

    >>> trees = make_trees(3, 2, 4, seed=0)
    >>> anyio.run(tree_logits(init_weights(4), 4, trees).predict).shape
    (3, 10)
    """
    cells = cells or Cells.of(params, hidden)
    with ml.loom() if loom else nullcontext():
        roots = ml.concatenate([encode(cells, t) for t in trees], axis=0)
    return ml.dense(roots, params["out"], params["out_bias"])


@final
class TreeLSTM:
    """The binary Tree-LSTM's weights, each trained with Adam."""

    def __init__(
        self,
        weights: dict[str, ml.Array],
        learning_rate: float = 0.01,
        operation: bool = True,
        device: str = "cpu",
        loom: bool = False,
    ) -> None:
        """``operation``: each node one `ml.operation` node (False: every op a layer).
        ``loom``: a batch's cells recorded in an ``ml.loom()`` block (`tree_logits`).
        ``device``: ``"cuda"`` puts the weights on the GPU (CuPy); the trees'
        symbols and labels stay host data, which the lookups and the loss
        check on the host and copy over."""
        self.hidden = int(weights["children"].shape[0]) // 2
        put = on_device(device)
        self.w = {k: ml.Weight(put(v.copy()), optimizer=ml.optim.adam(learning_rate)) for k, v in weights.items()}
        self.cells = Cells.of(self.w, self.hidden, operation)
        self.loom = loom

    def logits(self, trees: Sequence[Tree]) -> ml.ArrayLayer:
        return tree_logits(self.w, self.hidden, trees, self.cells, self.loom)

    def loss(self, trees: Sequence[Tree]) -> ml.ScalarLayer:
        return ml.cross_entropy(self.logits(trees), labels(trees))

    def weights(self) -> dict[str, ml.Array]:
        return {k: w.data for k, w in self.w.items()}


# ---- the baseline ---------------------------------------------------------------------------------
def symbol_counts(trees: Sequence[Tree]) -> ml.Array:
    """``(trees, 13)``: how often each digit and each operator occurs in each tree.

    >>> tree = Tree(np.array([3, 5, 1]), np.array([-1, -1, 0]), np.array([-1, -1, 1]), 8)
    >>> symbol_counts([tree]).astype(int).tolist()
    [[0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0]]
    """
    counts = np.zeros((len(trees), SYMBOLS), np.float32)
    for row, tree in enumerate(trees):
        leaf = tree.left < 0
        np.add.at(counts[row], tree.symbol[leaf], 1.0)
        np.add.at(counts[row], DIGITS + tree.symbol[~leaf], 1.0)
    return counts


@final
class BagOfSymbols:
    """The structure-blind baseline: the sum of the tree's symbol embeddings
    (digits and operators), then a ReLU layer (`examples._common.BagOfSymbols`)."""

    def __init__(self, hidden: int, seed: int = 0, learning_rate: float = 0.01) -> None:
        self.bag = Bag(SYMBOLS, DIGITS, hidden, seed, learning_rate)

    def logits(self, trees: Sequence[Tree]) -> ml.ArrayLayer:
        return self.bag.logits_of_counts(symbol_counts(trees))

    def loss(self, trees: Sequence[Tree]) -> ml.ScalarLayer:
        return ml.cross_entropy(self.logits(trees), labels(trees))


# ---- training -------------------------------------------------------------------------------------
LABELLED: Final[Labelled[Tree]] = Labelled(labels)


@final
@dataclass(frozen=True, slots=True)
class Result:
    tree_lstm: Curve
    baseline: Curve
    majority: float  # accuracy of always answering the most frequent training label


async def run(
    epochs: int = 6,
    hidden: int = 64,
    batch: int = 32,
    seed: int = 0,
    train_size: int = 10000,
    test_size: int = 1000,
    max_leaves: int = 5,
    progress: bool = True,
    device: str = "cpu",
) -> Result:
    """Train both models on the same trees; the test trees come from another seed.
    ``device``: the Tree-LSTM's (the small baseline stays on the host)."""
    train = make_trees(train_size, 2, max_leaves, seed)
    test = make_trees(test_size, 2, max_leaves, seed + 1_000_003)
    majority = float(np.mean(labels(test) == np.argmax(np.bincount(labels(train), minlength=DIGITS))))
    model = TreeLSTM(init_weights(hidden, seed), device=device, loom=True)
    tree_lstm = await LABELLED.fit(model, train, test, epochs, batch, seed, "Tree-LSTM", progress)
    bag = BagOfSymbols(hidden, seed)
    baseline = await LABELLED.fit(bag, train, test, epochs, batch, seed, "bag of symbols", progress)
    return Result(tree_lstm, baseline, majority)


def plot(result: Result, path: str, task: str = "value mod 10, test trees") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for curve, name in ((result.tree_lstm, "Tree-LSTM"), (result.baseline, "bag of symbols")):
        epochs = np.arange(1, len(curve.losses) + 1)
        loss_axis.plot(epochs, curve.losses, label=name)
        accuracy_axis.plot(epochs, curve.accuracies, label=name)
    accuracy_axis.axhline(result.majority, color="gray", linestyle=":", label="majority label")
    loss_axis.set(xlabel="epoch", ylabel="training cross-entropy", title="training loss")
    accuracy_axis.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1), title=task)
    loss_axis.legend()
    accuracy_axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a binary Tree-LSTM on arithmetic expressions (value mod 10).")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="trees per training step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=10000)
    parser.add_argument("--max-leaves", type=int, default=5, help="trees have 2 to this many leaves")
    parser.add_argument("--plot", default="tree_lstm.png", help="where to write the training curves (PNG)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="cuda: the Tree-LSTM on the GPU (CuPy)")
    args = parser.parse_args()
    result = anyio.run(
        lambda: run(
            args.epochs,
            args.hidden,
            args.batch,
            args.seed,
            args.train_size,
            max_leaves=args.max_leaves,
            device=args.device,
        )
    )
    plot(result, args.plot)
    for curve, name in ((result.tree_lstm, "Tree-LSTM"), (result.baseline, "bag of symbols")):
        print(f"{name:15} test accuracy {curve.accuracies[-1]:.3f}  ({curve.seconds:.1f} s of training)")
    print(f"{'majority label':15} test accuracy {result.majority:.3f}  (curves in {args.plot})")


if __name__ == "__main__":
    main()
