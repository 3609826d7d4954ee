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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, final

from monadl.dyna.join import Index, Joins
from monadl.dyna.syntax import Item, Rule

__all__ = ["Adjoints", "Algebra", "Entry", "backward"]

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
    converged run's zero updates: `monadl.dyna.settle`). ``every``: keep
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
            for rule, i, body, c in joins.instantiations(a, entry.first, chart, index):
                g = g_agenda.get(c)
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
