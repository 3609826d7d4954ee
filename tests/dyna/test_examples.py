"""The HMM forward algorithm and CKY inside, against brute force and a direct DP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from examples import dyna_programs as dp


def hmm() -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    rng = np.random.default_rng(0)
    return rng.dirichlet(np.ones(3)), rng.dirichlet(np.ones(3), size=3), rng.dirichlet(np.ones(2), size=3), [0, 1, 1, 0]


def test_hmm_likelihood_and_expected_counts_match_brute_force() -> None:
    init, trans, emit, observations = hmm()
    likelihood, counts = dp.expected_transitions(init, trans, emit, observations)
    total, expected = 0.0, np.zeros_like(trans)
    for states in itertools.product(range(3), repeat=len(observations)):
        p = init[states[0]] * emit[states[0], observations[0]]
        for t in range(1, len(states)):
            p *= trans[states[t - 1], states[t]] * emit[states[t], observations[t]]
        total += p
        for t in range(1, len(states)):
            expected[states[t - 1], states[t]] += p
    assert likelihood == pytest.approx(total, rel=1e-12)
    np.testing.assert_allclose(counts, expected / total, rtol=1e-10)
    assert counts.sum() == pytest.approx(len(observations) - 1)


def direct_inside(binary: np.ndarray, lexical: np.ndarray, words: list[int]) -> float:
    n, k = len(words), binary.shape[0]
    chart = np.zeros((n + 1, n + 1, k))
    for i, w in enumerate(words):
        chart[i, i + 1] = lexical[:, w]
    for width in range(2, n + 1):
        for i in range(n - width + 1):
            for j in range(i + 1, i + width):
                chart[i, i + width] += np.einsum("xyz,y,z->x", binary, chart[i, j], chart[j, i + width])
    return float(chart[0, n, 0])


def test_cky_inside_matches_a_direct_dp_and_finite_differences() -> None:
    rng = np.random.default_rng(1)
    binary, lexical = rng.uniform(0, 1, (2, 2, 2)), rng.uniform(0, 1, (2, 3))
    words = [0, 2, 1, 1]
    axioms = dp.cky_axioms(binary, lexical, words)
    run = dp.CKY.run(axioms)
    assert run.chart[("sentence",)] == pytest.approx(direct_inside(binary, lexical, words), rel=1e-12)
    grads = run.gradient(("sentence",))
    for item in [("rule", 0, 1, 0), ("lex", 1, 2), ("rule", 1, 1, 1)]:
        up, down = dict(axioms), dict(axioms)
        up[item] += 1e-6
        down[item] -= 1e-6
        numeric = (dp.CKY.run(up).chart[("sentence",)] - dp.CKY.run(down).chart[("sentence",)]) / 2e-6
        assert grads[item] == pytest.approx(numeric, rel=1e-5)


def test_examples_program_prints_consistent_results(capsys: pytest.CaptureFixture[str]) -> None:
    dp.main()
    printed = capsys.readouterr().out
    assert "(sum 3.000 = 3 transitions)" in printed  # expected counts of a 4-step sequence
    likelihood = float(printed.split("HMM likelihood ")[1].split(";")[0])
    assert 0 < likelihood < 1
    inside = float(printed.split("inside probability of the sentence: ")[1])
    assert 0 < inside < 1
