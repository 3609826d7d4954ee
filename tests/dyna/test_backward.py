"""What a gradient holds, the same in every semiring and both programs: the
axioms by default, and with ``derived=True`` each derived item's gradient with
respect to an amount added to it (an HMM's backward probabilities)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from examples import dyna_programs as dp
from monadl.dyna import LOG_REAL, MAX_TIMES, REAL, ArrayProgram, Item, Program, Semiring
from tests.dyna.test_scalar import PATH, path_axioms

N = 3
HMM_ARRAYS = {"alpha": {1: N}, "init": {0: N}, "trans": {0: N, 1: N}, "emit": {0: N}}


def hmm(steps: int = 5) -> tuple[dict[Item, float], np.ndarray, np.ndarray, float]:
    """Axioms, the forward and backward probabilities alpha[t, s], beta[t, s], and the likelihood."""
    rng = np.random.default_rng(7)
    init, trans, emit = rng.dirichlet(np.ones(N)), rng.dirichlet(np.ones(N), size=N), rng.dirichlet(np.ones(2), size=N)
    obs = [int(o) for o in rng.integers(0, 2, steps)]
    alpha, beta = np.zeros((steps, N)), np.ones((steps, N))
    alpha[0] = init * emit[:, obs[0]]
    for t in range(1, steps):
        alpha[t] = alpha[t - 1] @ trans * emit[:, obs[t]]
    for t in range(steps - 2, -1, -1):
        beta[t] = trans @ (emit[:, obs[t + 1]] * beta[t + 1])
    return dp.hmm_axioms(init, trans, emit, obs), alpha, beta, float(alpha[-1].sum())


def in_semiring(axioms: dict[Item, float], semiring: Semiring) -> dict[Item, float]:
    return {k: math.log(v) for k, v in axioms.items()} if semiring is LOG_REAL else axioms


@pytest.mark.parametrize("semiring", [REAL, LOG_REAL, MAX_TIMES], ids=lambda s: s.name)
@pytest.mark.parametrize("batched", [False, True], ids=["item-at-a-time", "batched"])
def test_a_gradient_holds_axioms_only_unless_derived_items_are_asked_for(semiring: Semiring, batched: bool) -> None:
    axioms, _, _, _ = hmm()
    axioms = in_semiring(axioms, semiring)
    run: Any = (
        ArrayProgram(dp.HMM.rules, semiring, arrays=HMM_ARRAYS).run(axioms)
        if batched
        else Program(dp.HMM.rules, semiring).run(axioms)
    )
    goal = ("likelihood",)
    grads = run.gradient(goal)
    assert set(grads) <= set(axioms)
    if semiring is not MAX_TIMES:  # the tape: every axiom (all popped); max-times: those on the best derivation
        assert set(grads) == set(axioms)
    full = run.gradient(goal, derived=True)
    derived = set(full) - set(axioms)
    assert {x[0] for x in derived} == {"alpha", "likelihood"}
    assert full[goal] == pytest.approx(1.0)
    for item, value in grads.items():
        assert full[item] == value


@pytest.mark.parametrize("semiring", [REAL, LOG_REAL], ids=lambda s: s.name)
@pytest.mark.parametrize("batched", [False, True], ids=["item-at-a-time", "batched"])
def test_derived_gradients_of_the_hmm_are_backward_probabilities(semiring: Semiring, batched: bool) -> None:
    axioms, alpha, beta, likelihood = hmm()
    program: Any = (
        ArrayProgram(dp.HMM.rules, semiring, arrays=HMM_ARRAYS) if batched else Program(dp.HMM.rules, semiring)
    )
    grads = program.run(in_semiring(axioms, semiring)).gradient(("likelihood",), derived=True)
    for t in range(alpha.shape[0]):
        for s in range(N):
            if semiring is REAL:  # d L / d alpha(t, s) = beta(t, s)
                assert grads[("alpha", t, s)] == pytest.approx(beta[t, s], rel=1e-10)
            else:  # d log L / d log alpha(t, s): the posterior of state s at time t
                assert grads[("alpha", t, s)] == pytest.approx(alpha[t, s] * beta[t, s] / likelihood, rel=1e-10)


def test_a_derived_gradient_is_the_change_from_an_amount_added_to_the_item() -> None:
    axioms = path_axioms(4)  # a cyclic graph: the amount goes round the cycles too
    options: dict[str, Any] = {"tolerance": 1e-14, "max_pops": 100_000}
    grads = PATH.run(axioms, **options).gradient(("total",), derived=True)
    eps = 1e-6
    for item in [("pathto", 2), ("stop", 1)]:
        up, down = {**axioms, item: eps}, {**axioms, item: -eps}
        numeric = (PATH.run(up, **options).chart[("total",)] - PATH.run(down, **options).chart[("total",)]) / (2 * eps)
        assert grads[item] == pytest.approx(numeric, rel=1e-6), item


def test_an_axiom_that_is_also_derived_stays_an_axiom() -> None:
    axioms = path_axioms(5)  # pathto(0) is an axiom, and the cycles derive more of it
    run = PATH.run(axioms, tolerance=1e-14, max_pops=100_000)
    assert ("pathto", 0) in run.gradient(("total",))
    assert ("pathto", 1) not in run.gradient(("total",))
