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

The loom node's rule runs the schedule (`monadl.fold._loom_run`): per depth and trace,
the members' operands gathered from the *arenas* (per output, the rows of
every call whose output a consumer reads at one position: a tree's left
child's ``h`` is a leaf's or an internal node's, one arena), the program's
batching rule once (`Program.batch`), its outputs written into the arenas;
backward, the depths in reverse, each group's delta the rows its consumers
and the slots read sent back, a weight's delta summed over the groups (one
``X_cat.T @ dY`` a group). Outputs of other shapes to one arena (each
example's own width; known when the loom runs) are held apart by shape, a
group reading them one batched call per pattern (`monadl.fold._loom_arenas`).
A member none of whose outputs got a delta sends none, as alone: a weight
only such calls use takes no step (a group some of whose members got none
runs its others again as a group, since a zero delta times an infinite
derivative, sqrt's at 0, is NaN). A batch of one input
(`monadl.fold._run.LOOM_INPUTS`) builds its nodes as a call does.

All calls run one by one, group by group (by depth: each after its
operands'), where batching is off (``Settings(batching=False)``), under
``check_finite`` (each call's value and delta checked, an error naming its
call), and where a group fails: then the first call that fails raises its
own error, naming the block's line and the input of the batch it was built
for (where none does, a WARNING of the ``monadl.batching`` logger says so).
A group whose program has a step that does not batch runs its own calls
one by one, the others batched (`monadl.fold._loom_looped`).

Recorded are calls of a `Function` block in a batch whose leaves are each
an output of the batch's earlier calls, a constant row of data (`Scalar`,
`Vector`, `Zeros`: stacked per group; in an ``ml.loom()`` block, a NumPy
float array of one row too, ``X[i:i + 1]``) or an integer or boolean NumPy
array (indices, masks), and whose weights are NumPy's; any other call (a
float, a larger data array, a layer built elsewhere, a weight passed in, a
device's weights) builds its
node as outside a batch, over the slots it reads. Every recorded call is
computed, read or not: under ``check_finite`` a NaN in a call whose outputs
nothing reads raises, where the same input built alone computes nothing.
The first call of a kind is read as building its node would be (the
signature's lookup is most of it); calls like it are recorded by
straight-line code compiled for their structure
(`monadl.fold._loom_recorders`: half the cost). The schedule is worked out
once, when the batch is built, with NumPy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from sys import _getframe
from threading import get_ident
from typing import TYPE_CHECKING, Any, Final, TypeAlias, final

import numpy as np

from monadl.fold._loom_recorders import MOST, CallRecorder, Group, learn
from monadl.fold._loom_run import LOOM, SLOT, Open
from monadl.fold._loom_schedule import Schedule
from monadl.layers._layer import Layer, _new, _next_serial
from monadl.layers._primitives import AS_LAYER, shown
from monadl.layers._program import Program
from monadl.layers._recording import MISS
from monadl.layers._site import PACKAGE_DIR, site_text
from monadl.layers._structures import filler
from monadl.layers._tracing import _taker
from monadl.layers._weight import Weight

if TYPE_CHECKING:
    from monadl.layers._operation import Operation
    from monadl.layers._site import Site
    from monadl.layers._tracing import Trace

__all__ = ["LOOM", "SLOT", "Loom", "in_words"]

_INDICES: Final = frozenset("biu")


# ---- recording ---------------------------------------------------------------------------------
_Fill: TypeAlias = Callable[[tuple[Any, ...], list[Any]], Any]
_Known: TypeAlias = "tuple[int, Callable[[list[Any]], tuple[Any, ...]], tuple[int, ...], _Fill, Trace]"


@final
class Loom:
    """One batch's recorded calls, and the node that runs them (see the module's docstring)."""

    __slots__ = (
        "base",
        "closed",
        "count",
        "groups",
        "inputs",
        "node",
        "recorders",
        "sites",
        "thread",
        "traces",
        "tries",
        "unrecorded",
        "weights",
        "why",
    )

    def __init__(self, site: Site) -> None:
        # The node first: every slot and every layer built over one comes after it, as
        # `monadl.runtime.node.collect`'s order (by number) needs; its operands, the weights, are set by `done`.
        node: Layer[Any, Any] = _new(Layer)
        node._op, node._inputs, node._params, node._site = LOOM, (), (Open(site),), site
        node._serial = _next_serial()
        self.node = node
        self.inputs = (node,)  # (a slot's: one tuple for all)
        self.base = node._serial + 1  # (a slot's number: its layer's, less this)
        self.groups: dict[tuple[int, ...], Group] = {}  # by depth, the trace's first key (and rows of data)
        # Per trace (by id: a trace, a frozen dataclass, hashes its fields), how its calls are recorded
        # (`_known`; the trace kept alive with it, so that its id stays its).
        self.traces: dict[int, _Known] = {}
        self.count = 0
        self.weights: dict[Weight[Any, Any], int] = {}
        self.thread = get_ident()  # (an ``ml.loom()`` block records its own thread's calls only)
        self.closed = False
        self.unrecorded: dict[Any, int] = {}  # (calls built as nodes, by why: a DEBUG line of the block's)
        self.why: dict[int, str] = {}  # (per trace not recorded, why: `_unstacked`)
        # The lines calls were made at, each as one object (not one a call: 0.3 us a call less), by
        # their code's identity: code objects of equal text at equal lines compare equal across files.
        self.sites: dict[tuple[int, int], Site] = {}
        # Per operation, the recorders of calls like earlier ones (`learn`), and how many were tried.
        self.recorders: dict[Operation[Any, Any], list[CallRecorder]] = {}
        self.tries: dict[Operation[Any, Any], int] = {}

    def site_of(self, code: Any, at: int) -> Site:
        """The site of a call made at instruction ``at`` of ``code``, one object a line."""
        site = self.sites.get((id(code), at))
        if site is None:  # (the site holds the code: its id is not reused while it is here)
            site = self.sites[(id(code), at)] = (code, at)
        return site

    def _built(self, why: Any) -> None:
        self.unrecorded[why] = self.unrecorded.get(why, 0) + 1

    def record(self, op: Operation[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of ``op`` (a `Function` block's in a batch, or one while an
        ``ml.loom()`` block is open in this context): recorded if made in the
        loom's thread (a worker thread that copied the context builds its own
        nodes) before it was done (a task a block started may go on after
        it), else built as outside one."""
        trace, leaves, sources = op.found(args, kwargs)
        if self.closed or get_ident() != self.thread:
            return trace.make(leaves, sources, op._site)
        if sources:  # (an output of a call built as a node: before the block, or not recorded, and so on down)
            source = sources[0]
            self._built((source._op, source._site))
            return trace.make(leaves, sources, op._site)
        known = self.traces.get(id(trace))
        if known is None:
            known = self.traces[id(trace)] = self._known(trace, leaves)
        key, take, layers, fill, _ = known
        if key < 0:
            self._built(self.why[id(trace)])
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
            elif v._op is AS_LAYER and _data(v._inputs[0]):  # (a `Scalar`'s, `Vector`'s or `Zeros`' row)
                rows |= 1 << j  # (its data, kept as the layer: under check_finite, an error names its line)
            else:  # (a layer built elsewhere)
                self._built((v._op, v._site))  # (said at the block's end, at DEBUG: `in_words`)
                return trace.make(leaves, sources, op._site)
        if rows:  # (a group's operands are slots, or data of one shape and dtype, alike: stacked)
            at: tuple[Any, ...] = (depth, key, rows, *[_shown(operands[j]) for j in layers if rows >> j & 1])
        else:
            at = (depth, key)
        group = self.groups.get(at)
        if group is None:
            group = self.groups[at] = Group(trace, key, depth, op._site)
        group.add(operands)
        site: Any = op._site  # (a `Function`'s: where the block was made)
        if site is None:  # (a call in an ``ml.loom()`` block: the line that made it, as its node's would be)
            frame = _getframe(2)  # (this, `Operation.__call__`, then the caller)
            while frame.f_code.co_filename.startswith(PACKAGE_DIR) and frame.f_back is not None:
                frame = frame.f_back
            site = self.site_of(frame.f_code, frame.f_lasti)
            group.sites.append(site)
        serial = _next_serial()
        first = serial - self.base
        group.firsts.append(first)
        inputs = self.inputs
        one: Layer[Any, Any] = _new(Layer)
        one._op, one._inputs, one._params, one._site, one._serial = SLOT, inputs, (first, depth), site, serial
        slots = [one]
        for k in range(1, trace.outputs):  # (a cell's state: its h and c)
            more: Layer[Any, Any] = _new(Layer)
            more._op, more._inputs, more._params, more._site = SLOT, inputs, (first + k, depth), site
            more._serial = _next_serial()
            slots.append(more)
        if not kwargs and self.tries.get(op, 0) < MOST:  # (calls like it: straight-line code)
            self.tries[op] = self.tries.get(op, 0) + 1
            learn(self, op, args, leaves, trace)
        return fill(tuple(slots), leaves)

    def caller(self, op: Operation[Any, Any], first: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
        """Calls of ``op`` on one argument (a Fold batch's `Function` block's;
        ``first``: on what it makes of the input, a composition's) recorded:
        by a recorder of calls like it, as `Operation.__call__` asks them,
        else by `record` (a closure: a Fold runner's, one per block)."""
        recorders, record = self.recorders, self.record
        none: dict[str, Any] = {}

        def call(x: Any) -> Any:
            if first is not None:
                x = first(x)
            for recorder in recorders.get(op, ()):
                made = recorder((x,))
                if made is not MISS:
                    return made
            return record(op, (x,), none)

        return call

    def _known(self, trace: Trace, leaves: list[Any]) -> _Known:
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
        kinds = {type(w._data) for w in trace.weights}  # (the calls' arrays: NumPy's or CuPy's, of one library)
        for j, i in enumerate(used):
            v = leaves[i]
            if type(v) is Layer:
                layers.append(j)
            elif not _data(v) or not (v.dtype.kind in _INDICES or _row(v)):
                self.why[id(trace)] = _unstacked(v)
                return -1, take, (), fill, trace
            elif not (type(v) is np.ndarray and v.dtype.kind in "iu"):  # (a host's indices go with a device's arrays)
                kinds.add(type(v))
        if trace.op is None:
            self.why[id(trace)] = "a cell whose result is no layer it computed (an argument, a constant)"
            return -1, take, (), fill, trace
        if len(kinds) > 1 or not kinds <= {np.ndarray, _device_arrays()}:
            self.why[id(trace)] = "arrays of another library than NumPy's and CuPy's, or of two (built as nodes)"
            return -1, take, (), fill, trace
        for w in trace.weights:
            self.weights.setdefault(w, len(self.weights))
        key = self.count
        self.count += trace.outputs
        return key, take, tuple(layers), fill, trace

    def done(self) -> None:
        """The batch is built: the loom node reads its weights and runs its schedule."""
        self.closed = True
        self.recorders.clear()  # (they hold the loom: no cycle left for the collector)
        if not self.groups:
            return
        self.node._inputs = tuple(self.weights)
        self.node._params = (Schedule(self),)


def _row(data: Any) -> bool:
    """Whether data are a row (``X[i:i + 1]``: a first axis of one), which a
    group stacks; a larger array, the same one given to every call (a mask, a
    table), would be copied per call."""
    return data.ndim > 1 and data.shape[0] == 1 and data.dtype.kind in "fc"


def _data(v: Any) -> bool:
    """Whether ``v`` is an array that a group stacks: NumPy's, or CuPy's."""
    return type(v) is np.ndarray or type(v) is _device_arrays()


def _device_arrays() -> Any:
    """CuPy's array type where CuPy is imported (else None: no array is CuPy's)."""
    cupy = sys.modules.get("cupy")
    return None if cupy is None else cupy.ndarray


def _unstacked(v: Any) -> str:
    """Why a trace's calls are not recorded: ``v``, a leaf of its arguments."""
    if _data(v):
        return (
            f"a data argument of shape {v.shape}, neither indices nor a row (X[i:i + 1]): data the same in every "
            "call belong in the cell (closed over), a call's own in ml.as_layer(x)"
        )
    if type(v) is Weight:
        return "a weight passed as an argument: a cell that closes over its weights is recorded"
    return f"a {type(v).__name__} argument, which a loom does not stack: a number as a row, np.full((1, 1), x)"


def in_words(why: Any) -> str:
    """A reason of `Loom.unrecorded`, in words."""
    if type(why) is str:
        return why
    op, site = why
    if op is SLOT:
        return (
            f"an output of another loom's calls (another ml.loom() block's, or a Fold batch's, at {site_text(site)}): "
            "calls are recorded with the calls of their own block; make one block around them"
        )
    if type(op.rule) is Program:  # (a marked cell's call built as a node: before the block, or not recorded)
        return (
            f"an output of a call of {shown(op)} built as a node (at {site_text(site)}: made before the block, or "
            "not recorded, for its own reason), and so on down the calls that read it"
        )
    return (
        f"an operand built outside the loom's calls ({shown(op)} at {site_text(site)}; a recorded call's "
        "operands are the block's recorded calls' outputs or data: compute it in a marked cell of the block)"
    )


def _shown(row: Layer[Any, Any]) -> tuple[Any, Any, Any]:
    """A constant row's library, shape and dtype (rows of others are another group's)."""
    data = row._inputs[0]
    return type(data), data.shape, data.dtype
