"""One run of the batching scheduler (`monadl.runtime.schedule.batched`) over
one graph: a level's nodes grouped by signature (`Run.level`), and each group
(`Run.group`) run as one call of its batching rule, or node by node where the
cost rule or its operands say no.

A group's operands are made here, one by one: weights and parameters shared
(the signature holds them), an operand that differs between members stacked
(`batched_records.stack`) or gathered by index from earlier groups' outputs
(`Groups.gather`), plain numbers that differ stacked as a column
(`batched_records.number_columns`) or else grouped by value, an index that
holds arrays stacked; then the group's records are written
(`batched_records.group_records`), so the one node backward back-propagates
it unchanged. This loop runs once per operand of every group: its names are
bound outside it, and it calls nothing per member that C could do instead.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_not, itemgetter
from typing import TYPE_CHECKING, Any, final

import numpy as np

from monadl.layers._batching_rules import BATCHING_RULES
from monadl.layers._layer import Layer
from monadl.layers._operands import NUMBERS
from monadl.layers._outputs import OUTPUT, Outputs, StackedOutputs, batch_output
from monadl.layers._program import Program
from monadl.layers._weight import Weight
from monadl.runtime.node import compute as compute_node
from monadl.runtime.schedule.batched_groups import Groups
from monadl.runtime.schedule.batched_log import declined, watching
from monadl.runtime.schedule.batched_marked import marked_minimum
from monadl.runtime.schedule.batched_operands import Operand
from monadl.runtime.schedule.batched_records import (
    batchable,
    cast_scalars,
    differs,
    group_records,
    number_columns,
    stack,
    stack_index,
)
from monadl.runtime.schedule.batched_rule import ALONE, ALONE_WHY, MIN_GROUP, coarse
from monadl.runtime.schedule.batched_signature import number_key, signature
from monadl.runtime.schedule.batched_weights import (
    FACTORED,
    MIN_FACTORED,
    MIN_PACKED,
    packs,
    reads_large,
    saves_kernels,
)

if TYPE_CHECKING:
    from monadl.runtime.evaluation import Evaluation

__all__ = ["Run"]


@final
class Run:
    """One scheduler run over one graph, and where each member's value sits
    in its group's output."""

    __slots__ = ("alone", "batched", "batches", "ev", "forced", "groups", "records", "saving")

    def __init__(self, ev: Evaluation, forced: bool, groups: Groups | None = None) -> None:
        self.ev = ev
        self.records = ev.records
        self.forced = forced
        self.batches = 0  # groups that ran batched
        self.batched = 0  # and their members
        self.saving = False  # whether a group saved more than its members' dispatch (`saves_kernels`)
        self.groups = Groups(ev.records) if groups is None else groups
        self.alone = watching()  # (what ran one by one and why: only while the log is on for DEBUG)

    def each(self, nodes: list[Any]) -> None:
        """Nodes one by one, as the inline scheduler runs them."""
        compute, records, ev = compute_node, self.records, self.ev
        for node in nodes:
            records[node] = compute(ev, node, True)

    def level(self, nodes: list[Any]) -> None:
        """Nodes that are all ready, grouped by signature."""
        groups: dict[Any, list[Any]] = {}
        get, records, where = groups.get, self.records, self.groups.where
        for node in nodes:  # (once per node of the graph: names bound outside the loop)
            sig = signature(records, node, where)
            if sig is None:
                if self.alone is not None:
                    name = node._op.name  # (an ``ml.loom()`` block's node, a read of it: `monadl.fold._loom_run`)
                    if name == "loom":
                        self.alone.looms += 1
                    elif name == "slot":
                        self.alone.reads += 1
                    else:
                        self.alone.unsigned += 1
                self.each([node])
                continue
            members = get(sig)  # (no empty list made per member, as setdefault would)
            if members is None:
                groups[sig] = [node]
            else:
                members.append(node)
        for members in groups.values():
            self.group(members)

    def _by_value(self, members: list[Any], numbers: list[int]) -> None:
        """``members`` grouped by the values of their plain numbers at
        ``numbers``, where stacking them did not batch."""
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for node in members:
            inputs = node._inputs
            groups.setdefault(tuple([number_key(inputs[p]) for p in numbers]), []).append(node)
        for group in groups.values():
            self.group(group, False)

    def _factors(self, node: Any) -> bool:
        """Whether a product alone runs as a group of one all the same: where
        a weight's deltas are kept as factors (`Groups.outer`) and the weight
        is large (`MIN_FACTORED`), its rows join the other groups' instead of
        a weight-sized outer product and addition of its own."""
        if not self.groups.outer or node._op.name not in FACTORED or len(node._inputs) < 2:
            return False
        w = node._inputs[1]
        return type(w) is Weight and w.size >= MIN_FACTORED  # (prod of the shape: a tensor's size is a method)

    def group(self, members: list[Any], numbers_stack: bool = True) -> None:
        """One group of equal signature: one batched call, or node by node.
        ``numbers_stack``: stack plain numbers that differ between members
        (else they are equal: the group was split by their values)."""
        first = members[0]
        op = first._op
        rule: Any = BATCHING_RULES.get(op.name) if op.name not in ALONE else None
        if op is OUTPUT:
            rule = batch_output
        minimum = MIN_GROUP
        if type(op.rule) is Program:  # an operation: its program batches itself, and pays from 2 to 4
            rule, minimum = (op.rule.factored if self.groups.outer else op.rule.batch), marked_minimum(first)
        n = len(members)
        if MIN_PACKED <= n < minimum and (
            packs(first, self.records, self.groups.where) or (self.groups.outer and reads_large(first))
        ):
            minimum = MIN_PACKED
        numbers_stack = numbers_stack and (op.elementwise or type(op.rule) is Program)  # (else by value)
        if rule is None or (n < (2 if self.forced else minimum) and not (n == 1 and self._factors(first))):
            if rule is None and n > 1:
                declined(members, ALONE_WHY.get(op.name) or f"{op.name} has no batching rule")
            elif self.alone is not None:
                self.alone.few(members)
            self.each(members)
            return
        records, groups = self.records, self.groups
        inputs = first._inputs
        inputs_of = list(map(_inputs, members))
        arity = len(inputs)
        args: list[Any] = []
        batched: list[bool] = []
        operands: list[Operand] = []
        kinds: set[type] = set()
        numbers: list[int] = []  # positions of plain numbers that differ between members
        # Per operand, whether its members are numbers (data: NumPy's scalars, Python's), not tensors (a
        # layer's or a weight's value, a NumPy scalar too where it has no dimensions) nor arrays.
        scalars: list[bool | None] = []
        for p, x0 in enumerate((*inputs, *first._params)):
            kind = type(x0)
            is_node = kind is Layer or kind is Weight
            # Weights and parameters are the same in all members (the signature holds them);
            # arrays and layers are shared only if they are one object; numbers, if equal.
            stacks = kind is Layer or (kind is not Weight and hasattr(x0, "shape"))
            if stacks:
                column = list(map(itemgetter(p), inputs_of)) if p < arity else [m._params[p - arity] for m in members]
                # (identity tested in C: `any` of `is not`, no generator frame per member)
                stacks = n == 1 or any(map(is_not, column, repeat(x0)))  # (one: `_factors` said so)
            elif kind in NUMBERS and p < arity and numbers_stack:  # (else the signature held the value)
                column = list(map(itemgetter(p), inputs_of))
                # (all equal to a number that is not zero: counted in C; else member by member)
                if not (x0 and column.count(x0) == n) and any(map(differs, column, repeat(x0))):
                    numbers.append(p)
                    args.append(column)  # (made a column below)
                    batched.append(True)
                    operands.append(Operand(None, [None] * n))
                    scalars.append(True)
                    continue
            elif kind is tuple and p >= arity and True in [hasattr(q, "shape") for q in x0]:
                # An index holding arrays (h[src, 0]): those that differ between members stacked.
                indices = stack_index([m._params[p - arity] for m in members])
                if indices is not None:
                    args.append(indices)
                    batched.append(True)
                    continue
            scalar: bool | None
            if not stacks:
                rec = records[x0] if is_node else None
                value = x0 if rec is None else rec.value
                operand = Operand(rec, None)
                scalar = rec is None and (isinstance(value, np.generic) or kind in NUMBERS)
            else:
                sources = groups.sources(column) if type(x0) is Layer else None
                if sources is not None:  # rows of earlier groups' outputs: gathered by index
                    value = groups.gather(sources, n)
                    operand = Operand(None, None, sources)
                    scalar = False  # (a member's value, ``out[i]``: a layer's)
                else:
                    recs = [records[x] if type(x) is Layer or type(x) is Weight else None for x in column]
                    values = [x if r is None else r.value for x, r in zip(column, recs)]
                    if type(values[0]) is Outputs:  # operation nodes, read by a traced view inside the operation
                        value = StackedOutputs.stack(values)
                    else:
                        value = stack(values)
                    operand = Operand(None, recs)
                    scalar = False
                    if isinstance(values[0], np.generic):  # (data's numbers, layers' tensors; of both: unknown)
                        held = recs.count(None)
                        scalar = True if held == n else None if held else False
            args.append(value)
            batched.append(stacks)
            if p < arity:
                kinds.add(type(value))
                operands.append(operand)
                scalars.append(scalar)
        # Each member's float scalars in the dtype its own node gives them (before its numbers
        # take the dtype left: a stacked column of np.float64 beside a float32 array is float32).
        floats = op.floats_from()
        if floats is not None and not cast_scalars(args, batched, arity, scalars, floats):
            declined(members, "their operands mix float dtypes")
            self.each(members)
            return
        if numbers and not number_columns(args, numbers, batched, arity, type(op.rule) is Program, kinds):
            self._by_value(members, numbers)
            return
        if not batchable(op, kinds, args[:arity], batched):
            if any(batched):  # (else the members compute one thing)
                declined(members, "their operands mix array libraries or dtypes")
            self.each(members)
            return
        if not self.forced and coarse(args, batched, n, op.elementwise):
            if self.alone is not None:
                self.alone.coarse += n
            self.each(members)
            return
        try:
            if type(op.rule) is Program:
                result = rule(tuple(args), tuple(batched), n, scalars=tuple(scalars))
            else:
                result = rule(tuple(args), tuple(batched), n)
        except Exception:  # run node by node: the same error, named at the member's own line
            result = None
        if result is None:
            if numbers:  # (what their values would batch, as before numbers were stacked)
                self._by_value(members, numbers)
            else:
                declined(members, None)
                self.each(members)
            return
        scalars_of = tuple(scalars) if type(op.rule) is Program else None
        group_records(groups, members, result, operands, args, rule, tuple(batched), scalars_of)
        self.batches += 1
        self.batched += n
        if not self.saving:
            self.saving = saves_kernels(first, records, groups.where)


_inputs = attrgetter("_inputs")
