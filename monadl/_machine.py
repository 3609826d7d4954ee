"""The machine that runs `Do` computations and layer graphs.

One evaluation (one ``train()``, ``predict()`` or ``run()``) owns a table of
*records*, one per layer or weight it reached. A record is the reference-
counted wrapper of the paper: the forward value, the backward rules, a count
of consumers still holding it, and the accumulator of their deltas. Releasing
the last hold on a record runs its backward once, with the summed delta, and
then releases its operands; so a diamond is back-propagated once per node and
the work is linear in the graph.

Everything is iterative. The machine is a single generator with an explicit
stack of continuation frames; it yields only at real asynchronous effects
(``Do.from_async``/``Do.resource``) and at forks, so a pure graph runs without
touching the event loop, and neither a chain of 100,000 operations nor a
chain of 100,000 ``bind``s grows the Python stack.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from contextlib import asynccontextmanager
from operator import attrgetter
from typing import Any, Final

import anyio
import numpy as np

from monadl import _cuda, _parallel
from monadl._namespace import _HOST, common_namespace, host_scalars_to_python, is_array, library_name, namespace
from monadl._settings import current_settings
from monadl.direct import AwaitLayers, Passthrough, inside_direct
from monadl.do import BIND, DIRECT, EFFECT, FORWARD, MAP, PURE, SHARED, ZIP, Do
from monadl.errors import DTypeError, NonFiniteError, ShapeError
from monadl.layers._layer import Layer, Weight, site_text
from monadl.layers._primitives import unbroadcast
from monadl.tape import Tape
from monadl.typeclasses.monoid import SparseRows

Machine = Generator[Awaitable[Any], Any, Any]

# Continuation frame tags.
_K_MAP: Final = 0
_K_BIND: Final = 1
_K_BIND_DONE: Final = 2
_K_ZIP: Final = 3
_K_SHARED: Final = 4
_K_GRAPH: Final = 5
_K_FROM_DO: Final = 6
_K_ROOT: Final = 7
_K_ROOTS: Final = 8
_K_DIRECT: Final = 9
_K_DIRECT_DONE: Final = 10
_START: Final = object()  # what a direct frame receives first: no awaited values yet
_SUSPENDED: Final = object()


class _Record:
    """One layer's or weight's state in one evaluation."""

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
        self.fits = fits  # the operands' deltas come back in their shapes: no unbroadcasting
        self.refcount = 0
        self.delta: Any = None
        self.needs_grad = needs_grad
        self.node = node
        self.tape_backward: Callable[[Any], None] | None = None
        self.release: Any = None
        self.is_weight = False

    def accumulate(self, delta: Any) -> None:
        """A consumer's delta: summed now, sent upstream at the last release."""
        self.delta = delta if self.delta is None else self.delta + delta

    def tape(self) -> Tape[Any, Any]:
        return Tape(self.value, self.accumulate if self.needs_grad else None)


class _Shared:
    __slots__ = ("count", "release", "value")

    def __init__(self, value: Any, release: Any) -> None:
        self.value = value
        self.release = release
        self.count = 1


class _UserRelease:
    __slots__ = ("done", "release", "value")

    def __init__(self, release: Callable[[Any], Awaitable[None]], value: Any) -> None:
        self.release = release
        self.value = value
        self.done = False


class Evaluation:
    """The state of one run: records, shared values, open resources."""

    __slots__ = (
        "check_finite",
        "coroutines",
        "cuda_streams",
        "effects",
        "fork_threshold_s",
        "forked",
        "gradients",
        "open",
        "records",
        "shared",
        "timings",
        "train",
        "workers",
    )

    def __init__(self, train: bool, may_fork: bool = True) -> None:
        settings = current_settings()
        self.train = train
        self.records: dict[Any, _Record] = {}
        self.shared: dict[Do[Any], _Shared] = {}
        self.open: list[_UserRelease] = []
        self.coroutines: list[Any] = []  # direct-style coroutines started here
        self.check_finite = settings.check_finite
        self.workers = settings.workers if may_fork else 1
        self.fork_threshold_s = settings.fork_threshold_s
        self.cuda_streams = settings.cuda_streams
        self.forked = False  # some graph ran on the worker pool
        self.effects = False  # something beyond primitives ran: backward stays on this thread
        self.gradients: dict[Weight[Any, Any], Any] | None = None  # kept by finish()
        self.timings: list[Any] = []  # graphs timed for the fork rule, recorded at the end (`_parallel.settle`)

    def weight_gradients(self) -> dict[Weight[Any, Any], Any]:
        if self.gradients is not None:
            return self.gradients
        return {rec.node: rec.delta for rec in self.records.values() if rec.is_weight and rec.delta is not None}

    def finish(self) -> None:
        """After the last release: keep the weights' gradients, drop the records.

        Dropped here, inside the machine's run, the thousands of records,
        closures and intermediate values die while the cyclic GC is paused;
        left alive until after it resumes, they would be scanned and promoted
        to older generations for nothing, and full collections would follow.
        """
        if self.train:
            self.gradients = self.weight_gradients()
        self.records.clear()


# ---- forward -----------------------------------------------------------------------
def evaluate(ev: Evaluation, root: Do[Any]) -> Machine:
    """Acquire ``root`` in ``ev``: returns ``(value, release token)``."""
    records = ev.records
    stack: list[Any] = []
    cur = root
    val: Any = None
    tok: Any = None
    descending = True
    while True:
        if descending:
            kind = cur._kind
            if kind == FORWARD:
                node = cur._a
                rec = records.get(node)
                if rec is None and type(node) is Weight:
                    rec = _weight_record(ev, node)
                if rec is None:
                    stack.append((_K_ROOT, node))
                    stack.append([_K_GRAPH, [node], None, 0, 0.0])
                    descending = False
                    continue
                rec.refcount += 1
                val, tok = rec.tape(), rec
                descending = False
            elif kind == MAP:
                stack.append((_K_MAP, cur._b))
                cur = cur._a
            elif kind == BIND:
                stack.append((_K_BIND, cur._b))
                cur = cur._a
            elif kind == PURE:
                val, tok = cur._a, None
                descending = False
            elif kind == ZIP:
                dos = cur._a
                if not dos:
                    val, tok = (), None
                    descending = False
                elif len(dos) > 1 and all(d._kind == FORWARD for d in dos):
                    # Independent forwards: one graph, so the runtime may fork across them.
                    stack.append((_K_ROOTS, dos))
                    roots = []
                    for d in dos:
                        if d._a in records:
                            continue
                        if type(d._a) is Weight:
                            _weight_record(ev, d._a)
                        else:
                            roots.append(d._a)
                    stack.append([_K_GRAPH, roots, None, 0, 0.0])
                    descending = False
                else:
                    stack.append([_K_ZIP, dos, 0, [], []])
                    cur = dos[0]
            elif kind == SHARED:
                entry = ev.shared.get(cur)
                if entry is not None:
                    entry.count += 1
                    val, tok = entry.value, entry
                    descending = False
                else:
                    ev.effects = True
                    stack.append((_K_SHARED, cur))
                    cur = cur._a
            elif kind == DIRECT:
                ev.effects = True
                coroutine = cur._a()
                ev.coroutines.append(coroutine)
                stack.append([_K_DIRECT, coroutine, [], False])
                val, tok = _START, None
                descending = False
            else:  # EFFECT
                assert kind == EFFECT
                ev.effects = True
                val = yield cur._a()
                tok = None
                if cur._b is not None:
                    tok = _UserRelease(cur._b, val)
                    ev.open.append(tok)
                descending = False
            continue

        if not stack:
            return val, tok
        frame = stack.pop()
        tag = frame[0]
        if tag == _K_GRAPH:
            outcome = _graph(ev, frame, stack)
            if outcome is _SUSPENDED:
                cur = stack[-1][1]._do
                descending = True
            elif outcome is not None:
                yield outcome  # the graph runs on the worker pool meanwhile
        elif tag == _K_DIRECT:
            # Step a direct-style coroutine: it asks for forward values of
            # layers (evaluated here, in this evaluation), awaits something
            # foreign (handed to the event loop), or returns its layer.
            coroutine, held = frame[1], frame[2]
            if val is _START:
                sending: Any = None
            else:
                held.append(tok)
                sending = val.data if frame[3] else tuple(t.data for t in val)
            failure: BaseException | None = None
            while True:
                flag = inside_direct.set(True)
                try:
                    request = coroutine.send(sending) if failure is None else coroutine.throw(failure)
                except StopIteration as stop:
                    result = stop.value
                    if not isinstance(result, (Layer, Weight)):
                        raise TypeError(
                            f"a direct-style layer function must return a Layer or a Weight, got {type(result).__name__}"
                        ) from None
                    stack.append((_K_DIRECT_DONE, tuple(held)))
                    cur = Do(FORWARD, result)
                    break
                finally:
                    inside_direct.reset(flag)
                if type(request) is AwaitLayers:
                    frame[3] = request.single
                    stack.append(frame)
                    layers = request.layers
                    cur = Do(FORWARD, layers[0]) if request.single else Do(ZIP, tuple(Do(FORWARD, x) for x in layers))
                    break
                try:
                    sending, failure = (yield Passthrough(request)), None
                except BaseException as exc:  # delivered to the coroutine, as the event loop would
                    sending, failure = None, exc
            descending = True
        elif tag == _K_DIRECT_DONE:
            tok = (frame[1], tok)  # the returned layer is released before the awaited ones
        elif tag == _K_ROOTS:
            recs = [records[d._a] for d in frame[1]]
            for rec in recs:
                rec.refcount += 1
            val, tok = tuple(rec.tape() for rec in recs), tuple(recs)
        elif tag == _K_ROOT:
            rec = records[frame[1]]
            rec.refcount += 1
            val, tok = rec.tape(), rec
        elif tag == _K_MAP:
            val = frame[1](val)
        elif tag == _K_BIND:
            stack.append((_K_BIND_DONE, tok))
            cur = frame[1](val)
            if not isinstance(cur, Do):
                raise TypeError(f"a function given to bind returned {type(cur).__name__}, not a Do")
            descending = True
        elif tag == _K_BIND_DONE:
            # Released right to left: the inner computation first.
            tok = (frame[1], tok)
        elif tag == _K_ZIP:
            frame[3].append(val)
            frame[4].append(tok)
            i = frame[2] + 1
            if i < len(frame[1]):
                frame[2] = i
                stack.append(frame)
                cur = frame[1][i]
                descending = True
            else:
                val, tok = tuple(frame[3]), tuple(frame[4])
        elif tag == _K_SHARED:
            entry = _Shared(val, tok)
            ev.shared[frame[1]] = entry
            tok = entry
        else:  # _K_FROM_DO: a layer built from a Do[Tape] has its tape
            assert tag == _K_FROM_DO
            if not isinstance(val, Tape):
                raise TypeError(f"the Do of {frame[1]!r} yielded {type(val).__name__}, not a Tape")
            ev.effects = True
            rec = _Record(val.data, None, (), val.backward is not None, frame[1])
            rec.tape_backward = val.backward
            rec.release = tok
            records[frame[1]] = rec


def _graph(ev: Evaluation, frame: Any, stack: list[Any]) -> Any:
    """Compute the records of a layer graph, in construction order.

    A layer is always built after its operands, so sorting the layers not yet
    evaluated by their construction serial gives a topological order: each is
    visited once to collect and once to compute, with no recursion.

    Returns None when done; `_SUSPENDED` when it met a layer built from a
    ``Do`` (the frames to resume are pushed, and the machine evaluates that
    ``Do`` first); or an awaitable that computes the whole graph on the worker
    pool, when the graph is coarse enough to pay for forking.
    """
    records = ev.records
    order: list[Any] | None = frame[2]
    resumed = order is not None
    if order is None:
        order = _collect(ev, frame[1])
        frame[2] = order
        if not order:
            return None
        if _cuda.loaded() and _cuda.on_device(records, order) and all(node._op is not None for node in order):
            # On a GPU the host only launches kernels: branches go to CUDA streams, not threads.
            _cuda.forward(order, ev.cuda_streams, lambda node: records.__setitem__(node, compute(ev, node, True)))
            return None
        if ev.workers > 1 and _parallel.worth_forking(ev, order):
            ev.forked = True
            frame[3] = len(order)
            return _parallel.forward(ev, order)
        frame[4] = time.perf_counter()
    for i in range(frame[3], len(order)):
        node = order[i]
        if resumed and node in records:  # a Do evaluated meanwhile may have computed it
            continue
        if node._op is None:
            frame[3] = i
            frame[4] = 0.0  # timing a graph that awaits measures the wait: don't
            stack.append(frame)
            stack.append((_K_FROM_DO, node))
            return _SUSPENDED
        records[node] = compute(ev, node, True)
    if frame[4]:
        _parallel.measured(ev, order, time.perf_counter() - frame[4])
    return None


def compute(ev: Evaluation, node: Any, count: bool) -> _Record:
    """The forward of one primitive layer whose operands are all computed.

    ``count``: take this consumer's hold on each operand here (the worker
    pool counts holds before it starts instead).
    """
    records = ev.records
    op = node._op
    inputs = node._inputs
    # One and two operands are nearly every node: unrolled, as this is the hot loop.
    if len(inputs) == 2:
        x, y = inputs
        kind = type(x)
        if kind is Layer or kind is Weight:
            rx = records[x]
            rx.refcount += count
            x = rx.value
            needs = rx.needs_grad
        else:
            rx, needs = None, False
        kind = type(y)
        if kind is Layer or kind is Weight:
            ry = records[y]
            ry.refcount += count
            y = ry.value
            needs = needs or ry.needs_grad
        else:
            ry = None
        args: tuple[Any, ...] = (x, y)
        ins: tuple[_Record | None, ...] = (rx, ry)
        kx, ky = type(x), type(y)
        # Beside a plain number (not a layer's value), an operand's delta has its shape.
        fits = op.elementwise and ((rx is None and kx in _PYTHON_NUMBERS) or (ry is None and ky in _PYTHON_NUMBERS))
        if kx is ky:
            if kx is np.ndarray:
                if op.same_dtype and x.dtype is not y.dtype:
                    _check_dtypes(node, args)
            elif kx not in _HOST and op.same_dtype and x.dtype != y.dtype:  # both from one other library (CuPy ...)
                _check_dtypes(node, args)
        elif (kx not in _HOST or ky not in _HOST) and kx not in _PYTHON_NUMBERS and ky not in _PYTHON_NUMBERS:
            args = _foreign_operands(node, args)  # (a Python number fits any library as it is)
    elif len(inputs) == 1:
        x = inputs[0]
        kind = type(x)
        if kind is Layer or kind is Weight:
            rx = records[x]
            rx.refcount += count
            x = rx.value
            needs = rx.needs_grad
        else:
            rx, needs = None, False
        args, ins = (x,), (rx,)
        fits = op.elementwise
    else:
        args, ins, needs = _operands(records, inputs, count)
        fits = False
        kinds = {type(a) for a in args}
        if not kinds <= _HOST:
            args = _foreign_operands(node, args)
        if op.same_dtype and (kinds != _ARRAYS_ONLY or len({a.dtype for a in args}) > 1):
            _check_dtypes(node, args)  # (NumPy arrays of one dtype pass without it)
    params = node._params
    try:
        out, vjps = op.rule(*args, *params) if params else op.rule(*args)
    except ValueError as exc:
        raise ShapeError(
            f"{op.name}: operands {_describe(args)} do not fit together ({exc}); layer built at {_where(node)}"
        ) from exc
    except Exception as exc:
        exc.add_note(f"monadl: in {op.name} of {_describe(args)}; layer built at {_where(node)}")
        raise
    if ev.check_finite and not _all_finite(out):
        raise NonFiniteError(
            f"{op.name} produced a NaN or an infinity from {_describe(args)}; layer built at {_where(node)}"
        )
    if not vjps:  # a rule without delta rules (stop_gradient): no delta flows through it
        needs = False
    return _Record(out, vjps if needs else None, ins, needs, node, fits)


_PYTHON_NUMBERS: Final = frozenset({float, int, bool})
_ARRAYS_ONLY: Final = {np.ndarray}


def _foreign_operands(node: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Operands not all NumPy: one library only (else `DeviceError`), and NumPy
    scalars as Python numbers, which every array library accepts."""
    xp = common_namespace(args, node._op.name)
    return args if xp is np else host_scalars_to_python(args)


def _all_finite(x: Any) -> bool:
    xp = namespace(x)
    return bool(xp.all(xp.isfinite(x)))


def _operands(
    records: dict[Any, _Record], inputs: tuple[Any, ...], count: bool
) -> tuple[tuple[Any, ...], tuple[_Record | None, ...], bool]:
    """Operand values and records of a node with any number of operands."""
    args: list[Any] = []
    ins: list[_Record | None] = []
    needs = False
    for x in inputs:
        kind = type(x)
        if kind is Layer or kind is Weight:
            rec = records[x]
            if count:
                rec.refcount += 1
            args.append(rec.value)
            ins.append(rec)
            needs = needs or rec.needs_grad
        else:
            args.append(x)
            ins.append(None)
    return tuple(args), tuple(ins), needs


def _collect(ev: Evaluation, roots: list[Any]) -> list[Any]:
    """The layers under ``roots`` not evaluated yet, in construction order.

    Weights met on the way get their records here. The walk stops at layers
    built from a ``Do``: what they need is evaluated when their ``Do`` runs.
    """
    records = ev.records
    order = list(dict.fromkeys(roots))
    seen = set(order)
    for node in order:  # the list grows while it is walked: breadth first
        for x in node._inputs:
            kind = type(x)
            if kind is Layer:
                if x not in seen and x not in records:
                    seen.add(x)
                    order.append(x)
            elif kind is Weight and x not in records:
                _weight_record(ev, x)
    order.sort(key=_serial)
    return order


_serial = attrgetter("_serial")


def _weight_record(ev: Evaluation, weight: Weight[Any, Any]) -> _Record:
    """A weight's record: its data as it is now; gradients only when training."""
    rec = _Record(weight._data, None, (), ev.train, weight)
    rec.is_weight = True
    ev.records[weight] = rec
    return rec


# ---- backward and release -------------------------------------------------------
def release(ev: Evaluation, token: Any, backward: bool) -> Machine:
    """Release a token; a record whose last hold goes runs its backward once."""
    if not ev.effects:  # primitives and weights only: nothing to close
        started = time.perf_counter()
        if backward and ev.forked:
            yield _parallel.backward(ev, token)
        elif backward:
            _sweep(ev)
        _parallel.settle(ev, time.perf_counter() - started if backward else 0.0)
        ev.finish()
        return
    work = [token]
    while work:
        t = work.pop()
        kind = type(t)
        if kind is _Record:
            t.refcount -= 1
            if t.refcount:
                continue
            if backward and t.delta is not None:
                if t.vjps is not None:
                    for r, g in input_deltas(ev, t):
                        r.delta = g if r.delta is None else r.delta + g
                elif t.tape_backward is not None:
                    t.tape_backward(t.delta)
            if not t.is_weight:
                t.delta = None
                t.vjps = None
            for r in t.inputs:
                if r is not None:
                    work.append(r)
            if t.release is not None:
                work.append(t.release)
        elif kind is tuple:
            work.extend(t)
        elif kind is _Shared:
            t.count -= 1
            if t.count == 0:
                work.append(t.release)
        elif kind is _UserRelease:
            if not t.done:
                t.done = True
                yield t.release(t.value)
        else:
            assert t is None, t
    _parallel.settle(ev, 0.0)  # the counted release runs here whether the forward forked or not
    ev.finish()


def _sweep(ev: Evaluation) -> None:
    """Back-propagate a pure evaluation (primitives and weights only) in one pass.

    Records enter ``ev.records`` after their operands, so in reverse insertion
    order each record comes after all its consumers: its delta is complete when
    it is reached. This is the reference-counted release of `release` without
    the counting, which a graph of primitives (no shared ``Do``, no resource,
    no direct-style code) does not need: each backward still runs once, with the
    summed delta.
    """
    check = ev.check_finite
    for rec in reversed(ev.records.values()):
        delta = rec.delta
        if delta is None:
            continue
        vjps = rec.vjps
        if vjps is None:
            continue
        if type(delta) is SparseRows:  # a sparse delta reached a layer: its rules expect arrays
            delta = delta.to_dense()
        fits = rec.fits
        i = 0  # (indexing the rules beats zipping or enumerating them here)
        for r in rec.inputs:
            if r is not None and r.needs_grad:
                try:
                    g = vjps[i](delta)
                    if not fits:
                        value = r.value
                        if type(g) is not np.ndarray or type(value) is not np.ndarray or g.shape != value.shape:
                            g = _fit(g, value)
                except Exception as exc:
                    _backward_note(exc, rec)
                    raise
                if check:
                    _check_delta(rec, g)
                r.delta = g if r.delta is None else r.delta + g
            i += 1  # noqa: SIM113
        rec.delta = None
        rec.vjps = None


def input_deltas(ev: Evaluation, rec: _Record) -> list[tuple[_Record, Any]]:
    """The backward of one primitive record: each operand's share of its delta,
    only for operands that lead to a weight, with broadcasting undone."""
    delta = rec.delta
    if type(delta) is SparseRows:  # a sparse delta reached a layer: its rules expect arrays
        delta = delta.to_dense()
    out = []
    for r, vjp in zip(rec.inputs, rec.vjps):
        if r is not None and r.needs_grad:
            try:
                g = vjp(delta) if rec.fits else _fit(vjp(delta), r.value)
            except Exception as exc:
                _backward_note(exc, rec)
                raise
            if ev.check_finite:
                _check_delta(rec, g)
            out.append((r, g))
    return out


def _fit(delta: Any, value: Any) -> Any:
    """``delta`` with broadcasting undone, so that it has the shape of ``value``."""
    shape = getattr(value, "shape", ())
    return delta if getattr(delta, "shape", ()) == shape else unbroadcast(delta, shape)


def _backward_note(exc: Exception, rec: _Record) -> None:
    exc.add_note(f"monadl: in the backward of {rec.node._op.name}, layer built at {_where(rec.node)}")


def _check_delta(rec: _Record, delta: Any) -> None:
    if not _all_finite(delta.rows if type(delta) is SparseRows else delta):
        raise NonFiniteError(
            f"the backward of {rec.node._op.name} produced a NaN or an infinity; layer built at {_where(rec.node)}"
        )


async def drive(machine: Machine) -> Any:
    """Run a machine generator on the current event loop.

    A failure of what it awaited goes back into the machine, which may hand
    it to a direct-style coroutine that awaited it.
    """
    pause = current_settings().pause_gc
    try:
        request = _advance(machine.send, None, pause)
        while True:
            try:
                result = await request
            except BaseException as exc:
                request = _advance(machine.throw, exc, pause)
            else:
                request = _advance(machine.send, result, pause)
    except StopIteration as stop:
        return stop.value
    finally:
        machine.close()


def drive_sync(machine: Machine) -> Any:
    """Run a machine that needs no event loop (a graph of primitives)."""
    try:
        request = _advance(machine.send, None, current_settings().pause_gc)
    except StopIteration as stop:
        return stop.value
    machine.close()
    if hasattr(request, "close"):
        request.close()
    raise RuntimeError("this computation awaits something: run it inside an event loop with await")


def _advance(step: Callable[[Any], Any], arg: Any, pause_gc: bool) -> Any:
    """One synchronous stretch of a machine, with the cyclic GC paused if asked
    (and if it is on: a caller who turned it off keeps it off)."""
    if not pause_gc or not gc.isenabled():
        return step(arg)
    gc.disable()
    try:
        return step(arg)
    finally:
        gc.enable()


async def abort(ev: Evaluation) -> None:
    """After a failure: close every direct-style coroutine still suspended and
    every resource still open, newest first."""
    for coroutine in reversed(ev.coroutines):
        coroutine.close()
    with anyio.CancelScope(shield=True):
        for held in reversed(ev.open):
            if not held.done:
                held.done = True
                with contextlib.suppress(Exception):  # the original failure is the one to report
                    await held.release(held.value)


# ---- entry points ------------------------------------------------------------------
def forward_backward(ev: Evaluation, root: Any) -> Machine:
    """Forward, seed the root's delta with ones, back-propagate; returns the value."""
    tape, token = yield from evaluate(ev, Do(FORWARD, root))
    if tape.backward is not None:
        tape.backward(_ones_like(tape.data))
    yield from release(ev, token, True)
    return tape.data


def _ones_like(value: Any) -> Any:
    # Not value * 0 + 1, which is NaN where the value is infinite.
    xp = namespace(value)
    return np.ones_like(value)[()] if xp is np else xp.ones_like(value)


async def train(root: Any) -> Any:
    ev = Evaluation(train=True)
    try:
        value = await drive(forward_backward(ev, root))
        grads = ev.weight_gradients()
        # Compute every step before committing any: a failing update changes nothing.
        steps = [(w, *_step(w, g)) for w, g in grads.items()]
        if _cuda.is_device_array(value):
            await _cuda.ready()
    except BaseException:
        await abort(ev)
        raise
    for weight, data, state in steps:
        weight._data = data
        weight._state = state
    return value


def _step(weight: Weight[Any, Any], grad: Any) -> tuple[Any, Any]:
    if type(grad) is SparseRows:
        return _sparse_step(weight, grad)
    old = weight._data
    update, state = weight._optimizer.update(grad, weight._state, old)
    if _is_temporary(update, old):
        new = np.add(update, old, out=update)  # one weight-sized array less to allocate and fill
    else:
        new = old + update
    dtype = old.dtype
    if isinstance(new, np.ndarray):
        new = new.astype(dtype, copy=False)
    elif isinstance(new, (np.generic, float, int)):
        new = dtype.type(new)
    else:  # an array of another library
        new = namespace(new).astype(new, dtype, copy=False)
    return new, state


def _is_temporary(update: Any, like: Any) -> bool:
    """Whether ``update`` is a NumPy array that nothing but the caller's name
    refers to (not optimizer state, not a gradient, not a view), shaped and
    typed like ``like``: then adding in place is safe. This is NumPy's own
    test for eliding temporaries, which a name defeats."""
    return (
        _COUNTS_EVERY_REFERENCE
        and type(update) is np.ndarray
        and update.nbytes >= _ELIDE_BYTES
        and sys.getrefcount(update) == 3  # the caller's name, our parameter, getrefcount's argument
        and type(like) is np.ndarray
        and update.dtype == like.dtype
        and update.shape == like.shape
        and update.flags.owndata
        and update.flags.writeable
    )


_ELIDE_BYTES: Final = 1 << 16  # below this, checking costs about what it saves
# From CPython 3.14 the interpreter may hold borrowed references that
# getrefcount does not count, so a count no longer proves an array private.
_COUNTS_EVERY_REFERENCE: Final = sys.implementation.name == "cpython" and sys.version_info < (3, 14)


def _sparse_step(weight: Weight[Any, Any], grad: SparseRows) -> tuple[Any, Any]:
    """Step only the rows a sparse delta touches.

    The optimizer sees those rows of the weight and of every state leaf shaped
    like the weight (moments, velocities), and the other rows keep theirs
    ("lazy" updates, as TensorFlow's lazy Adam); state that is not per row,
    such as a step count, is shared.
    """
    old = weight._data
    xp = namespace(old)
    if not hasattr(getattr(xp, "add", None), "at"):
        # No scatter in this library: step densely (every row, every row's state).
        update, state = weight._optimizer.update(grad.to_dense(), weight._state, old)
        return xp.astype(old + update, old.dtype, copy=False), state
    rows, summed = grad.summed()
    state_rows = _state_rows(weight._state, old.shape, rows)
    update, new_state_rows = weight._optimizer.update(summed, state_rows, old[rows])
    new = xp.asarray(old, copy=True)
    new[rows] = xp.astype(old[rows] + update, old.dtype, copy=False)
    return new, _put_state_rows(weight._state, new_state_rows, old.shape, rows)


def _state_rows(state: Any, shape: tuple[int, ...], rows: Any) -> Any:
    if is_array(state) and state.shape == shape:
        return state[rows]
    if isinstance(state, tuple):
        parts = [_state_rows(s, shape, rows) for s in state]
        return type(state)(*parts) if hasattr(state, "_fields") else tuple(parts)
    return state


def _put_state_rows(old: Any, new: Any, shape: tuple[int, ...], rows: Any) -> Any:
    if is_array(old) and old.shape == shape:
        full = namespace(old).asarray(old, copy=True)
        full[rows] = new
        return full
    if isinstance(old, tuple):
        parts = [_put_state_rows(o, n, shape, rows) for o, n in zip(old, new)]
        return type(old)(*parts) if hasattr(old, "_fields") else tuple(parts)
    return new


async def predict(root: Any) -> Any:
    ev = Evaluation(train=False)
    try:
        tape, token = await drive(evaluate(ev, Do(FORWARD, root)))
        await drive(release(ev, token, False))
        if _cuda.is_device_array(tape.data):
            await _cuda.ready()
    except BaseException:
        await abort(ev)
        raise
    return tape.data


async def run(do: Do[Any]) -> Any:
    ev = Evaluation(train=False)
    try:
        value, token = await drive(evaluate(ev, do))
        await drive(release(ev, token, False))
    except BaseException:
        await abort(ev)
        raise
    return value


@asynccontextmanager
async def acquire(do: Do[Any]) -> AsyncIterator[Any]:
    ev = Evaluation(train=False)
    try:
        value, token = await drive(evaluate(ev, do))
    except BaseException:
        await abort(ev)
        raise
    try:
        yield value
    except BaseException:
        await abort(ev)
        raise
    try:
        await drive(release(ev, token, False))
    except BaseException:
        await abort(ev)
        raise


def gradients_sync(root: Any) -> tuple[Any, dict[Weight[Any, Any], Any]]:
    """Value and weight gradients of a pure graph, without stepping any weight."""
    ev = Evaluation(train=True, may_fork=False)
    value = drive_sync(forward_backward(ev, root))
    return value, ev.weight_gradients()


async def gradients(root: Any) -> tuple[Any, dict[Weight[Any, Any], Any]]:
    """Value and weight gradients, without stepping any weight."""
    ev = Evaluation(train=True)
    try:
        value = await drive(forward_backward(ev, root))
    except BaseException:
        await abort(ev)
        raise
    return value, ev.weight_gradients()


def predict_sync(root: Any) -> Any:
    ev = Evaluation(train=False, may_fork=False)
    tape, token = drive_sync(evaluate(ev, Do(FORWARD, root)))
    drive_sync(release(ev, token, False))
    return tape.data


# ---- errors ---------------------------------------------------------------------
def _where(node: Any) -> str:
    return site_text(node._site)


def _describe(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        if isinstance(a, np.ndarray):
            parts.append(f"{a.dtype}{list(a.shape)}")
        elif isinstance(a, np.generic):
            parts.append(f"{a.dtype} scalar")
        elif is_array(a):
            parts.append(f"{library_name(a)} {_dtype_name(a.dtype)}{list(a.shape)}")
        else:
            parts.append(f"{type(a).__name__} {a!r}")
    return ", ".join(parts)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # array_api_strict.float32 -> float32


def _check_dtypes(node: Any, args: Sequence[Any]) -> None:
    first = None
    for a in args:
        if is_array(a) and a.ndim and namespace(a).isdtype(a.dtype, "real floating"):
            if first is None:
                first = a.dtype
            elif a.dtype != first:
                raise DTypeError(
                    f"{node._op.name}: operands {_describe(args)} mix {_dtype_name(first)} and {_dtype_name(a.dtype)} arrays; "
                    f"cast one with .astype first; layer built at {_where(node)}"
                )
