"""The result of running an `monadl.dyna.ArrayProgram`: its chart of batched
items, the tape to differentiate it, and its back-pointers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, final

import numpy as np

from monadl.dyna.backward import Entry, backward
from monadl.dyna.derivation import Derivation, best_derivation, derivation_gradient
from monadl.dyna.einsum import Array, ArrayAlgebra
from monadl.dyna.semiring import tape_arithmetic
from monadl.dyna.settle import array_checks, settled_adjoints
from monadl.dyna.syntax import Item, Rule

if TYPE_CHECKING:
    from monadl.dyna.arrays import ArrayProgram

__all__ = ["GIVEN", "UNDERIVED", "ArrayRun", "Record"]

GIVEN = -1
"""An entry of `ArrayRun.best` that an axiom gave (its own value: a leaf)."""
UNDERIVED = -2
"""An entry of `ArrayRun.best` that nothing derived nor gave (an entry of an
array that other entries made exist): not an item of the item-at-a-time run.
Any other entry derived, its value the semiring's zero too (every derivation
tied there: in max-times, weights of 0; in min-plus, distances of inf)."""


@final
@dataclass(frozen=True, slots=True)
class Record:
    """A batched rule instance's contribution, for back-pointers (max-times, min-plus).

    Args:
        rule: the program's rule (scalar items).
        body: its ground body, as batched items.
        subscripts: the array letters of each body item.
        out: the head's array letters.
        summed: the letters summed out.
        where: per head entry, the winning values of the summed letters.
    """

    rule: Rule
    body: tuple[Item, ...]
    subscripts: tuple[str, ...]
    out: str
    summed: str
    where: Array


@final
@dataclass(slots=True)
class ArrayRun:
    """The chart (of batched items), the tape to differentiate it, and the
    back-pointers (max-times, min-plus).

    Args:
        program: the program that ran.
        chart: batched items and their arrays.
        tape: the pops, in order.
        pops: how many batched items popped.
        axioms: scalar axiom -> (batched item, index, value).
        best: per batched item, which `Record` set each entry (or `GIVEN`, `UNDERIVED`).
        records: the contributions the back-pointers name.
        pending: the agenda left when the run stopped.
        settled: as `monadl.dyna.Run`'s: nothing pending would change the chart.
        converged: as `monadl.dyna.Run`'s: settled, and no value diverged.
    """

    program: ArrayProgram
    chart: dict[Item, Array]
    tape: list[Entry[Array]]
    pops: int
    axioms: dict[Item, tuple[Item, tuple[int, ...], float]]
    best: dict[Item, Array]
    records: list[Record]
    pending: dict[Item, Array] = field(default_factory=dict)
    converged: bool = False
    settled: bool = False

    def value(self, item: Item) -> float:
        """The chart's value of a scalar item, e.g. ``("alpha", 5, 3)`` (the
        semiring's zero if it was never derived)."""
        packed, index = self.program.locate(item)
        if packed not in self.chart:
            return self.program.semiring.zero
        return float(self.chart[packed][index])

    def gradient(self, goal: Item, *, derived: bool = False) -> dict[Item, float]:
        """d value(goal) / d value(axiom), for the scalar axioms given to the
        run, as `monadl.dyna.Run.gradient` (the same keys, except that a
        batched axiom pops whole, so all its entries have gradients).

        Args:
            goal: a scalar item.
            derived: also give each derived scalar item (an entry of nonzero
                value that is no axiom) its gradient, as `Run.gradient` does.
        """
        s = self.program.semiring
        packed_goal, goal_index = self.program.locate(goal)
        if s.gradient == "backpointer":  # (a goal never derived has no best derivation: {}, as item at a time)
            if not self._derived(goal):
                return {}
            return derivation_gradient(goal, self._back, self.value, s, derived=derived)
        if packed_goal not in self.chart:  # a goal never derived: 0 for all that popped, as item at a time
            return self._zeros(derived)
        seed = np.full(np.shape(self.chart[packed_goal]), s.zero)
        seed[goal_index] = s.one
        algebra = ArrayAlgebra(s, self.program.subscripts)
        pending = None
        if self.settled and self.pending:
            changed, diverged = array_checks(s.zero)
            joins, popped = self.program.joins, len(self.tape)
            pending = settled_adjoints(
                self.chart, joins, algebra, packed_goal, seed, self.pending, changed, diverged, popped
            )
        adjoints = backward(self.tape, self.chart, self.program.joins, algebra, packed_goal, seed, pending, derived)
        goal_value = self.value(goal)
        log_real = tape_arithmetic(s) == "log-real"  # (asked once: a few calls of plus and times)
        out: dict[Item, float] = {}
        for scalar, (packed, position, value) in self.axioms.items():
            if packed in adjoints.first_updates:
                g = adjoints.updates.get(packed)
                out[scalar] = 0.0 if g is None else _derived(log_real, float(g[position]), value, goal_value)
        if derived:  # an entry's adjoint: that of the first pop that reached it (with a nonzero entry)
            for packed, pops in adjoints.pops.items():
                shape = np.shape(pops[0][0])
                g, reached = np.full(shape, s.zero), np.zeros(shape, bool)
                for update, adjoint in pops:
                    now = (update != s.zero) & ~reached
                    if adjoint is not None:
                        g[now] = adjoint[now]
                    reached |= now
                values = self.chart[packed]
                for position in np.ndindex(shape):
                    scalar = self.program.unlocate(packed, position)
                    if reached[position] and scalar not in self.axioms and values[position] != s.zero:
                        out[scalar] = _derived(log_real, float(g[position]), float(values[position]), goal_value)
        return out

    def _zeros(self, derived: bool) -> dict[Item, float]:
        """A gradient of 0 for each axiom that popped (and with ``derived``,
        each derived entry of nonzero value)."""
        zeros = {scalar: 0.0 for scalar, (packed, _, _) in self.axioms.items() if packed in self.chart}
        if derived:
            for packed, values in self.chart.items():
                for position in np.ndindex(np.shape(values)):
                    scalar = self.program.unlocate(packed, position)
                    if scalar not in self.axioms and values[position] != self.program.semiring.zero:
                        zeros[scalar] = 0.0
        return zeros

    def best_derivation(self, goal: Item) -> Derivation:
        """The derivation that gave a scalar item its value, over scalar items,
        as `monadl.dyna.Run.best_derivation` (max-times, min-plus).

        >>> from monadl.dyna.arrays import ArrayProgram
        >>> from monadl.dyna.semiring import MIN_PLUS
        >>> rules = [Rule(("d", "J"), [("d", "I"), ("e", "I", "J")]), Rule(("d", 0), [], 0.0)]
        >>> p = ArrayProgram(rules, MIN_PLUS, arrays={"d": {0: 3}, "e": {0: 3, 1: 3}})
        >>> run = p.run({("e", 0, 1): 4.0, ("e", 0, 2): 1.0, ("e", 2, 1): 2.0})
        >>> run.value(("d", 1)), run.best_derivation(("d", 1)).leaves()
        (3.0, [('e', 0, 2), ('e', 2, 1)])
        """
        s = self.program.semiring
        if s.gradient != "backpointer":
            raise ValueError(f"a best derivation needs an idempotent semiring with back-pointers, not {s.name}")
        if not self._derived(goal):
            raise KeyError(f"{goal} was not derived")
        return best_derivation(goal, self._back)

    def _derived(self, item: Item) -> bool:
        """Whether an axiom gave the scalar item or a rule derived it (at
        the semiring's zero too: where every derivation ties there, its
        subgradient is along the one kept, as item at a time)."""
        packed, index = self.program.locate(item)
        reasons = self.best.get(packed)
        return reasons is not None and int(reasons[index]) != UNDERIVED

    def _back(self, item: Item) -> tuple[Rule, list[Item]] | None:
        packed, index = self.program.locate(item)
        reasons = self.best.get(packed)
        if reasons is None or reasons[index] < 0:
            return None
        record = self.records[int(reasons[index])]
        if not record.body:  # a constant rule
            return record.rule, []
        letters = dict(zip(record.out, index)) | dict(zip(record.summed, map(int, record.where[index])))
        body = [self.program.unlocate(b, tuple(letters[c] for c in s)) for b, s in zip(record.body, record.subscripts)]
        return record.rule, body


def _derived(log_real: bool, g: float, value: float, goal_value: float) -> float:
    """d goal / d x from the adjoint ``g`` of an update of ``value`` to x
    (``log_real``: the semiring's `tape_arithmetic` is log-real)."""
    if log_real:  # g is log d exp(goal) / d exp(x): d goal / d x in log space is exp(g + x - goal)
        if goal_value == -math.inf:  # (a goal of probability 0 stays 0 near here: exp(-inf + inf) was NaN)
            return 0.0
        return math.exp(g + value - goal_value)
    return g
