"""A goal of a program as a monadl layer: the weights bound to functors give
the axioms' values, and the run's gradient is the layer's backward pass.

A run (forward chaining) is one Python call. Under an event loop it starts
inline (a thread hop costs about 0.2 ms) but may take no longer than the
loop may wait (``ml.settings(yield_interval_s=...)``, 5 ms): a run still
going then is dropped and made again in a worker thread, and so is every
later run of that program, and of a goal of many axioms (`THREAD_AXIOMS`)
from the first. So the loop keeps its turns while a program chains: a
timeout or a cancellation around ``predict()`` or ``train()`` takes effect
at once, and the abandoned run stops at its next pop, changing nothing (a
run that never ends, ``a += -1 * a. a += 1.``, stops there too; bound it
with ``max_pops``). With no event loop (``ml.check_grads``) a run stays
inline. The backward, the tape's pops, runs in the backward pass as the
other layers' do."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, TypeAlias, TypeVar, final

import anyio.to_thread
import numpy as np

from monadl.do import Do
from monadl.dyna.syntax import Item
from monadl.errors import NonFiniteError
from monadl.layers import Expr, Layer, Weight
from monadl.layers._site import site_text
from monadl.runtime.drive import synchronous
from monadl.runtime.settings import current_settings
from monadl.tape import Tape

__all__ = [
    "Differentiable",
    "Source",
    "Timing",
    "bind_weight",
    "bound_data",
    "goal_layer",
    "stopping",
]


class Differentiable(Protocol):
    """A finished run that differentiates a goal with respect to its axioms.

    ``settled``: nothing pending would change the chart; ``converged``:
    settled, and no value went to infinity or NaN."""

    @property
    def settled(self) -> bool: ...

    @property
    def converged(self) -> bool: ...

    def gradient(self, goal: Item, *, derived: bool = False) -> dict[Item, float]:
        """d goal / d axiom for the axioms of the run."""
        ...


R = TypeVar("R", bound=Differentiable)


THREAD_AXIOMS: Final = 1000
"""A goal whose axioms (fixed ones and weights' entries) are this many or
more chains in a worker thread from its first run: at a few microseconds an
axiom its run takes milliseconds, and the hop (about 0.2 ms) is small beside it."""


@final
class Timing:
    """How long a program's last run took (its goal layers' forward chaining)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


Source: TypeAlias = "Expr[Any, Any] | np.ndarray[Any, Any] | float"
"""What ``weights`` binds a functor to: a `Weight` or a `Layer` (the entries of
its value are the axioms, and get their gradients; a layer computes them in
the graph, a PCFG's rule probabilities as ``ml.log_softmax`` of scores), or
plain data (fixed axioms)."""

Stop = Callable[[Any], bool]
"""A predicate on a run so far, checked after each pop (``stop`` of `Program.run`)."""


class _Abandoned(Exception):
    """Raised in a run that nothing waits for any more (its wait was
    cancelled), or that outran the loop's turn inline: it stops at once."""


def stopping(options: Mapping[str, Any], stop: Stop | None) -> dict[str, Any]:
    """A run's options with ``stop`` checked after each pop, before the options' own ``stop`` if any.

    >>> stopping({"max_pops": 3}, None)
    {'max_pops': 3}
    >>> both = stopping({"stop": lambda run: run > 2}, lambda run: run < 0)["stop"]
    >>> both(3), both(-1), both(1)
    (True, True, False)
    """
    own = options.get("stop")
    if stop is None:
        return dict(options)
    if own is None:
        return {**options, "stop": stop}
    return {**options, "stop": lambda run: stop(run) or own(run)}


def goal_layer(
    run: Callable[[dict[Item, float], Stop | None], R],
    value: Callable[[R], float],
    goal: Item,
    axioms: Mapping[Item, float] | None,
    weights: Mapping[Any, Source] | None,
    timing: Timing | None = None,
    check: Callable[[Mapping[Any, Source]], None] | None = None,
) -> Layer[float, float]:
    """A goal's value as a scalar layer over the weights bound to functors
    (what `Program.goal` and `ArrayProgram.goal` return). A run that
    settled without converging (a value went to infinity or NaN) is a
    `NonFiniteError`: its goal's value is no sum's.

    Args:
        run: runs the program from the axioms' values, checking the given
            `Stop` (if not None) after each pop (`stopping`).
        value: the goal's value in a finished run.
        goal: the item differentiated.
        axioms: fixed axioms.
        weights: functor -> `Source`: the axiom ``f(i, j)`` is the entry ``[i, j]`` of its value.
        timing: the program's, shared by its goal layers: a run that took
            longer than the loop may wait sends the next ones to a thread.
        check: refuses bindings (`check_goal`), called on the layers'
            values once computed (with the other bindings as given).

    >>> import anyio
    >>> from monadl.dyna.scalar import Program
    >>> from monadl.dyna.syntax import Rule
    >>> p = Program([Rule(("y",), [("w", "I"), ("x", "I")])])
    >>> w = Weight(np.array([1.0, 2.0]))
    >>> y = goal_layer(lambda values, stop: p.run(values, stop=stop), lambda run: run.chart[("y",)], ("y",), {("x", 0): 3.0, ("x", 1): 4.0}, {"w": w})
    >>> anyio.run(y.predict)
    np.float64(11.0)
    """
    bound = dict(weights or {})
    fixed = dict(axioms or {})
    functors = list(bound)
    known = {f: bound_data(f, x) for f, x in bound.items()}
    computed = [f for f, data in known.items() if data is None]  # (layers: values known when they ran)

    def forward(tapes: tuple[Tape[Any, Any], ...], stop: Stop | None) -> Tape[float, float]:
        if computed and check is not None:
            check({**bound, **{f: np.asarray(t.data) for f, t in zip(functors, tapes) if f in computed}})
        values = dict(fixed)
        dtypes = []
        for functor, tape in zip(functors, tapes):
            data = np.asarray(tape.data)
            dtypes.append(data.dtype)
            for position in np.ndindex(data.shape):
                values[(functor, *position)] = float(data[position])
        done = run(values, stop)
        result = value(done)
        if dtypes and np.result_type(*dtypes).kind == "f":  # (the run's floats: a scalar of the weights' dtype)
            result = np.result_type(*dtypes).type(result)
        if done.settled and not done.converged:  # (an early stop, with max_pops or stop, is the user's)
            raise NonFiniteError(
                f"goal {goal} (its layer built at {site_text(made._site)}): the program's run reached no fixpoint: "
                "values went to infinity or NaN "
                f"(the goal's is {result}): the sum along a cycle of weight 1 or more diverges"
            )
        wanted = [t for t in tapes if t.backward is not None]
        if not wanted:
            return Tape(result)
        # The gradient now, where the run was made: in its worker thread for a long
        # run, not in the backward on the event loop's thread (as long as the run);
        # an abandoned run stops first.
        if stop is not None:
            stop(done)
        grads = done.gradient(goal)

        def backward(delta: float) -> None:
            for functor, tape in zip(functors, tapes):
                if tape.backward is None:
                    continue
                data = np.asarray(tape.data)
                g = np.zeros(data.shape, dtype=data.dtype)
                for position in np.ndindex(data.shape):
                    g[position] = grads.get((functor, *position), 0.0)
                tape.backward(g * delta if data.ndim else (g * delta)[()])

        return Tape(result, backward)

    measured = Timing() if timing is None else timing

    def timed(tapes: tuple[Tape[Any, Any], ...], stop: Stop | None) -> Tape[float, float]:
        started = time.perf_counter()
        try:
            return forward(tapes, stop)
        finally:
            measured.seconds = time.perf_counter() - started

    def inline(tapes: tuple[Tape[Any, Any], ...]) -> Do[Tape[float, float]]:
        budget = current_settings().yield_interval_s
        if synchronous() or budget == float("inf"):  # (no loop to keep turns for, or never a turn)
            return Do.pure(timed(tapes, None))
        try:
            return Do.pure(timed(tapes, _within(budget)))
        except _Abandoned:  # (longer than the loop may wait: made again where the loop keeps its turns)
            return in_a_thread(tapes)

    def in_a_thread(tapes: tuple[Tape[Any, Any], ...]) -> Do[Tape[float, float]]:
        if synchronous():  # (no event loop to keep turns for, nor to await a thread)
            return Do.pure(timed(tapes, None))
        return Do.from_async(lambda: _threaded(timed, tapes))

    entries = len(fixed) + sum(data.size for data in known.values() if data is not None)

    def where(tapes: tuple[Tape[Any, Any], ...]) -> Do[Tape[float, float]]:
        # (decided at each run: a layer built once and trained often follows its program's last run)
        if measured.seconds <= current_settings().yield_interval_s and entries < THREAD_AXIOMS:  # (short)
            return inline(tapes)
        return in_a_thread(tapes)

    def source(x: Source) -> Do[Tape[Any, Any]]:
        return x.forward() if isinstance(x, Expr) else Do.pure(Tape(np.asarray(x)))

    made: Layer[float, float] = Layer(Do.gather(source(bound[f]) for f in functors).bind(where))
    return made


def _within(seconds: float) -> Stop:
    """A `Stop` that abandons the run (`_Abandoned`) once it has taken ``seconds``."""
    deadline = time.perf_counter() + seconds

    def stop(run: object) -> bool:
        if time.perf_counter() > deadline:
            raise _Abandoned
        return False

    return stop


async def _threaded(
    timed: Callable[[tuple[Tape[Any, Any], ...], Stop | None], Tape[float, float]], tapes: tuple[Tape[Any, Any], ...]
) -> Tape[float, float]:
    """``timed(tapes, stop)`` in a worker thread, the event loop keeping its
    turns; a cancelled wait abandons it, and the run stops at its next pop."""
    abandoned = threading.Event()

    def stop(run: object) -> bool:
        if abandoned.is_set():
            raise _Abandoned
        return False

    try:
        return await anyio.to_thread.run_sync(timed, tapes, stop, abandon_on_cancel=True)
    finally:
        abandoned.set()  # (done, or cancelled: then nothing reads the run, so it stops)


def bound_data(functor: Any, source: Source) -> np.ndarray[Any, Any] | None:
    """What a functor is bound to, as an array: a weight's data or plain
    data; None for a layer (its value is known when it ran). Anything else
    is refused, saying what a functor takes.

    >>> bound_data("x", Weight(np.ones(2))), bound_data("x", 2.0), bound_data("x", Weight(np.ones(2)) * 2.0)
    (array([1., 1.]), array(2.), None)
    >>> bound_data("x", "0.5")
    Traceback (most recent call last):
    ...
    TypeError: weights['x'] is a str: a functor is bound to a Weight, a Layer or an array of numbers, whose entries are its axioms
    """
    if isinstance(source, Weight):  # (for its shape and axes: the library reads it, not a cell, so not ``.data``)
        return np.asarray(source._data)
    if isinstance(source, Expr):
        return None
    data = np.asarray(source)
    if not (np.issubdtype(data.dtype, np.number) or data.dtype == np.bool_):
        raise TypeError(
            f"weights[{functor!r}] is a {type(source).__name__}: a functor is bound to a Weight, a Layer or an "
            "array of numbers, whose entries are its axioms"
        )
    return data


def bind_weight(functor: str, weight: Weight[Any, Any]) -> dict[str, Weight[Any, Any]]:
    """``{functor: weight}``: the axioms ``functor(*index)`` are the weight's entries.

    >>> w = Weight(np.zeros(2))
    >>> bind_weight("edge", w) == {"edge": w}
    True
    """
    return {functor: weight}
