"""Weighted logic programs with items batched into arrays.

`monadl.dyna` pops one scalar item at a time. When some arguments of a
functor range over a dense domain (the states of an HMM, the nonterminals of
a grammar), an `ArrayProgram` declares them array axes: ``alpha(T, S)`` with
``arrays={"alpha": {1: 50}}`` (argument 1, 50 states) becomes the item ``alpha(T)`` whose value is a
vector over ``S``. The agenda, the chart and the tape hold arrays; a rule
instance's product becomes an einsum over its array variables (summing those
absent from the head: the semiring's plus over the scalar instances it
replaces), and the backward pass is the appendix's, popping the tape, with
each product replaced by the einsum's vector-Jacobian product.

Real and log-real semirings (log-real contracts with a max-shifted einsum,
so long runs do not underflow). Agenda: FIFO; stops on an empty agenda,
``max_pops`` or ``tolerance``. Items batched this way exist as whole arrays:
every entry of a batched axiom gets its gradient, zeros included.

>>> rules = [Rule(("y", "J"), [("w", "I", "J"), ("x", "I")])]
>>> p = ArrayProgram(rules, arrays={"w": {0: 2, 1: 2}, "x": {0: 2}, "y": {0: 2}})
>>> run = p.run({("w", 0, 0): 1.0, ("w", 0, 1): 2.0, ("w", 1, 1): 3.0, ("x", 0): 10.0, ("x", 1): 1.0})
>>> run.value(("y", 1)), run.gradient(("y", 1))[("w", 1, 1)]
(23.0, 1.0)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from monadl.dyna import (
    LOG_REAL,
    REAL,
    Item,
    Pattern,
    Program,
    Rule,
    Semiring,
    _bindings,
    _goal_layer,
    _ground,
    _Index,
    _is_variable,
)
from monadl.layers._layer import Layer, Weight

__all__ = ["ArrayProgram", "ArrayRun"]

Array = np.ndarray


@dataclass
class _Entry:
    item: Item
    old_chart: Array | None  # None: the item did not exist before this pop
    old_agenda: Array
    changed: bool


@dataclass
class ArrayRun:
    """The chart (of batched items) and the tape to differentiate it."""

    program: ArrayProgram
    chart: dict[Item, Array]
    tape: list[_Entry]
    pops: int
    axioms: dict[Item, tuple[Item, tuple[int, ...], float]]  # scalar axiom -> (batched item, index, value)

    def value(self, item: Item) -> float:
        """The chart's value of a scalar item, e.g. ``("alpha", 5, 3)`` (the
        semiring's zero if it was never derived)."""
        packed, index = self.program.locate(item)
        if packed not in self.chart:
            return self.program.semiring.zero
        return float(self.chart[packed][index])

    def gradient(self, goal: Item) -> dict[Item, float]:
        """d value(goal) / d value(axiom) for every scalar axiom given to the run
        (in log-real, where values are logarithms: d log-value / d log-value, as
        `monadl.dyna.Run.gradient`)."""
        return self.program._backward(self, goal)


class ArrayProgram:
    """Rules over items some of whose arguments are array axes (see the module docs).

    Args:
        rules: as for `monadl.dyna.Program`.
        semiring: `REAL` or `LOG_REAL`.
        arrays: for each batched functor, its array axes: argument position
            (from 0) -> size. In every rule, a variable at an array position
            appears only at array positions, at most once per item.
    """

    def __init__(
        self, rules: Sequence[Rule], semiring: Semiring = REAL, *, arrays: Mapping[str, Mapping[int, int]]
    ) -> None:
        if semiring is not REAL and semiring is not LOG_REAL:
            raise ValueError(f"batched items need the real or log-real semiring, not {semiring.name}")
        self.semiring = semiring
        self.arrays = {f: tuple(sorted(p)) for f, p in arrays.items()}
        self.shapes = {f: tuple(p[k] for k in sorted(p)) for f, p in arrays.items()}
        packed: list[Rule] = []
        self._subscripts: dict[int, tuple[list[str], str]] = {}
        for rule in rules:
            letters: dict[str, str] = {}
            head, head_subs = self._split(rule, rule.head, letters)
            body = [self._split(rule, b, letters) for b in rule.body]
            for pattern in (rule.head, *rule.body):  # an array variable never at a plain position
                positions = self.arrays.get(pattern[0], ())
                wrong = [t for k, t in enumerate(pattern[1:]) if k not in positions and t in letters]
                if wrong:
                    raise ValueError(
                        f"rule {rule}: {wrong} are array axes elsewhere, so they cannot be plain arguments of {pattern[0]}"
                    )
            packed_rule = Rule(head, [p for p, _ in body], rule.coeff)
            packed.append(packed_rule)
            self._subscripts[id(packed_rule)] = ([s for _, s in body], head_subs)
        self._joins = Program(packed, semiring)  # the joins over the remaining (plain) arguments

    def _split(self, rule: Rule, pattern: Pattern, letters: dict[str, str]) -> tuple[Pattern, str]:
        positions = self.arrays.get(pattern[0], ())
        kept: list[object] = [pattern[0]]
        subscripts = ""
        for k, term in enumerate(pattern[1:]):
            if k not in positions:
                kept.append(term)
                continue
            if not _is_variable(term):
                raise ValueError(
                    f"rule {rule}: argument {k} of {pattern[0]} is an array axis; it must be a variable, not {term!r}"
                )
            letter = letters.setdefault(term, chr(ord("a") + len(letters)))
            if letter in subscripts:
                raise ValueError(f"rule {rule}: {term} occurs twice among the array axes of {pattern[0]}")
            subscripts += letter
        return tuple(kept), subscripts

    def locate(self, item: Item) -> tuple[Item, tuple[int, ...]]:
        """The batched item holding a scalar item, and the index in its array."""
        positions = self.arrays.get(item[0], ())
        args = item[1:]
        packed = (item[0], *(a for k, a in enumerate(args) if k not in positions))
        return packed, tuple(int(args[k]) for k in positions)

    # ---- the semiring on arrays ---------------------------------------------------------------
    def _plus(self, a: Array | None, b: Array | None) -> Array | None:
        if a is None or b is None:
            return b if a is None else a
        result: Array = np.add(a, b) if self.semiring is REAL else np.logaddexp(a, b)
        return result

    def _contract(self, rule: Rule, operands: list[tuple[str, Array]], out: str, sizes: Mapping[str, int]) -> Array:
        """coeff times the einsum of ``operands`` into subscripts ``out``, in the semiring."""
        present = {c for s, _ in operands for c in s}
        one = 1.0 if self.semiring is REAL else 0.0
        operands = operands + [(c, np.full(sizes[c], one)) for c in out if c not in present]
        spec = ",".join(s for s, _ in operands) + "->" + out
        coeff = self.semiring.one if rule.coeff == 1.0 else rule.coeff
        if self.semiring is REAL:
            result: Array = coeff * np.einsum(spec, *(x for _, x in operands))
            return result
        shift = coeff
        scaled = []
        for _, x in operands:
            top = float(np.max(x)) if x.size else -math.inf
            top = top if math.isfinite(top) else 0.0
            scaled.append(np.exp(x - top))
            shift += top
        with np.errstate(divide="ignore"):
            logged: Array = np.log(np.einsum(spec, *scaled)) + shift
        return logged

    def _changed(self, old: Array, new: Array, tolerance: float) -> bool:
        with np.errstate(invalid="ignore"):
            differ = new != old
            return bool(np.any(differ) and np.max(np.abs(np.where(differ, new - old, 0.0))) > tolerance)

    def _sizes(self, subscripts: Sequence[str], values: Sequence[Array]) -> dict[str, int]:
        return {c: n for s, v in zip(subscripts, values) for c, n in zip(s, np.shape(v))}

    def goal(
        self,
        goal: Item,
        axioms: Mapping[Item, float] | None = None,
        weights: Mapping[Any, Weight[Any, Any]] | None = None,
        **run_options: Any,
    ) -> Layer[float, float]:
        """``value(goal)`` as a differentiable scalar layer, as `monadl.dyna.Program.goal`:
        ``weights`` binds functors to weights whose entries are the axioms."""
        return _goal_layer(
            lambda values: self.run(values, **run_options), lambda run: run.value(goal), goal, axioms, weights
        )

    # ---- forward ------------------------------------------------------------------------------
    def run(self, axioms: Mapping[Item, float], *, max_pops: int | None = None, tolerance: float = 0.0) -> ArrayRun:
        """Forward chaining from scalar ``axioms``, packed into arrays (missing
        entries of a batched axiom are the semiring's zero)."""
        zero = self.semiring.zero
        located = {tuple(k): (*self.locate(tuple(k)), float(v)) for k, v in axioms.items()}
        initial: dict[Item, Array] = {}
        for scalar, (packed, index, value) in located.items():
            if packed not in initial:
                initial[packed] = np.full(self.shapes.get(packed[0], ()), zero)
            try:
                initial[packed][index] = value
            except IndexError:
                raise ValueError(
                    f"axiom {scalar}: index {index} is outside the array axes {self.shapes[packed[0]]} of {packed[0]}"
                ) from None
        chart: dict[Item, Array] = {}
        agenda: dict[Item, Array] = dict(initial)
        fifo: deque[Item] = deque(initial)
        index_ = _Index()
        tape: list[_Entry] = []
        run = ArrayRun(self, chart, tape, 0, located)
        waiting = 0  # consecutive items put back (updates within tolerance)
        while fifo and waiting < len(fifo):
            if max_pops is not None and run.pops >= max_pops:
                break
            a = fifo.popleft()
            update = agenda[a]
            old = chart.get(a)
            new = update if old is None else self._plus(old, update)
            assert new is not None
            changed = old is None or self._changed(old, new, tolerance)
            if not changed and old is not None and tolerance > 0.0:
                fifo.append(a)  # stays pending: later updates may add up to more than the tolerance
                waiting += 1
                continue
            waiting = 0
            del agenda[a]
            tape.append(_Entry(a, old, update, changed))
            run.pops += 1
            chart[a] = new
            if old is None:
                index_.add(a)
            if not changed:
                continue
            for rule, i, ground in self._joins._instantiations(a, old is None, chart, index_):
                subscripts, out = self._subscripts[id(rule)]
                values = [update if j == i else chart[x] if (j < i or x != a) else old for j, x in enumerate(ground)]
                assert all(v is not None for v in values)
                contribution = self._contract(rule, list(zip(subscripts, values)), out, {})  # type: ignore[arg-type]
                c = _ground(rule.head, _bindings(rule, ground))
                if c not in agenda:
                    fifo.append(c)
                agenda[c] = self._plus(agenda.get(c), contribution)  # type: ignore[assignment]
        return run

    # ---- backward -----------------------------------------------------------------------------
    def _backward(self, run: ArrayRun, goal: Item) -> dict[Item, float]:
        s = self.semiring
        packed_goal, goal_index = self.locate(goal)
        if packed_goal not in run.chart:
            return {}
        chart = dict(run.chart)
        index = _Index()
        for item in chart:
            index.add(item)
        seed = np.full(np.shape(chart[packed_goal]), s.zero)
        seed[goal_index] = s.one
        g_chart: dict[Item, Array] = {packed_goal: seed}
        g_agenda: dict[Item, Array] = {}
        for entry in reversed(run.tape):
            a, old, update = entry.item, entry.old_chart, entry.old_agenda
            g_update: Array | None = None
            to_chart_t: dict[Item, Array] = {}  # into gchart(t): passes through to gchart(t-1)
            to_chart_prev: dict[Item, Array] = {}  # into gchart(t-1)
            if entry.changed:
                for rule, i, ground in self._joins._instantiations(a, old is None, chart, index):
                    c = _ground(rule.head, _bindings(rule, ground))
                    g = g_agenda.get(c)
                    if g is None:
                        continue
                    subscripts, out = self._subscripts[id(rule)]
                    values: list[Array] = [
                        update if j == i else chart[x] if (j < i or x != a) else old  # type: ignore[misc]
                        for j, x in enumerate(ground)
                    ]
                    sizes = self._sizes(subscripts, values)
                    for jp in range(len(ground)):  # the einsum's VJP for each operand
                        operands = [(subscripts[j], values[j]) for j in range(len(ground)) if j != jp] + [(out, g)]
                        vjp = self._contract(rule, operands, subscripts[jp], sizes)
                        if jp == i:
                            g_update = self._plus(g_update, vjp)
                            continue
                        target = to_chart_t if jp < i else to_chart_prev
                        target[ground[jp]] = self._plus(target.get(ground[jp]), vjp)  # type: ignore[assignment]
            g_chart_t_a = self._plus(g_chart.get(a), to_chart_t.get(a))
            for target in (to_chart_t, to_chart_prev):
                for x, v in target.items():
                    g_chart[x] = self._plus(g_chart.get(x), v)  # type: ignore[assignment]
            combined = self._plus(g_update, g_chart_t_a)
            if combined is not None:
                g_agenda[a] = combined
            if old is None:
                del chart[a]
                index.remove(a)
                g_chart.pop(a, None)  # chart(t-1)[a] did not exist: nothing before it
            else:
                chart[a] = old
        grads: dict[Item, float] = {}
        goal_value = float(run.chart[packed_goal][goal_index])
        for scalar, (packed, position, value) in run.axioms.items():
            g = g_agenda.get(packed)
            if g is None:
                continue
            if s is LOG_REAL:  # g is log d exp(goal) / d exp(x): d goal / d x in log space is exp(g + x - goal)
                grads[scalar] = math.exp(float(g[position]) + value - goal_value)
            else:
                grads[scalar] = float(g[position])
        return grads
