"""The log-real, max-times and min-plus semirings, and forward-only ones."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from monadl.dyna import LOG_REAL, MAX_TIMES, MIN_PLUS, Item, Program, Rule, Semiring


def test_log_real_square_program() -> None:
    program = Program([Rule(("a",), [("a",), ("a",)]), Rule(("a",), [("r",)])], LOG_REAL)
    r = 0.21
    run = program.run({("r",): math.log(r)}, tolerance=1e-15, max_pops=10_000)
    assert math.exp(run.chart[("a",)]) == pytest.approx(0.3, abs=1e-9)
    # d log a / d log r = (da/dr) * r / a = 2.5 * 0.21 / 0.3
    assert run.gradient(("a",))[("r",)] == pytest.approx(2.5 * r / 0.3, rel=1e-6)


def test_log_real_hmm_over_a_long_sequence_does_not_underflow() -> None:
    from examples import dyna_programs as dp

    rng = np.random.default_rng(0)
    init, trans, emit = rng.dirichlet(np.ones(2)), rng.dirichlet(np.ones(2), size=2), rng.dirichlet(np.ones(3), size=2)
    observations = list(rng.integers(0, 3, 800))
    axioms = {
        k: (math.log(v) if v > 0 else -math.inf) for k, v in dp.hmm_axioms(init, trans, emit, observations).items()
    }
    program = Program(dp.HMM.rules, LOG_REAL)
    run = program.run(axioms)
    log_likelihood = run.chart[("likelihood",)]
    # the same by a scaled forward algorithm
    alpha = init * emit[:, observations[0]]
    expected = 0.0
    for o in observations[1:]:
        expected += math.log(alpha.sum())
        alpha = (alpha / alpha.sum()) @ trans * emit[:, o]
    expected += math.log(alpha.sum())
    assert log_likelihood < -700  # exp() of it underflows float64
    assert log_likelihood == pytest.approx(expected, rel=1e-10)
    grads = run.gradient(("likelihood",))
    # d log L / d log trans summed over transitions = number of transitions
    assert sum(grads[("trans", a, b)] for a in range(2) for b in range(2)) == pytest.approx(
        len(observations) - 1, rel=1e-8
    )


SHORTEST = Program(
    [Rule(("path", "J"), [("path", "I"), ("edge", "I", "J")]), Rule(("goal",), [("path", "T"), ("target", "T")])],
    MIN_PLUS,
)


def graph(seed: int, n: int = 6) -> dict[Item, float]:
    rng = np.random.default_rng(seed)
    axioms: dict[Item, float] = {("path", 0): 0.0, ("target", n - 1): 0.0}
    for i in range(n):
        for j in range(n):
            if i != j and rng.uniform() < 0.6:
                axioms[("edge", i, j)] = float(rng.uniform(1, 10))
    return axioms


@pytest.mark.parametrize("seed", range(4))
def test_shortest_paths_match_floyd_warshall_with_edge_subgradients(seed: int) -> None:
    axioms = graph(seed)
    n = 6
    dist = np.full((n, n), np.inf)
    np.fill_diagonal(dist, 0)
    for item, value in axioms.items():
        if item[0] == "edge":
            dist[item[1], item[2]] = value
    for k in range(n):
        dist = np.minimum(dist, dist[:, [k]] + dist[[k], :])
    run = SHORTEST.run(axioms, priority="value")
    for j in range(n):
        if np.isfinite(dist[0, j]):
            assert run.chart[("path", j)] == pytest.approx(dist[0, j])
    assert len({e.item for e in run.tape if e.item[0] == "path"}) == sum(np.isfinite(dist[0]))
    assert sum(1 for e in run.tape if e.item[0] == "path") == sum(np.isfinite(dist[0]))  # Dijkstra: each pops once
    if not np.isfinite(dist[0, n - 1]):
        return
    grads = run.gradient(("goal",))
    on_path = [x for x, g in grads.items() if x[0] == "edge"]
    assert all(grads[x] == 1.0 for x in on_path)
    assert sum(axioms[x] for x in on_path) == pytest.approx(dist[0, n - 1])
    fifo = SHORTEST.run(axioms)  # any order reaches the same fixed point
    assert fifo.chart[("goal",)] == pytest.approx(run.chart[("goal",)])


def test_viterbi_matches_brute_force_and_finite_differences() -> None:
    from examples import dyna_programs as dp

    rng = np.random.default_rng(3)
    init, trans, emit = rng.dirichlet(np.ones(3)), rng.dirichlet(np.ones(3), size=3), rng.dirichlet(np.ones(2), size=3)
    observations = [0, 1, 1, 0, 1]
    axioms = dp.hmm_axioms(init, trans, emit, observations)
    program = Program(dp.HMM.rules, MAX_TIMES)
    run = program.run(axioms, priority="value")
    best = max(
        init[s[0]]
        * emit[s[0], observations[0]]
        * math.prod(trans[s[t - 1], s[t]] * emit[s[t], observations[t]] for t in range(1, len(s)))
        for s in itertools.product(range(3), repeat=len(observations))
    )
    assert run.chart[("likelihood",)] == pytest.approx(best, rel=1e-12)
    grads = run.gradient(("likelihood",))
    options: dict[str, Any] = {"priority": "value"}
    for item in [k for k in axioms if k[0] in ("trans", "emit")]:
        up, down = dict(axioms), dict(axioms)
        up[item] += 1e-7
        down[item] -= 1e-7
        numeric = (
            program.run(up, **options).chart[("likelihood",)] - program.run(down, **options).chart[("likelihood",)]
        ) / 2e-7
        assert grads.get(item, 0.0) == pytest.approx(numeric, rel=1e-4, abs=1e-9), item


def test_other_semirings_run_forward_only() -> None:
    boolean = Semiring("boolean", 0.0, 1.0, max, min)
    reach = Program([Rule(("reach", "J"), [("reach", "I"), ("edge", "I", "J")])], boolean)
    run = reach.run({("reach", 0): 1.0, ("edge", 0, 1): 1.0, ("edge", 1, 2): 1.0, ("edge", 3, 0): 1.0})
    assert {x for x, v in run.chart.items() if x[0] == "reach" and v} == {("reach", 0), ("reach", 1), ("reach", 2)}
    with pytest.raises(NotImplementedError, match="boolean"):
        run.gradient(("reach", 2))
    with pytest.raises(ValueError, match="idempotent"):
        Program(reach.rules, inputs={"edge"}).run({}, priority="value")


def test_a_copy_of_a_semiring_is_that_semiring() -> None:
    """The built-ins were told apart by identity: a copy (dataclasses.replace,
    a pickle) got other gradients, and ArrayProgram refused it as 'not
    log-real' while naming log-real."""
    import dataclasses

    from monadl.dyna import LOG_REAL, MIN_PLUS, parse

    text = "path(0) += {one}. path(J) += edge(I, J) * path(I)."
    edges = {(0, 1): 0.3, (0, 2): 0.5, (1, 3): 0.4, (2, 3): 0.2, (1, 2): 0.6}
    for semiring, one, of in ((LOG_REAL, 0.0, math.log), (MIN_PLUS, 0.0, float)):
        axioms = {("edge", i, j): of(v) for (i, j), v in edges.items()}
        runs = [parse(text.format(one=one), s).run(axioms) for s in (semiring, dataclasses.replace(semiring))]
        assert runs[0].chart == runs[1].chart
        assert runs[0].gradient(("path", 3)) == runs[1].gradient(("path", 3))


def test_a_max_plus_semiring_of_ones_own_gets_its_backpointer_gradient() -> None:
    """Its times is +, but the backpointer's gradient took it for *: zeros."""
    from monadl.dyna import Semiring, parse

    max_plus = Semiring(
        "max-plus", -math.inf, 0.0, max, lambda a, b: a + b, gradient="backpointer", better=lambda v: -v
    )
    run = parse("path(0) += 0. path(J) += edge(I, J) * path(I).", max_plus).run(
        {("edge", 0, 1): 3.0, ("edge", 1, 2): 4.0, ("edge", 0, 2): 5.0}
    )
    assert run.chart[("path", 2)] == 7.0
    gradient = run.gradient(("path", 2))
    assert (
        gradient[("edge", 0, 1)] == 1.0 and gradient[("edge", 1, 2)] == 1.0 and gradient.get(("edge", 0, 2), 0.0) == 0.0
    )


def test_a_pickled_built_in_semiring_is_that_semiring() -> None:
    """The built-ins were made of lambdas, which pickle refused (and
    cloudpickle copied by value, into a semiring equal to none of them)."""
    import copy
    import pickle

    from monadl.dyna import REAL

    for semiring in (REAL, LOG_REAL, MAX_TIMES, MIN_PLUS):
        back = pickle.loads(pickle.dumps(semiring))
        assert back == semiring and back.times is semiring.times and back.better is semiring.better
        assert copy.deepcopy(semiring) == semiring


def test_a_log_real_semiring_of_ones_own_gets_the_log_real_gradient() -> None:
    """Its tape's adjoints were converted only where it equalled LOG_REAL, name
    included: under another name the gradient was the raw log adjoints
    (-0.288 where finite differences give 0.333), with no error."""
    import operator

    from monadl.dyna import parse

    text = "path(0) += 0. path(J) += edge(I, J) * path(I)."
    axioms = {("edge", i, j): math.log(0.5) for i in range(4) for j in range(i + 1, 4)}
    mine = Semiring("my-log-real", -math.inf, 0.0, np.logaddexp, operator.add, gradient="tape")
    mine_by_lambda = Semiring("mine", -math.inf, 0, np.logaddexp, lambda a, b: a + b, gradient="tape")
    in_float32 = Semiring(  # (a reviewer's: refused as 'neither' by a float64 tolerance)
        "mine32", -math.inf, 0.0, lambda a, b: np.logaddexp(np.float32(a), np.float32(b)), operator.add, gradient="tape"
    )
    real_by_numpy = Semiring("my-real", 0, 1, np.add, np.multiply, gradient="tape")
    expected = {(0, 1): 1 / 3, (0, 2): 2 / 9, (0, 3): 4 / 9, (1, 2): 1 / 9, (1, 3): 2 / 9, (2, 3): 1 / 3}
    for semiring in (LOG_REAL, mine, mine_by_lambda, in_float32):
        run = parse(text, semiring).run(axioms)
        rel = 1e-6 if semiring is in_float32 else 1e-12
        assert math.exp(run.chart[("path", 3)]) == pytest.approx(1.125, rel=rel)  # 0.5 + 0.25 + 0.25 + 0.125
        gradient = run.gradient(("path", 3))
        for (i, j), g in expected.items():
            assert gradient[("edge", i, j)] == pytest.approx(g, rel=rel), (semiring.name, i, j)
    real = parse(text.replace("+= 0.", "+= 1."), real_by_numpy).run(dict.fromkeys(axioms, 0.5))
    assert real.gradient(("path", 3))[("edge", 0, 1)] == pytest.approx(0.75)  # path 0-1-3 and 0-1-2-3 over 0.5


@pytest.mark.parametrize(
    ("plus", "times", "zero", "one", "shown"),
    [
        (max, lambda a, b: a + b, -math.inf, 0.0, "plus(2, 3) gave 3.0, times(2, 3) 5.0"),  # max-plus
        (max, lambda a, b: a * b, 0.0, 1.0, "plus(2, 3) gave 3.0, times(2, 3) 6.0"),  # max-times
        (lambda a, b: a + b, lambda a, b: a * b, 0.0, 2.0, "plus(2, 3) gave 5.0, times(2, 3) 6.0"),  # one is 2
    ],
)
def test_a_tape_gradient_in_other_arithmetic_is_refused_at_construction(
    plus: Any, times: Any, zero: float, one: float, shown: str
) -> None:
    """A max-plus semiring with gradient='tape' trained on the log adjoints
    (-0.69 where the subgradient is 1): the tape is a gradient in real and
    log-real arithmetic only."""
    with pytest.raises(ValueError) as caught:
        Semiring("mine", zero, one, plus, times, gradient="tape")
    message = str(caught.value)
    assert message.startswith("semiring mine: gradient='tape' differentiates the real semiring")
    assert shown in message and "use gradient='backpointer'" in message and "gradient=None (forward only)" in message


def test_a_tape_semiring_whose_arithmetic_takes_no_float_is_refused_with_what_it_raised() -> None:
    with pytest.raises(ValueError, match=r"arithmetic is neither \(plus\(2, 3\) gave TypeError: no floats"):

        def tensors_only(a: float, b: float) -> float:
            raise TypeError("no floats")

        Semiring("mine", -math.inf, 0.0, tensors_only, lambda a, b: a + b, gradient="tape")


def test_an_unknown_gradient_is_refused_at_construction() -> None:
    """A typo, 'tapee', was taken for forward only, and train() said 'no
    gradient here' without naming it."""
    import operator

    with pytest.raises(ValueError) as caught:
        Semiring("myreal", 0.0, 1.0, operator.add, operator.mul, gradient="tapee")
    assert str(caught.value) == (
        "semiring myreal: gradient='tapee' is none of 'tape' (real and log-real), "
        "'backpointer' (max or min: max-times, min-plus) or None (forward only)"
    )
