"""The HISS example: its parser, its cell's arities, and that it learns on the HISS data (skipped without it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

import monadl as ml
from examples import halide_tree_lstm as ht

DATA = ht.DATA / ht.FILE
needs_data = pytest.mark.skipif(not DATA.is_file(), reason=f"the HISS data is not at {ht.DATA}")


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("v0 - v1 - v2", "((v0 - v1) - v2)"),  # (equal precedence groups to the left)
        ("v0 || v1 && v2 == v0", "(v0 || (v1 && (v2 == v0)))"),
        ("! v0 < v1 * v2 + 1", "(!v0 < ((v1 * v2) + 1))"),
        ("max ( min ( v0 , v1 ) , ( v2 ) ) / 2", "(max(min(v0, v1), v2) / 2)"),
        ("select ( True , v0 , v1 + v2 )", "select(True, v0, (v1 + v2))"),
    ],
)
def test_expressions_parse_by_halides_precedence(text: str, read: str) -> None:
    tree = ht.parse_tree(text.split(), 0)
    assert tree.text() == read
    assert all(k < i for i, kids in enumerate(tree.children) for k in kids)  # children first
    assert max(len(kids) for kids in tree.children) <= ht.ARITY


@pytest.mark.parametrize("text", ["v0 +", "min ( v0 )", "v0 v1", "( v0", ")", "select ( v0 , v1 , v2 , v0 )"])
def test_malformed_expressions_are_refused_with_where(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected .* at token \d+ of"):
        ht.parse_tree(text.split(), 0)


def test_the_marked_cell_and_every_op_a_layer_give_the_same_loss_and_gradients() -> None:
    texts = ["select ( v0 < v1 , ! v2 , v0 )", "v0", "max ( v0 , v1 ) - min ( v1 , v0 ) * v2"]
    trees = [ht.parse_tree(text.split(), k % ht.CLASSES) for k, text in enumerate(texts)]
    tokens = ht.vocabulary(trees)
    weights = ht.init_weights(len(tokens) + 1, 4, seed=3)
    results = []
    for operation in (True, False):
        model = ht.TreeLSTM(tokens, weights, operation=operation)
        loss = ht.LABELLED.loss(model, trees)
        results.append((anyio.run(loss.predict), anyio.run(ml.gradients, loss, list(model.w.values()))))
    (marked, marked_grads), (plain, plain_grads) = results
    assert marked == pytest.approx(plain, rel=1e-6)
    for a, b in zip(marked_grads, plain_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert np.abs(plain_grads[3]).sum() > 0.0  # (U3, select's third child's matrix, is reached)


@needs_data
def test_every_expression_of_the_data_parses_and_prints_back() -> None:
    trees = ht.load(ht.DATA / "halide_var3_d2.jsonl") + ht.load(DATA, limit=3000)
    for tree in trees:
        tokens = re.findall(r"\|\||&&|==|!=|<=|>=|[()!,<>+\-*/]|\w+", tree.text())
        again = ht.parse_tree(tokens, tree.label)
        assert (again.tokens, again.children) == (tree.tokens, tree.children)
    with DATA.open() as lines:
        first = json.loads(next(lines))
    assert trees[467].label == ht.bucket(len(first[1]))


@needs_data
def test_it_learns_what_the_bag_of_tokens_cannot() -> None:
    # About 2 s here. Measured at this size and seed: Tree-LSTM 0.79, bag 0.61, majority class 0.36.
    trees = ht.load(DATA, limit=3000)
    result = anyio.run(lambda: ht.run(trees, epochs=2, hidden=32, progress=False))
    tree, bag = result.tree_lstm, result.baseline
    assert tree.losses[-1] < 0.7 * tree.losses[0]
    assert tree.accuracies[-1] > bag.accuracies[-1] + 0.1
    assert tree.accuracies[-1] > result.majority + 0.3


def test_without_the_data_it_says_where_to_point_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.halide_tree_lstm", "--data", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and f"no {ht.FILE} in {tmp_path}: pass the folder" in done.stderr


GOOD = '[["v0", "+", "v1"], ["v0"]]'


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('[["v0", "+", "v1"], ["v0"', "not JSON (Expecting ',' delimiter at column 26)"),
        ("hello", "not JSON (Expecting value at column 1)"),
        ('{"lhs": ["v0"], "rhs": ["v0"]}', "expected [lhs_tokens, rhs_tokens], two lists of tokens, found '{"),
        ('[["v0", "+", "v1"]]', "expected [lhs_tokens, rhs_tokens]"),
        ('[["v0"], ["v0"], ["v1"]]', "expected [lhs_tokens, rhs_tokens]"),
        ('["v0 + v1", ["v0"]]', "expected [lhs_tokens, rhs_tokens]"),
        ('[["v0", "+", "v1"], "v0"]', "expected [lhs_tokens, rhs_tokens]"),  # (was the label of 2 tokens)
        ('[["v0", "+", "v1"], []]', "the rhs has no tokens"),
        ('[["v0", "+", 1], ["v0"]]', "token 3 of the lhs is 1, not a string"),
        ('[["v0"], [null]]', "token 1 of the rhs is null, not a string"),
        ('[["abs", "(", "v0", ")"], ["v0"]]', "token 1 of the lhs, 'abs', is none of min max select"),
        ('[["v0", "%", "v1"], ["v0"]]', "token 2 of the lhs, '%', is none of"),
        ('[["v0"], ["x"]]', "token 1 of the rhs, 'x', is none of"),
        ('[["v0", "+", "v1", ")"], ["v0"]]', "expected the end at token 4 of 'v0 + v1 )', found ')'"),
    ],
)
def test_a_malformed_line_is_refused_with_its_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}:4: {says}')}"):
        ht.load(path)


def test_a_line_not_utf8_is_refused_with_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(f"{GOOD}\n".encode() + b'[["v\xff"], ["v0"]]\n')
    with pytest.raises(ValueError, match=f"^{re.escape(f'{path}:2: not UTF-8 (invalid start byte at byte 5)')}$"):
        ht.load(path)


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"\n{GOOD}\r\n  \n{GOOD}\n\n")
    trees = ht.load(path)
    assert [(t.text(), t.label) for t in trees] == [("(v0 + v1)", 0)] * 2
    assert len(ht.load(path, limit=1)) == 1


def _example(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    plot = str(data / "curves.png")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.halide_tree_lstm",
            "--data",
            str(data),
            "--plot",
            plot,
            "--epochs",
            "1",
            *args,
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("limit", [-1, 0, 1, 3, ht.FEWEST - 1])
def test_a_limit_too_small_to_split_is_refused(tmp_path: Path, limit: int) -> None:
    # (0 was a TypeError in np.bincount, 1 a ZeroDivisionError, 3 printed the accuracy of one test tree)
    (tmp_path / ht.FILE).write_text(f"{GOOD}\n" * 20)
    done = _example(tmp_path, "--limit", str(limit))
    assert done.returncode == 2
    assert f"--limit {limit}: the example needs {ht.FEWEST} expressions at least" in done.stderr
    assert "accuracy" not in done.stdout


def test_a_file_too_short_to_split_is_refused_and_the_fewest_run(tmp_path: Path) -> None:
    (tmp_path / ht.FILE).write_text(f"{GOOD}\n" * (ht.FEWEST - 1))
    done = _example(tmp_path)
    assert done.returncode == 2
    assert f"has {ht.FEWEST - 1} expressions: the example needs {ht.FEWEST} at least" in done.stderr
    with pytest.raises(ValueError, match=f"^{ht.FEWEST - 1} trees are too few: the example needs {ht.FEWEST}"):
        anyio.run(ht.run, ht.load(tmp_path / ht.FILE))
    (tmp_path / ht.FILE).write_text(f"{GOOD}\n" * ht.FEWEST)
    done = _example(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "majority class  test accuracy 1.000" in done.stdout


DEEP = 10_000


@pytest.mark.parametrize(
    ("text", "tokens", "under_the_root"),
    [
        ("v0 + ( " * DEEP + "v1" + " )" * DEEP, ("v0",) * DEEP + ("v1",) + ("+",) * DEEP, (0, 2 * DEEP - 1)),
        ("! " * DEEP + "v0", ("v0",) + ("!",) * DEEP, (DEEP - 1,)),
        ("( " * DEEP + "v0" + " )" * DEEP, ("v0",), ()),
        ("min ( v0 , " * DEEP + "v1" + " )" * DEEP, ("v0",) * DEEP + ("v1",) + ("min",) * DEEP, (0, 2 * DEEP - 1)),
    ],
)
def test_deep_expressions_parse(text: str, tokens: tuple[str, ...], under_the_root: tuple[int, ...]) -> None:
    # (the parser recursed: a RecursionError at 400 levels of v0 + ( ... ), 1,000 of ! or of brackets)
    tree = ht.parse_tree(text.split(), 0)
    assert (tree.tokens, tree.children[-1]) == (tokens, under_the_root)


def test_a_deep_expressions_error_keeps_its_file_and_line(tmp_path: Path) -> None:
    tokens = ("v0 + ( " * DEEP + "v1" + " )" * (DEEP - 1)).split()
    path = tmp_path / "pairs.jsonl"
    path.write_text(f"{GOOD}\n{json.dumps([tokens, ['v0']])}\n")
    with pytest.raises(ValueError) as refused:
        ht.load(path)
    says = str(refused.value)
    assert says.startswith(f"{path}:2: expected ')' at token {len(tokens) + 1} of 'v0 + ( v0 + ( ")
    assert says.endswith(" ... ) ) ) ) ) ) ) ) ) ) ) ) ) ) )', found the end")  # (not its 40,000 tokens)
