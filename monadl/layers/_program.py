"""`Program`: the traced steps of an `monadl.operation`, run as one primitive rule.

A program is a list of steps, each a primitive of `PRIMITIVES` with its
operands named by slots of an environment: the node's operands first, then
the trace's constants, then each step's value. Run on one member's arrays
(`Program.__call__`) it is an ordinary rule: value and one VJP per operand,
the VJPs sharing one reverse sweep over the steps' own VJPs (with
broadcasting undone by `unbroadcast`, as the runtime's backward does:
`monadl.layers._program_sweep`). Run on
a group (`Program.batch`) each step goes through its batching rule where an
operand is stacked, and as itself where all are shared. Either way a step's
operands go through the runtime's operand rule once per signature, and its
casts are replayed after (`monadl.layers._program_casts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, final

from monadl._namespace import _HOST, common_namespace, namespace
from monadl.errors import DTypeError, IndexRangeError, NonFiniteError
from monadl.layers._batching_rules import BATCHING_RULES
from monadl.layers._non_finite import made
from monadl.layers._operands import (
    Numbers,
    describe,
    member_float_dtype,
    one_float_dtype,
    step_numbers,
)
from monadl.layers._outputs import (
    OUTPUT,
    Outputs,
    StackedOutputs,
    arrays_of,
    batch_output,
    finite_value,
)
from monadl.layers._primitives import Primitive, shown
from monadl.layers._products import factored as products_factored
from monadl.layers._program_casts import (
    Casts,
    apply_casts,
    casts_of,
    is_number,
    numbers_made,
    signature,
    tensor_slots,
)
from monadl.layers._program_feeds import feeds as _feeds
from monadl.layers._program_feeds import part_feeds as _part_feeds
from monadl.layers._program_sweep import Sweep
from monadl.layers._step import Step
from monadl.layers._tiles import Tiling, basic_slice, slice_readers

__all__ = ["Program"]

Value = Any
Vjp = Callable[[Value], Value]


# ---- the program --------------------------------------------------------------------------------
@final
class Program:
    """The rule of an operation node (see the module's docstring)."""

    __slots__ = (
        "consts",
        "declined",
        "factors",
        "feeds",
        "group_plans",
        "live",
        "multi",
        "name",
        "outputs",
        "part_feeds",
        "plans",
        "readers",
        "size",
        "slices",
        "steps",
        "tensors",
        "tiles",
        "tilings",
        "trace",
    )

    def __init__(
        self,
        name: str,
        size: int,
        consts: tuple[Any, ...],
        steps: tuple[Step, ...],
        outputs: tuple[int, ...],
        factors: frozenset[int] = frozenset(),
    ) -> None:
        self.name = name
        self.size = size  # the node's operands
        # The operand slots of weights (arguments, and those the function closes over): the delta
        # of a few rows' product with one goes to it as factors, as an unmarked product's does.
        self.factors = factors
        self.tensors = tensor_slots(size, len(consts), steps)
        self.consts = consts
        self.steps = steps
        self.outputs = outputs
        self.multi = len(outputs) > 1
        self.readers = tuple(s.operands() for s in steps)
        self.slices = tuple(basic_slice(s) for s in steps)
        self.live = tuple(any(s.grads) for s in steps)
        self.feeds = _feeds(size, len(consts), steps, outputs)
        self.part_feeds = _part_feeds(size, len(consts), steps, outputs)
        # Per operand signature (`signature`), what the operand rule did at each step: later
        # calls with it apply that, not the rule (whose checks, Python's, cost more than a small
        # step: a float32 cell's float64 weight is cast at each step of each call); per group
        # signature (its stacking too), the same, or the step at which it declined.
        self.plans: dict[tuple[Any, ...], tuple[Casts, ...]] = {}
        self.group_plans: dict[tuple[Any, ...], tuple[Casts, ...] | Step] = {}
        self.declined: Step | None = None  # the step that last kept a group from batching (for its log)
        # Slots read only by slices (a cell's gate vector), and whether those tile it, by shape.
        self.tiles = {r: js for r, js in slice_readers(steps, self.slices).items() if r not in outputs}
        self.tilings: dict[tuple[int, tuple[int, ...]], Tiling] = {}
        # The trace it was made for (weakly: its operation keeps it), where the batching log
        # asks why nodes of one function did not batch: their traces' signatures tell.
        self.trace: Callable[[], Any] | None = None

    def __call__(self, *args: Value, called: str | None = None) -> tuple[Value, tuple[Vjp, ...]]:
        """``called``: where the node running it was built, under ``check_finite``:
        then each step's value, and each delta of its backward, is checked
        for a NaN or an infinity, which raises `NonFiniteError` at that step's
        line inside the function, as it would unmarked."""
        env = [*args, *self.consts]
        vjps = []
        key = signature(args)
        plan = self.plans.get(key)
        did: list[Casts] = []
        tensors = self.tensors
        for i, (step, read) in enumerate(zip(self.steps, self.readers)):
            values = read(env)
            if plan is None:
                fixed = self._operand_rule(step, values, [tensors[r] for r in step.refs], tensors[len(env)])
                did.append(casts_of(values, fixed))
                values = fixed
            elif (casts := plan[i]) is not None:
                values = apply_casts(values, casts)
            try:
                if called is None:
                    out, rules = step.op.rule(*values, *step.parameters(env))
                else:
                    out, rules = self._checked(step, values, step.parameters(env), called)
            except IndexRangeError as exc:  # (its own error: the step's line, and the operation's)
                exc.args = (self._out_of_range(step, exc.args[0]),)
                raise
            except ValueError as exc:  # (the step's own operands: the output of an `Outputs` operand it read)
                raise ValueError(f"{shown(step.op)} of {describe(values)} at {_where(step)}: {exc}") from exc
            except NonFiniteError:
                raise
            except DTypeError as exc:  # (a rule's own, `where`'s: the step's line, as `_operand_rule`'s say)
                if exc.args and type(exc.args[0]) is str and "layer built at" not in exc.args[0]:
                    exc.args = (f"{exc.args[0]}; layer built at {_where(step)}, inside the operation {self.name}",)
                raise
            except Exception as exc:
                exc.add_note(f"monadl: in {shown(step.op)} at {_where(step)}, inside the operation {self.name}")
                raise
            env.append(out)
            vjps.append(rules)
        if plan is None:
            self.plans[key] = tuple(did)
        value = Outputs([env[o] for o in self.outputs]) if self.multi else env[self.outputs[0]]
        return value, Sweep(self, env, vjps, None, called).rules()

    def _checked(
        self, step: Step, values: tuple[Value, ...], params: tuple[Any, ...], called: str
    ) -> tuple[Value, tuple[Vjp, ...]]:
        """A step under ``check_finite`` (see `__call__`); a nested operation's own steps checked too."""
        site = self._site(step, called)
        rule = step.op.rule
        out, rules = rule(*values, *params, called=site) if type(rule) is Program else rule(*values, *params)
        if not finite_value(out):
            raise NonFiniteError(made(shown(step.op), values, site))
        return out, rules

    def _out_of_range(self, step: Step, text: str) -> str:
        """An `IndexRangeError`'s text from ``step``, completed with where it
        is: a lookup's name and line (a nested operation's text has them,
        and gets its call's line), inside this operation; the runtime adds
        the line that called this one."""
        inside = f"{_where(step)}, inside the operation {self.name}"
        if type(step.op.rule) is Program:
            return f"{text} called at {inside}"
        return f"{shown(step.op)}: {text}; layer built at {inside}"

    def _site(self, step: Step, called: str) -> str:
        return f"{_where(step)}, inside the operation {self.name} called at {called}"

    def _operand_rule(
        self, step: Step, values: tuple[Value, ...], tensors: list[bool], tensor: bool
    ) -> tuple[Value, ...]:
        """A step's operands under the runtime's rule for a node's (`one_float_dtype`,
        naming the line inside this operation; ``tensors``: which operands are
        tensors, ``tensor``: whether the step's value is one, see `tensor_slots`);
        ``values`` itself where it casts none."""

        def where() -> str:  # (built only for a message: a site's text costs more than the rule)
            return f"{_where(step)}, inside the operation {self.name}"

        # One library per step (an operation's host integers beside a device's arrays are refused here).
        parts = arrays_of(values)
        kinds = {type(p) for p in parts}
        if len(kinds) > 1 and not kinds <= _HOST:
            common_namespace(parts, f"{shown(step.op)} at {where()}")
        start = step.op.floats_from()
        if start is None or not tensor:  # (an operator on data alone: NumPy's arithmetic, as unmarked)
            return values
        if start:  # (`where`: its two sides, not its condition)
            sides = values[start:]
            fixed = one_float_dtype(shown(step.op), sides, where, tensors[start:])
            return values if fixed is sides else (*values[:start], *fixed)
        return one_float_dtype(shown(step.op), values, where, tensors)

    def _numbers(
        self, env: list[Value], stacked: list[bool], scalars: tuple[bool | None, ...] | None
    ) -> list[bool | None]:
        """Per slot of a group's operands and constants, whether each member's
        is a number (`member_float_dtype`'s ``scalars``): not for the call's
        layers and weights; for its stacked data, as ``scalars`` says (None:
        unknown); for what is not stacked, as its type says."""
        tensors, given = self.tensors, scalars or ()
        kinds: list[bool | None] = []
        for r, v in enumerate(env):
            if tensors[r]:
                kinds.append(False)
            elif r < len(given) and given[r] is not None:
                kinds.append(given[r])
            elif stacked[r]:
                kinds.append(True if type(v) is Numbers else None)
            else:
                kinds.append(is_number(v))
        return kinds

    def _member_rule(
        self,
        step: Step,
        values: tuple[Value, ...],
        flags: tuple[bool, ...],
        scalars: list[bool | None],
        tensor: bool,
    ) -> Sequence[Value] | None:
        """`_operand_rule` for a group: each member's operands cast as its own
        call would cast them (`member_float_dtype`); None where that cannot
        be (a member would raise, or its dtype is unknown here)."""
        parts = tuple([p for p in arrays_of(values) if type(p) is not Numbers])  # (a group's Python numbers)
        kinds = {type(p) for p in parts}
        if len(kinds) > 1 and not kinds <= _HOST:
            common_namespace(parts, f"{shown(step.op)} at {_where(step)}, inside the operation {self.name}")
        start = step.op.floats_from()
        if start is None or not tensor:  # (an operator on data alone: NumPy's arithmetic, as unmarked)
            return values
        if start == 0:
            return member_float_dtype(values, flags, scalars)
        cast = member_float_dtype(values[start:], flags[start:], scalars[start:])
        return None if cast is None else (*values[:start], *cast)

    def factored(
        self,
        args: tuple[Any, ...],
        batched: tuple[bool, ...],
        n: int,
        scalars: tuple[bool | None, ...] | None = None,
    ) -> tuple[Value, tuple[Vjp, ...]] | None:
        """`batch`, with the deltas of its weights' products kept as factors
        (`monadl.deltas.Outer`), for the merged
        runs of `monadl.runtime.schedule.fibers`, whose counted release
        multiplies them once per weight."""
        return self.batch(args, batched, n, True, scalars)

    def batch(
        self,
        args: tuple[Any, ...],
        batched: tuple[bool, ...],
        n: int,
        factored: bool = False,
        scalars: tuple[bool | None, ...] | None = None,
    ) -> tuple[Value, tuple[Vjp, ...]] | None:
        """The batching rule of the node: the program once over a group's
        stacked (and shared) operands; None where a step cannot batch.
        ``factored``: see `factored`. ``scalars``: per operand, whether its
        members are numbers, NumPy scalars that are data (see `member_float_dtype`)."""
        env = [*args, *self.consts]
        stacked = [*batched, *(False,) * len(self.consts)]
        kinds = self._numbers(env, stacked, scalars)
        vjps: list[tuple[Vjp, ...]] = []
        key = (signature(args), batched, scalars)
        plan = self.group_plans.get(key)
        if type(plan) is Step:  # (a member would raise, or its dtype is unknown here: as the first time)
            self.declined = plan
            return None
        did: list[Casts] = []
        self.declined = None
        numbers = Numbers in map(type, args)  # the members' plain numbers: cast step by step
        for i, (step, read) in enumerate(zip(self.steps, self.readers)):
            values = read(env)
            flags = tuple([stacked[r] for r in step.refs])
            given = [kinds[r] for r in step.refs]
            tensor = self.tensors[len(env)]
            kind = False if tensor else numbers_made(values, flags)
            if plan is None:  # (before the numbers: a Python float computes in the dtype the rule leaves)
                fixed = self._member_rule(step, values, flags, given, tensor)
                if fixed is None:
                    self.declined = self.group_plans[key] = step
                    return None
                did.append(casts_of(values, fixed))
                values = tuple(fixed)
            elif (casts := plan[i]) is not None:
                values = apply_casts(values, casts)
            if numbers and Numbers in map(type, values):
                found = step_numbers(step.op, values, flags, n)
                if found is None:
                    self.declined = step
                    return None
                if type(found) is Numbers:  # numbers only: numbers still (no delta to any)
                    env.append(found)
                    stacked.append(True)
                    kinds.append(kind)
                    vjps.append(())
                    continue
                values = found
            params = step.parameters(env)
            pflags = step.stacked_parameters(stacked)
            if True in flags or True in pflags:
                rule = batching_rule(step.op)
                if rule is None:
                    result = None
                elif type(step.op.rule) is Program:  # (a nested operation: which operands are numbers too)
                    result = rule((*values, *params), flags + pflags, n, scalars=tuple(given))
                else:
                    result = rule((*values, *params), flags + pflags, n)
                if result is None:
                    self.declined = step
                    return None
                out, rules = result
                if step.op.name in _PRODUCTS and flags[:2] == (True, False) and step.refs[1] in self.factors:
                    rules = products_factored(rules, values[0], values[1], factored)  # (stacked rows @ a weight)
            else:  # shared by the whole group: computed once
                out, rules = step.op.rule(*values, *params)
            env.append(out)
            stacked.append(True in flags or True in pflags)
            kinds.append(kind)
            vjps.append(rules)
        if plan is None:
            self.group_plans[key] = tuple(did)
        outs = []
        for o in self.outputs:
            value = env[o]
            if type(value) is Numbers:  # (each member's a Python number: no row of an array is one)
                return None
            if not stacked[o]:  # every member's output is this one array
                value = namespace(value).broadcast_to(value, (n, *value.shape))
            outs.append(value)
        value = StackedOutputs(tuple(outs)) if self.multi else outs[0]
        return value, Sweep(self, env, vjps, stacked, None).rules()


_PRODUCTS: Final = frozenset({"matmul", "dense"})  # rows @ matrix (+ bias)


def batching_rule(op: Primitive) -> Any:
    """A step's batching rule: the table's, or a nested operation's own."""
    if type(op.rule) is Program:
        return op.rule.batch
    if op is OUTPUT:
        return batch_output
    return BATCHING_RULES.get(op.name)


def _where(step: Step) -> str:
    from monadl.layers._site import site_text

    return site_text(step.site)
