"""Weighted logic programs with items batched into arrays.

`monadl.dyna.Program` pops one scalar item at a time. When some arguments of a
functor range over a dense domain (the states of an HMM, the nonterminals of
a grammar), an `ArrayProgram` declares them array axes: ``alpha(T, S)`` with
``arrays={"alpha": {1: 50}}`` (argument 1, 50 states) becomes the item
``alpha(T)`` whose value is a vector over ``S``. The agenda, the chart and the
tape hold arrays; a rule instance's product becomes an einsum over its array
variables (summing those absent from the head: the semiring's plus over the
scalar instances it replaces).

Real and log-real: the backward pass is the appendix's, popping the tape, with
each product replaced by the einsum's vector-Jacobian product (log-real
contracts with one einsum of the operands each shifted by its largest entry,
and sums again from its terms any output entry that underflowed, so neither a
long run nor operands that peak at different entries underflow).
Max-times and min-plus: the einsum's sum is a max or a min that keeps
back-pointers (which summed-out indices won, per entry), so each scalar item
has its best derivation, and the gradient is the subgradient along it, as item
at a time. Agenda: FIFO (no ``priority``); stops on an empty agenda,
``max_pops``, ``tolerance`` or ``stop``. Items batched this way exist as
whole arrays: every entry of a batched axiom gets its gradient, zeros
included.

>>> rules = [Rule(("y", "J"), [("w", "I", "J"), ("x", "I")])]
>>> p = ArrayProgram(rules, arrays={"w": {0: 2, 1: 2}, "x": {0: 2}, "y": {0: 2}})
>>> run = p.run({("w", 0, 0): 1.0, ("w", 0, 1): 2.0, ("w", 1, 1): 3.0, ("x", 0): 10.0, ("x", 1): 1.0})
>>> run.value(("y", 1)), run.gradient(("y", 1))[("w", 1, 1)]
(23.0, 1.0)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack, final

import numpy as np

from monadl.dyna.array_run import GIVEN, UNDERIVED, ArrayRun, Record
from monadl.dyna.backward import Entry
from monadl.dyna.checks import (
    check_array_positions,
    check_array_sizes,
    check_axioms,
    check_goal,
    check_options,
    check_reads,
    declared_inputs,
)
from monadl.dyna.einsum import Array, array_plus, best_contract, contract
from monadl.dyna.join import Index, Joins
from monadl.dyna.layer import Source, Timing, bound_data, goal_layer, stopping
from monadl.dyna.semiring import MAX_TIMES, REAL, Semiring, coefficient, diverged
from monadl.dyna.syntax import Item, Pattern, Rule, is_variable
from monadl.layers import Layer

__all__ = ["ArrayProgram", "ArrayRun", "ArrayRunOptions", "Record"]


class ArrayRunOptions(TypedDict, total=False):
    """The keywords of `ArrayProgram.run`, which `ArrayProgram.goal` passes on
    to each of its goal's runs: `monadl.dyna.RunOptions` but ``priority`` (the
    agenda is FIFO)."""

    max_pops: int | None
    tolerance: float
    stop: Callable[[ArrayRun], bool] | None


@final
class ArrayProgram:
    """Rules over items some of whose arguments are array axes (see the module docs).

    Args:
        rules: as for `monadl.dyna.Program` (constant rules may name any entry).
        semiring: `REAL`, `LOG_REAL`, `MAX_TIMES` or `MIN_PLUS`.
        arrays: for each batched functor, its array axes: argument position
            (from 0, an argument the rules give the functor) -> size. In every
            rule, a variable at an array position appears only at array
            positions, at most once per item, and has one size at all of them;
            a constant at an array position is refused (write a variable and
            an item that selects the entry: CKY's ``goal += constit(S, 0, N)
            * start(S).``, not ``constit(0, 0, N)``).
        inputs: as for `monadl.dyna.Program`: functors a run may give none of.
    """

    def __init__(
        self,
        rules: Sequence[Rule],
        semiring: Semiring = REAL,
        *,
        arrays: Mapping[str, Mapping[int, int]],
        inputs: Iterable[str] = (),
    ) -> None:
        self.plus = array_plus(semiring)  # refuses the semirings it cannot batch
        check_array_positions(rules, arrays)
        self.semiring = semiring
        self.arrays = {f: tuple(sorted(p)) for f, p in arrays.items()}
        self.shapes = {f: tuple(p[k] for k in sorted(p)) for f, p in arrays.items()}
        self.constants = [rule for rule in rules if not rule.body]
        self.rules = list(rules)
        self.inputs = declared_inputs(inputs, self.rules)
        self.heads = {rule.head[0] for rule in rules}
        self.timing = Timing()  # (its goal layers': a long run sends the next ones to a thread)
        packed: list[Rule] = []
        self.subscripts: dict[int, tuple[tuple[str, ...], str]] = {}
        self.originals: dict[int, Rule] = {}
        for rule in rules:
            if not rule.body:
                continue
            letters: dict[str, str] = {}
            check_array_sizes(rule, arrays)
            head_pattern, head_subs = self._split(rule, rule.head, letters)
            body = [self._split(rule, b, letters) for b in rule.body]
            for pattern in (rule.head, *rule.body):  # an array variable never at a plain position
                positions = self.arrays.get(pattern[0], ())
                wrong = [t for k, t in enumerate(pattern[1:]) if k not in positions and t in letters]
                if wrong:
                    raise ValueError(
                        f"rule {rule}: {wrong} are array axes elsewhere, so they cannot be plain arguments of {pattern[0]}"
                    )
            packed_rule = Rule(head_pattern, [p for p, _ in body], rule.coeff)
            packed.append(packed_rule)
            self.subscripts[id(packed_rule)] = (tuple(s for _, s in body), head_subs)
            self.originals[id(packed_rule)] = rule
        self.joins = Joins(packed)  # the joins over the remaining (plain) arguments

    def _split(self, rule: Rule, pattern: Pattern, letters: dict[str, str]) -> tuple[Pattern, str]:
        positions = self.arrays.get(pattern[0], ())
        kept: list[object] = [pattern[0]]
        subscripts = ""
        for k, term in enumerate(pattern[1:]):
            if k not in positions:
                kept.append(term)
                continue
            if not is_variable(term):
                raise ValueError(
                    f"rule {rule}: argument {k} of {pattern[0]} is an array axis; it must be a variable, not {term!r}"
                )
            letter = letters.setdefault(term, chr(ord("a") + len(letters)))
            if letter in subscripts:
                raise ValueError(f"rule {rule}: {term} occurs twice among the array axes of {pattern[0]}")
            subscripts += letter
        return tuple(kept), subscripts

    def locate(self, item: Item) -> tuple[Item, tuple[int, ...]]:
        """The batched item holding a scalar item, and the index in its array.

        >>> ArrayProgram([], arrays={"alpha": {1: 3}}).locate(("alpha", 5, 2))
        (('alpha', 5), (2,))
        """
        positions = self.arrays.get(item[0], ())
        args = item[1:]
        packed = (item[0], *(a for k, a in enumerate(args) if k not in positions))
        if not positions:
            return packed, ()
        sizes = self.shapes[item[0]]
        if positions[-1] >= len(args):
            raise ValueError(
                f"{item}: {item[0]} has {len(args)} arguments here, and its argument {positions[-1]} is an array axis "
                f"(arrays[{item[0]!r}]): write {item[0]} with as many arguments as the rules do"
            )
        index = []
        for k, size in zip(positions, sizes):
            a = args[k]
            # (an index, not a truncated float or a wrapped negative: another item would get its value)
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not 0 <= a < size:
                raise ValueError(
                    f"{item}: argument {k} of {item[0]} is {a!r}, outside the array axes {sizes} of {item[0]} "
                    f"(an int in 0..{size - 1})"
                )
            index.append(int(a))
        return packed, tuple(index)

    def unlocate(self, packed: Item, index: tuple[int, ...]) -> Item:
        """The scalar item at ``index`` of a batched item (the inverse of `locate`).

        >>> ArrayProgram([], arrays={"alpha": {1: 3}}).unlocate(("alpha", 5), (2,))
        ('alpha', 5, 2)
        """
        positions = self.arrays.get(packed[0], ())
        plain, axes = iter(packed[1:]), iter(index)
        arity = len(packed) - 1 + len(positions)
        return (packed[0], *(next(axes) if k in positions else next(plain) for k in range(arity)))

    def goal(
        self,
        goal: Item,
        axioms: Mapping[Item, float] | None = None,
        weights: Mapping[Any, Source] | None = None,
        **options: Unpack[ArrayRunOptions],
    ) -> Layer[float, float]:
        """``value(goal)`` as a differentiable scalar layer, as `monadl.dyna.Program.goal`:
        ``weights`` binds functors to weights, layers or arrays whose entries are the axioms,
        and ``options`` are `run`'s (`ArrayRunOptions`: ``max_pops``, ``tolerance``, ``stop``;
        no ``priority``), given to each run; any other is refused here.

        >>> import anyio, monadl as ml
        >>> p = ArrayProgram([Rule(("s",), [("x", "I"), ("x", "I")])], arrays={"x": {0: 2}})
        >>> anyio.run(p.goal(("s",), weights={"x": ml.Weight(np.array([0.5, 0.25]))}).predict)
        np.float64(0.3125)
        """

        def check(bound: Mapping[Any, Source] | None) -> None:
            check_goal(goal, self.rules, axioms, bound, inputs=self.inputs)
            for functor, weight in (bound or {}).items():
                data = bound_data(functor, weight)
                shape = () if data is None else data.shape  # (a layer's: when it is computed)
                for k, size in zip(sorted(self.arrays.get(functor, {})), self.shapes.get(functor, ())):
                    if k < len(shape) and shape[k] > size:
                        raise ValueError(
                            f"weights[{functor!r}] has shape {shape}, and {functor}'s argument {k} is an array axis "
                            f"of {size}: its entries past {size - 1} would be items outside it"
                        )

        check_options(options, list(ArrayRunOptions.__annotations__), "ArrayProgram.goal")
        check(weights)
        return goal_layer(
            lambda values, stop: self._run(values, **stopping(options, stop)),
            lambda run: run.value(goal),
            goal,
            axioms,
            weights,
            self.timing,
            check,
        )

    def run(
        self,
        axioms: Mapping[Item, float],
        *,
        max_pops: int | None = None,
        tolerance: float = 0.0,
        stop: Callable[[ArrayRun], bool] | None = None,
    ) -> ArrayRun:
        """Forward chaining from scalar ``axioms`` and the constant rules,
        packed into arrays (missing entries of a batched axiom are the
        semiring's zero). ``max_pops``, ``tolerance`` and ``stop`` (a
        predicate on the run so far, checked after each pop) as in
        `monadl.dyna.Program.run`, whose refusals (axioms of a misspelt
        functor or another number of arguments, a rule reading what nothing
        gives) this run makes too.

        >>> p = ArrayProgram([Rule(("y", "I"), [("x", "I")], 2.0), Rule(("x", 1), [], 5.0)], arrays={"x": {0: 2}, "y": {0: 2}})
        >>> p.run({("x", 0): 1.0}).chart[("y",)]
        array([ 2., 10.])
        """
        check_axioms(axioms, self.rules)  # (a goal checks its own, once: `check_goal`)
        check_reads(self.rules, axioms, {}, self.inputs)
        return self._run(axioms, max_pops=max_pops, tolerance=tolerance, stop=stop)

    def _run(
        self,
        axioms: Mapping[Item, float],
        *,
        max_pops: int | None = None,
        tolerance: float = 0.0,
        stop: Callable[[ArrayRun], bool] | None = None,
    ) -> ArrayRun:
        s = self.semiring
        track = s.gradient == "backpointer"
        located = {tuple(k): (*self.locate(tuple(k)), float(v)) for k, v in axioms.items()}
        agenda: dict[Item, Array] = {}
        because: dict[Item, Array] = {}  # per pending item, the record behind each entry (back-pointers)
        records: list[Record] = []

        def entry_of(scalar: Item) -> tuple[Item, tuple[int, ...]]:
            packed, index = self.locate(scalar)
            if packed not in agenda:
                agenda[packed] = np.full(self.shapes.get(packed[0], ()), s.zero)
                because[packed] = np.full(agenda[packed].shape, UNDERIVED, dtype=np.intp)
            return packed, index

        for scalar, (_, _, value) in located.items():
            packed, index = entry_of(scalar)
            agenda[packed][index] = value
            because[packed][index] = GIVEN
        for rule in self.constants:  # head += coeff, combined with an axiom of the same entry
            packed, index = entry_of(rule.head)
            combined = s.plus(float(agenda[packed][index]), coefficient(s, rule))
            if track and (combined != agenda[packed][index] or because[packed][index] == UNDERIVED):
                records.append(Record(rule, (), (), "", "", np.zeros((0,), dtype=np.intp)))
                because[packed][index] = len(records) - 1
            agenda[packed][index] = combined
        chart: dict[Item, Array] = {}
        fifo: deque[Item] = deque(agenda)
        queued = set(agenda)  # (in the FIFO; the others wait for a contribution: popping them would change nothing)
        index_ = Index()
        tape: list[Entry[Array]] = []
        run = ArrayRun(self, chart, tape, 0, located, {}, records, agenda)
        while fifo:
            if max_pops is not None and run.pops >= max_pops:
                break
            a = fifo.popleft()
            queued.discard(a)
            update = agenda[a]
            old = chart.get(a)
            new = update if old is None else self.plus(old, update)
            changed = old is None or self._changed(old, new, tolerance)
            if not changed:
                # Waits: later contributions may add up to more than the tolerance (an update
                # that changes nothing still came along rule instances: `ArrayRun.gradient`).
                continue
            del agenda[a]
            reasons = because.pop(a, None)
            tape.append(Entry(a, old, update, changed))
            run.pops += 1
            chart[a] = new
            if track and reasons is not None:
                # (an entry's first derivation sets it, as item at a time, though its value ties at the zero)
                kept = run.best[a] if old is not None else None
                run.best[a] = reasons if kept is None else np.where((new != old) | (kept == UNDERIVED), reasons, kept)
            if old is None:
                index_.add(a)
            for rule, i, body, c in self.joins.instantiations(a, old is None, chart, index_):
                subscripts, out = self.subscripts[id(rule)]
                values = [update if j == i else chart[x] if (j < i or x != a) else old for j, x in enumerate(body)]
                operands = [(sub, v) for sub, v in zip(subscripts, values) if v is not None]
                coeff = coefficient(s, rule)
                if track:
                    contribution, summed, where = best_contract(s, coeff, operands, out)
                    records.append(Record(self.originals[id(rule)], tuple(body), subscripts, out, summed, where))
                    if c in agenda:
                        pending = agenda[c]
                        better = contribution > pending if s == MAX_TIMES else contribution < pending
                        better |= because[c] == UNDERIVED
                        because[c] = np.where(better, len(records) - 1, because[c])
                    else:
                        because[c] = np.full(np.shape(contribution), len(records) - 1, dtype=np.intp)
                else:
                    contribution = contract(s, coeff, operands, out, {})
                agenda[c] = self.plus(agenda[c], contribution) if c in agenda else contribution
                if c not in queued:
                    queued.add(c)
                    fifo.append(c)
            if stop is not None and stop(run):
                break
        # Converged: nothing pending would change the chart (a run stopped early may have got there too).
        run.settled = tolerance == 0.0 and not any(
            x not in chart or self._changed(chart[x], self.plus(chart[x], agenda[x]), 0.0) for x in fifo
        )
        # A value gone to infinity or NaN stands still too, at no fixpoint: a divergent run has not converged.
        run.converged = run.settled and not diverged(s, chart.values())
        return run

    @staticmethod
    def _changed(old: Array, new: Array, tolerance: float) -> bool:
        """Whether some entry changed (by more than ``tolerance``); NaN staying NaN does not."""
        with np.errstate(invalid="ignore"):
            differ = (new != old) & ~(np.isnan(new) & np.isnan(old))
            if not np.any(differ):
                return False
            if tolerance == 0.0:
                return True
            gaps = np.abs(np.asarray(new - old)[differ])  # (an entry that became NaN has a NaN gap: it changed)
            return bool(np.any(np.isnan(gaps)) or np.max(gaps) > tolerance)
