"""The entry points: ``train``, ``predict``, ``gradients``, ``Do.run``, ``Do.acquire``.

Each runs one evaluation inside `_transaction`: if anything fails or is
cancelled before the end, every direct-style coroutine still suspended is
closed and every resource still open is released, and no weight changes
(``train`` commits its steps only after everything else succeeded).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager, suppress
from math import prod
from typing import Any, Final

import numpy as np

from monadl._namespace import namespace
from monadl.deltas import PIECE_ROWS, Outer, SparseRows
from monadl.do import FORWARD, Do
from monadl.errors import NoGradientError, ShapeError
from monadl.layers._recording import RECORDING
from monadl.layers._site import site_text
from monadl.layers._weight import Weight
from monadl.optim._sgd import steps_from_factors
from monadl.optim.apply import Prepared, consume_gradients, current, prepare, stateful
from monadl.runtime import process
from monadl.runtime.drive import abort, drive, drive_sync
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.interpret import evaluate
from monadl.runtime.nested import refuse_inside_evaluation
from monadl.runtime.node import where
from monadl.runtime.schedule import cuda, inline, pool
from monadl.runtime.settings import current_settings
from monadl.runtime.turns import before_commit, turn_if_due

__all__ = [
    "acquire",
    "gradients",
    "gradients_sync",
    "predict",
    "predict_sync",
    "refuse_inside_evaluation",
    "run",
    "train",
]

Machine = Generator[Any, Any, Any]


@asynccontextmanager
async def _transaction(ev: Evaluation) -> AsyncIterator[None]:
    """Evaluate-then-commit-or-abort: on any failure, clean ``ev`` up and re-raise.
    An ``ml.loom()`` block open around the run records none of its calls
    (an ``@ml.direct`` body's, which the run itself reads)."""
    recording = None if RECORDING.get() is None else RECORDING.set(None)
    try:
        yield
    except BaseException as failure:
        await abort(ev, failure)
        raise
    finally:
        if recording is not None:
            with suppress(ValueError):  # (a coroutine closed outside the context it ran in)
                RECORDING.reset(recording)
        # (their frames hold the contexts they ran in, which hold the evaluation: a cycle, kept
        # until a full collection, of the evaluation's records and arrays)
        ev.coroutines.clear()


async def train(root: Any) -> Any:
    """Forward, backward, and one optimizer step for every weight reached.

    A loss that sends a gradient to no weight at all raises
    `NoGradientError` (`_no_gradient`): there is nothing to step.
    """
    refuse_inside_evaluation("train()")
    settings = current_settings()
    process.first_use(settings.tune_process)
    ev = Evaluation(train=True)
    async with _transaction(ev):
        value = await drive(ev, forward_backward(ev, root, scalar=True))
        if cuda.is_device_array(value):
            await cuda.ready()
        await before_commit(ev)  # a cancelled train() changes nothing, a deadline passed in its last work too
        grads = ev.weight_gradients(factored=True)
        if not grads:
            raise NoGradientError(_no_gradient(root, value, ev.unreached), value)
        if await _multiplied_ahead(ev, grads):
            await before_commit(ev)
        ready: dict[Weight[Any, Any], Prepared] | None = None
        if _long(grads):
            ready = await _prepare(ev, grads)
            await before_commit(ev)  # (a deadline passed in the last of the steps computed ahead)
        consume_gradients(grads, finite=settings.finite_steps, ready=ready)
    if settings.tune_process:
        process.fit_gc(ev.nodes)
    return value


def _no_gradient(root: Any, value: Any, read: list[Weight[Any, Any]]) -> str:
    """Why a ``train()`` steps nothing, and what to look at: the loss's line,
    its value, and the weights its forward read only as data, if any."""
    number = value.item() if hasattr(value, "item") else value
    shown = f"{number}: a mean over no elements, a division by a count of 0?" if number != number else f"{number}"
    head = f"train() of the loss built at {where(root)}: no gradient reaches any Weight, so nothing was stepped"
    if not read:
        why = (
            f"its forward read no weight at all: the loss is a constant ({shown}). Was the batch empty, or "
            "without anything to predict (series of length 0 or 1, no targets)?"
        )
    else:
        sites = ", ".join(site_text(w._site) for w in read[:3]) + (
            f" and {len(read) - 3} more" if len(read) > 3 else ""
        )
        why = (
            f"its forward read {len(read)} weight{'s' * (len(read) != 1)} (made at {sites}) only as data, so the "
            f"loss ({shown}) is a constant to them: through ml.stop_gradient (estimate.frozen), as values read with "
            "ml.values, or into a black box (a Do.from_async effect)?"
        )
    return (
        f"{head}; {why} To skip batches that have nothing to train, test the batch before building its loss, or "
        "catch ml.NoGradientError (its .value is the loss); predict() gives a value without a step"
    )


PREPARE_ELEMENTS: Final = 1 << 18
"""Weights of optimizers with state, in elements, from which a commit
computes their steps ahead, with turns for the event loop between them (at
Adam's 8 ns an element, about 2 ms)."""


MULTIPLY_AHEAD: Final = 1 << 23
"""Multiply-adds of a weight's delta kept as factors (its rows times its
elements) from which a commit multiplies them ahead, in pieces of
`MULTIPLY_PIECE`, with turns for the event loop between them: the merged runs
of 1,024 direct-style examples, 17,583 rows of a 64 x 64 weight's factors,
held it 45 ms in one commit. Not where the commit adds the product into the
weight's data as it steps it (`_added_in_commit`)."""

MULTIPLY_PIECE: Final = 1 << 26
"""Multiply-adds of a piece of `MULTIPLY_AHEAD`'s products (`Outer.pieces`):
about 1.5-5 ms on the project's VM, one thread, float32. (Pieces of 4M each
made a weight-sized sum of a few rows' products: a parser's 3,072 x 1,024
weight's delta of 228 rows, 228 pieces, took 1.3 s against one product's
9 ms, and its batch of 32 sentences at hidden size 1,024 ran 1.5x faster
than one by one, not 5x.)"""


FACTORS_IN_COMMIT: Final = 1 << 27
"""Multiply-adds of a plain-SGD weight's delta of fewer than `PIECE_ROWS`
rows kept as factors up to which its commit takes it as they are
(`_added_in_commit`): about 4 ms on the project's VM, one thread."""


def _added_in_commit(weight: Weight[Any, Any], grad: Outer, rows: int, work: int) -> bool:
    """Whether a commit adds ``grad``'s product into ``weight``'s data as it
    steps it, one pass over the data (plain SGD from few rows' factors:
    `monadl.optim._sgd.factored_step`): multiplied ahead, it is a product
    into a fresh array, read again to add and to check, and an MLP's step of
    16 to 32 rows through 512 x 512 to 1,024 x 1,024 weights took 1.7-2x as
    long. Up to `FACTORS_IN_COMMIT`, the event loop's wait for that one
    product."""
    return rows < PIECE_ROWS and work <= FACTORS_IN_COMMIT and not stateful(weight) and steps_from_factors(weight, grad)


async def _multiplied_ahead(ev: Evaluation, grads: dict[Weight[Any, Any], Any]) -> bool:
    """Whether some of ``grads`` were deltas kept as factors of `MULTIPLY_AHEAD`
    multiply-adds or more, NumPy's, now multiplied (`Outer.pieces`, a turn
    whenever one is due), for the commit to step by the products."""
    done = False
    for weight, grad in grads.items():
        if type(grad) is Outer and type(grad.lefts[0]) is np.ndarray:
            rows = sum([left.shape[0] for left in grad.lefts])
            work = rows * prod(grad.shape)
            if work >= MULTIPLY_AHEAD and not _added_in_commit(weight, grad, rows, work):
                pieces = grad.pieces(MULTIPLY_PIECE)
                while True:
                    try:
                        next(pieces)
                    except StopIteration as product:
                        grads[weight] = product.value
                        break
                    await turn_if_due(ev)
                done = True
    return done


def _long(grads: dict[Weight[Any, Any], Any]) -> bool:
    """Whether a commit's steps of optimizers with state are long enough to be
    computed ahead (`PREPARE_ELEMENTS`): a loop, no list, no coroutine, since
    every step of a small model pays it."""
    elements = 0
    for w, g in grads.items():
        if stateful(w) and type(g) is not SparseRows:  # (a table's sparse step is its rows': in the commit)
            data = w._data
            elements += data.size if type(data) is np.ndarray else w.size  # (a tensor's size is a method)
    return elements >= PREPARE_ELEMENTS


async def _prepare(ev: Evaluation, grads: dict[Weight[Any, Any], Any]) -> dict[Weight[Any, Any], Prepared]:
    """The steps of weights whose optimizers keep state, computed one by one
    with a turn for the event loop whenever one is due (16 Adam weights of
    512 x 512 held it 33 ms in one commit), for the commit to write all at
    once."""
    heavy = [w for w in grads if stateful(w)]
    ready: dict[Weight[Any, Any], Prepared] = {}
    for _ in range(3):  # (again for those another commit wrote meanwhile: another train() on this loop)
        for weight in heavy:
            ready[weight] = prepare(weight, grads[weight])
            await turn_if_due(ev)
        heavy = [w for w in heavy if not current(w, ready[w])]
        if not heavy:
            break
    return ready


async def gradients(
    root: Any,
    on_gradient: Callable[[Weight[Any, Any], Any], None] | None = None,
    on_reached: Callable[[list[Weight[Any, Any]]], None] | None = None,
) -> tuple[Any, dict[Weight[Any, Any], Any]]:
    """Value and weight gradients (of the sum, if not a scalar), without a step.

    ``on_gradient(weight, gradient)``, if given, is called once per weight
    with a gradient, the moment that gradient is final, while the backward
    pass goes on (data parallelism starts reducing it then), on the event
    loop's thread. A backward forked onto the worker pool tells it nothing;
    every gradient is in the returned dict all the same. ``on_reached``, if
    given, is called once between the forward and the backward with the
    weights the forward reached: no other weight will have a gradient.
    """
    tune = current_settings().tune_process  # (as train() and predict(): a clipping loop calls neither)
    process.first_use(tune)
    ev = Evaluation(train=True)
    ev.on_gradient = on_gradient
    async with _transaction(ev):
        value = await drive(ev, forward_backward(ev, root, scalar=False, reached=on_reached))
    if tune:
        process.fit_gc(ev.nodes)
    return value, ev.weight_gradients()


def gradients_sync(root: Any) -> tuple[Any, dict[Weight[Any, Any], Any]]:
    """`gradients` of a pure graph, with no event loop."""
    ev = Evaluation(train=True, may_fork=False)
    value = drive_sync(ev, forward_backward(ev, root, scalar=False))
    return value, ev.weight_gradients()


async def predict(root: Any) -> Any:
    """The forward value of a layer."""
    tune = current_settings().tune_process
    process.first_use(tune)
    ev = Evaluation(train=False)
    async with _transaction(ev):
        value = await drive(ev, _forward_only(ev, Do(FORWARD, root)))
        if cuda.is_device_array(value.data):
            await cuda.ready()
    if tune:
        process.fit_gc(ev.nodes)
    return value.data


def predict_sync(root: Any) -> Any:
    """`predict` of a pure graph, with no event loop."""
    ev = Evaluation(train=False, may_fork=False)
    return drive_sync(ev, _forward_only(ev, Do(FORWARD, root))).data


async def run(do: Do[Any]) -> Any:
    """Acquire ``do`` in a fresh evaluation, release it, return its value."""
    ev = Evaluation(train=False)
    async with _transaction(ev):
        return await drive(ev, _forward_only(ev, do))


@asynccontextmanager
async def acquire(do: Do[Any]) -> AsyncIterator[Any]:
    """``do``'s value, alive (its resources open) inside the block."""
    ev = Evaluation(train=False)
    async with _transaction(ev):
        value, token = await drive(ev, evaluate(ev, do))
        yield value
        await drive(ev, release(ev, token, False))


# ---- the machines ---------------------------------------------------------------------
def forward_backward(
    ev: Evaluation, root: Any, scalar: bool, reached: Callable[[list[Weight[Any, Any]]], None] | None = None
) -> Machine:
    """Forward, seed the root's delta with ones, back-propagate; returns the value.

    ``reached``, if given, is told the weights the forward reached, before the backward.
    """
    tape, token = yield from evaluate(ev, Do(FORWARD, root))
    data = tape.data
    if scalar and prod(getattr(data, "shape", ())) != 1:  # (not ``size``: PyTorch's is a method)
        raise ShapeError(
            f"train() needs a scalar loss, got an array of shape {list(data.shape)} from the "
            f"{'weight made' if isinstance(root, Weight) else 'layer built'} at {where(root)}; "
            "reduce it first (ml.sum or ml.mean), as PyTorch's backward() asks"
        )
    if reached is not None:
        reached([rec.node for rec in ev.records.values() if rec.is_weight])
    if tape.backward is not None:
        tape.backward(_ones_like(data))
    yield from release(ev, token, True)
    return data


def _forward_only(ev: Evaluation, do: Do[Any]) -> Machine:
    value, token = yield from evaluate(ev, do)
    yield from release(ev, token, False)
    return value


def release(ev: Evaluation, token: Any, backward: bool) -> Machine:
    """The end of an evaluation: back-propagate (if asked) and release everything.

    A pure evaluation takes the fast path, one reverse sweep over its records
    (or the worker pool's backward, if its forward forked); otherwise the
    paper's counted release.
    """
    timed = ev.workers > 1
    started = time.perf_counter() if timed else 0.0
    if ev.effects:
        yield from inline.release(ev, token, backward)
    elif backward and ev.forked:
        yield pool.backward(ev, token)
    elif backward and ev.on_gradient is not None:
        yield from inline.sweep_notifying(ev)
    elif backward:
        yield from inline.sweep(ev)
    if timed:
        pool.settle(ev, time.perf_counter() - started if backward and not ev.effects else 0.0)
    ev.finish()


def _ones_like(value: Any) -> Any:
    # Not value * 0 + 1, which is NaN where the value is infinite.
    xp = namespace(value)
    return np.ones_like(value)[()] if xp is np else xp.ones_like(value)
