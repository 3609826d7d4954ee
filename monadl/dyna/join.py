"""Which rule instances an item takes part in: an index of the existing items
and the join that extends one body item to whole rule instances."""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from typing import Any, Final, final

from monadl.dyna.syntax import Item, Pattern, Rule, ground, is_variable, match

__all__ = ["Index", "Joins"]

_UNBOUND: Final = object()


@final
class Index:
    """Existing items by functor and by each (argument position, value), so a
    join looks only at the items that agree with what is already bound.

    >>> index = Index()
    >>> index.add(("edge", 0, 1)); index.add(("edge", 2, 1)); index.add(("edge", 0, 3))
    >>> index.candidates(("edge", "I", "J"), {"J": 1})
    [('edge', 0, 1), ('edge', 2, 1)]
    """

    __slots__ = ("_buckets",)

    def __init__(self, items: Sequence[Item] = ()) -> None:
        self._buckets: dict[tuple[Any, ...], dict[Item, None]] = {}
        for item in items:
            self.add(item)

    def add(self, item: Item) -> None:
        """Index an item (once)."""
        self._buckets.setdefault((item[0], len(item)), {})[item] = None
        for position, value in enumerate(item[1:], 1):
            self._buckets.setdefault((item[0], len(item), position, value), {})[item] = None

    def remove(self, item: Item) -> None:
        """Forget an indexed item."""
        del self._buckets[(item[0], len(item))][item]
        for position, value in enumerate(item[1:], 1):
            del self._buckets[(item[0], len(item), position, value)][item]

    def candidates(self, pattern: Pattern, bound: Mapping[str, Any]) -> list[Item]:
        """Items that may match the pattern under the bindings (the smallest bucket)."""
        best: dict[Item, None] = self._buckets.get((pattern[0], len(pattern)), {})
        for position, term in enumerate(pattern[1:], 1):
            value = bound.get(term, _UNBOUND) if is_variable(term) else term
            if value is _UNBOUND:
                continue
            bucket = self._buckets.get((pattern[0], len(pattern), position, value), {})
            if len(bucket) < len(best):
                best = bucket
        return list(best)


@final
class Joins:
    """The rule instances a popped item drives (Eisner et al. 2005, figure 3).

    >>> joins = Joins([Rule(("p", "J"), [("e", "I", "J"), ("p", "I")])])
    >>> chart = {("p", 0): 1.0, ("e", 0, 1): 0.5}
    >>> [(str(rule), i, body, c) for rule, i, body, c in joins.instantiations(("p", 0), True, chart, Index(list(chart)))]
    [('p(J) += e(I, J) * p(I)', 1, [('e', 0, 1), ('p', 0)], ('p', 1))]
    """

    __slots__ = ("_drives",)

    def __init__(self, rules: Sequence[Rule]) -> None:
        # For each functor: the (rule, body position) pairs it can drive.
        self._drives: dict[Any, list[tuple[Rule, int]]] = {}
        for rule in rules:
            for i, b in enumerate(rule.body):
                self._drives.setdefault(b[0], []).append((rule, i))

    def instantiations(
        self, a: Item, first: bool, chart: Container[Item], index: Index
    ) -> Iterator[tuple[Rule, int, list[Item], Item]]:
        """Each (rule, i, ground body, head item) with ``a`` as body item i, the
        other body items existing (at time t for j < i, at t-1 for j > i:
        ``first`` says that ``a`` did not exist at t-1). The head comes from the
        join's bindings (matching the body again cost as much as the join)."""
        for rule, i in self._drives.get(a[0], ()):
            start = match(rule.body[i], a, {})
            if start is None:
                continue
            # An explicit stack of partial instances, in the order a recursive join would yield them.
            stack: list[tuple[int, dict[str, Any], list[Item]]] = [(0, start, [])]
            while stack:
                j, bound, body = stack.pop()
                if j == len(rule.body):
                    yield rule, i, body, ground(rule.head, bound)
                    continue
                if j == i:
                    stack.append((j + 1, bound, [*body, a]))
                    continue
                pattern = rule.body[j]
                if all(not is_variable(t) or t in bound for t in pattern[1:]):
                    item = ground(pattern, bound)
                    candidates: Sequence[Item] = [item] if item in chart else []
                else:
                    candidates = index.candidates(pattern, bound)
                extended = []
                for item in candidates:
                    if j > i and item == a and first:
                        continue  # a did not exist at t-1
                    matched = match(pattern, item, bound)
                    if matched is not None:
                        extended.append((j + 1, matched, [*body, item]))
                stack.extend(reversed(extended))
