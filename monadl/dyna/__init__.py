"""Differentiable weighted logic programs (Eisner, Goldlust & Smith 2005):
forward chaining with an agenda, and the backward pass that pops its tape.

A program is a list of rules ``head += coeff * body_1 * ... * body_k`` over
items with arguments (upper-case arguments are variables), or constants
``head += coeff``::

    program = Program([
        Rule(("stop", "I"), [("edgezero", "I"), ("pathto", "I")]),
        Rule(("pathto", "J"), [("edge", "I", "J"), ("pathto", "I")]),
        Rule(("pathto", 0), [], 1.0),
    ])

Axioms are ground items with values, plain numbers or entries of a monadl
`Weight` (``bind_weight("edge", w)`` makes ``edge(i, j)`` the entry
``w.data[i, j]``) or of a layer's value (rule probabilities normalised in the
graph, ``ml.log_softmax(scores)``). `Program.run` computes the chart item at a time;
`ArrayProgram` batches dense arguments into arrays. ``goal`` gives a goal
item's value as a monadl layer, so the weights bound to axioms train with
``await loss.train()``.

Semirings: real and log-real (the gradient pops the tape: exact for the
computation performed, early stopping included), max-times and min-plus
(the best derivation, `Run.best_derivation`, and the subgradient along it),
any other forward only. The chart records which items exist apart from their
values, so an axiom whose value is exactly zero still receives its gradient.
An update that would change nothing (an exactly-zero product reaching an item
that already has a value, or one too small to change it) does not pop: it
waits on the agenda, and later updates add to it. When the run converged (at
tolerance 0, with nothing pending that would change the chart, and no value
gone to infinity or NaN: a divergent sum stands still there too), the gradient
gives each update still waiting the adjoint of an amount added to its item
and carried on to the fixpoint, so exactly-zero weights get their gradients,
off cycles and on them (``a += x * a. a += 1.`` at ``x = 0``: ``da/dx = 1``).
That adjoint is solved a strongly connected part of the program's instances
at a time; on a cycle of weight 1 or more whose values are all zero it
diverges, and one of weight near 1 may not settle within the pops allowed:
both are a `NonFiniteError`. After an early stop (``max_pops``, a tolerance,
``stop``) with updates that would still change the chart, the gradient is
the stopped computation's, and waiting updates contribute nothing.

The modules: `syntax` (items, rules, text), `semiring`, `join` (the index and
the join of rule instances), `backward` (the tape's backward pass, for every
value algebra), `settle` (the adjoints of updates that never popped),
`derivation` (best derivations), `scalar` and `scalar_run` (item at a time), `einsum`,
`arrays` and `array_run` (batched), `layer` (goals as layers), `checks` (what a
run and a goal refuse: misspelt names, wrong numbers of arguments).

>>> p = parse("a += a * a. a += r.")
>>> run = p.run({("r",): 0.3}, max_pops=3)  # r, then a twice
>>> round(run.chart[("a",)], 6), round(run.gradient(("a",))[("r",)], 6)
(0.39, 1.6)
"""

from monadl.dyna.arrays import ArrayProgram, ArrayRun, ArrayRunOptions
from monadl.dyna.derivation import Derivation
from monadl.dyna.layer import bind_weight
from monadl.dyna.scalar import Program, Run, RunOptions, parse
from monadl.dyna.semiring import LOG_REAL, MAX_TIMES, MIN_PLUS, REAL, Semiring
from monadl.dyna.syntax import Item, Pattern, Rule

__all__ = [
    "LOG_REAL",
    "MAX_TIMES",
    "MIN_PLUS",
    "REAL",
    "ArrayProgram",
    "ArrayRun",
    "ArrayRunOptions",
    "Derivation",
    "Item",
    "Pattern",
    "Program",
    "Rule",
    "Run",
    "RunOptions",
    "Semiring",
    "bind_weight",
    "parse",
]
