"""Best derivations (Viterbi paths, shortest paths, best parses), item at a
time and batched, and max-times / min-plus batched with back-pointers giving
the same values, derivations and subgradients as item at a time."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from examples import dyna_programs as dp
from monadl.dyna import MAX_TIMES, MIN_PLUS, REAL, ArrayProgram, Derivation, Item, Program, Rule
from tests.dyna.test_semiring import SHORTEST, graph


def hmm_model(n: int = 3, steps: int = 7, seed: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    init, trans, emit = rng.dirichlet(np.ones(n)), rng.dirichlet(np.ones(n), size=n), rng.dirichlet(np.ones(2), size=n)
    return init, trans, emit, [int(o) for o in rng.integers(0, 2, steps)]


def hand_viterbi(init: np.ndarray, trans: np.ndarray, emit: np.ndarray, obs: list[int]) -> tuple[float, list[int]]:
    delta = init * emit[:, obs[0]]
    back = []
    for o in obs[1:]:
        scores = delta[:, None] * trans  # [from, to]
        back.append(scores.argmax(axis=0))
        delta = scores.max(axis=0) * emit[:, o]
    state = int(delta.argmax())
    path = [state]
    for pointers in reversed(back):
        state = int(pointers[state])
        path.append(state)
    return float(delta.max()), path[::-1]


def states(derivation: Derivation) -> list[int]:
    """The Viterbi path: the states of the alpha items, by time."""
    return [item[2] for item in sorted({d.item for d in derivation.walk() if d.item[0] == "alpha"})]


HMM_ARRAYS = {"alpha": {1: 3}, "init": {0: 3}, "trans": {0: 3, 1: 3}, "emit": {0: 3}}


@pytest.mark.parametrize("seed", range(3))
def test_viterbi_path_item_at_a_time_and_batched_matches_a_hand_written_viterbi(seed: int) -> None:
    init, trans, emit, obs = hmm_model(seed=seed)
    axioms = dp.hmm_axioms(init, trans, emit, obs)
    best, path = hand_viterbi(init, trans, emit, obs)
    goal = ("likelihood",)
    scalar = Program(dp.HMM.rules, MAX_TIMES).run(axioms, priority="value")
    batched = ArrayProgram(dp.HMM.rules, MAX_TIMES, arrays=HMM_ARRAYS).run(axioms)
    assert scalar.chart[goal] == pytest.approx(best, rel=1e-12)
    assert batched.value(goal) == pytest.approx(best, rel=1e-12)
    tree = scalar.best_derivation(goal)
    assert states(tree) == path
    assert batched.best_derivation(goal) == tree
    # the leaves are the factors of the path's probability
    assert np.prod([axioms[x] for x in tree.leaves()]) == pytest.approx(best, rel=1e-12)
    assert tree.leaves()[:3] == [("init", path[0]), ("obs", 0, obs[0]), ("emit", path[0], obs[0])]
    # every alpha item batched has the value item at a time gives it
    for item, value in scalar.chart.items():
        assert batched.value(item) == pytest.approx(value, rel=1e-12), item
    expected = scalar.gradient(goal)
    got = batched.gradient(goal)
    assert set(got) == set(expected) == set(tree.leaves())
    for item, value in expected.items():
        assert got[item] == pytest.approx(value, rel=1e-12), item
    # the subgradient of a transition used once is the path's probability over it
    used = [x for x in tree.leaves() if x[0] == "trans" and tree.leaves().count(x) == 1]
    for x in used:
        assert got[x] == pytest.approx(best / axioms[x], rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_shortest_paths_batched_match_item_at_a_time(seed: int) -> None:
    n = 6
    axioms = graph(seed, n)
    scalar = SHORTEST.run(axioms, priority="value")
    program = ArrayProgram(SHORTEST.rules, MIN_PLUS, arrays={"path": {0: n}, "edge": {0: n, 1: n}, "target": {0: n}})
    batched = program.run(axioms)
    for j in range(n):
        assert batched.value(("path", j)) == pytest.approx(scalar.chart.get(("path", j), np.inf))
    goal = ("goal",)
    if goal not in scalar.chart:
        assert batched.value(goal) == np.inf
        assert batched.gradient(goal) == {}
        with pytest.raises(KeyError, match="not derived"):
            batched.best_derivation(goal)
        return
    tree = scalar.best_derivation(goal)
    assert batched.best_derivation(goal) == tree
    edges = [x for x in tree.leaves() if x[0] == "edge"]
    assert sum(axioms[x] for x in edges) == pytest.approx(scalar.chart[goal])
    assert edges[0][1] == 0 and all(a[2] == b[1] for a, b in pairwise(edges))  # a path from 0
    assert batched.gradient(goal) == scalar.gradient(goal)
    assert all(batched.gradient(goal)[x] == 1.0 for x in edges)


def hand_viterbi_cky(binary: np.ndarray, lexical: np.ndarray, words: list[int]) -> tuple[float, str]:
    n, k = len(words), binary.shape[0]
    best: dict[tuple[int, int, int], float] = {}
    tree: dict[tuple[int, int, int], str] = {}
    for i, w in enumerate(words):
        for x in range(k):
            best[i, i + 1, x], tree[i, i + 1, x] = lexical[x, w], f"({x} w{w})"
    for width in range(2, n + 1):
        for i in range(n - width + 1):
            end = i + width
            for x in range(k):
                p, j, y, z = max(
                    (binary[x, y, z] * best[i, j, y] * best[j, end, z], j, y, z)
                    for j in range(i + 1, end)
                    for y in range(k)
                    for z in range(k)
                )
                best[i, end, x], tree[i, end, x] = p, f"({x} {tree[i, j, y]} {tree[j, end, z]})"
    return best[0, n, 0], tree[0, n, 0]


@pytest.mark.parametrize("seed", range(3))
def test_viterbi_cky_gives_the_best_parse_item_at_a_time_and_batched(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = 3
    binary, lexical = rng.uniform(0.1, 1, (k, k, k)), rng.uniform(0.1, 1, (k, 4))
    words = [int(w) for w in rng.integers(0, 4, 5)]
    probability, parse = dp.best_parse(binary, lexical, words)
    hand_probability, hand_parse = hand_viterbi_cky(binary, lexical, words)
    assert probability == pytest.approx(hand_probability, rel=1e-12)
    # Best parses tie whenever a symbol's rules nest either way ((2 (2 a) (2 b)) (2 c) against
    # (2 a) ((2 b) (2 c)) under 2 -> 2 2): the parse given is a tree over the words with the best probability.
    assert parse_probability(parse, binary, lexical, words) == pytest.approx(hand_probability, rel=1e-12)
    assert parse == hand_parse or parse_probability(hand_parse, binary, lexical, words) == pytest.approx(probability)
    axioms = dp.cky_axioms(binary, lexical, words)
    arrays = {"constit": {0: k}, "rule": {0: k, 1: k, 2: k}, "lex": {0: k}, "start": {0: k}}
    batched = ArrayProgram(dp.CKY.rules, MAX_TIMES, arrays=arrays).run(axioms)
    assert batched.value(("sentence",)) == pytest.approx(probability, rel=1e-12)
    for run in (batched, Program(dp.CKY.rules, MAX_TIMES).run(axioms)):
        tree = run.best_derivation(("sentence",))
        assert np.prod([axioms[x] for x in tree.leaves()]) == pytest.approx(probability, rel=1e-12)
        batched_parse = dp.bracket(tree.children[0])
        assert parse_probability(batched_parse, binary, lexical, words) == pytest.approx(probability, rel=1e-12)


def parse_probability(parse: str, binary: np.ndarray, lexical: np.ndarray, words: list[int]) -> float:
    """The probability of a bracketed parse, checking that its leaves are the words in order."""
    tokens = parse.replace("(", " ( ").replace(")", " ) ").split()
    position, leaves = 0, []

    def node() -> tuple[int, float]:
        nonlocal position
        assert tokens[position] == "("
        symbol = int(tokens[position + 1])
        position += 2
        if tokens[position].startswith("w"):
            word = int(tokens[position][1:])
            leaves.append(word)
            position += 2
            return symbol, float(lexical[symbol, word])
        (left, p), (right, q) = node(), node()
        position += 1
        return symbol, float(binary[symbol, left, right]) * p * q

    symbol, probability = node()
    assert symbol == 0 and leaves == words and position == len(tokens)
    return probability


def test_a_best_derivation_is_refused_where_there_is_none() -> None:
    program = Program([Rule(("a",), [("b",)])], REAL)
    with pytest.raises(ValueError, match="idempotent"):
        program.run({("b",): 1.0}).best_derivation(("a",))
    viterbi = Program([Rule(("a",), [("b",)])], MAX_TIMES).run({("b",): 0.5})
    with pytest.raises(KeyError, match="not derived"):
        viterbi.best_derivation(("c",))
    assert viterbi.best_derivation(("b",)) == Derivation(("b",), None)


def test_a_cycle_that_improves_has_no_best_derivation() -> None:
    # a += 2 * a: every lap improves a, so after a few pops its back-pointer points at itself
    program = Program([Rule(("a",), [("a",)], 2.0)], MAX_TIMES)
    run = program.run({("a",): 1.0}, max_pops=4)
    with pytest.raises(RuntimeError, match="cycle"):
        run.best_derivation(("a",))


def test_shared_sub_derivations_are_built_once() -> None:
    # b doubles in each of 40 levels: 2**40 leaves as a tree, 41 items as a graph
    rules = [Rule(("l", "J"), [("l", "I"), ("l", "I"), ("next", "I", "J")])]
    axioms: dict[Item, float] = {("l", 0): 1.0}
    axioms.update({("next", i, i + 1): 1.0 for i in range(40)})
    tree = Program(rules, MAX_TIMES).run(axioms).best_derivation(("l", 40))
    assert tree.children[0] is tree.children[1]
    assert Program(rules, MAX_TIMES).run(axioms).gradient(("l", 40))[("l", 0)] == pytest.approx(2.0**40)


def test_a_constant_rule_is_a_leaf_with_a_rule_in_a_derivation() -> None:
    n = 6
    axioms = graph(1, n)
    del axioms[("path", 0)]
    rules = [*SHORTEST.rules, Rule(("path", 0), [], 0.0)]
    scalar = Program(rules, MIN_PLUS).run(axioms, priority="value")
    batched = ArrayProgram(rules, MIN_PLUS, arrays={"path": {0: n}, "edge": {0: n, 1: n}, "target": {0: n}}).run(axioms)
    tree = scalar.best_derivation(("goal",))
    assert batched.best_derivation(("goal",)) == tree
    [start] = [d for d in tree.walk() if d.item == ("path", 0)]
    assert start.rule == Rule(("path", 0), [], 0.0) and start.children == ()
    assert ("path", 0) not in scalar.gradient(("goal",))
    assert batched.gradient(("goal",), derived=True)[("path", 0)] == 1.0
