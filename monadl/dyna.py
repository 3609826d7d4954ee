"""Differentiable weighted logic programs: forward chaining with an agenda,
and the backward pass that pops its tape (Eisner, Goldlust & Smith 2005,
section 4.2 and figure 3 for the forward pass; section 5.2, figure 4 and the
online appendix for the gradient).

A program is a list of rules ``head += coeff * body_1 * ... * body_k`` over
items with arguments; upper-case arguments are variables::

    program = Program([
        Rule(("stop", "I"), [("edgezero", "I"), ("pathto", "I")]),
        Rule(("pathto", "J"), [("edge", "I", "J"), ("pathto", "I")]),
    ])

Axioms are ground items with values, plain numbers or rows of a monadl
`Weight` (``bind_weight("edge", w)`` makes ``edge(i, j)`` the entry
``w.data[i, j]``). `Program.run` computes the chart; `Program.goal` gives a
goal item's value as a monadl layer, so the weights bound to axioms train with
``await loss.train()``.

The semiring is the real one (+, *): the backward pass is exact for the
computation actually performed, early stopping included. The chart records
which items exist apart from their values, so an axiom whose value is exactly
zero still receives its gradient.

>>> p = Program([Rule(("a",), [("a",), ("a",)]), Rule(("a",), [("r",)])])
>>> run = p.run({("r",): 0.3}, max_pops=3)  # r, then a twice
>>> round(run.chart[("a",)], 6), round(run.gradient(("a",))[("r",)], 6)
(0.39, 1.6)
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np

from monadl.do import Do
from monadl.layers._layer import Layer, Weight
from monadl.tape import Tape

__all__ = [
    "LOG_REAL",
    "MAX_TIMES",
    "MIN_PLUS",
    "REAL",
    "Item",
    "Program",
    "Rule",
    "Run",
    "Semiring",
    "bind_weight",
    "parse",
]

Item: TypeAlias = tuple[Any, ...]
"""A ground item: a functor and its arguments, ``("edge", 0, 1)``."""
Pattern: TypeAlias = tuple[Any, ...]
"""An item with variables: arguments that are upper-case strings."""


@dataclass(frozen=True)
class Semiring:
    """Values combine with ``plus`` across derivations and ``times`` within one.

    ``gradient``: "tape" (the appendix's backward pass, in this semiring's own
    arithmetic: the real and log-real semirings), "backpointer" (subgradients
    along the best derivation: max-times, min-plus) or None (forward only).
    ``better`` orders values for an agenda by value (idempotent semirings).
    """

    name: str
    zero: float
    one: float
    plus: Callable[[float, float], float]
    times: Callable[[float, float], float]
    gradient: str | None = None
    better: Callable[[float], float] | None = None

    def product(self, values: Iterator[float] | Sequence[float]) -> float:
        result = self.one
        for v in values:
            result = self.times(result, v)
        return result


REAL = Semiring("real", 0.0, 1.0, lambda a, b: a + b, lambda a, b: a * b, gradient="tape")
LOG_REAL = Semiring("log-real", -math.inf, 0.0, np.logaddexp, lambda a, b: a + b, gradient="tape")
"""Values are logarithms: plus is log-add-exp, times is +. Coefficients of
rules are logs too (0.0 for 1)."""
MAX_TIMES = Semiring("max-times", 0.0, 1.0, max, lambda a, b: a * b, gradient="backpointer", better=lambda v: -v)
"""Viterbi: the best derivation's product."""
MIN_PLUS = Semiring("min-plus", math.inf, 0.0, min, lambda a, b: a + b, gradient="backpointer", better=lambda v: v)
"""Shortest paths: the best derivation's sum. Coefficients of rules add (0.0 for none)."""


def _is_variable(term: Any) -> bool:
    return isinstance(term, str) and term[:1].isupper()


@dataclass(frozen=True)
class Rule:
    """``head += coeff * body[0] * ... * body[k-1]``."""

    head: Pattern
    body: Sequence[Pattern]
    coeff: float = 1.0

    def __post_init__(self) -> None:
        if not self.body:
            raise ValueError(f"rule {self}: a rule needs at least one body item (write constants as axioms)")
        bound = {t for b in self.body for t in b[1:] if _is_variable(t)}
        free = [t for t in self.head[1:] if _is_variable(t) and t not in bound]
        if free:
            raise ValueError(
                f"rule {self}: head variables {free} do not occur in the body; only range-restricted rules are allowed"
            )

    def __str__(self) -> str:
        def show(p: Pattern) -> str:
            return f"{p[0]}({', '.join(map(str, p[1:]))})" if len(p) > 1 else str(p[0])

        coeff = "" if self.coeff == 1.0 else f"{self.coeff} * "
        return f"{show(self.head)} += {coeff}{' * '.join(show(b) for b in self.body)}"


def _match(pattern: Pattern, item: Item, bindings: dict[str, Any]) -> dict[str, Any] | None:
    """Extend ``bindings`` so that ``pattern`` is ``item``, or None."""
    if pattern[0] != item[0] or len(pattern) != len(item):
        return None
    out = bindings
    for term, value in zip(pattern[1:], item[1:]):
        if _is_variable(term):
            if term in out:
                if out[term] != value:
                    return None
            else:
                out = {**out, term: value}
        elif term != value:
            return None
    return out


def _ground(pattern: Pattern, bindings: Mapping[str, Any]) -> Item:
    return (pattern[0], *(bindings[t] if _is_variable(t) else t for t in pattern[1:]))


class _Index:
    """Existing items by functor and by each (argument position, value), so a
    join looks only at the items that agree with what is already bound."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[Any, ...], dict[Item, None]] = {}

    def add(self, item: Item) -> None:
        self._buckets.setdefault((item[0], len(item)), {})[item] = None
        for position, value in enumerate(item[1:], 1):
            self._buckets.setdefault((item[0], len(item), position, value), {})[item] = None

    def remove(self, item: Item) -> None:
        del self._buckets[(item[0], len(item))][item]
        for position, value in enumerate(item[1:], 1):
            del self._buckets[(item[0], len(item), position, value)][item]

    def candidates(self, pattern: Pattern, bindings: Mapping[str, Any]) -> list[Item]:
        best: dict[Item, None] = self._buckets.get((pattern[0], len(pattern)), {})
        for position, term in enumerate(pattern[1:], 1):
            value = bindings.get(term, _UNBOUND) if _is_variable(term) else term
            if value is _UNBOUND:
                continue
            bucket = self._buckets.get((pattern[0], len(pattern), position, value), {})
            if len(bucket) < len(best):
                best = bucket
        return list(best)


_UNBOUND = object()


@dataclass
class _Entry:
    item: Item
    old_chart: float
    old_agenda: float
    first: bool  # the item did not exist before this pop
    because: tuple[Rule, list[Item]] | None = None  # the derivation that set the update (back-pointer semirings)


@dataclass
class Run:
    """The result of forward chaining: the chart and the tape to differentiate it."""

    program: Program
    chart: dict[Item, float]
    tape: list[_Entry]
    pops: int
    pending: dict[Item, float] = field(default_factory=dict)
    best: dict[Item, tuple[Rule, list[Item]] | None] = field(default_factory=dict)
    axioms: dict[Item, float] = field(default_factory=dict)

    def gradient(self, goal: Item) -> dict[Item, float]:
        """d chart[goal] / d value, for every axiom of the run: the backward
        pass of the appendix, popping the tape (real and log-real semirings:
        in log-real, d log-value / d log-value), or the subgradient along the
        best derivation (max-times, min-plus)."""
        semiring = self.program.semiring
        if semiring.gradient == "tape":
            return self.program._backward(self, goal)
        if semiring.gradient == "backpointer":
            return self.program._best_derivation_gradient(self, goal)
        raise NotImplementedError(f"the {semiring.name} semiring has no gradient here (forward only)")


class Program:
    """Rules, run by forward chaining (see the module docs)."""

    def __init__(self, rules: Sequence[Rule], semiring: Semiring = REAL) -> None:
        self.rules = list(rules)
        self.semiring = semiring
        # For each functor: the (rule, body position) pairs it can drive.
        self._drives: dict[Any, list[tuple[Rule, int]]] = {}
        for rule in self.rules:
            for i, b in enumerate(rule.body):
                self._drives.setdefault(b[0], []).append((rule, i))

    # ---- forward ----------------------------------------------------------------------------
    def run(
        self,
        axioms: Mapping[Item, float],
        *,
        max_pops: int | None = None,
        tolerance: float = 0.0,
        priority: Callable[[Item, float], float] | str | None = None,
        stop: Callable[[Run], bool] | None = None,
    ) -> Run:
        """Forward chaining from ``axioms``.

        Args:
            axioms: ground items and their values (zero values included: they
                exist, and get gradients).
            max_pops: stop after this many pops (early stopping).
            tolerance: updates smaller than this in magnitude are not popped
                (the run stops when only such updates are pending).
            priority: which pending item pops next (lowest first); FIFO when
                None; "value" pops the best pending value first (idempotent
                semirings: then each item pops once, as in Dijkstra's algorithm).
            stop: a predicate on the run so far, checked after each pop.
        """
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
        index = _Index()
        agenda: dict[Item, float] = {}
        because: dict[Item, tuple[Rule, list[Item]] | None] = {}
        fifo: deque[Item] = deque()
        # With a priority: a heap of (rank, push order, item); an entry whose
        # rank no longer matches the item's pending value is stale, skipped.
        heap: list[tuple[float, int, Item]] = []
        pushes = itertools.count()
        tape: list[_Entry] = []
        run = Run(self, chart, tape, 0, agenda, axioms={tuple(k): float(v) for k, v in axioms.items()})
        track = semiring.gradient == "backpointer"

        def push(item: Item, value: float, reason: tuple[Rule, list[Item]] | None) -> None:
            if item in agenda:
                combined = semiring.plus(agenda[item], value)
                if track and combined != agenda[item]:
                    because[item] = reason
                agenda[item] = combined
            else:
                agenda[item] = value
                because[item] = reason
                if rank is None:
                    fifo.append(item)
            if rank is not None:
                heapq.heappush(heap, (rank(item, agenda[item]), next(pushes), item))

        for item, value in axioms.items():
            push(tuple(item), float(value), None)
        while agenda:
            if max_pops is not None and run.pops >= max_pops:
                break
            a = self._choose(agenda, fifo, heap, chart, tolerance, rank)
            if a is None:
                break
            update = agenda.pop(a)
            reason = because.pop(a, None)
            first = a not in chart
            old = chart.get(a, semiring.zero)
            new = semiring.plus(old, update)
            tape.append(_Entry(a, old, update, first, reason))
            run.pops += 1
            chart[a] = new
            if track and (first or new != old):
                run.best[a] = reason
            if first:
                index.add(a)
            if first or new != old:
                for c, contribution, ground in self._contributions(a, old, update, first, chart, index):
                    push(c, contribution, (ground[0], ground[1]) if track else None)
            if stop is not None and stop(run):
                break
        return run

    def _choose(
        self,
        agenda: dict[Item, float],
        fifo: deque[Item],
        heap: list[tuple[float, int, Item]],
        chart: dict[Item, float],
        tolerance: float,
        rank: Callable[[Item, float], float] | None,
    ) -> Item | None:
        semiring = self.semiring

        def poppable(item: Item) -> bool:
            if item not in chart:
                return True
            if semiring is REAL:
                return abs(agenda[item]) > tolerance
            # elsewhere: pop when the update would still change the chart by more than tolerance
            new = semiring.plus(chart[item], agenda[item])
            return bool(new != chart[item] and not abs(new - chart[item]) <= tolerance)

        if rank is not None:
            while heap:
                ranked, _, item = heapq.heappop(heap)
                # An item that is not poppable now gets a fresh entry when its value next changes.
                if item in agenda and ranked == rank(item, agenda[item]) and poppable(item):
                    return item
            return None
        for _ in range(len(fifo)):
            item = fifo.popleft()
            if item not in agenda:
                continue
            if poppable(item):
                return item
            fifo.append(item)
        return None

    def _instantiations(
        self, a: Item, first: bool, chart: Mapping[Item, object], index: _Index
    ) -> Iterator[tuple[Rule, int, list[Item]]]:
        """Each (rule, i, ground body) with a as body i, the other body items
        existing (at time t for j < i, at t-1 for j > i)."""
        for rule, i in self._drives.get(a[0], ()):
            start = _match(rule.body[i], a, {})
            if start is None:
                continue
            yield from self._extend(rule, i, 0, start, [], a, first, chart, index)

    def _extend(
        self,
        rule: Rule,
        i: int,
        j: int,
        bindings: dict[str, Any],
        ground: list[Item],
        a: Item,
        first: bool,
        chart: Mapping[Item, object],
        index: _Index,
    ) -> Iterator[tuple[Rule, int, list[Item]]]:
        if j == len(rule.body):
            yield rule, i, ground
            return
        if j == i:
            yield from self._extend(rule, i, j + 1, bindings, [*ground, a], a, first, chart, index)
            return
        pattern = rule.body[j]
        if all(not _is_variable(t) or t in bindings for t in pattern[1:]):
            item = _ground(pattern, bindings)
            candidates: Sequence[Item] = [item] if item in chart else []
        else:
            candidates = index.candidates(pattern, bindings)
        for item in candidates:
            if j > i and item == a and first:
                continue  # a did not exist at t-1
            extended = _match(pattern, item, bindings)
            if extended is not None:
                yield from self._extend(rule, i, j + 1, extended, [*ground, item], a, first, chart, index)

    def _contributions(
        self, a: Item, old: float, update: float, first: bool, chart: dict[Item, float], index: _Index
    ) -> Iterator[tuple[Item, float, tuple[Rule, list[Item]]]]:
        times = self.semiring.times
        for rule, i, ground in self._instantiations(a, first, chart, index):
            product = times(self._coeff(rule), update)
            for j, item in enumerate(ground):
                if j != i:
                    product = times(product, chart[item] if (j < i or item != a) else old)
            yield _ground(rule.head, _bindings(rule, ground)), product, (rule, ground)

    def _coeff(self, rule: Rule) -> float:
        # A coefficient is a semiring value; the default 1.0 means "none" in every semiring.
        return self.semiring.one if rule.coeff == 1.0 else rule.coeff

    # ---- backward ------------------------------------------------------------------------------
    def _backward(self, run: Run, goal: Item) -> dict[Item, float]:
        chart = dict(run.chart)
        index = _Index()
        for item in chart:
            index.add(item)
        # The adjoints are sums of products of the run's (nonnegative) values,
        # so they are computed in the semiring's own arithmetic: in log-real,
        # as logarithms, which cannot underflow on long runs.
        s = self.semiring
        plus, times, zero = s.plus, s.times, s.zero
        g_chart: dict[Item, float] = {goal: s.one} if goal in chart else {}
        g_agenda: dict[Item, float] = {}
        for entry in reversed(run.tape):
            a, old, update = entry.item, entry.old_chart, entry.old_agenda
            new = chart[a]
            g_agenda_old = zero
            to_chart_t: dict[Item, float] = {}  # into gchart(t): passes through to gchart(t-1)
            to_chart_prev: dict[Item, float] = {}  # into gchart(t-1)
            if entry.first or new != old:
                for rule, i, ground in self._instantiations(a, entry.first, chart, index):
                    c = _ground(rule.head, _bindings(rule, ground))
                    g = g_agenda.get(c, zero)
                    if g == zero:
                        continue
                    coeff = self._coeff(rule)
                    values = [chart[x] if (j < i or x != a) else old for j, x in enumerate(ground)]
                    others = times(coeff, s.product(v for j, v in enumerate(values) if j != i))
                    g_agenda_old = plus(g_agenda_old, times(others, g))
                    for jp, x in enumerate(ground):
                        if jp == i:
                            continue
                        rest = times(
                            times(coeff, update), s.product(v for j, v in enumerate(values) if j not in (i, jp))
                        )
                        target = to_chart_t if jp < i else to_chart_prev
                        target[x] = plus(target.get(x, zero), times(g, rest))
            g_chart_t_a = plus(g_chart.get(a, zero), to_chart_t.get(a, zero))
            for target in (to_chart_t, to_chart_prev):
                for x, v in target.items():
                    g_chart[x] = plus(g_chart.get(x, zero), v)
            g_agenda[a] = plus(g_agenda_old, g_chart_t_a)
            chart[a] = old
            if entry.first:
                del chart[a]
                index.remove(a)
                g_chart.pop(a, None)  # chart(t-1)[a] did not exist: nothing before it
        if s is LOG_REAL:
            # g holds log d exp(goal) / d exp(x); an axiom's gradient in log space
            # is d goal / d x = exp(g + x - goal).
            value = run.chart.get(goal, zero)
            return {
                x: math.exp(g_agenda[x] + v - value) for x, v in run.axioms.items() if g_agenda.get(x, zero) != zero
            }
        return g_agenda

    def _best_derivation_gradient(self, run: Run, goal: Item) -> dict[Item, float]:
        """Subgradient of the goal along its best derivation (back-pointers)."""
        counts: dict[Item, int] = {}
        coefficients: list[float] = []
        work = [goal] if goal in run.chart else []
        steps = 0
        while work:
            item = work.pop()
            steps += 1
            if steps > 10 * len(run.chart) + 10:
                raise RuntimeError("the best derivation has a cycle (weights that improve around a loop)")
            reason = run.best.get(item)
            if reason is None:
                counts[item] = counts.get(item, 0) + 1
                continue
            rule, ground = reason
            coefficients.append(self._coeff(rule))
            work.extend(ground)
        s = self.semiring
        if s is MIN_PLUS:
            return {x: float(n) for x, n in counts.items()}
        grads = {}
        for x, n in counts.items():  # max-times: d/dx of x**n times the rest
            rest = s.product(run.chart[y] ** m for y, m in counts.items() if y != x)
            grads[x] = n * run.chart[x] ** (n - 1) * rest * s.product(coefficients)
        return grads

    # ---- as a monadl layer -------------------------------------------------------------------------
    def goal(
        self,
        goal: Item,
        axioms: Mapping[Item, float] | None = None,
        weights: Mapping[Any, Weight[Any, Any]] | None = None,
        **run_options: Any,
    ) -> Layer[float, float]:
        """``chart[goal]`` as a differentiable scalar layer.

        ``weights`` binds functors to weights: the axiom ``f(i, j)`` is
        ``weights[f].data[i, j]`` for every entry of the array (zeros
        included). Its backward pass runs the tape, only when a delta is wanted.
        """
        return _goal_layer(
            lambda values: self.run(values, **run_options), lambda run: run.chart.get(goal, 0.0), goal, axioms, weights
        )


class _Differentiable(Protocol):
    def gradient(self, goal: Item) -> dict[Item, float]: ...


R = TypeVar("R", bound=_Differentiable)


def _goal_layer(
    run: Callable[[dict[Item, float]], R],
    value: Callable[[R], float],
    goal: Item,
    axioms: Mapping[Item, float] | None,
    weights: Mapping[Any, Weight[Any, Any]] | None,
) -> Layer[float, float]:
    """A goal's value as a scalar layer over the weights bound to functors
    (``Program.goal``; shared by the batched programs of `monadl.dyna_arrays`)."""
    bound = dict(weights or {})
    fixed = dict(axioms or {})
    functors = list(bound)

    def forward(tapes: tuple[Tape[Any, Any], ...]) -> Tape[float, float]:
        values = dict(fixed)
        for functor, tape in zip(functors, tapes):
            data = np.asarray(tape.data)
            for position in np.ndindex(data.shape):
                values[(functor, *position)] = float(data[position])
        done = run(values)
        result = value(done)
        wanted = [t for t in tapes if t.backward is not None]
        if not wanted:
            return Tape(result)

        def backward(delta: float) -> None:
            grads = done.gradient(goal)
            for functor, tape in zip(functors, tapes):
                if tape.backward is None:
                    continue
                data = np.asarray(tape.data)
                g = np.zeros(data.shape, dtype=data.dtype)
                for position in np.ndindex(data.shape):
                    g[position] = grads.get((functor, *position), 0.0)
                tape.backward(g * delta if data.ndim else (g * delta)[()])

        return Tape(result, backward)

    return Layer(Do.gather(bound[f].forward() for f in functors).map(forward))


def _bindings(rule: Rule, ground: list[Item]) -> dict[str, Any]:
    bindings: dict[str, Any] = {}
    for pattern, item in zip(rule.body, ground):
        matched = _match(pattern, item, bindings)
        assert matched is not None
        bindings = matched
    return bindings


def bind_weight(functor: str, weight: Weight[Any, Any]) -> dict[str, Weight[Any, Any]]:
    """``{functor: weight}``: the axioms ``functor(*index)`` are the weight's entries."""
    return {functor: weight}


_TERM = re.compile(r"\s*([a-z_][A-Za-z0-9_]*)\s*(?:\(([^()]*)\))?\s*$")
_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*(e[-+]?\d+)?|\.\d+(e[-+]?\d+)?)\s*$", re.IGNORECASE)


def parse(text: str, semiring: Semiring = REAL) -> Program:
    """A program from text, one rule per ``.``::

        stop(I) += edgezero(I) * pathto(I).
        pathto(J) += edge(I, J) * pathto(I).
        b(X) += 0.5 * a(X) * w(X, Y) * a(Y).   % a leading number is the coefficient

    Upper-case arguments are variables; integers and lower-case words are
    constants; ``%`` starts a comment.

    >>> parse("a += a * a. a += r.").rules[0].body
    [('a',), ('a',)]
    """
    rules = []
    cleaned = "\n".join(line.split("%", 1)[0] for line in text.splitlines())
    for number, statement in enumerate(s.strip() for s in _split_rules(cleaned)):
        if not statement:
            continue
        if "+=" not in statement:
            raise ValueError(f"rule {number + 1} ({statement!r}): expected 'head += body'")
        head_text, body_text = statement.split("+=", 1)
        factors = _split_top(body_text, "*")
        coeff = 1.0
        if factors and _NUMBER.match(factors[0]):
            coeff = float(factors.pop(0))
        rules.append(Rule(_term(head_text, statement), [_term(f, statement) for f in factors], coeff))
    return Program(rules, semiring)


def _split_rules(text: str) -> list[str]:
    """Split at the '.' that ends a rule, not the one inside a number."""
    out, current = [], ""
    for i, ch in enumerate(text):
        if ch == "." and not (i + 1 < len(text) and text[i + 1].isdigit() and current[-1:].isdigit()):
            out.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        raise ValueError(f"the last rule ({current.strip()!r}) does not end with '.'")
    return out


def _split_top(text: str, separator: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def _term(text: str, statement: str) -> Pattern:
    match = _TERM.match(text)
    if match is None:
        raise ValueError(f"in {statement!r}: {text.strip()!r} is not an item like name(X, 3)")
    args = [a.strip() for a in match.group(2).split(",")] if match.group(2) else []
    return (match.group(1), *(int(a) if a.lstrip("-").isdigit() else a for a in args))
