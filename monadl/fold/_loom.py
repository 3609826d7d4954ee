"""A Fold batch's loom: its cells' calls recorded, not built, and run as ONE node.

TF Fold's loom (Looks et al. 2017, section 2) turns a batch of inputs into
a schedule, per depth one batched call per operation, with no object per
node of the input. A `block.batch(inputs)` does the same for its
`Function` blocks (marked operations): a call whose leaves are data (an
index array) or outputs of the batch's earlier calls is *recorded* (its
trace, its operands, its depth: one more than its deepest operand's) and
returns the trace's result over *slot* layers (`SLOT`), one per output,
each a read of the one loom node that the batch builds (`Loom.done`). So a
batch of 32 trees of 255 nodes is one node and its slots, where building
every call as its node had the runtime walk, group, gather and record 8,000
nodes each step; the blocks' graph is the same function of the weights
(the tests check values and gradients against the same blocks built call by
call, and against the natural recursion).

The loom node's rule runs the schedule (`Schedule`): per depth and trace,
the members' operands gathered from the *arenas* (per output, the rows of
every call whose output a consumer reads at one position: a tree's left
child's ``h`` is a leaf's or an internal node's, one arena), the program's
batching rule once (`Program.batch`), its outputs written into the arenas;
backward, the depths in reverse, each group's delta the rows its consumers
and the slots read sent back, a weight's delta summed over the groups (one
``X_cat.T @ dY`` a group). A member none of whose outputs got a delta sends
none, as it would alone: a weight that only such calls use is not reached
and takes no step (a group some of whose members got none runs its others
again as a group of their own, since a zero delta times an infinite
derivative, sqrt's at 0, is NaN). A batch of one input (`monadl.fold._run.LOOM_INPUTS`)
builds its nodes as a call does.

Calls run one by one, group by group (by depth: each after its operands'),
where batching is off (``Settings(batching=False)``), under
``check_finite`` (each call's value and delta checked, an error naming its
call), where a step of a program has no batching rule, where calls give
outputs of different shapes to one arena, and where a group fails: then the
first call that fails raises its own error, naming the block's line and the
input of the batch it was built for (a DEBUG line of the ``monadl.batching``
logger says why a batch ran so).

Recorded are calls of a `Function` block in a batch whose leaves are each
an output of the batch's earlier calls, a constant row of data (`Scalar`,
`Vector`, `Zeros`: stacked per group) or an integer or boolean NumPy array
(indices, masks), and whose weights are NumPy's; any other call (a float,
a layer built elsewhere, a weight passed in, a device's weights) builds its
node as outside a batch, over the slots it reads. Every recorded call is
computed, read or not: under ``check_finite`` a NaN in a call whose outputs
nothing reads raises, where the same input built alone computes nothing. Recording a call costs about what building its node
did (the signature's lookup is most of either); the schedule is worked out
once, when the batch is built, with NumPy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias, final

import numpy as np

from monadl._namespace import all_finite, namespace
from monadl.errors import NonFiniteError
from monadl.layers._batch_site import built_for
from monadl.layers._layer import Layer, _new, _next_serial
from monadl.layers._non_finite import backward_made, data_held, finite_delta, made
from monadl.layers._outputs import Outputs, OutputsDelta, StackedOutputs, finite_value
from monadl.layers._primitives import AS_LAYER, Primitive, shown
from monadl.layers._site import site_text
from monadl.layers._structures import filler
from monadl.layers._tracing import _taker
from monadl.runtime.node import failed, where
from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from monadl.layers._operation import Operation
    from monadl.layers._site import Site
    from monadl.layers._tracing import Trace
    from monadl.layers._weight import Weight

__all__ = ["SLOT", "Loom"]

_INDICES: Final = frozenset("biu")
_log: Final = logging.getLogger("monadl.batching")


# ---- the slots: a call's outputs, read from the loom's value -----------------------------------
def _slot_rule(value: LoomValue, slot: int, depth: int) -> tuple[Any, tuple[Callable[[Any], Any]]]:
    """A slot of the loom's calls (numbered: a call's first slot, plus the
    output's number; and its call's depth): a view of its row; its delta is
    kept by slot."""
    deltas = value.deltas

    def vjp(g: Any) -> LoomDelta:
        deltas.add(slot, g)
        return deltas

    return value.read(slot), (vjp,)


SLOT: Final = Primitive("slot", _slot_rule)


@final
class LoomDelta:
    """The deltas that reads of a loom's slots sent back, by slot. Every read's
    VJP returns this one object, and ``+`` of it with itself is itself (the
    runtime sums a node's deltas: here, once)."""

    __slots__ = ("by_slot", "lock")
    shape: Final = None  # (as its value's: no broadcasting to undo)

    def __init__(self) -> None:
        self.by_slot: dict[int, Any] = {}
        self.lock = threading.Lock()  # (reads may run on the worker pool's threads)

    def add(self, slot: int, g: Any) -> None:
        with self.lock:
            old = self.by_slot.get(slot)
            self.by_slot[slot] = g if old is None else old + g

    def __add__(self, other: LoomDelta) -> LoomDelta:
        assert other is self
        return self

    def finite(self) -> bool:
        return all(finite_delta(g) for g in self.by_slot.values())


# ---- recording ---------------------------------------------------------------------------------
@final
class _Group:
    """The calls of one trace at one depth: per member its operands (a slot
    or a data array, per leaf the program takes) and its first slot. A
    call's slots are numbered from its first layer's number (less the
    loom's), so that an error finds the input of the batch it was built for."""

    __slots__ = ("depth", "firsts", "key", "members", "site", "trace")

    def __init__(self, trace: Trace, key: int, depth: int, site: Site | None) -> None:
        self.trace = trace
        self.key = key  # (its outputs' first key: which arena each goes to, `Schedule`)
        self.depth = depth
        self.site = site  # (its block's line: where each of its calls was built)
        self.members: list[list[Any]] = []
        self.firsts: list[int] = []


_Fill: TypeAlias = Callable[[tuple[Any, ...], list[Any]], Any]
_Known: TypeAlias = "tuple[int, Callable[[list[Any]], tuple[Any, ...]], tuple[int, ...], _Fill, Trace]"


@final
class Loom:
    """One batch's recorded calls, and the node that runs them (see the module's docstring)."""

    __slots__ = ("base", "count", "groups", "node", "traces", "weights")

    def __init__(self, site: Site) -> None:
        # The node first: every slot and every layer built over one comes after it, as
        # `monadl.runtime.node.collect`'s order (by number) needs; its operands, the weights, are set by `done`.
        node: Layer[Any, Any] = _new(Layer)
        node._op, node._inputs, node._params, node._site = LOOM, (), (), site
        node._serial = _next_serial()
        self.node = node
        self.base = node._serial + 1  # (a slot's number: its layer's, less this)
        self.groups: dict[tuple[int, ...], _Group] = {}  # by depth, the trace's first key (and rows of data)
        # Per trace (by id: a trace, a frozen dataclass, hashes its fields), how its calls are recorded
        # (`_known`; the trace kept alive with it, so that its id stays its).
        self.traces: dict[int, _Known] = {}
        self.count = 0
        self.weights: dict[Weight[Any, Any], int] = {}

    def call(self, op: Operation[Any, Any], x: Any) -> Any:
        """A `Function` block's call on ``x`` in a batch: recorded, or built as outside one."""
        trace, leaves, sources = op.found((x,), {})
        known = self.traces.get(id(trace))
        if known is None:
            known = self.traces[id(trace)] = self._known(trace, leaves, sources)
        key, take, layers, fill, _ = known
        if key < 0 or sources:
            return trace.make(leaves, sources, op._site)
        node = self.node
        operands = list(take(leaves))
        depth = 0
        rows = 0  # (which layers are constant rows of data, as bits)
        for j in layers:  # (the trace's signature fixes which leaves are layers: are they this batch's slots?)
            v = operands[j]
            if v._op is SLOT and v._inputs[0] is node:
                slot, d = v._params
                operands[j] = slot
                if d >= depth:
                    depth = d + 1
            elif v._op is AS_LAYER and type(v._inputs[0]) is np.ndarray:  # (a `Scalar`'s, `Vector`'s or `Zeros`' row)
                rows |= 1 << j  # (its data, kept as the layer: under check_finite, an error names its line)
            else:  # (a layer built elsewhere)
                return trace.make(leaves, sources, op._site)
        at = (depth, key) if not rows else (depth, key, rows)  # (a group's operands are slots, or data, alike)
        group = self.groups.get(at)
        if group is None:
            group = self.groups[at] = _Group(trace, key, depth, op._site)
        group.members.append(operands)
        site: Any = op._site  # (a `Function`'s: where the block was made)
        serial = _next_serial()
        first = serial - self.base
        group.firsts.append(first)
        one: Layer[Any, Any] = _new(Layer)
        one._op, one._inputs, one._params, one._site, one._serial = SLOT, (node,), (first, depth), site, serial
        outputs = trace.outputs
        if outputs == 1:
            return fill((one,), leaves)
        slots = [one]
        for k in range(1, outputs):
            more: Layer[Any, Any] = _new(Layer)
            more._op, more._inputs, more._params, more._site = SLOT, one._inputs, (first + k, depth), site
            more._serial = _next_serial()
            slots.append(more)
        return fill(tuple(slots), leaves)

    def _known(self, trace: Trace, leaves: list[Any], sources: list[Any]) -> _Known:
        """How the calls of ``trace`` are recorded, from its first call's
        ``leaves`` (the trace's signature fixes which are layers, weights,
        data and of which dtype): its outputs' first key (-1: built as
        outside a batch: a float, a weight passed in, data that are no
        indices, a weight not NumPy's, a result of no layer), the leaves it
        takes, which of them are layers, and how a result is filled in."""
        used = trace.used
        take = _taker(used)
        fill = filler(trace.template)
        layers: list[int] = []
        for j, i in enumerate(used):
            v = leaves[i]
            if type(v) is Layer:
                layers.append(j)
            elif not (type(v) is np.ndarray and v.dtype.kind in _INDICES):
                return -1, take, (), fill, trace
        if sources or trace.op is None or any(type(w._data) is not np.ndarray for w in trace.weights):
            return -1, take, (), fill, trace
        for w in trace.weights:
            self.weights.setdefault(w, len(self.weights))
        key = self.count
        self.count += trace.outputs
        return key, take, tuple(layers), fill, trace

    def done(self) -> None:
        """The batch is built: the loom node reads its weights and runs its schedule."""
        if not self.groups:
            return
        self.node._inputs = tuple(self.weights)
        self.node._params = (Schedule(self),)


# ---- the schedule ------------------------------------------------------------------------------
@final
class _Planned:
    """A group as the schedule runs it: its program, its operands (per
    position: an arena and the rows to gather, or the members' data
    stacked), where its weights are among the loom's, and where its
    outputs go (per output: an arena and the first of its rows)."""

    __slots__ = ("group", "n", "operands", "outs", "program", "weights")

    def __init__(self, group: _Group, weights: list[int]) -> None:
        self.group = group
        self.n = len(group.members)
        assert group.trace.op is not None
        self.program: Any = group.trace.op.rule
        self.weights = weights
        self.operands: list[tuple[int | None, Any, bool]] = []
        self.outs: list[tuple[int, int]] = []


@final
class Schedule:
    """The loom's calls as groups by depth (a valid order: a call's operands
    are outputs of shallower calls), and the arenas their outputs go to."""

    __slots__ = ("arena", "base", "capacity", "planned", "rows", "site", "span", "weights")

    def __init__(self, loom: Loom) -> None:
        # (not the loom itself: its node holds this schedule, and a cycle would keep both till a collection)
        self.site = loom.node._site
        self.base = loom.base
        self.weights = list(loom.weights)
        groups = sorted(loom.groups.values(), key=lambda g: g.depth)  # (stable: in the order first built)
        span = max(g.firsts[-1] + g.trace.outputs for g in groups)
        self.span = span  # (slots are numbered below it)
        keys = np.zeros(span, np.intp)  # per slot, its output's key: its trace's first, plus its number
        firsts = {id(g): np.asarray(g.firsts, np.intp) for g in groups}
        for g in groups:
            for k in range(g.trace.outputs):
                keys[firsts[id(g)] + k] = g.key + k
        # Arenas: the outputs that one consumer's position reads go to one arena (union-find of keys).
        parent = list(range(loom.count))

        def find(a: int) -> int:
            while parent[a] != a:
                a = parent[a]
            return a

        columns = {id(g): list(zip(*g.members)) for g in groups}  # (per operand position, the members')
        for g in groups:
            for column in columns[id(g)]:
                if type(column[0]) is int:
                    read = [find(int(r)) for r in np.unique(keys[np.asarray(column, np.intp)])]
                    for r in read[1:]:
                        parent[find(r)] = read[0]
        arena: dict[int, int] = {}
        for key in range(loom.count):
            arena.setdefault(find(key), len(arena))
        capacity = [0] * len(arena)
        rows = np.zeros(span, np.intp)  # per slot, its row in its arena
        arena_of = np.zeros(span, np.intp)
        weights = loom.weights
        self.planned: list[_Planned] = []
        for g in groups:
            plan = _Planned(g, [weights[w] for w in g.trace.weights])
            for k in range(g.trace.outputs):
                a = arena[find(g.key + k)]
                plan.outs.append((a, capacity[a]))
                rows[firsts[id(g)] + k] = np.arange(capacity[a], capacity[a] + plan.n)
                arena_of[firsts[id(g)] + k] = a
                capacity[a] += plan.n
            self.planned.append(plan)
        for plan in self.planned:  # (the operands' rows: every producer's rows are known now)
            for column in columns[id(plan.group)]:
                if type(column[0]) is int:
                    ids = np.asarray(column, np.intp)
                    idx = rows[ids]
                    plan.operands.append((int(arena_of[ids[0]]), idx, len(np.unique(idx)) == len(idx)))
                elif type(column[0]) is Layer:  # (constant rows of data)
                    plan.operands.append((None, np.stack([v._inputs[0] for v in column]), False))
                else:
                    plan.operands.append((None, np.stack(column), False))
        self.rows = rows
        self.arena = arena_of
        self.capacity = capacity

    def where(self, group: _Group, row: int) -> str:
        """``file:line`` of the block that made a call, and the input of the batch it was built for."""
        site = self.site if group.site is None else group.site
        return site_text(site) + built_for(self.base + group.firsts[row])


# ---- running it --------------------------------------------------------------------------------
class _Unbatched(Exception):
    """The schedule cannot run batched (a step with no batching rule, shapes
    that differ within an arena, a group that failed): its calls run one by one."""


@final
class LoomValue:
    """The loom node's value: its calls' outputs (batched: in arenas; one by
    one: per slot), read by the slots, and the deltas the reads send back."""

    __slots__ = ("arenas", "deltas", "schedule", "values", "vjps", "weights")
    shape: Final = None  # (not an array: the runtime finds no broadcasting to undo, no signature to batch)
    dtype: Final = None

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.arenas: list[Any] = []
        self.values: list[Any] | None = None  # (one by one: per slot)
        self.vjps: list[Any] = []  # (per group batched; per call one by one)
        self.deltas = LoomDelta()
        self.weights: list[Any] = []  # (their values: a group's reached members run again in the backward)

    def read(self, slot: int) -> Any:
        if self.values is not None:
            return self.values[slot]
        schedule = self.schedule
        return self.arenas[schedule.arena[slot]][schedule.rows[slot]]

    def finite(self) -> bool:
        """(Under ``check_finite`` the calls ran one by one, each checked.)"""
        return True


def _loom_rule(*args: Any) -> tuple[LoomValue, tuple[Callable[[Any], Any], ...]]:
    """The loom node's rule: its weights' values, then its `Schedule`."""
    *weights, schedule = args
    value = LoomValue(schedule)
    value.weights = weights
    settings = current_settings()
    checked = settings.check_finite
    if checked or settings.batching is False:
        _one_by_one(value, weights, checked)
    else:
        try:
            _batched(value, weights)
        except _Unbatched as why:
            if _log.isEnabledFor(logging.DEBUG):
                calls = sum(plan.n for plan in schedule.planned)
                where = site_text(schedule.site)
                _log.debug("a Fold batch of %d calls (built at %s) runs its calls one by one: %s", calls, where, why)
            value.arenas, value.vjps = [], []
            _one_by_one(value, weights, False)
    grads: list[Any] | None = None

    def rule(j: int) -> Callable[[Any], Any]:
        def vjp(delta: LoomDelta) -> Any:
            nonlocal grads
            if grads is None:  # (the first weight's VJP runs the backward for all)
                grads = _backward(value, len(weights), checked)
            return grads[j]

        return vjp

    return value, tuple([rule(j) for j in range(len(weights))])


LOOM: Final = Primitive("fold batch", _loom_rule, names_errors=True)


def _batched(value: LoomValue, weights: list[Any]) -> None:
    """The schedule's groups by depth, each one call of its program's batching rule."""
    schedule = value.schedule
    arenas: list[Any] = [None] * len(schedule.capacity)
    value.arenas = arenas
    for plan in schedule.planned:
        n = plan.n
        args: list[Any] = []
        for source, rows, _ in plan.operands:  # (rows to gather from an arena; for data, the members' stacked)
            args.append(rows if source is None else arenas[source][rows])
        count = len(args)
        args += [weights[j] for j in plan.weights]
        program = plan.program
        try:
            result = program.batch(tuple(args), (True,) * count + (False,) * len(plan.weights), n)
        except Exception as exc:  # (one by one: the first call that fails raises its own error)
            raise _Unbatched(f"a group of {n} calls of {program.name} raised {type(exc).__name__}") from None
        if result is None:
            step = program.declined
            raise _Unbatched(
                f"{program.name}'s step {'?' if step is None else shown(step.op)} has no batching rule here"
            )
        out, vjps = result
        parts = out.parts if type(out) is StackedOutputs else (out,)
        for (a, start), part in zip(plan.outs, parts):
            arena = arenas[a]
            if arena is None:
                xp = namespace(part)
                arena = arenas[a] = xp.empty((schedule.capacity[a], *part.shape[1:]), part.dtype)
            elif arena.shape[1:] != part.shape[1:] or arena.dtype != part.dtype:
                raise _Unbatched(
                    f"calls give outputs of shapes {arena.shape[1:]} ({arena.dtype}) and {part.shape[1:]} "
                    f"({part.dtype}) to one position of a cell (the latter {program.name}'s)"
                )
            arena[start : start + n] = part
        value.vjps.append(vjps)


def _one_by_one(value: LoomValue, weights: list[Any], checked: bool) -> None:
    """The calls one by one (by depth), each as its node would run alone
    (``checked``: ``check_finite``'s checks, its errors naming the call)."""
    schedule = value.schedule
    values: list[Any] = [None] * schedule.span
    value.values = values
    for plan, group, row in _calls(schedule):
        operands = [_operand(values, x, checked) for x in group.members[row]]
        args = (*operands, *[weights[j] for j in plan.weights])
        program = plan.program
        try:
            if checked:
                with np.errstate(all="ignore"):
                    out, vjps = program(*args, called=schedule.where(group, row))
                if not finite_value(out):
                    raise NonFiniteError(made(shown(_op(group)), args, schedule.where(group, row)))
            else:
                out, vjps = program(*args)
        except Exception as exc:  # (the error names the weights' lines too; raised without a local, as compute's)
            raise failed(exc, _op(group), args, schedule.where(group, row), (*operands, *_weights(schedule, plan)))  # noqa: B904
        first = group.firsts[row]
        if type(out) is Outputs:
            values[first : first + len(out)] = out
        else:
            values[first] = out
        value.vjps.append(vjps)


def _weights(schedule: Schedule, plan: _Planned) -> list[Any]:
    return [schedule.weights[j] for j in plan.weights]


def _operand(values: list[Any], x: Any, checked: bool) -> Any:
    """A call's operand, one by one: a slot's value, a constant row's data
    (``checked``: refused with its line if it holds a NaN or an infinity,
    as its own node's check would), or data."""
    kind = type(x)
    if kind is int:
        return values[x]
    if kind is Layer:
        data = x._inputs[0]
        if checked and not all_finite(data):
            raise NonFiniteError(data_held(data, where(x)))
        return data
    return x


def _calls(schedule: Schedule) -> Iterator[tuple[_Planned, _Group, int]]:
    """The calls one by one, group by group (by depth: each after its operands' calls)."""
    for plan in schedule.planned:
        for row in range(plan.n):
            yield plan, plan.group, row


def _op(group: _Group) -> Primitive:
    op = group.trace.op
    assert op is not None
    return op


def _backward(value: LoomValue, count: int, checked: bool) -> list[Any]:
    """Each weight's delta (None: not reached), from the slots' deltas."""
    if value.values is not None:
        return _backward_one_by_one(value, count, checked)
    schedule = value.schedule
    arenas = value.arenas
    deltas: list[Any] = [None] * len(arenas)
    reached: list[Any] = [None] * len(arenas)
    for a, arena in enumerate(arenas):
        if arena is not None:
            deltas[a] = namespace(arena).zeros_like(arena)
            reached[a] = np.zeros(len(arena), bool)
    for slot, g in value.deltas.by_slot.items():
        a, row = schedule.arena[slot], schedule.rows[slot]
        deltas[a][row] += g
        reached[a][row] = True
    grads: list[Any] = [None] * count
    for plan, vjps in zip(reversed(schedule.planned), reversed(value.vjps)):
        n = plan.n
        hit = None
        parts = []
        for a, start in plan.outs:
            parts.append(deltas[a][start : start + n])
            seen = reached[a][start : start + n]
            hit = seen if hit is None else hit | seen
        assert hit is not None
        if not hit.any():  # (no member got a delta: none sends one)
            continue
        operands = plan.operands
        if not hit.all():  # (the others' zero deltas times an infinite derivative, sqrt's at 0, would be NaN)
            vjps, operands, parts, n = _reached_only(value, plan, np.flatnonzero(hit), parts)
        d = OutputsDelta(tuple(parts), (n,)) if len(parts) > 1 else parts[0]
        for p, (source, rows, unique) in enumerate(operands):
            if source is None:  # (data)
                continue
            g = vjps[p](d)
            if g is None:
                continue
            if unique:
                deltas[source][rows] += g
            else:
                np.add.at(deltas[source], rows, g)
            reached[source][rows] = True
        base = len(plan.operands)
        for i, j in enumerate(plan.weights):
            g = vjps[base + i](d)
            if g is not None:
                grads[j] = g if grads[j] is None else grads[j] + g
    return grads


def _reached_only(
    value: LoomValue, plan: _Planned, keep: Any, parts: list[Any]
) -> tuple[Any, list[tuple[int | None, Any, bool]], list[Any], int]:
    """A group's members that got a delta (``keep``), run again as a group of
    their own, as they would send deltas alone: their VJPs, operands, output
    deltas and count."""
    operands = [(source, rows[keep], unique) for source, rows, unique in plan.operands]
    args = [rows if source is None else value.arenas[source][rows] for source, rows, _ in operands]
    count = len(args)
    args += [value.weights[j] for j in plan.weights]
    result = plan.program.batch(tuple(args), (True,) * count + (False,) * len(plan.weights), len(keep))
    assert result is not None  # (the whole group batched)
    return result[1], operands, [p[keep] for p in parts], len(keep)


def _backward_one_by_one(value: LoomValue, count: int, checked: bool) -> list[Any]:
    schedule = value.schedule
    deltas: list[Any] = [None] * schedule.span
    for slot, g in value.deltas.by_slot.items():
        deltas[slot] = g
    grads: list[Any] = [None] * count
    for (plan, group, row), vjps in zip(reversed(list(_calls(schedule))), reversed(value.vjps)):
        first = group.firsts[row]
        outs = deltas[first : first + group.trace.outputs]
        if all(g is None for g in outs):
            continue
        d = OutputsDelta(tuple(outs)) if len(outs) > 1 else outs[0]
        operands = group.members[row]
        for p, x in enumerate(operands):
            if type(x) is int:
                g = vjps[p](d)
                if g is None:
                    continue
                if checked and not finite_delta(g):
                    raise NonFiniteError(backward_made(shown(_op(group)), schedule.where(group, row)))
                deltas[x] = g if deltas[x] is None else deltas[x] + g
        base = len(operands)
        for i, j in enumerate(plan.weights):
            g = vjps[base + i](d)
            if g is not None:
                grads[j] = g if grads[j] is None else grads[j] + g
    return grads
