"""The result of running a `monadl.dyna.Program`: its chart, the tape to
differentiate it, and its back-pointers; and the scalar arithmetic that the
tape's backward pass runs in."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, final

from monadl.dyna.backward import Entry, backward
from monadl.dyna.derivation import Derivation, best_derivation, derivation_gradient
from monadl.dyna.semiring import Semiring, coefficient, tape_arithmetic
from monadl.dyna.settle import scalar_checks, settled_adjoints
from monadl.dyna.syntax import Item, Rule

if TYPE_CHECKING:
    from monadl.dyna.scalar import Program

__all__ = ["Reason", "Run", "ScalarAlgebra"]

Reason: TypeAlias = "tuple[Rule, list[Item]] | None"


@final
@dataclass(frozen=True, slots=True)
class ScalarAlgebra:
    """A semiring's scalar arithmetic, for the tape's backward pass.

    >>> from monadl.dyna.semiring import REAL
    >>> ScalarAlgebra(REAL).vjp(Rule(("c",), [("a",), ("b",)], 3.0), [2.0, 5.0], 0, 1.0)  # d(3ab)/da
    15.0
    """

    semiring: Semiring

    def plus(self, a: float, b: float) -> float:
        """The semiring's plus."""
        return self.semiring.plus(a, b)

    def vjp(self, rule: Rule, operands: Sequence[float], position: int, adjoint: float) -> float:
        """``adjoint`` times the coefficient times the other operands."""
        s = self.semiring
        result = s.times(adjoint, coefficient(s, rule))
        for j, v in enumerate(operands):
            if j != position:
                result = s.times(result, v)
        return result


@final
@dataclass(slots=True)
class Run:
    """The result of forward chaining: the chart and the tape to differentiate it.

    Args:
        program: the program that ran.
        chart: every derived or given item and its value.
        tape: the pops, in order.
        pops: how many items popped.
        pending: the agenda left when the run stopped.
        best: back-pointers (max-times, min-plus): the rule instance that set
            each derived item's value.
        axioms: the axioms given to the run.
        settled: at tolerance 0, nothing pending would change the chart (also
            when ``max_pops`` or ``stop`` ended the run just there): what is
            pending came along rule instances the tape does not hold, and the
            gradient carries it to the fixpoint (`Run.gradient`).
        converged: settled, and no value went to infinity or NaN (a divergent
            run stands still there too, at no fixpoint).
    """

    program: Program
    chart: dict[Item, float]
    tape: list[Entry[float]]
    pops: int
    pending: dict[Item, float] = field(default_factory=dict)
    best: dict[Item, Reason] = field(default_factory=dict)
    axioms: dict[Item, float] = field(default_factory=dict)
    converged: bool = False
    settled: bool = False

    def gradient(self, goal: Item, *, derived: bool = False) -> dict[Item, float]:
        """d chart[goal] / d value, for the axioms of the run.

        The real and log-real semirings pop the tape (the appendix's backward
        pass; in log-real, where values are logarithms, d log-value / d
        log-value); max-times and min-plus give the subgradient along the best
        derivation. The keys are the axioms the computation reached (the tape:
        every axiom that popped, zeros included; a best derivation: the axioms
        on it); any other axiom's gradient is 0.

        An update that never popped because it would change nothing (an
        exactly-zero product reaching an item that already has a value, or
        one too small to change it) still has a derivative: when the run
        converged, each such item's pending update gets the adjoint of an
        amount added to it at the end and carried to the fixpoint
        (`NonFiniteError` if that adjoint diverges, on a cycle of weight 1 or
        more, or does not settle).

        Args:
            goal: the item differentiated.
            derived: also give each derived item the gradient with respect to
                an amount added to it (when it first popped, as if an axiom
                had contributed it: in an HMM, d likelihood / d alpha is the
                backward probability beta); in log-real, where values are
                logarithms, that times the item's value over the goal's
                (alpha·beta / likelihood: in an HMM, the state's posterior).

        >>> from monadl.dyna.scalar import Program
        >>> p = Program([Rule(("b",), [("a",), ("a",)]), Rule(("c",), [("b",), ("a",)])])
        >>> run = p.run({("a",): 2.0})
        >>> run.gradient(("c",)), run.gradient(("c",), derived=True)[("b",)]  # c = a**3
        ({('a',): 12.0}, 2.0)
        """
        s = self.program.semiring
        if s.gradient == "backpointer":
            if goal not in self.chart:
                return {}
            return derivation_gradient(goal, self.best.get, self.chart.__getitem__, s, derived=derived)
        if s.gradient != "tape":
            raise NotImplementedError(f"the {s.name} semiring has no gradient here (forward only)")
        algebra = ScalarAlgebra(s)
        pending = None
        if self.settled and self.pending:
            changed, diverged = scalar_checks(s.zero)
            joins, popped = self.program.joins, len(self.tape)
            pending = settled_adjoints(self.chart, joins, algebra, goal, s.one, self.pending, changed, diverged, popped)
        adjoints = backward(self.tape, self.chart, self.program.joins, algebra, goal, s.one, pending)
        out: dict[Item, float] = {}
        log_real = tape_arithmetic(s) == "log-real"  # (asked once: a few calls of plus and times)
        for x in adjoints.first_updates:
            axiom = x in self.axioms
            if not (axiom or derived):
                continue
            g = adjoints.updates.get(x)
            if g is None:
                out[x] = 0.0
            elif log_real:
                # g is log d exp(goal) / d exp(x): in log space d goal / d x = exp(g + x - goal)
                # (a derived item's x: its value, not its first update, which may be one path of many);
                # a goal of probability 0 stays 0 near here (exp(-inf + inf) was NaN).
                goal_value = self.chart[goal]
                value = self.axioms[x] if axiom else self.chart[x]
                out[x] = 0.0 if goal_value == -math.inf else math.exp(g + value - goal_value)
            else:
                out[x] = g
        return out

    def best_derivation(self, goal: Item) -> Derivation:
        """The derivation that gave the goal its value (max-times: the Viterbi
        derivation; min-plus: the shortest one), as a tree of items and rules.

        >>> from monadl.dyna.scalar import parse
        >>> from monadl.dyna.semiring import MIN_PLUS
        >>> p = parse("path(J) += path(I) * edge(I, J). path(0) += 0.", MIN_PLUS)
        >>> run = p.run({("edge", 0, 1): 4.0, ("edge", 0, 2): 1.0, ("edge", 2, 1): 2.0}, priority="value")
        >>> [d.item for d in run.best_derivation(("path", 1)).walk() if d.item[0] == "edge"]
        [('edge', 0, 2), ('edge', 2, 1)]
        """
        s = self.program.semiring
        if s.gradient != "backpointer":
            raise ValueError(f"a best derivation needs an idempotent semiring with back-pointers, not {s.name}")
        if goal not in self.chart:
            raise KeyError(f"{goal} was not derived")
        return best_derivation(goal, self.best.get)
