"""An N-ary Tree-LSTM on the Halide expressions of the HISS paper, against a bag-of-tokens baseline.

The data are the HISS paper's (``../shared/data/hiss/``, read from there when
present; ``--data`` names another folder): each line pairs a random Halide
expression with a simpler equivalent its authors found by brute force. The
task: from the expression's tree alone, how short is its simplest known
equivalent? Five classes of the equivalent's length in tokens: 1 (the
expression is a constant or a variable in disguise), 2-7, 8-11, 12-15, and
16 or more. Whether ``v0 - (v0 + v0)`` or ``select(v0 < v0, v1, v2)``
collapses depends on which subtrees meet at which operator, which a bag of
the same tokens cannot see.

Trees: ``min`` and ``max`` take two arguments and ``select`` three, ``!``
one, the infix operators two (by Halide's precedence: ``||`` below ``&&``
below comparisons below ``+ -`` below ``* /``); leaves are constants (``0``,
``1``, ..., ``True``, ``False``, and in ``halide_var3_d2.jsonl`` the symbolic
``c0``, ``c1``, ...) and variables (``v0``, ``v1``, ...). So a node has 0 to 3
children.

The model is the N-ary Tree-LSTM of Tai et al. (2015, section 3.2) with
N = 3, one matrix and one forget gate per child position: at a node with
symbol x and children (h_k, c_k), k < its arity,

    i, o, u, f_1, f_2, f_3 = E[x] + sum_k h_k U_k    (six slices of the gates)
    c = sigmoid(i) * tanh(u) + sum_k sigmoid(f_k) * c_k
    h = sigmoid(o) * tanh(c)

One Python function computes a node from its children's states, whatever
their number; marked as one `ml.operation`, it is traced once per arity, and
the runtime batches each arity's nodes across the batch's trees.

Run: ``python examples/halide_tree_lstm.py`` (``--help`` for the sizes).
Shows a progress bar, prints both models' test accuracy beside the majority
class's, and writes the training curves to ``halide_tree_lstm.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, final

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml
from examples._common import BagOfSymbols, Labelled
from examples.tree_lstm import Result, State, plot

DATA: Final = Path(__file__).resolve().parents[2] / "shared" / "data" / "hiss"
"""Where the project's shared data keeps the HISS pairs (``--data`` for elsewhere)."""
FILE: Final = "halide_var3_d3.jsonl"

FUNCTIONS: Final = {"min": 2, "max": 2, "select": 3}
PRECEDENCE: Final = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
}
TIGHTNESS: Final = {**PRECEDENCE, "!": max(PRECEDENCE.values()) + 1}  # (a prefix: tighter than all)
ARITY: Final = 3  # the most children a node has (select's)
BUCKETS: Final = (1, 7, 11, 15)  # the simplest equivalent's tokens: <= 1, <= 7, <= 11, <= 15, more
CLASSES: Final = len(BUCKETS) + 1
FEWEST: Final = 10  # the fewest trees `run` takes: a fifth of them, at least 2, to test on
LEAF: Final = re.compile(r"[vc][0-9]+|[0-9]+|True|False")  # a variable, a symbolic or literal constant
TOKENS: Final = "min max select ! || && == != < <= > >= + - * / ( ) , v0 v1 ... c0 c1 ... 0 1 ... True False"


# ---- data -----------------------------------------------------------------------------------------
@final
@dataclass(frozen=True, slots=True)
class Tree:
    """An expression's tree, its nodes numbered children first (the root last).

    Attributes:
        tokens: per node, its operator or leaf token.
        children: per node, its children's numbers (smaller than its own).
        label: the class of its simplest known equivalent's length (`bucket`).
    """

    tokens: tuple[str, ...]
    children: tuple[tuple[int, ...], ...]
    label: int

    def text(self) -> str:
        """The expression, its infix operations parenthesised.

        >>> parse_tree("v0 - ( v0 + v0 )".split(), 0).text()
        '(v0 - (v0 + v0))'
        """
        parts: list[str] = []
        for token, kids in zip(self.tokens, self.children):
            args = [parts[k] for k in kids]
            if token in FUNCTIONS:
                parts.append(f"{token}({', '.join(args)})")
            elif token == "!":
                parts.append(f"!{args[0]}")
            else:
                parts.append(f"({args[0]} {token} {args[1]})" if args else token)
        return parts[-1]


@final
@dataclass(slots=True)
class _Bracket:
    """A bracket `parse_tree` is inside (or the whole expression): its function, if any, the commas it
    still needs, and its operators still waiting for their right operand (the tightest last)."""

    function: str | None = None
    commas: int = 0
    operators: list[str] = field(default_factory=list)


def parse_tree(tokens: Sequence[str], label: int) -> Tree:
    """The tree of one expression's tokens (shunting-yard, with one stack of waiting operators per
    open bracket and no recursion, so that any depth parses; infix operators of equal precedence
    group to the left, ``!`` binds tighter than all of them).

    >>> parse_tree("select ( v0 < v1 , ! v2 , v0 * v1 + v2 )".split(), 0).text()
    'select((v0 < v1), !v2, ((v0 * v1) + v2))'
    >>> parse_tree("v0 + ( v1".split(), 0)
    Traceback (most recent call last):
    ...
    ValueError: expected ')' at token 5 of 'v0 + ( v1', found the end
    """
    nodes: list[str] = []
    children: list[tuple[int, ...]] = []
    roots: list[int] = []  # the subtrees read and not yet any node's children, left to right
    brackets = [_Bracket()]  # the innermost last; the first is the whole expression
    at = 0

    def fail(expected: str) -> ValueError:
        found = repr(tokens[at]) if at < len(tokens) else "the end"
        return ValueError(f"expected {expected} at token {at + 1} of {shorten(' '.join(tokens))!r}, found {found}")

    def node(token: str, arity: int) -> None:
        nodes.append(token)
        children.append(tuple(roots[len(roots) - arity :]))
        del roots[len(roots) - arity :]
        roots.append(len(nodes) - 1)

    def close(weakest: int) -> None:  # the innermost bracket's operators binding at least as tightly
        waiting = brackets[-1].operators
        while waiting and TIGHTNESS[waiting[-1]] >= weakest:
            operator = waiting.pop()
            node(operator, 1 if operator == "!" else 2)

    operand = True  # whether an operand comes next (else an infix operator or the bracket's end)
    while True:
        token = tokens[at] if at < len(tokens) else None
        bracket = brackets[-1]
        if operand:
            if token == "!":
                bracket.operators.append(token)
            elif token == "(":
                brackets.append(_Bracket())
            elif token in FUNCTIONS:
                at += 1
                if at >= len(tokens) or tokens[at] != "(":
                    raise fail("'('")
                brackets.append(_Bracket(token, FUNCTIONS[token] - 1))
            elif token is not None and LEAF.fullmatch(token):
                node(token, 0)
                operand = False
            else:
                raise fail("an operand")
        elif token in PRECEDENCE:
            close(PRECEDENCE[token])
            bracket.operators.append(token)
            operand = True
        else:  # the end of an argument, of a bracket, or of the whole
            end = None if len(brackets) == 1 else "," if bracket.commas else ")"
            if token != end:
                raise fail("the end" if end is None else repr(end))
            close(0)
            if end is None:
                return Tree(tuple(nodes), tuple(children), label)
            if end == ",":
                bracket.commas -= 1
                operand = True
            else:
                brackets.pop()
                if bracket.function is not None:
                    node(bracket.function, FUNCTIONS[bracket.function])
        at += 1


def bucket(length: int) -> int:
    """The class of an equivalent of ``length`` tokens.

    >>> [bucket(n) for n in (1, 2, 7, 8, 15, 16)]
    [0, 1, 1, 2, 3, 4]
    """
    return bisect_left(BUCKETS, length)


def load(path: Path, limit: int | None = None) -> list[Tree]:
    """The trees of a file of ``[lhs_tokens, rhs_tokens]`` lines (the first ``limit``), blank lines skipped.

    Raises:
        ValueError: ``{path}:{line}: ...`` for the first malformed line: not UTF-8, not JSON, not a
            pair of lists of `TOKENS`, or an lhs that does not parse.
    """
    trees: list[Tree] = []
    with path.open("rb") as lines:  # (bytes, so that a line that is not UTF-8 is told by its number)
        for number, line in enumerate(lines, 1):
            if limit is not None and len(trees) >= limit:
                break
            if not line.strip():
                continue
            try:
                lhs, rhs = pair(line)
                trees.append(parse_tree(lhs, bucket(len(rhs))))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    return trees


def pair(line: bytes) -> tuple[list[str], list[str]]:
    """The two token lists of one line of the data.

    >>> pair(b'[["v0", "+", "v1"], "v0"]')
    Traceback (most recent call last):
    ...
    ValueError: expected [lhs_tokens, rhs_tokens], two lists of tokens, found '[["v0", "+", "v1"], "v0"]'
    """
    try:
        text = line.decode().rstrip()  # (rstrip: a JSON error at the line's end says its column, not "line 2")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start + 1})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(side, list) for side in value)):
        raise ValueError(f"expected [lhs_tokens, rhs_tokens], two lists of tokens, found {shorten(text)!r}")
    for side, tokens in zip(("lhs", "rhs"), value):
        if not tokens:
            raise ValueError(f"the {side} has no tokens")
        for at, token in enumerate(tokens, 1):
            if not isinstance(token, str):
                raise ValueError(f"token {at} of the {side} is {shorten(json.dumps(token))}, not a string")
            if not known(token):
                raise ValueError(f"token {at} of the {side}, {token!r}, is none of {TOKENS}")
    return value[0], value[1]


def known(token: str) -> bool:
    """Whether ``token`` is one of the data's `TOKENS`.

    >>> [known(t) for t in ("select", "<=", "v3", "c0", "12", "True", "abs", "x", "%")]
    [True, True, True, True, True, True, False, False, False]
    """
    return (
        token in FUNCTIONS or token in PRECEDENCE or token in ("!", "(", ")", ",") or LEAF.fullmatch(token) is not None
    )


def shorten(text: str, most: int = 60) -> str:
    """``text``, its middle cut to keep it about ``most`` characters."""
    return text if len(text) <= most else f"{text[: most // 2].rstrip()} ... {text[-most // 2 :].lstrip()}"


def split(trees: Sequence[Tree], seed: int, test: float = 0.2) -> tuple[list[Tree], list[Tree]]:
    """A shuffled split into training and test trees."""
    order = np.random.default_rng(seed).permutation(len(trees))
    cut = round(len(trees) * (1.0 - test))
    return [trees[i] for i in order[:cut]], [trees[i] for i in order[cut:]]


def vocabulary(trees: Sequence[Tree]) -> dict[str, int]:
    """Every token of ``trees`` by an index from 1 (0: a token they lack)."""
    return {token: i for i, token in enumerate(sorted({t for tree in trees for t in tree.tokens}), 1)}


def labels(trees: Sequence[Tree]) -> ml.Array:
    return np.array([t.label for t in trees])


# ---- the N-ary Tree-LSTM ----------------------------------------------------------------------------
def init_weights(symbols: int, hidden: int, seed: int = 0) -> dict[str, ml.Array]:
    """``embed`` is E (the six gate slices of each symbol: i o u f_1 f_2 f_3),
    ``U1``-``U3`` the children's matrices, ``out``/``out_bias`` classify the
    root. The forget slices start at +1, so that memory flows up at first."""
    rng = np.random.default_rng(seed)
    gates = (3 + ARITY) * hidden
    forget = np.zeros(gates)
    forget[3 * hidden :] = 1.0
    weights = {"embed": rng.normal(0.0, 0.5, (symbols, gates)) + forget}
    for k in range(1, ARITY + 1):
        weights[f"U{k}"] = rng.normal(0.0, 1.0, (hidden, gates)) / np.sqrt(ARITY * hidden)
    weights["out"] = rng.normal(0.0, 1.0, (hidden, CLASSES)) / np.sqrt(hidden)
    weights["out_bias"] = np.zeros(CLASSES)
    return {k: v.astype(np.float32) for k, v in weights.items()}


def node_state(
    params: Mapping[str, ml.ArrayOperand], hidden: int, symbol: ml.Array, children: tuple[State, ...]
) -> State:
    """A node's state from its symbol (a one-element index array) and its children's states."""
    n = hidden
    gates = ml.embedding(params["embed"], symbol)
    for k, child in enumerate(children, 1):
        gates = gates + child.h @ params[f"U{k}"]
    c = ml.sigmoid(gates[:, :n]) * ml.tanh(gates[:, 2 * n : 3 * n])
    for k, child in enumerate(children):
        c = c + ml.sigmoid(gates[:, (3 + k) * n : (4 + k) * n]) * child.c
    return State(ml.sigmoid(gates[:, n : 2 * n]) * ml.tanh(c), c)


@final
class TreeLSTM:
    """The N-ary Tree-LSTM's weights, each trained with Adam, and its cell."""

    def __init__(
        self,
        tokens: Mapping[str, int],
        weights: dict[str, ml.Array],
        learning_rate: float = 0.01,
        operation: bool = True,
    ) -> None:
        """``tokens``: the `vocabulary`; ``operation``: each node one `ml.operation`
        node of the graph (False: every op of the cell a layer; the same values)."""
        self.tokens = tokens
        self.hidden = int(weights["U1"].shape[0])
        self.w = {k: ml.Weight(v.copy(), optimizer=ml.optim.adam(learning_rate)) for k, v in weights.items()}
        cell = functools.partial(node_state, self.w, self.hidden)
        self.cell = ml.operation(cell) if operation else cell

    def encode(self, tree: Tree) -> ml.ArrayLayer:
        """The root's hidden vector, ``(1, hidden)``: one cell per node, children first."""
        states: list[State] = []
        for token, kids in zip(tree.tokens, tree.children):
            symbol = np.array([self.tokens.get(token, 0)])
            states.append(self.cell(symbol, tuple([states[k] for k in kids])))
        return states[-1].h

    def logits(self, trees: Sequence[Tree]) -> ml.ArrayLayer:
        roots = ml.concatenate([self.encode(t) for t in trees], axis=0)
        return ml.dense(roots, self.w["out"], self.w["out_bias"])


@final
class BagOfTokens:
    """The structure-blind baseline: the tree's token counts, embedded and summed, then a ReLU layer."""

    def __init__(self, tokens: Mapping[str, int], hidden: int, seed: int = 0) -> None:
        self.tokens = tokens
        self.bag = BagOfSymbols(len(tokens) + 1, CLASSES, hidden, seed)

    def logits(self, trees: Sequence[Tree]) -> ml.ArrayLayer:
        counts = np.zeros((len(trees), len(self.tokens) + 1), np.float32)
        for row, tree in enumerate(trees):
            for token in tree.tokens:
                counts[row, self.tokens.get(token, 0)] += 1.0
        return self.bag.logits_of_counts(counts)


# ---- training -------------------------------------------------------------------------------------
LABELLED: Final[Labelled[Tree]] = Labelled(labels)


async def run(
    trees: Sequence[Tree], epochs: int = 5, hidden: int = 64, batch: int = 32, seed: int = 0, progress: bool = True
) -> Result:
    """Train both models on 80% of ``trees``, test them on the rest (`FEWEST` trees at least)."""
    if len(trees) < FEWEST:
        raise ValueError(f"{len(trees)} trees are too few: the example needs {FEWEST} at least, a fifth to test on")
    train, test = split(trees, seed)
    tokens = vocabulary(train)
    majority = float(np.mean(labels(test) == np.argmax(np.bincount(labels(train), minlength=CLASSES))))
    model = TreeLSTM(tokens, init_weights(len(tokens) + 1, hidden, seed))
    tree_lstm = await LABELLED.fit(model, train, test, epochs, batch, seed, "Tree-LSTM", progress)
    bag = BagOfTokens(tokens, hidden, seed)
    baseline = await LABELLED.fit(bag, train, test, epochs, batch, seed, "bag of tokens", progress)
    return Result(tree_lstm, baseline, majority)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Train an N-ary Tree-LSTM on the HISS paper's Halide expressions: how short is each "
        "one's simplest known equivalent?"
    )
    parser.add_argument("--data", type=Path, default=DATA, help=f"the folder holding {FILE} (default: {DATA})")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="trees per training step")
    parser.add_argument(
        "--limit", type=int, default=None, help=f"use the file's first LIMIT expressions ({FEWEST} at least)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="halide_tree_lstm.png", help="where to write the training curves (PNG)")
    args = parser.parse_args()
    if args.limit is not None and args.limit < FEWEST:
        parser.error(f"--limit {args.limit}: the example needs {FEWEST} expressions at least, a fifth to test on")
    path = args.data / FILE
    if not path.is_file():
        parser.exit(2, f"{parser.prog}: no {FILE} in {args.data}: pass the folder of the HISS data with --data\n")
    trees = load(path, args.limit)
    if len(trees) < FEWEST:
        parser.exit(2, f"{parser.prog}: {path} has {len(trees)} expressions: the example needs {FEWEST} at least\n")
    result = anyio.run(lambda: run(trees, args.epochs, args.hidden, args.batch, args.seed))
    plot(result, args.plot, "simplest equivalent's length, test")
    for curve, name in ((result.tree_lstm, "Tree-LSTM"), (result.baseline, "bag of tokens")):
        print(f"{name:15} test accuracy {curve.accuracies[-1]:.3f}  ({curve.seconds:.1f} s of training)")
    print(f"{'majority class':15} test accuracy {result.majority:.3f}  (curves in {args.plot})")


if __name__ == "__main__":
    main()
