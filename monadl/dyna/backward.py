"""The backward pass that pops the tape of a forward chaining run (Eisner,
Goldlust & Smith 2005, section 5.2, figure 4 and the online appendix), written
once for every value algebra: scalars of a semiring (`monadl.dyna.scalar`)
and arrays contracted by einsums (`monadl.dyna.arrays`).

Each tape entry records a pop: the item, its chart value before the pop (None
when it did not exist) and the update it popped with. Popping the entries in
reverse, the adjoint of each update is what the rule instances it drove pass
back, plus the adjoint of the chart after the pop. The adjoints are sums of
products of the run's values, so they are computed in the algebra's own
arithmetic (in log-real, as logarithms, which cannot underflow on long runs).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, final

from monadl.dyna.join import Index, Joins
from monadl.dyna.syntax import Item, Rule, head
from monadl.errors import NonFiniteError

__all__ = ["Adjoints", "Algebra", "Entry", "backward", "settled_adjoints"]

V = TypeVar("V")


@final
@dataclass(frozen=True, slots=True)
class Entry(Generic[V]):
    """One pop of the agenda.

    Args:
        item: the item popped.
        old: its chart value before the pop; None when it did not exist.
        update: the agenda's value it popped with.
        changed: whether the pop changed the chart (only then did it drive rules).
    """

    item: Item
    old: V | None
    update: V
    changed: bool

    @property
    def first(self) -> bool:
        """The item did not exist before this pop."""
        return self.old is None


class Algebra(Protocol[V]):
    """The arithmetic the backward pass needs, on one kind of value."""

    def plus(self, a: V, b: V) -> V:
        """The semiring's plus."""
        ...

    def vjp(self, rule: Rule, operands: Sequence[V], position: int, adjoint: V) -> V:
        """``adjoint`` times the derivative of the rule's product (its
        coefficient times the operands) with respect to ``operands[position]``,
        in the semiring's arithmetic (the adjoint of that operand)."""
        ...


@final
@dataclass(frozen=True, slots=True)
class Adjoints(Generic[V]):
    """What the backward pass found.

    Args:
        updates: for each item that popped, the adjoint of the first update
            it popped with (for an axiom: of its value).
        first_updates: that first update, for each item that popped.
        pops: when asked for (``every``), for each item every update it
            popped with and that update's adjoint (None: zero), in the
            order they popped.
    """

    updates: dict[Item, V]
    first_updates: dict[Item, V]
    pops: dict[Item, list[tuple[V, V | None]]] = field(default_factory=dict)


def backward(
    tape: Sequence[Entry[V]],
    chart: Mapping[Item, V],
    joins: Joins,
    algebra: Algebra[V],
    goal: Item,
    seed: V,
    pending: Mapping[Item, V] | None = None,
    every: bool = False,
) -> Adjoints[V]:
    """Pop the tape in reverse from ``chart`` (the chart after the run), with
    the adjoint ``seed`` on the goal's chart value. ``pending``: the adjoint
    of what was pushed onto an item after its last pop and never popped (a
    converged run's zero updates: `monadl.dyna.scalar.Run`). ``every``: keep
    every pop's update and adjoint (`Adjoints.pops`).

    >>> from monadl.dyna.scalar import ScalarAlgebra
    >>> from monadl.dyna.semiring import REAL
    >>> square = Joins([Rule(("a",), [("a",), ("a",)])])
    >>> tape = [Entry(("a",), None, 0.5, True), Entry(("a",), 0.5, 0.25, True)]  # a = 0.5, then a += a * a
    >>> backward(tape, {("a",): 0.75}, square, ScalarAlgebra(REAL), ("a",), 1.0).updates
    {('a',): 2.0}
    """
    chart = dict(chart)
    index = Index(list(chart))
    g_chart: dict[Item, V] = {goal: seed} if goal in chart else {}
    g_agenda: dict[Item, V] = dict(pending) if pending else {}
    first_updates: dict[Item, V] = {}
    pops: dict[Item, list[tuple[V, V | None]]] = {}
    plus = algebra.plus

    def add(target: dict[Item, V], x: Item, v: V) -> None:
        target[x] = plus(target[x], v) if x in target else v

    for entry in reversed(tape):
        a, old, update = entry.item, entry.old, entry.update
        g_update: V | None = None
        to_chart_t: dict[Item, V] = {}  # into gchart(t): passes through to gchart(t-1)
        to_chart_prev: dict[Item, V] = {}  # into gchart(t-1)
        if entry.changed:
            for rule, i, body in joins.instantiations(a, entry.first, chart, index):
                g = g_agenda.get(head(rule, body))
                if g is None:
                    continue
                # The values the forward pass multiplied: a's update at i, a's old value after i.
                operands = [update if j == i else chart[x] if (j < i or x != a) else old for j, x in enumerate(body)]
                values: list[V] = [v for v in operands if v is not None]
                assert len(values) == len(body), "an item that did not exist took part in a rule"
                for jp, x in enumerate(body):
                    vjp = algebra.vjp(rule, values, jp, g)
                    if jp == i:
                        g_update = vjp if g_update is None else plus(g_update, vjp)
                    else:
                        add(to_chart_t if jp < i else to_chart_prev, x, vjp)
        g_chart_t_a = g_chart.get(a)
        if a in to_chart_t:
            g_chart_t_a = to_chart_t[a] if g_chart_t_a is None else plus(g_chart_t_a, to_chart_t[a])
        for target in (to_chart_t, to_chart_prev):
            for x, v in target.items():
                add(g_chart, x, v)
        parts = [g for g in (g_update, g_chart_t_a) if g is not None]
        if parts:
            g_agenda[a] = parts[0] if len(parts) == 1 else plus(parts[0], parts[1])
        else:
            g_agenda.pop(a, None)  # this update's adjoint is zero, whatever a later pop's was
        if every:
            pops.setdefault(a, []).append((update, g_agenda.get(a)))
        if old is None:
            del chart[a]
            index.remove(a)
            g_chart.pop(a, None)  # chart(t-1)[a] did not exist: nothing before it
            first_updates[a] = update
        else:
            chart[a] = old
    for popped in pops.values():
        popped.reverse()
    return Adjoints(g_agenda, first_updates, pops)


def settled_adjoints(
    chart: Mapping[Item, V],
    joins: Joins,
    algebra: Algebra[V],
    goal: Item,
    seed: V,
    items: Collection[Item],
    moved: Callable[[V | None, V], bool],
    diverged: Callable[[V], bool],
    budget: int,
) -> dict[Item, V]:
    """For each of ``items``, d chart[goal] / d (an amount added to it after
    the run, carried on to the fixpoint): the adjoint equations over the final
    chart's rule instances (an item's adjoint is the goal's seed, if it is the
    goal, plus what each instance it takes part in passes back from its head).
    A converged run's updates that never popped (they would have changed
    nothing) have these adjoints: they came along rule instances, but the tape
    holds no pop that carried them on.

    The equations are solved a strongly connected component at a time, heads
    before the items they are made of: once each, off cycles; on a cycle, by
    an agenda of its own until its adjoints stop moving (``moved(old, new)``:
    whether an adjoint changed; None: it had none). An adjoint on a cycle that
    ``diverged`` (a cycle of weight 1 or more), or more than ``budget`` pops on
    cycles, raise `NonFiniteError`.
    """
    if goal not in chart:
        return {}
    index = Index(list(chart))
    making: dict[Item, list[tuple[Rule, list[Item]]]] = {}  # each instance once, by its head
    seen: set[tuple[int, tuple[Item, ...]]] = set()
    for a in chart:
        for rule, _, body in joins.instantiations(a, False, chart, index):
            key = (id(rule), tuple(body))
            if key not in seen:
                seen.add(key)
                making.setdefault(head(rule, body), []).append((rule, body))
    plus = algebra.plus
    adjoint: dict[Item, V] = {goal: seed}

    def add(x: Item, g: V) -> None:
        adjoint[x] = plus(adjoint[x], g) if x in adjoint else g

    def parts(h: Item) -> list[Item]:
        return [x for _, body in making.get(h, ()) for x in body]

    components, finish = _components(goal, parts)
    for component in components:
        if len(component) == 1 and component[0] not in parts(component[0]):
            h = component[0]
            if h in adjoint:
                for rule, body in making.get(h, ()):
                    values = [chart[x] for x in body]
                    for j, x in enumerate(body):
                        add(x, algebra.vjp(rule, values, j, adjoint[h]))
            continue
        # On a cycle: heads before what they are made of, as far as the cycle allows
        # (reverse postorder: a topological order but for the edges that close cycles).
        members = set(component)
        agenda = {h: adjoint[h] for h in component if h in adjoint}
        heap = [(-finish[h], h) for h in agenda]
        heapq.heapify(heap)
        while heap:
            budget -= 1
            if budget < 0:
                raise NonFiniteError(
                    f"the gradient of {goal} does not settle within the pops allowed: an update that changed "
                    f"nothing lies on a cycle through {component[0]} whose weight is 1 or near it (start its "
                    "weights off zero, or bound the run with max_pops)"
                )
            h = heapq.heappop(heap)[1]
            delta = agenda.pop(h)
            for rule, body in making.get(h, ()):
                values = [chart[x] for x in body]
                for j, x in enumerate(body):
                    g = algebra.vjp(rule, values, j, delta)
                    if x not in members:
                        add(x, g)
                        continue
                    old = adjoint.get(x)
                    new = g if old is None else plus(old, g)
                    if not moved(old, new):
                        continue
                    if diverged(new):
                        raise NonFiniteError(
                            f"the gradient of {goal} diverges: an update that changed nothing lies on a cycle "
                            f"through {x} of weight 1 or more (start its weights off zero, or bound the run "
                            "with max_pops)"
                        )
                    adjoint[x] = new
                    if x in agenda:
                        agenda[x] = plus(agenda[x], g)
                    else:
                        agenda[x] = g
                        heapq.heappush(heap, (-finish[x], x))
    return {x: adjoint[x] for x in items if x in adjoint}


def _components(start: Item, successors: Callable[[Item], list[Item]]) -> tuple[list[list[Item]], dict[Item, int]]:
    """The strongly connected components reachable from ``start``, each before
    the components its items lead to (Tarjan's algorithm, iterative), and the
    order in which the depth-first search finished each item."""
    finish: dict[Item, int] = {}
    number: dict[Item, int] = {}
    low: dict[Item, int] = {}
    stack: list[Item] = []
    on_stack: set[Item] = set()
    found: list[list[Item]] = []
    work: list[tuple[Item, list[Item], int]] = [(start, successors(start), 0)]
    number[start] = low[start] = 0
    stack.append(start)
    on_stack.add(start)
    while work:
        v, nexts, i = work[-1]
        if i < len(nexts):
            work[-1] = (v, nexts, i + 1)
            w = nexts[i]
            if w not in number:
                number[w] = low[w] = len(number)
                stack.append(w)
                on_stack.add(w)
                work.append((w, successors(w), 0))
            elif w in on_stack:
                low[v] = min(low[v], number[w])
            continue
        work.pop()
        finish[v] = len(finish)
        if work:
            u = work[-1][0]
            low[u] = min(low[u], low[v])
        if low[v] == number[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(component)
    found.reverse()  # (Tarjan finds a component after those it leads to)
    return found, finish
