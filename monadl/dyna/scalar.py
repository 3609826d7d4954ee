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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypedDict, Unpack, final

from monadl.dyna.backward import Entry
from monadl.dyna.checks import check_axioms, check_goal, check_options, check_reads, declared_inputs
from monadl.dyna.join import Index, Joins
from monadl.dyna.layer import Source, Timing, goal_layer, stopping
from monadl.dyna.scalar_run import Reason, Run, ScalarAlgebra
from monadl.dyna.semiring import REAL, Semiring, annihilated, coefficient, diverged
from monadl.dyna.settle import moved
from monadl.dyna.syntax import Item, Rule, parse_rules
from monadl.layers import Layer

__all__ = ["Program", "Run", "RunOptions", "ScalarAlgebra", "parse"]


class RunOptions(TypedDict, total=False):
    """The keywords of `Program.run`, which `Program.goal` passes on to each
    of its goal's runs (so mypy refuses a misspelt one where the goal is built).

    >>> options: RunOptions = {"max_pops": 3}
    >>> parse("a += a * a. a += r.").run({("r",): 0.3}, **options).pops
    3
    """

    max_pops: int | None
    tolerance: float
    priority: Callable[[Item, float], float] | str | None
    stop: Callable[[Run], bool] | None


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
        inputs: functors that only axioms give (or weights), which a run may
            give none of (a graph of no edges). A rule reading a functor
            that nothing derives or gives in a run is refused there, as a
            misspelt name, unless it is declared here.
    """

    def __init__(self, rules: Sequence[Rule], semiring: Semiring = REAL, *, inputs: Iterable[str] = ()) -> None:
        self.rules = list(rules)
        self.semiring = semiring
        self.inputs = declared_inputs(inputs, self.rules)
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
                functor no rule reads or derives, or of another number of
                arguments than the rules read, is refused (a misspelt name),
                as is a rule that reads what no rule derives and no axiom
                gives, unless it is one of the program's ``inputs``.
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
        check_reads(self.rules, axioms, {}, self.inputs)
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
        rank = _rank(semiring, priority)
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
        if semiring == REAL and tolerance > 0:
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
        **options: Unpack[RunOptions],
    ) -> Layer[float, float]:
        """``chart[goal]`` as a differentiable scalar layer.

        ``weights`` binds functors to weights, layers or arrays (`Source`):
        the axiom ``f(i, j)`` is the entry ``[i, j]`` of ``weights[f]``'s value
        for every entry of the array (zeros included; so an entry that stands
        for no axiom, min-plus's missing edge, is the semiring's zero in a
        layer, ``ml.where(mask, cost, np.inf)``, where a weight's data must
        stay finite). Its backward pass runs
        the tape, only when a delta is wanted.
        ``options`` are `run`'s (`RunOptions`: ``max_pops``, ``tolerance``,
        ``priority``, ``stop``), given to each run; any other is refused here.
        A run that stood still at no fixpoint, a value gone to infinity or NaN
        (a cycle of weight more than 1), is a `NonFiniteError`; one stopped early
        (``max_pops``, ``stop``) gives the value it reached. A sum that grows
        without end by steps that do not grow (a cycle of weight exactly 1, a
        negative cycle in min-plus) reaches no infinity: the run goes on until
        the float's steps stop changing it, which is for ever in practice;
        bound such a program with ``max_pops`` or a timeout around the await.

        >>> import anyio, numpy as np, monadl as ml
        >>> w = ml.Weight(np.array([0.5, 0.25]))
        >>> anyio.run(parse("s += x(I) * x(I).").goal(("s",), weights={"x": w}).predict)
        np.float64(0.3125)
        """
        check_options(options, list(RunOptions.__annotations__), "Program.goal")
        _rank(self.semiring, options.get("priority"))  # (refused here, not at the first run)
        check = partial(check_goal, goal, self.rules, axioms, inputs=self.inputs)
        check(weights)
        zero = self.semiring.zero  # (a goal never derived: the semiring's zero, as `ArrayRun.value`)
        return goal_layer(
            lambda values, stop: self._run(values, **stopping(options, stop)),
            lambda run: run.chart.get(goal, zero),
            goal,
            axioms,
            weights,
            self.timing,
            check,
        )


def _rank(
    semiring: Semiring, priority: Callable[[Item, float], float] | str | None
) -> Callable[[Item, float], float] | None:
    """What ranks the agenda's items (lowest pops first) for a run's
    ``priority``; None: FIFO. A string other than ``"value"``, or ``"value"``
    in a semiring with no order of better values, is refused.

    >>> from monadl.dyna.semiring import MIN_PLUS
    >>> _rank(MIN_PLUS, "value")(("a",), 2.0)
    2.0
    >>> _rank(REAL, "value")
    Traceback (most recent call last):
    ...
    ValueError: an agenda by value needs an idempotent semiring, not real
    """
    if priority == "value":
        better = semiring.better
        if better is None:
            raise ValueError(f"an agenda by value needs an idempotent semiring, not {semiring.name}")
        return lambda item, value: better(value)
    if isinstance(priority, str):
        raise ValueError(f"priority must be a function, None or 'value', not {priority!r}")
    return priority


def parse(text: str, semiring: Semiring = REAL, *, inputs: Iterable[str] = ()) -> Program:
    """A program from text, one rule per ``.``::

        stop(I) += edgezero(I) * pathto(I).
        pathto(J) += edge(I, J) * pathto(I).
        pathto(0) += 1.                        % a constant: no body item
        b(X) += 0.5 * a(X) * w(X, Y) * a(Y).   % a leading number is the coefficient

    Upper-case arguments are variables (``_`` alone: a fresh one at each
    occurrence); integers and lower-case words are
    constants; ``%`` starts a comment. ``semiring`` and ``inputs`` (functors
    a run may give none of) are `Program`'s.

    >>> parse("a += a * a. a += r.").rules[0].body
    [('a',), ('a',)]
    """
    return Program(parse_rules(text), semiring, inputs=inputs)
