"""The adjoints of a converged run's updates that never popped (they would
have changed nothing): the adjoint equations over the final chart's rule
instances, solved for the backward pass (`monadl.dyna.backward.backward`'s
``pending``), and when an adjoint moves or diverges, for scalars and arrays."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

import numpy as np

from monadl.dyna.backward import Algebra
from monadl.dyna.einsum import Array
from monadl.dyna.join import Index, Joins
from monadl.dyna.syntax import Item, Rule
from monadl.errors import NonFiniteError

__all__ = ["array_checks", "moved", "scalar_checks", "settled_adjoints"]

V = TypeVar("V")


def moved(old: float, new: float) -> bool:
    """Whether a value changed: NaN staying NaN does not (``NaN != NaN``
    would pop a diverged cycle, inf + -inf, forever).

    >>> moved(1.0, 2.0), moved(math.nan, math.nan), moved(1.0, math.nan)
    (True, False, True)
    """
    return new != old and not (math.isnan(new) and math.isnan(old))


def scalar_checks(zero: float) -> tuple[Callable[[float | None, float], bool], Callable[[float], bool]]:
    """Whether a scalar adjoint moved (from none: whether it is no ``zero``),
    and whether it diverged (NaN, +inf, or -inf where that is no zero)."""

    def moved_from(old: float | None, new: float) -> bool:
        return new != zero if old is None else moved(old, new)

    def diverged(value: float) -> bool:
        return math.isnan(value) or value == math.inf or (value == -math.inf and zero != -math.inf)

    return moved_from, diverged


def array_checks(zero: float) -> tuple[Callable[[Array | None, Array], bool], Callable[[Array], bool]]:
    """`scalar_checks` for arrays: an entry that moved or diverged is enough."""

    def moved_from(old: Array | None, new: Array) -> bool:
        with np.errstate(invalid="ignore"):
            if old is None:
                return bool(np.any(new != zero))
            return bool(np.any((new != old) & ~(np.isnan(new) & np.isnan(old))))

    def diverged(value: Array) -> bool:
        return bool(np.any(np.isnan(value) | (value == math.inf) | ((value == -math.inf) & (zero != -math.inf))))

    return moved_from, diverged


def settled_adjoints(
    chart: Mapping[Item, V],
    joins: Joins,
    algebra: Algebra[V],
    goal: Item,
    seed: V,
    items: Collection[Item],
    moved: Callable[[V | None, V], bool],
    diverged: Callable[[V], bool],
    pops: int,
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
    ``diverged`` (a cycle of weight 1 or more), or more pops on cycles than a
    million and ten per pop of the run (``pops``), raise `NonFiniteError`.
    """
    if goal not in chart:
        return {}
    index = Index(list(chart))
    making: dict[Item, list[tuple[Rule, list[Item]]]] = {}  # each instance once, by its head
    seen: set[tuple[int, tuple[Item, ...]]] = set()
    for a in chart:
        for rule, _, body, c in joins.instantiations(a, False, chart, index):
            key = (id(rule), tuple(body))
            if key not in seen:
                seen.add(key)
                making.setdefault(c, []).append((rule, body))
    plus = algebra.plus
    budget = 1_000_000 + 10 * pops
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
        # On a cycle: in sweeps, heads before what they are made of as far as the cycle
        # allows (reverse postorder: a topological order but for the edges that close
        # cycles), each item's deltas summed until its turn. (Always the first item that
        # had one, by a heap, popped the top items' ever smaller deltas again and again
        # and starved the rest: a 5-item cycle of weight 0.94 ran out of a million pops.)
        members = set(component)
        order = sorted(component, key=lambda item: -finish[item])
        agenda = {h: adjoint[h] for h in component if h in adjoint}
        while agenda:
            for h in order:
                delta = agenda.pop(h, None)
                if delta is None:
                    continue
                budget -= 1
                if budget < 0:
                    raise NonFiniteError(
                        f"the gradient of {goal} does not settle within the pops allowed: an update that changed "
                        f"nothing lies on a cycle through {component[0]} whose weight is 1 or near it, and a sum "
                        "along it diverges or settles too slowly: make the cycle's weight less than 1, or bound "
                        "the run with max_pops (the gradient of the stopped computation)"
                    )
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
                                f"through {x} of weight 1 or more, and a sum along it diverges (for any amount off "
                                "zero): make the cycle's weight less than 1, or bound the run with max_pops (the "
                                "gradient of the stopped computation)"
                            )
                        adjoint[x] = new
                        agenda[x] = plus(agenda[x], g) if x in agenda else g
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
