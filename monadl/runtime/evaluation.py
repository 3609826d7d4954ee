"""One evaluation's state: its records, shared values and open resources.

An evaluation is one ``train()``, ``predict()``, ``gradients()`` or ``run()``.
It owns a table of *records*, one per layer or weight it reached. A record is
the reference-counted wrapper of the paper: the forward value, the delta rules
(VJPs), a count of consumers still holding it, and the accumulator of their
deltas. Records enter the table after their operands, so the table's insertion
order is topological: the reverse sweep (`schedule.inline.sweep`) relies on it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from monadl._in_dtype import dtype_differs, in_dtype_of
from monadl.deltas import Outer
from monadl.errors import NonFiniteError, OperandError, ShapeError
from monadl.layers._commits import COMMIT_LOCK, READERS, TRAINING
from monadl.layers._outputs import Outputs, StackedOutputs, finite_value
from monadl.layers._site import site_text
from monadl.layers._weight import Weight
from monadl.runtime.settings import current_settings
from monadl.tape import Tape

if TYPE_CHECKING:
    from monadl.do import Do

__all__ = ["STRIDE", "Evaluation", "Record", "Records", "Shared", "UserRelease"]

STRIDE: Final = 32
"""Nodes or records between two looks at the clock, at most (a look costs
about 50 ns; slow nodes make the stride shorter: `Evaluation.paced`)."""


class Record:
    """One layer's or weight's state in one evaluation.

    Attributes:
        value: the forward value.
        vjps: one delta rule per operand (None once spent, or when no weight is
            upstream).
        inputs: the operands' records (None for a plain operand).
        fits: the operands' deltas come back in their shapes, so no
            broadcasting needs undoing (unary elementwise rules, an array
            beside a plain number).
        refcount: consumers still holding this record (the counted release).
        delta: the sum of the consumers' deltas so far.
        needs_grad: some weight is upstream, so a delta is worth computing.
        node: the layer or weight this record is of.
        tape_backward: for a layer built from a ``Do``: its tape's backward.
        release: for a layer built from a ``Do``: the token to release after it.
        is_weight: a weight's record keeps its delta (the gradient).
    """

    __slots__ = (
        "delta",
        "fits",
        "inputs",
        "is_weight",
        "needs_grad",
        "node",
        "refcount",
        "release",
        "tape_backward",
        "value",
        "vjps",
    )

    def __init__(self, value: Any, vjps: Any, inputs: Any, needs_grad: bool, node: Any, fits: bool = False) -> None:
        self.value = value
        self.vjps = vjps
        self.inputs = inputs
        self.fits = fits
        self.refcount = 0
        self.delta: Any = None
        self.needs_grad = needs_grad
        self.node = node
        self.tape_backward: Callable[[Any], None] | None = None
        self.release: Any = None
        self.is_weight = False

    def accumulate(self, delta: Any) -> None:
        """A consumer's delta: summed now, sent upstream once, by the backward."""
        self.delta = delta if self.delta is None else self.delta + delta

    def tape(self) -> Tape[Any, Any]:
        """The record as a tape handed to a ``Do`` (``bind``, a backward of
        one's own): its deltas are checked for shape, as nothing else sends
        one of another (a user's backward that stacked its delta made a
        weight's gradient, and after a step the weight, of another shape)."""
        return Tape(self.value, self._delivered if self.needs_grad else None)

    def _delivered(self, delta: Any) -> None:
        value = self.value
        if not is_value(delta):  # (a list's shape was NumPy's reading of it, and None's was ())
            site = getattr(self.node, "_site", None)
            built = "" if site is None else f" built at {site_text(site)}"
            sent = "None" if delta is None else f"a {type(delta).__name__}"
            raise OperandError(
                f"a backward of your own (a Tape's) sent {sent}, not an array, to the "
                f"{'weight' if self.is_weight else 'layer'}{built}, of shape {_shape(value)}: a delta is an array "
                "of its operand's shape (a number where its operand is one)"
            )
        if hasattr(value, "shape") and tuple(value.shape) != _shape(delta):
            site = getattr(self.node, "_site", None)
            built = "" if site is None else f" built at {site_text(site)}"
            raise ShapeError(
                f"a backward of your own (a Tape's) sent a delta of shape {_shape(delta)} to the "
                f"{'weight' if self.is_weight else 'layer'}{built}, of shape {tuple(value.shape)}: a delta has "
                "its operand's shape"
            )
        if current_settings().check_finite and not finite_value(delta):  # (the next backward was blamed)
            site = getattr(self.node, "_site", None)
            built = "" if site is None else f" built at {site_text(site)}"
            raise NonFiniteError(f"a backward of your own (a Tape's) sent a NaN or an infinity to the layer{built}")
        self.accumulate(delta)


def _shape(x: Any) -> tuple[int, ...]:
    """An array's shape, a number's (), a list's as NumPy reads it."""
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else np.shape(x)


def is_value(x: object) -> bool:
    """Whether ``x`` may be a Tape's data or delta: an array (of any library,
    or a sparse or factored delta) or a number; not a list, None or a str,
    which failed later, where no layer was named.

    >>> is_value(np.zeros(2)), is_value(1.0), is_value([1.0]), is_value(None)
    (True, True, False, False)
    """
    return hasattr(x, "shape") or (isinstance(x, (int, float, complex)) and not isinstance(x, bool))


class Records(dict[Any, Record]):
    """An evaluation's records, by layer or weight, in insertion order.

    A member of a group that the batching scheduler ran as one kernel gets
    its record only when something reads it (`__missing__`): a consumer that
    runs alone, a root, a later graph. The groups that read it by index (most
    of a tree's nodes) need none, so a batch of 8,000 tree nodes does not
    make 8,000 records, value views and delta rules that nothing uses.

    Attributes:
        places: where each member's value sits (`Place`: its group's record,
            its row, its part of a consumer's signature); a node here was
            computed, with a record or not yet (check both, as ``in`` looks
            at the records only).
        sinks: each group's delta sink (`Gather`), where a delta is worth computing.
    """

    __slots__ = ("places", "sinks")

    def __init__(self) -> None:
        super().__init__()
        self.places: dict[Any, Any] = {}
        self.sinks: dict[Record, Any] = {}

    def clear(self) -> None:
        super().clear()
        self.places.clear()
        self.sinks.clear()

    def computed(self, node: Any) -> bool:
        """Whether ``node`` was computed in this evaluation (with a record or as a group's member)."""
        return node in self or node in self.places

    def __missing__(self, node: Any) -> Record:
        place = self.places.get(node)
        if place is None:
            raise KeyError(node)
        group, row, _ = place
        value = group.value
        if type(value) is StackedOutputs:
            value = Outputs(tuple([part[row] for part in value.parts]))
        else:
            value = value[row]
        sink = self.sinks.get(group)
        rec = Record(value, None if sink is None else (partial(sink.put, row),), (group,), group.needs_grad, node, True)
        # After its group and before the reader: the order stays topological. One
        # step in C, so that two threads reading one member (the worker pool's)
        # make one record between them.
        made = self.setdefault(node, rec)
        if made is rec:
            group.refcount += 1  # (its members hold a group)
        return made


class Shared:
    """A ``Do.shared()`` computation's value in one evaluation, and its holders."""

    __slots__ = ("count", "release", "value")

    def __init__(self, value: Any, release: Any) -> None:
        self.value = value
        self.release = release
        self.count = 1


class UserRelease:
    """A resource's release, to run once: at its last release or on failure."""

    __slots__ = ("done", "release", "value")

    def __init__(self, release: Callable[[Any], Awaitable[None]], value: Any) -> None:
        self.release = release
        self.value = value
        self.done = False


READING: Final[ContextVar[Evaluation | None]] = ContextVar("monadl_reading", default=None)
"""The evaluation whose driver runs in this context (tasks it starts inherit it)."""


class Evaluation:
    """The state of one run: records, shared values, open resources.

    Attributes:
        train: deltas flow to weights (a ``train()`` or ``gradients()``).
        records: by layer or weight, in topological (insertion) order.
        shared: ``Do.shared()`` values by computation.
        pending: what a concurrent branch is computing now (a shared ``Do``,
            a layer built from a ``Do``), with the event that says it is done:
            another branch that needs it waits instead of computing it twice.
        open: resources acquired, released at the end or on failure.
        coroutines: direct-style coroutines started here, their frames (closed on failure, each in its context).
        effects: something beyond primitives ran (a ``Do`` layer, a resource,
            direct style): the counted release back-propagates, not the sweep.
        forked: some graph ran on the worker pool.
        gradients: the weights' gradients, kept when the records are dropped.
        unreached: where no weight has a gradient, the weights the forward
            read all the same (kept for the error of a ``train()`` that
            would step none: `monadl.errors.NoGradientError`).
        timings: graphs timed for the fork rule (only when ``workers > 1``).
        nodes: layers collected so far (the collector's threshold follows it).
        deadline: when the event loop is next due a turn (`time.perf_counter`).
        stride: nodes or records computed between two looks at the clock
            (`paced`).
        on_gradient: told each weight's gradient the moment it is final (all
            records that use the weight back-propagated), as
            ``on_gradient(weight, gradient)``; None (the default) costs nothing.
        running: its driver runs (`reads`): a ``train()`` from inside it, by
            a task it started or one of its effects, is refused
            (`monadl.runtime.nested.refuse_inside_evaluation`).
        outer: the evaluation whose driver ran where this one's began (a
            ``predict()`` awaited inside a model), if any.
    """

    __slots__ = (
        "check_finite",
        "coroutines",
        "cuda_streams",
        "deadline",
        "effects",
        "failed",
        "fork_threshold_s",
        "forked",
        "gradients",
        "nodes",
        "on_gradient",
        "open",
        "outer",
        "pending",
        "pinned",
        "records",
        "running",
        "shared",
        "stride",
        "timings",
        "train",
        "unreached",
        "workers",
        "yield_interval_s",
    )

    def __init__(self, train: bool, may_fork: bool = True) -> None:
        settings = current_settings()
        self.train = train
        self.records = Records()
        self.shared: dict[Do[Any], Shared] = {}
        self.pending: dict[Any, Any] = {}
        self.open: list[UserRelease] = []
        self.coroutines: list[Any] = []
        self.check_finite = settings.check_finite
        self.workers = settings.workers if may_fork else 1
        self.fork_threshold_s = settings.fork_threshold_s
        self.cuda_streams = settings.cuda_streams
        self.yield_interval_s = settings.yield_interval_s
        self.deadline = 0.0  # when the event loop is next due a turn (perf_counter); set by the driver
        self.stride = 4  # nodes or records between two looks at the clock (`paced`)
        self.forked = False
        self.effects = False
        self.failed: Any = None  # the node whose rule raised last (`compute`): which example's, a merged run notes
        self.gradients: dict[Weight[Any, Any], Any] | None = None
        self.unreached: list[Weight[Any, Any]] = []
        self.timings: list[Any] = []
        self.nodes = 0
        self.on_gradient: Callable[[Weight[Any, Any], Any], None] | None = None
        self.pinned: dict[Weight[Any, Any], Any] = {}  # data of weights written while this runs (`pin_for_readers`)
        self.running = False
        self.outer: Evaluation | None = None

    def paced(self, started: float, now: float) -> None:
        """Fit `stride` to what the last stride of nodes took (from
        ``started`` to ``now``): as many as take a quarter of the yield
        interval, from 1 (nodes of milliseconds: the event loop's turn then
        comes within about the interval, not dozens of nodes later) to
        `STRIDE`, growing by at most twice a look. It starts at a few, so
        that the first look comes early."""
        took, stride = now - started, self.stride
        fit = stride * 0.25 * self.yield_interval_s / took if took > 0 else STRIDE
        # (down at once, up by at most twice: nodes of mixed cost, a cheap one then a slow one;
        # a float until bounded: an infinite interval fits infinitely many)
        self.stride = 1 if fit < 1 else int(min(fit, 2 * stride, STRIDE))

    def reads(self, running: bool) -> None:
        """While ``running`` (its driver's run), a write of a weight's data
        leaves this evaluation what it read, or would have, before the write
        (`monadl.layers._commits.pin_for_readers`); after, what it kept goes.
        An evaluation begun inside another's run (a ``predict()`` awaited in
        an ``@ml.direct`` model, in a black box) reads that one's model."""
        self.running = running
        with COMMIT_LOCK:
            if running:
                outer = self.outer = READING.get()
                if outer is not None and outer.pinned:
                    self.pinned = dict(outer.pinned)
                READERS[id(self)] = self.pinned
                if self.train:
                    TRAINING[id(self)] = self.records
            else:
                del READERS[id(self)]
                TRAINING.pop(id(self), None)
                if self.pinned:
                    self.pinned = {}

    def weight_record(self, weight: Weight[Any, Any]) -> Record:
        """A weight's record: its data as it was when this evaluation began; a
        gradient only when training."""
        with COMMIT_LOCK:  # (a step in another thread may be writing into an array that nobody holds)
            data = self.pinned.get(weight, weight._data) if self.pinned else weight._data
        rec = Record(data, None, (), self.train, weight)
        rec.is_weight = True
        self.records[weight] = rec
        return rec

    def weight_gradients(self, factored: bool = False) -> dict[Weight[Any, Any], Any]:
        """The gradient of each weight that has one. A gradient kept as
        factors (`monadl.deltas.Outer`) is multiplied out here, unless
        ``factored`` (the commit, which steps plain SGD from the factors)."""
        grads = self.gradients
        if grads is None:
            grads = {rec.node: rec.delta for rec in self.records.values() if rec.is_weight and rec.delta is not None}
        for weight, grad in grads.items():
            if type(grad) is Outer and not factored:
                grads[weight] = grad = grad.dense()
            data = weight._data
            if type(grad) is not Outer and dtype_differs(grad, data):
                grads[weight] = in_dtype_of(grad, data)  # (a float64 delta into a float32 weight)
            if type(grad) is not Outer and getattr(grad, "shape", ()) != getattr(data, "shape", ()):
                raise ShapeError(  # (a step would have made it the weight's data, of that shape)
                    f"the gradient of the weight built at {site_text(weight._site)} has shape "
                    f"{tuple(getattr(grad, 'shape', ()))}, the weight {tuple(getattr(data, 'shape', ()))}: a backward "
                    "of your own (a Tape's) that sends a delta of another shape than its operand's?"
                )
        return grads

    def finish(self) -> None:
        """After the last release: keep the weights' gradients, drop the records.

        Dropped here, inside the runtime's synchronous stretch, the thousands
        of records, closures and intermediate values die while the cyclic GC
        is paused; left alive until after it resumes, they would be scanned
        and promoted to older generations for nothing.
        """
        if self.train:
            self.gradients = self.weight_gradients(factored=True)
            if not self.gradients:  # (an error's detail: no cost where a weight has one)
                self.unreached = [rec.node for rec in self.records.values() if rec.is_weight]
        self.records.clear()
