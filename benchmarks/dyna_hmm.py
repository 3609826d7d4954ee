"""The HMM forward algorithm with gradients: monadl.dyna against NumPy by hand.

monadl.dyna runs the forward algorithm as a weighted logic program (forward
chaining on an agenda, item at a time, in the log-real semiring so long
sequences do not underflow) and its gradient by popping the tape. The peer is
a vectorised NumPy forward-backward (scaled), which computes the same
log-likelihood and the same gradients d log L / d log trans.
monadl.dyna.ArrayProgram runs the same program with the states batched into
arrays (``alpha(T)`` a vector over states, ``trans`` a matrix, a rule
instance an einsum). All three are checked equal before the times are printed. Last, the Viterbi path:
ArrayProgram in the min-plus semiring over -log probabilities, its best
derivation read from the back-pointers, against a vectorised NumPy Viterbi.

Run: ``python -m benchmarks.dyna_hmm --steps 1000 --states 50`` (from the repository root).
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import numpy as np

from examples import dyna_programs as dp
from monadl.dyna import LOG_REAL, MIN_PLUS, ArrayProgram, Program


def numpy_forward_backward(
    init: np.ndarray, trans: np.ndarray, emit: np.ndarray, obs: np.ndarray
) -> tuple[float, np.ndarray]:
    """log L and d log L / d log trans, by a scaled forward-backward."""
    steps, n = len(obs), len(init)
    alpha = np.empty((steps, n))
    scale = np.empty(steps)
    a = init * emit[:, obs[0]]
    scale[0] = a.sum()
    alpha[0] = a / scale[0]
    for t in range(1, steps):
        a = (alpha[t - 1] @ trans) * emit[:, obs[t]]
        scale[t] = a.sum()
        alpha[t] = a / scale[t]
    beta = np.ones(n)
    counts = np.zeros((n, n))
    for t in range(steps - 1, 0, -1):
        b = emit[:, obs[t]] * beta
        counts += np.outer(alpha[t - 1], b) * trans / scale[t]
        beta = (trans @ b) / scale[t]
    return float(np.log(scale).sum()), counts  # expected counts = d log L / d log trans


def numpy_viterbi(init: np.ndarray, trans: np.ndarray, emit: np.ndarray, obs: np.ndarray) -> tuple[float, list[int]]:
    """The best path's cost (-log probability) and its states, by a vectorised Viterbi in -log space."""
    cost = -np.log(init) - np.log(emit[:, obs[0]])
    back = []
    for o in obs[1:]:
        scores = cost[:, None] - np.log(trans)  # [from, to]
        back.append(scores.argmin(axis=0))
        cost = scores.min(axis=0) - np.log(emit[:, o])
    state = int(cost.argmin())
    path = [state]
    for pointers in reversed(back):
        state = int(pointers[state])
        path.append(state)
    return float(cost.min()), path[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--states", type=int, default=50)
    parser.add_argument("--symbols", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    init = rng.dirichlet(np.ones(args.states))
    trans = rng.dirichlet(np.ones(args.states), size=args.states)
    emit = rng.dirichlet(np.ones(args.symbols), size=args.states)
    obs = rng.integers(0, args.symbols, args.steps)

    started = time.perf_counter()
    log_likelihood, counts = numpy_forward_backward(init, trans, emit, obs)
    numpy_seconds = time.perf_counter() - started

    axioms = {k: math.log(v) for k, v in dp.hmm_axioms(init, trans, emit, list(obs)).items()}
    program = Program(dp.HMM.rules, LOG_REAL)
    started = time.perf_counter()
    run = program.run(axioms)
    forward_seconds = time.perf_counter() - started
    grads = run.gradient(("likelihood",))
    dyna_seconds = time.perf_counter() - started

    n = args.states
    batched = ArrayProgram(
        dp.HMM.rules, LOG_REAL, arrays={"alpha": {1: n}, "init": {0: n}, "trans": {0: n, 1: n}, "emit": {0: n}}
    )
    started = time.perf_counter()
    batched_run = batched.run(axioms)
    batched_forward_seconds = time.perf_counter() - started
    batched_grads = batched_run.gradient(("likelihood",))
    batched_seconds = time.perf_counter() - started

    batched_counts = np.array([[batched_grads[("trans", a, b)] for b in range(n)] for a in range(n)])
    assert abs(batched_run.value(("likelihood",)) - log_likelihood) < 1e-8 * abs(log_likelihood)
    assert np.allclose(batched_counts, counts, rtol=1e-6, atol=1e-9)
    dyna_counts = np.array([[grads.get(("trans", a, b), 0.0) for b in range(args.states)] for a in range(args.states)])
    assert abs(run.chart[("likelihood",)] - log_likelihood) < 1e-8 * abs(log_likelihood)
    assert np.allclose(dyna_counts, counts, rtol=1e-6, atol=1e-9)
    # Viterbi: min-plus over -log probabilities (max-times would underflow on a long sequence), batched.
    costs = {k: -v for k, v in axioms.items()}
    started = time.perf_counter()
    numpy_cost, numpy_path = numpy_viterbi(init, trans, emit, obs)
    numpy_viterbi_seconds = time.perf_counter() - started
    viterbi = ArrayProgram(
        dp.HMM.rules, MIN_PLUS, arrays={"alpha": {1: n}, "init": {0: n}, "trans": {0: n, 1: n}, "emit": {0: n}}
    )
    started = time.perf_counter()
    derivation = viterbi.run(costs).best_derivation(("likelihood",))
    viterbi_seconds = time.perf_counter() - started
    path = [item[2] for item in sorted({d.item for d in derivation.walk() if d.item[0] == "alpha"})]
    assert path == numpy_path
    assert abs(sum(costs[x] for x in derivation.leaves()) - numpy_cost) < 1e-8 * numpy_cost

    print(f"machine: {platform.machine()}, python {platform.python_version()}, numpy {np.__version__}")
    print(f"HMM {args.steps} observations x {args.states} states: log L = {log_likelihood:.4f} (all agree)")
    rows = [
        ("numpy forward-backward", numpy_seconds, numpy_seconds),
        ("monadl.dyna forward", forward_seconds, numpy_seconds),
        ("monadl.dyna forward+gradient", dyna_seconds, numpy_seconds),
        ("ArrayProgram forward", batched_forward_seconds, numpy_seconds),
        ("ArrayProgram forward+gradient", batched_seconds, numpy_seconds),
        ("numpy Viterbi", numpy_viterbi_seconds, numpy_viterbi_seconds),
        ("ArrayProgram Viterbi path", viterbi_seconds, numpy_viterbi_seconds),
    ]
    print(f"{'implementation':30} {'seconds':>10} {'ratio':>10}")
    for name, seconds, peer in rows:
        print(f"{name:30} {seconds:10.4f} {seconds / peer:9.1f}x")


if __name__ == "__main__":
    main()
