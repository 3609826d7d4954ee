"""Forward chaining one item at a time on an agenda (Eisner, Goldlust & Smith
2005, section 4.2 and figure 3), its gradient by popping the tape, and best
derivations in the idempotent semirings.

>>> p = Program([Rule(("a",), [("a",), ("a",)]), Rule(("a",), [("r",)])])
>>> run = p.run({("r",): 0.3}, max_pops=3)  # r, then a twice
>>> round(run.chart[("a",)], 6), round(run.gradient(("a",))[("r",)], 6)
(0.39, 1.6)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeAlias, final

from monadl.dyna.backward import Entry, backward
from monadl.dyna.derivation import Derivation, best_derivation, derivation_gradient
from monadl.dyna.join import Index, Joins
from monadl.dyna.layer import Source, Timing, check_axioms, check_goal, goal_layer, stopping
from monadl.dyna.semiring import LOG_REAL, REAL, Semiring, annihilated, coefficient, diverged
from monadl.dyna.settle import moved, scalar_checks, settled_adjoints
from monadl.dyna.syntax import Item, Rule, parse_rules
from monadl.layers import Layer

__all__ = ["Program", "Run", "ScalarAlgebra", "parse"]

Reason: TypeAlias = "tuple[Rule, list[Item]] | None"


@final
@dataclass(frozen=True, slots=True)
class ScalarAlgebra:
    """A semiring's scalar arithmetic, for the tape's backward pass.

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
        for x in adjoints.first_updates:
            axiom = x in self.axioms
            if not (axiom or derived):
                continue
            g = adjoints.updates.get(x)
            if g is None:
                out[x] = 0.0
            elif s is LOG_REAL:
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


@final
class Program:
    """Rules, run by forward chaining.

    A rule is ``head += coeff * body_1 * ... * body_k`` over items with
    arguments (upper-case arguments are variables), or a constant
    ``head += coeff``::

        program = Program([
            Rule(("pathto", 0), [], 1.0),
            Rule(("pathto", "J"), [("edge", "I", "J"), ("pathto", "I")]),
        ])

    Args:
        rules: the rules.
        semiring: what the values are (`REAL` by default).
    """

    def __init__(self, rules: Sequence[Rule], semiring: Semiring = REAL) -> None:
        self.rules = list(rules)
        self.semiring = semiring
        self.joins = Joins(self.rules)
        self.timing = Timing()  # (its goal layers': a long run sends the next ones to a thread)

    def run(
        self,
        axioms: Mapping[Item, float],
        *,
        max_pops: int | None = None,
        tolerance: float = 0.0,
        priority: Callable[[Item, float], float] | str | None = None,
        stop: Callable[[Run], bool] | None = None,
    ) -> Run:
        """Forward chaining from ``axioms`` and the constant rules.

        Args:
            axioms: ground items and their values (zero values included: they
                exist, and get gradients); an item is a tuple, and one of a
                functor no rule reads or derives is refused (a misspelt name).
            max_pops: stop after this many pops (early stopping).
            tolerance: updates smaller than this in magnitude are not popped
                (the run stops when only such updates are pending).
            priority: which pending item pops next (lowest first); FIFO when
                None; "value" pops the best pending value first (idempotent
                semirings: then each item pops once, as in Dijkstra's algorithm).
                A function of the item and its pending value must give the same
                rank when asked again (an entry whose rank changed is stale).
            stop: a predicate on the run so far, checked after each pop.

        >>> parse("pathto(0) += 1. pathto(J) += pathto(I) * edge(I, J).").run({("edge", 0, 1): 0.5}).chart
        {('edge', 0, 1): 0.5, ('pathto', 0): 1.0, ('pathto', 1): 0.5}
        """
        check_axioms(axioms, self.rules)  # (a goal checks its own, once: `check_goal`)
        return self._run(axioms, max_pops=max_pops, tolerance=tolerance, priority=priority, stop=stop)

    def _run(
        self,
        axioms: Mapping[Item, float],
        *,
        max_pops: int | None = None,
        tolerance: float = 0.0,
        priority: Callable[[Item, float], float] | str | None = None,
        stop: Callable[[Run], bool] | None = None,
    ) -> Run:
        semiring = self.semiring
        rank: Callable[[Item, float], float] | None
        if priority == "value":
            better = semiring.better
            if better is None:
                raise ValueError(f"an agenda by value needs an idempotent semiring, not {semiring.name}")
            rank = lambda item, value: better(value)  # noqa: E731
        elif isinstance(priority, str):
            raise ValueError(f"priority must be a function, None or 'value', not {priority!r}")
        else:
            rank = priority
        chart: dict[Item, float] = {}
        index = Index()
        agenda: dict[Item, float] = {}
        because: dict[Item, Reason] = {}
        fifo: deque[Item] = deque()
        queued: set[Item] = set()  # (in the FIFO; the others wait for a push: popping them would change nothing)
        # With a priority: a heap of (rank, push order, item); an entry whose
        # rank no longer matches the item's pending value is stale, skipped.
        heap: list[tuple[float, int, Item]] = []
        pushes = itertools.count()
        tape: list[Entry[float]] = []
        run = Run(self, chart, tape, 0, agenda, axioms={tuple(k): float(v) for k, v in axioms.items()})
        track = semiring.gradient == "backpointer"

        def push(item: Item, value: float, reason: Reason) -> None:
            if item in agenda:
                combined = semiring.plus(agenda[item], value)
                if track and combined != agenda[item]:
                    because[item] = reason
                agenda[item] = combined
            else:
                agenda[item] = value
                because[item] = reason
            if rank is None:
                if item not in queued:
                    queued.add(item)
                    fifo.append(item)
            else:
                heapq.heappush(heap, (rank(item, agenda[item]), next(pushes), item))

        for item, value in axioms.items():
            push(tuple(item), float(value), None)
        for rule in self.rules:
            if not rule.body:
                push(rule.head, coefficient(semiring, rule), (rule, []) if track else None)
        while agenda:
            if max_pops is not None and run.pops >= max_pops:
                break
            a = self._choose(agenda, fifo, queued, heap, chart, tolerance, rank)
            if a is None:
                break
            update = agenda.pop(a)
            reason = because.pop(a, None)
            first = a not in chart
            old = chart.get(a, semiring.zero)
            new = semiring.plus(old, update)
            if math.isinf(new) and math.isfinite(update) and not first:
                # The sum overflowed (a cycle of weight 1 or more): its consumers get the infinity, not
                # the finite update that overflowed it, else they stand still short of it, finite.
                update = new
            changed = first or moved(old, new)
            tape.append(Entry(a, None if first else old, update, changed))
            run.pops += 1
            chart[a] = new
            if track and changed:
                run.best[a] = reason
            if first:
                index.add(a)
            if changed:
                for c, contribution, instance in self._contributions(a, old, update, first, chart, index):
                    push(c, contribution, instance if track else None)
            if stop is not None and stop(run):
                break
        # Converged: nothing pending would change the chart (a run stopped early may have got there too,
        # and one whose priority ranked an item differently when asked again may have stopped short).
        run.settled = tolerance == 0 and not any(self._poppable(x, agenda, chart, tolerance) for x in agenda)
        # A value gone to infinity or NaN stands still too, at no fixpoint: a divergent run has not converged.
        run.converged = run.settled and not diverged(semiring, chart.values())
        return run

    def _choose(
        self,
        agenda: dict[Item, float],
        fifo: deque[Item],
        queued: set[Item],
        heap: list[tuple[float, int, Item]],
        chart: dict[Item, float],
        tolerance: float,
        rank: Callable[[Item, float], float] | None,
    ) -> Item | None:
        if rank is not None:
            while heap:
                ranked, _, item = heapq.heappop(heap)
                # An item that is not poppable now gets a fresh entry when its value next changes.
                if (
                    item in agenda
                    and ranked == rank(item, agenda[item])
                    and self._poppable(item, agenda, chart, tolerance)
                ):
                    return item
            return None
        while fifo:
            item = fifo.popleft()
            queued.discard(item)
            # An item that is not poppable waits (out of the FIFO) until a push changes its update.
            if item in agenda and self._poppable(item, agenda, chart, tolerance):
                return item
        return None

    def _poppable(self, item: Item, agenda: dict[Item, float], chart: dict[Item, float], tolerance: float) -> bool:
        """Whether ``item``'s pending update pops: it is new, or it would change
        the chart (by more than ``tolerance`` when there is one; in the real
        semiring, an update of more than it)."""
        if item not in chart:
            return True
        semiring = self.semiring
        old, update = chart[item], agenda[item]
        if semiring is REAL and tolerance > 0:
            return not abs(update) <= tolerance  # (NaN pops)
        new = semiring.plus(old, update)
        return moved(old, new) and not abs(new - old) <= tolerance

    def _contributions(
        self, a: Item, old: float, update: float, first: bool, chart: dict[Item, float], index: Index
    ) -> Iterator[tuple[Item, float, tuple[Rule, list[Item]]]]:
        times = self.semiring.times
        for rule, i, body, c in self.joins.instantiations(a, first, chart, index):
            product = times(coefficient(self.semiring, rule), update)
            for j, item in enumerate(body):
                if j != i:
                    product = times(product, chart[item] if (j < i or item != a) else old)
            if product != product:  # (NaN: where a sum diverged, an infinity times a zero, or a NaN)
                factors = [update if j == i else chart[x] if (j < i or x != a) else old for j, x in enumerate(body)]
                product = annihilated(self.semiring, [coefficient(self.semiring, rule), *factors], product)
            yield c, product, (rule, body)

    def goal(
        self,
        goal: Item,
        axioms: Mapping[Item, float] | None = None,
        weights: Mapping[Any, Source] | None = None,
        **run_options: Any,
    ) -> Layer[float, float]:
        """``chart[goal]`` as a differentiable scalar layer.

        ``weights`` binds functors to weights, layers or arrays (`Source`):
        the axiom ``f(i, j)`` is the entry ``[i, j]`` of ``weights[f]``'s value
        for every entry of the array (zeros included). Its backward pass runs
        the tape, only when a delta is wanted.
        A run that stood still at no fixpoint, a value gone to infinity or NaN
        (a cycle of weight 1 or more), is a `NonFiniteError`; one stopped early
        (``max_pops``, ``stop``) gives the value it reached.

        >>> import anyio, numpy as np, monadl as ml
        >>> w = ml.Weight(np.array([0.5, 0.25]))
        >>> anyio.run(parse("s += x(I) * x(I).").goal(("s",), weights={"x": w}).predict)
        0.3125
        """
        check = partial(check_goal, goal, self.rules, axioms)
        check(weights)
        zero = self.semiring.zero  # (a goal never derived: the semiring's zero, as `ArrayRun.value`)
        return goal_layer(
            lambda values, stop: self._run(values, **stopping(run_options, stop)),
            lambda run: run.chart.get(goal, zero),
            goal,
            axioms,
            weights,
            self.timing,
            check,
        )


def parse(text: str, semiring: Semiring = REAL) -> Program:
    """A program from text, one rule per ``.``::

        stop(I) += edgezero(I) * pathto(I).
        pathto(J) += edge(I, J) * pathto(I).
        pathto(0) += 1.                        % a constant: no body item
        b(X) += 0.5 * a(X) * w(X, Y) * a(Y).   % a leading number is the coefficient

    Upper-case arguments are variables (``_`` alone: a fresh one at each
    occurrence); integers and lower-case words are
    constants; ``%`` starts a comment.

    >>> parse("a += a * a. a += r.").rules[0].body
    [('a',), ('a',)]
    """
    return Program(parse_rules(text), semiring)
