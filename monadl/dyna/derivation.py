"""Best derivations in the idempotent semirings (max-times: Viterbi, min-plus:
shortest paths), read from back-pointers, and the subgradient of a goal along
its best derivation. Shared by the item-at-a-time and the batched programs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias, final

from monadl.dyna.semiring import Semiring, coefficient
from monadl.dyna.syntax import Item, Rule

__all__ = ["BackPointer", "Derivation", "best_derivation", "derivation_gradient"]

BackPointer: TypeAlias = Callable[[Item], "tuple[Rule, Sequence[Item]] | None"]
"""The rule instance that gave an item its best value (the rule and its ground
body), or None for an axiom's own value."""


@final
@dataclass(frozen=True, slots=True)
class Derivation:
    """A derivation tree: an item, the rule that derived it (None for an
    axiom) and the derivations of the rule's body items, in body order. A
    constant rule (no body) is a leaf with a rule.

    >>> leaf = Derivation(("edge", 0, 1), None)
    >>> tree = Derivation(("pathto", 1), Rule(("pathto", "J"), [("edge", "I", "J"), ("pathto", "I")]), (leaf, leaf))
    >>> [d.item for d in tree.walk()]
    [('pathto', 1), ('edge', 0, 1), ('edge', 0, 1)]
    """

    item: Item
    rule: Rule | None
    children: tuple[Derivation, ...] = ()

    def walk(self) -> Iterator[Derivation]:
        """Every node, parents before children, left to right (iteratively: deep trees are fine)."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def leaves(self) -> list[Item]:
        """The axioms at the leaves, left to right (a Viterbi path's emissions and transitions)."""
        return [d.item for d in self.walk() if d.rule is None]


def _order(goal: Item, back: BackPointer) -> list[Item]:
    """The items of the goal's best derivation, each before the items it was derived from."""
    state: dict[Item, bool] = {}  # False: being expanded, True: done
    postorder: list[Item] = []
    stack: list[tuple[Item, bool]] = [(goal, False)]
    while stack:
        item, expanded = stack.pop()
        if expanded:
            state[item] = True
            postorder.append(item)
            continue
        if item in state:
            if not state[item]:
                raise RuntimeError(f"the best derivation of {goal} has a cycle through {item} (a loop that improves)")
            continue
        state[item] = False
        stack.append((item, True))
        pointer = back(item)
        if pointer is not None:
            stack.extend((child, False) for child in reversed(pointer[1]) if state.get(child) is not True)
    return postorder[::-1]


def best_derivation(goal: Item, back: BackPointer) -> Derivation:
    """The goal's best derivation tree. Subtrees shared by several parents are
    one object, so a tree with repeated items costs its number of items.

    >>> r = Rule(("a",), [("b",), ("b",)])
    >>> tree = best_derivation(("a",), {("a",): (r, [("b",), ("b",)]), ("b",): None}.__getitem__)
    >>> str(tree.rule), tree.leaves()
    ('a += b * b', [('b',), ('b',)])
    """
    built: dict[Item, Derivation] = {}
    for item in reversed(_order(goal, back)):
        pointer = back(item)
        if pointer is None:
            built[item] = Derivation(item, None)
        else:
            rule, body = pointer
            built[item] = Derivation(item, rule, tuple(built[x] for x in body))
    return built[goal]


def derivation_gradient(
    goal: Item, back: BackPointer, value: Callable[[Item], float], semiring: Semiring, *, derived: bool = False
) -> dict[Item, float]:
    """The subgradient of the goal's value along its best derivation: d goal /
    d x for each axiom x on it (and each derived item, with ``derived``),
    counting every occurrence; items off the derivation have gradient 0.

    >>> r = Rule(("a",), [("b",), ("b",)])
    >>> back = {("a",): (r, [("b",), ("b",)]), ("b",): None}.__getitem__
    >>> from monadl.dyna.semiring import MAX_TIMES
    >>> derivation_gradient(("a",), back, {("b",): 0.5}.__getitem__, MAX_TIMES)  # a = b * b
    {('b',): 1.0}
    """
    additive = times_is_plus(semiring)
    order = _order(goal, back)
    adjoint: dict[Item, float] = {goal: 1.0}
    for item in order:  # every parent of an item comes before it
        pointer = back(item)
        if pointer is None:
            continue
        rule, body = pointer
        g = adjoint.get(item, 0.0)
        coeff = coefficient(semiring, rule)
        for k, child in enumerate(body):
            if additive:  # times is +: each operand has derivative 1
                d = g
            else:  # times is *: the coefficient times the other operands
                d = g * coeff
                for m, other in enumerate(body):
                    if m != k:
                        d *= value(other)
            adjoint[child] = adjoint.get(child, 0.0) + d
    return {x: adjoint.get(x, 0.0) for x in order if derived or back(x) is None}


def times_is_plus(semiring: Semiring) -> bool:
    """Whether ``semiring``'s times is addition (min-plus, max-plus) rather
    than multiplication (max-times): what a backpointer's gradient needs to
    know. Asked of ``times`` itself, not of the semiring's identity: a
    max-plus semiring of one's own, or a copy of min-plus, got zero
    gradients as if its times multiplied."""
    probe = semiring.times(2.0, 3.0)
    if probe == 5.0:
        return True
    if probe == 6.0:
        return False
    raise ValueError(
        f"semiring {semiring.name}: a backpointer gradient needs times to be + or * (times(2, 3) gave {probe!r}); "
        "use gradient=None for forward only"
    )
