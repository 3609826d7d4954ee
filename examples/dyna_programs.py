"""Two classic dynamic programs written as monadl.dyna weighted logic programs.

* The forward algorithm of a hidden Markov model: the goal is the likelihood
  of an observation sequence, and the gradient with respect to each
  transition probability, times that probability over the likelihood, is the
  expected number of times the transition is used (the E step of EM).
* The inside algorithm of CKY for a probabilistic context-free grammar in
  Chomsky normal form: the goal is the probability of a sentence. The same
  rules in the max-times semiring are Viterbi CKY: the goal is the
  probability of the best parse, and its best derivation is that parse.

Run: ``python examples/dyna_programs.py`` prints them for small random models.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from monadl.dyna import MAX_TIMES, Derivation, Item, Program, Rule

HMM = Program(
    [
        Rule(("alpha", 0, "S"), [("init", "S"), ("obs", 0, "O"), ("emit", "S", "O")]),
        Rule(
            ("alpha", "T2", "S2"),
            [
                ("alpha", "T1", "S1"),
                ("succ", "T1", "T2"),
                ("trans", "S1", "S2"),
                ("obs", "T2", "O"),
                ("emit", "S2", "O"),
            ],
        ),
        Rule(("likelihood",), [("alpha", "T", "S"), ("final", "T")]),
    ]
)


def hmm_axioms(init: np.ndarray, trans: np.ndarray, emit: np.ndarray, observations: Sequence[int]) -> dict[Item, float]:
    axioms: dict[Item, float] = {("init", s): float(p) for s, p in enumerate(init)}
    axioms.update({("trans", a, b): float(trans[a, b]) for a in range(len(init)) for b in range(len(init))})
    axioms.update({("emit", s, o): float(emit[s, o]) for s in range(len(init)) for o in range(emit.shape[1])})
    axioms.update({("obs", t, o): 1.0 for t, o in enumerate(observations)})
    axioms.update({("succ", t, t + 1): 1.0 for t in range(len(observations) - 1)})
    axioms[("final", len(observations) - 1)] = 1.0
    return axioms


def expected_transitions(
    init: np.ndarray, trans: np.ndarray, emit: np.ndarray, observations: Sequence[int]
) -> tuple[float, np.ndarray]:
    """The likelihood and the expected transition counts, from the program's gradient."""
    run = HMM.run(hmm_axioms(init, trans, emit, observations))
    likelihood = run.chart[("likelihood",)]
    grads = run.gradient(("likelihood",))
    n = len(init)
    counts = np.array(
        [[trans[a, b] * grads.get(("trans", a, b), 0.0) / likelihood for b in range(n)] for a in range(n)]
    )
    return likelihood, counts


CKY = Program(
    [
        Rule(("constit", "X", "I", "J"), [("lex", "X", "W"), ("word", "I", "W"), ("next", "I", "J")]),
        Rule(
            ("constit", "X", "I", "K"),
            [("rule", "X", "Y", "Z"), ("constit", "Y", "I", "J"), ("constit", "Z", "J", "K")],
        ),
        Rule(("sentence",), [("constit", "S", 0, "N"), ("start", "S"), ("length", "N")]),
    ]
)


def cky_axioms(binary: np.ndarray, lexical: np.ndarray, words: Sequence[int], start: int = 0) -> dict[Item, float]:
    """``binary[x, y, z]``: P(x -> y z); ``lexical[x, w]``: P(x -> w)."""
    n_symbols = binary.shape[0]
    axioms: dict[Item, float] = {
        ("rule", x, y, z): float(binary[x, y, z])
        for x in range(n_symbols)
        for y in range(n_symbols)
        for z in range(n_symbols)
        if binary[x, y, z]
    }
    axioms.update(
        {
            ("lex", x, w): float(lexical[x, w])
            for x in range(n_symbols)
            for w in range(lexical.shape[1])
            if lexical[x, w]
        }
    )
    axioms.update({("word", i, w): 1.0 for i, w in enumerate(words)})
    axioms.update({("next", i, i + 1): 1.0 for i in range(len(words))})
    axioms[("start", start)] = 1.0
    axioms[("length", len(words))] = 1.0
    return axioms


def best_parse(binary: np.ndarray, lexical: np.ndarray, words: Sequence[int], start: int = 0) -> tuple[float, str]:
    """The probability of the sentence's best parse and the parse, bracketed:
    ``(0 (1 w0) (0 (1 w2) (1 w1)))`` for symbols 0 and 1 over words 0, 2, 1."""
    viterbi = Program(CKY.rules, MAX_TIMES)
    run = viterbi.run(cky_axioms(binary, lexical, words, start), priority="value")
    derivation = run.best_derivation(("sentence",))
    return run.chart[("sentence",)], bracket(derivation.children[0])


def bracket(constituent: Derivation) -> str:
    """A derivation of ``constit(X, I, J)`` as a bracketed tree (recursive:
    a tree's depth is at most its sentence's length)."""
    symbol = constituent.item[1]
    lexical, *rest = constituent.children
    if lexical.item[0] == "lex":  # constit(X, I, J) += lex(X, W) * word(I, W) * next(I, J)
        return f"({symbol} w{lexical.item[2]})"
    left, right = rest  # constit(X, I, K) += rule(X, Y, Z) * constit(Y, I, J) * constit(Z, J, K)
    return f"({symbol} {bracket(left)} {bracket(right)})"


def main() -> None:
    rng = np.random.default_rng(0)
    init = rng.dirichlet(np.ones(3))
    trans = rng.dirichlet(np.ones(3), size=3)
    emit = rng.dirichlet(np.ones(2), size=3)
    likelihood, counts = expected_transitions(init, trans, emit, [0, 1, 1, 0])
    print(f"HMM likelihood {likelihood:.6f}; expected transition counts (sum {counts.sum():.3f} = 3 transitions):")
    print(np.round(counts, 4))
    binary = rng.uniform(0, 1, (2, 2, 2))
    lexical = rng.uniform(0, 1, (2, 3))
    total = binary.sum(axis=(1, 2)) + lexical.sum(axis=1)
    binary, lexical = binary / total[:, None, None], lexical / total[:, None]
    probability, parse = best_parse(binary, lexical, [0, 2, 1])
    print(f"Viterbi CKY best parse: {parse} (probability {probability:.6f})")
    run = CKY.run(cky_axioms(binary, lexical, [0, 2, 1]))
    print(f"CKY inside probability of the sentence: {run.chart[('sentence',)]:.6f}")


if __name__ == "__main__":
    main()
