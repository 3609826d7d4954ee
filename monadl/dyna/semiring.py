"""The semirings a program computes in: how values combine across derivations
(``plus``) and within one (``times``)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from monadl.dyna.syntax import Rule

__all__ = ["LOG_REAL", "MAX_TIMES", "MIN_PLUS", "REAL", "Semiring", "annihilated", "coefficient", "tape_arithmetic"]

_GRADIENTS = ("tape", "backpointer", None)
"""What a semiring's ``gradient`` may be."""


@dataclass(frozen=True, slots=True)
class Semiring:
    """Values combine with ``plus`` across derivations and ``times`` within one.

    ``gradient``: "tape" (the appendix's backward pass, in this semiring's own
    arithmetic: the real and log-real semirings), "backpointer" (subgradients
    along the best derivation: max-times, min-plus) or None (forward only).
    ``better`` orders values for an agenda by value (idempotent semirings).

    A gradient is refused here, not at the first ``train()``, where it is
    none of these, and "tape" where the arithmetic is neither real nor
    log-real (`tape_arithmetic`): the tape's adjoints are the gradient only
    there, and in any other arithmetic they were numbers of no meaning.

    >>> boolean = Semiring("boolean", 0.0, 1.0, max, min)
    >>> boolean.product([1.0, 0.0]), REAL.product([2.0, 3.0]), MIN_PLUS.product([2.0, 3.0])
    (0.0, 6.0, 5.0)
    """

    name: str
    zero: float
    one: float
    plus: Callable[[float, float], float]
    times: Callable[[float, float], float]
    gradient: str | None = None
    better: Callable[[float], float] | None = None

    def __post_init__(self) -> None:
        if self.gradient not in _GRADIENTS:
            raise ValueError(
                f"semiring {self.name}: gradient={self.gradient!r} is none of 'tape' (real and log-real), "
                "'backpointer' (max or min: max-times, min-plus) or None (forward only)"
            )
        if self.gradient == "tape" and tape_arithmetic(self) is None:
            raise ValueError(
                f"semiring {self.name}: gradient='tape' differentiates the real semiring (zero 0, one 1, plus +, "
                "times *) and the log-real one (zero -inf, one 0, plus np.logaddexp, times +) only, and this one's "
                f"arithmetic is neither (plus(2, 3) gave {_tried(self.plus)}, times(2, 3) {_tried(self.times)}): "
                "its adjoints would be no gradient; where plus is max or min (max-times, min-plus, max-plus) use "
                "gradient='backpointer', otherwise gradient=None (forward only)"
            )

    def product(self, values: Iterable[float]) -> float:
        """The ``times`` of the values (``one`` for none)."""
        result = self.one
        for v in values:
            result = self.times(result, v)
        return result


def tape_arithmetic(semiring: Semiring) -> Literal["real", "log-real"] | None:
    """Which arithmetic the semiring computes in, real or log-real, asked of
    its zero, one, plus and times themselves, not of its name or identity
    (None for any other): where the tape's adjoints are a gradient, and in
    log-real, of the logarithms, to convert.

    >>> tape_arithmetic(Semiring("mine", -math.inf, 0.0, np.logaddexp, lambda a, b: a + b))
    'log-real'
    >>> tape_arithmetic(REAL), tape_arithmetic(MAX_TIMES)
    ('real', None)
    """
    zero, one, plus, times = semiring.zero, semiring.one, semiring.plus, semiring.times
    probes = ((2.0, 3.0), (-1.5, 0.25))  # (exact in float32: a float32 arithmetic passes as float64's)

    def close(x: Any, y: float) -> bool:  # (float32's log-add-exp is within 1e-7 of float64's)
        return math.isclose(float(x), y, rel_tol=1e-6)

    try:
        if (
            zero == 0.0
            and one == 1.0
            and all(close(plus(a, b), a + b) and close(times(a, b), a * b) for a, b in probes)
        ):
            return "real"
        if (
            zero == -math.inf
            and one == 0.0
            and all(
                close(times(a, b), a + b) and close(plus(a, b), math.log(math.exp(a) + math.exp(b))) for a, b in probes
            )
        ):
            return "log-real"
    except Exception:  # (a plus or times that takes no Python float: not one the tape knows)
        return None
    return None


def _tried(f: Callable[[float, float], float]) -> str:
    """``f(2.0, 3.0)``'s repr, or the error it raised, for a refusal's message."""
    try:
        return repr(f(2.0, 3.0))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _unchanged(value: float) -> float:
    """The value itself: min-plus's order, where smaller is better."""
    return value


# Named functions, never lambdas: a pickled built-in then unpickles to functions that
# are the same objects, so the copy equals the built-in and runs as it does.
REAL = Semiring("real", 0.0, 1.0, operator.add, operator.mul, gradient="tape")
"""Sums of products: probabilities, path sums."""
LOG_REAL = Semiring("log-real", -math.inf, 0.0, np.logaddexp, operator.add, gradient="tape")
"""Values are logarithms: plus is log-add-exp, times is +. Coefficients of
rules are logs too (0.0 for 1)."""
MAX_TIMES = Semiring("max-times", 0.0, 1.0, max, operator.mul, gradient="backpointer", better=operator.neg)
"""Viterbi: the best derivation's product."""
MIN_PLUS = Semiring("min-plus", math.inf, 0.0, min, operator.add, gradient="backpointer", better=_unchanged)
"""Shortest paths: the best derivation's sum. Coefficients of rules add (0.0 for none)."""


def diverged(semiring: Semiring, values: Iterable[float | np.ndarray]) -> bool:
    """Whether a chart value left the semiring's numbers: a NaN, or an infinity
    other than its zero or its one (a sum along a cycle of weight more than 1,
    a negative cycle in min-plus whose steps grow; a widest path's one is
    infinite). Such a run reached no fixpoint, however still it stands. A sum
    that grows by steps that do not grow (a cycle of weight exactly 1, a
    negative cycle of a fixed cost) never gets there: bound its run.

    >>> widest = Semiring("widest", 0.0, math.inf, max, min)
    >>> diverged(REAL, [1.0, math.inf]), diverged(MIN_PLUS, [math.inf]), diverged(widest, [math.inf])
    (True, False, False)
    """
    for v in values:
        a = np.asarray(v)
        with np.errstate(invalid="ignore"):
            if np.any(np.isnan(a) | (np.isinf(a) & (a != semiring.zero) & (a != semiring.one))):
                return True
    return False


def annihilated(semiring: Semiring, factors: Sequence[float], product: float) -> float:
    """A product of ``factors`` that came out NaN: the semiring's zero where a
    factor is zero and none is NaN (zero times anything is zero, a divergent
    sum too: each of its terms is zero, where floats give inf * 0 = NaN),
    else ``product``.

    >>> annihilated(REAL, [0.0, math.inf], math.nan), annihilated(LOG_REAL, [-math.inf, math.inf], math.nan)
    (0.0, -inf)
    """
    if any(math.isnan(v) for v in factors) or not any(v == semiring.zero for v in factors):
        return product
    return semiring.zero


def coefficient(semiring: Semiring, rule: Rule) -> float:
    """A rule's coefficient as a value of the semiring: as written, or the
    semiring's one where the rule has none.

    >>> coefficient(MIN_PLUS, Rule(("a",), [("b",)])), coefficient(MIN_PLUS, Rule(("a",), [("b",)], 2.0))
    (0.0, 2.0)
    >>> coefficient(MIN_PLUS, Rule(("a",), [("b",)], 1.0))  # a += 1 * b: b's distance and 1 more
    1.0
    """
    return semiring.one if rule.coeff is None else rule.coeff
