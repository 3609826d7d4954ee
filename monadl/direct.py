"""Direct style: ``await`` is Python's form of the paper's ``!``-notation.

Decorate an ``async def`` that returns a layer with `direct`, and calling it
gives a `Layer`. Inside it, ``await layer`` yields that layer's forward value
*within the evaluation that is running the decorated layer*, and
``await values(a, b)`` yields several at once, evaluated as one parallel
applicative. Nothing is evaluated twice: a layer that is awaited and also used
in the returned expression is computed once and back-propagated once. The
values are plain data, so ordinary ``if`` and ``for`` may depend on them.
A NumPy array among them is a read-only view of the evaluation's own array,
which the evaluation reads after the function returns: write into a copy.

>>> import anyio, numpy as np, monadl as ml
>>> w = ml.Weight(np.array([1.0, -2.0]))
>>> @direct
... async def larger_half(x: ml.ArrayLayer) -> ml.ScalarLayer:
...     a, b = await values(x[0], x[1])
...     return x[0] * 2.0 if a > b else x[1] * 2.0
>>> anyio.run(larger_half(w * 1.0).predict)
np.float64(2.0)

Any other ``await`` inside (I/O, ``anyio.sleep``, a black-box service) goes to
the event loop as usual. Where several examples run together (a batch of
them in one ``train()``), each step up to an ``await`` of layers runs within
one task, in its own copy of the context variables, and what it awaits
outside overlaps the other examples' work; a cancel scope may span awaits
outside monadl but not an ``await`` of layers (the step after it may run in
another task, where anyio's and trio's scopes cannot close; with one
example, the scope's cancellation would reach monadl's own waits, not the
function: `OperandError` says so at the await). The same holds for a task
group or a nursery (a cancel scope too), for ``asyncio.timeout`` and for
``asyncio.TaskGroup``. Put a timeout around ``train()`` or ``predict()``
instead; to overlap a service with the model's work, make the service a
layer and await it with the model's layers in one ``values(...)``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import sys
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextvars import ContextVar
from threading import get_ident
from typing import Any, Final, ParamSpec, TypeVar, final, overload

import numpy as np

from monadl._unawaited import Unawaited
from monadl.do import DIRECT, Do
from monadl.errors import OperandError
from monadl.layers._layer import Array, Expr, Layer
from monadl.layers._site import Site, caller_site
from monadl.layers._traced_now import TRACING

__all__ = ["direct", "read_only", "values"]

P = ParamSpec("P")
D = TypeVar("D")
G = TypeVar("G")
D1 = TypeVar("D1")
D2 = TypeVar("D2")
D3 = TypeVar("D3")
D4 = TypeVar("D4")
D5 = TypeVar("D5")


@final
class Step:
    """One step of a direct-style coroutine, as code inside it sees it
    (`inside_direct`): ``live`` is true only during that step (a task
    started inside copies the variable, and runs after the step: there it
    reads false); ``scope`` is the innermost cancel scope the step began in
    (`cancel_scope`); ``own_turn`` is set by a monadl evaluation nested in
    the step (``ml.gradients``, ``predict()``) while it gives the event loop
    a turn, so that the examples evaluated beside it wait for that step as
    for their reads, not as for something outside
    (`monadl.runtime.stepping.step_in_task`)."""

    __slots__ = ("live", "own_turn", "scope")

    def __init__(self, live: bool, scope: object) -> None:
        self.live = live
        self.scope = scope
        self.own_turn = False


inside_direct: Final[ContextVar[Step]] = ContextVar("monadl_inside_direct", default=Step(False, None))  # noqa: B039
"""The step of a direct-style coroutine that runs here, set by the machine while it steps one."""
_asyncio_states: list[Any] = []  # (anyio's task states on asyncio, found once)


def cancel_scope() -> object:
    """The current task's innermost cancel scope of anyio's or trio's (an
    object to compare by identity; asyncio's own ``asyncio.timeout`` is not
    one of them: `asyncio_scope_around`); None elsewhere. Read from each library's task state (about
    0.5 us on asyncio, 0.2 us on trio): no public call gives it, and where
    one of them changes, None (no check)."""
    if asyncio._get_running_loop() is not None:  # (no exception to raise where trio runs: it costs)
        if not _asyncio_states:
            states = getattr(sys.modules.get("anyio._backends._asyncio"), "_task_states", None)
            if states is None:
                return None
            _asyncio_states.append(states)
        state = _asyncio_states[0].get(asyncio.current_task())
        return None if state is None else getattr(state, "cancel_scope", None)
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return getattr(trio.lowlevel.current_task(), "_cancel_status", None)
        except RuntimeError:  # (no trio run here)
            return None
    return None


_ASYNCIO_SCOPES: Final[tuple[tuple[Callable[..., Any], str, bool, bool], ...]] = (
    (asyncio.Timeout.__aexit__, "an asyncio.timeout it opened", True, False),
    (asyncio.TaskGroup.__aexit__, "an asyncio.TaskGroup it opened", False, True),
)


def asyncio_scope_around(coroutine: Any) -> tuple[str, bool, bool] | None:
    """What of asyncio's own that cancels its task (``asyncio.timeout``,
    ``asyncio.TaskGroup``) a suspended direct-style coroutine opened around
    the await it waits in (``async with``, in it or in a coroutine it
    awaits), as `refused_scope`'s arguments; None where there is none or no
    asyncio.

    Neither is an anyio scope (`cancel_scope` does not see them), and their
    cancellation goes to a task, not a scope: it reached monadl's own wait
    (a bare ``CancelledError`` out of ``train()``) or the task that stepped
    another example (the timeout was lost). An ``async with`` keeps its
    ``__aexit__`` on the frame's stack, which the garbage collector's view
    of a suspended coroutine shows (a few microseconds an await of layers,
    on asyncio only)."""
    if asyncio._get_running_loop() is None:
        return None
    at = _position(coroutine)
    if at in _open_nothing:
        return None
    awaiting = coroutine
    while awaiting is not None:
        for held in gc.get_referents(awaiting):
            kind = type(held)
            if kind is types.MethodType:  # (Python 3.11 to 3.13: the bound __aexit__)
                held = held.__func__
            elif kind is not types.FunctionType:  # (later: the function, and the manager beside it)
                continue
            for exit_, scope, timeout, group in _ASYNCIO_SCOPES:
                if held is exit_:
                    return scope, timeout, group
        awaiting = getattr(awaiting, "cr_await", None) or getattr(awaiting, "gi_yieldfrom", None)
    if len(_open_nothing) >= 4096:
        _open_nothing.clear()
    _open_nothing.add(at)
    return None


_open_nothing: set[tuple[tuple[Any, int], ...]] = set()
"""The awaits (each frame's code and instruction along the chain) found
inside none of these scopes. Which ``async with`` blocks hold an instruction
is fixed by the code, so an await there is looked at once (0.4 us an await
of layers after, against 1.1 us for the walk: 2-4% of the control-flow
benchmark's direct style). Only the absence is kept: an ``async with`` whose
manager is chosen at run time (``async with a if x else b``) is missed where
the first pass chose another, never refused where it did not."""


def _position(coroutine: Any) -> tuple[tuple[Any, int], ...]:
    """Where a suspended coroutine waits: each frame's code and instruction, down its awaits."""
    at = []
    awaiting = coroutine
    while awaiting is not None:
        frame = getattr(awaiting, "cr_frame", None) or getattr(awaiting, "gi_frame", None)
        if frame is None:
            break
        at.append((frame.f_code, frame.f_lasti))
        awaiting = getattr(awaiting, "cr_await", None) or getattr(awaiting, "gi_yieldfrom", None)
    return tuple(at)


def refused_scope(scope: str, timeout: bool, group: bool) -> str:
    """The message of an ``await`` of layers inside ``scope`` (which the
    function opened): advice for a ``timeout``, for a task ``group``, or for
    both (anyio's scopes do not say which they are: a task group's is a
    cancel scope like any other)."""
    advice = []
    if timeout:
        advice.append("Put a timeout around train() or predict(), or around other awaits only.")
    if group:
        advice.append(
            "To overlap a service with the model's work, close the task group before this await, or make the "
            "service a layer, ml.Layer(ml.Do.from_async(service).map(ml.Tape)), and await it with the model's "
            "layers in one ml.values(...), which runs them concurrently."
        )
    return (
        f"an @ml.direct function awaits layers inside {scope}: its cancellation would reach "
        "monadl's own waits, not this function, and with several examples the step after this await may run "
        f"in another task, where it cannot close. {' '.join(advice)}"
    )


@final
class AwaitLayers(Unawaited):
    """What a direct-style coroutine yields to ask the machine for forward
    values; used as the values, or never awaited, it says so (`Unawaited`)."""

    __slots__ = ("layers", "single")

    def __init__(self, layers: tuple[Expr[Any, Any], ...], single: bool, site: Site | None = None) -> None:
        for layer in layers:
            if not isinstance(layer, Expr):
                raise TypeError(f"values(...) takes layers and weights, got {type(layer).__name__}")
        self.layers = layers
        self.single = single
        self.site = site  # (where ml.values was called, which its warning names if it is never awaited)
        self.pending = True

    def __await__(self) -> Generator[Any, Any, Any]:
        self.pending = False  # (its await began: no "never awaited" warning, cancelled or not)
        step = inside_direct.get()
        if not step.live:
            raise RuntimeError(
                "a Layer can be awaited only inside an @ml.direct function, during its evaluation, in the "
                "function's own task (not in a task it starts); elsewhere use `await layer.predict()`"
            )
        if (
            cancel_scope() is not step.scope
        ):  # (the step after it may run in another task; alone, its timeout reached monadl)
            raise OperandError(
                refused_scope(
                    "a cancel scope it opened (move_on_after, fail_after, CancelScope, or a task group or a "
                    "nursery, which opens one)",
                    True,
                    True,
                )
            )
        return (yield self)


def read_only(data: Any) -> Any:
    """What an await of layers hands the function for a forward value: a
    NumPy array as a read-only view of it, anything else as it is.

    The array is the evaluation's own: the rest of the evaluation reads it
    after the function returns (a backward reads a saved output, the
    returned layer its operands), and a weight's value is the weight's own
    memory. Written into, it changed this evaluation's loss and gradients,
    or a weight outside its step, silently (a new user's TBPTT reset
    ``h[ended] = 0``). A view costs about 0.2 us an array, where a copy
    would cost its size. CuPy's arrays have no read-only flag: they are
    handed as they are."""
    if type(data) is np.ndarray:
        view = data.view()
        view.setflags(write=False)
        return view
    return data


READ_ONLY_ADVICE: Final = (
    "ml.values(...) and `await layer` give an @ml.direct function read-only views of the evaluation's own "
    "arrays: what runs after the function returns (its backward pass too) reads them, and a weight's value is "
    "the weight's own memory. If the array written is one of them, write into a copy (`h = h.copy()`) or build "
    "a new array (`np.where(mask, 0.0, h)`)"
)
"""A note on NumPy's error for a write into a read-only array raised by a
direct-style function (`monadl.runtime.stepping.step_direct`): NumPy's own
message does not say where the array came from nor what to do."""


def note_read_only(error: ValueError) -> None:
    """Add `READ_ONLY_ADVICE` to NumPy's ``... is read-only`` error, once."""
    if str(error).endswith("is read-only") and READ_ONLY_ADVICE not in getattr(error, "__notes__", ()):
        error.add_note(READ_ONLY_ADVICE)


@final
class Passthrough:
    """An awaitable that hands one foreign yield of a coroutine to the event loop."""

    __slots__ = ("request",)

    def __init__(self, request: Any) -> None:
        self.request = request

    def __await__(self) -> Generator[Any, Any, Any]:
        return (yield self.request)


@overload
def values(a: Expr[D1, Any], /) -> Awaitable[tuple[D1]]: ...
@overload
def values(a: Expr[D1, Any], b: Expr[D2, Any], /) -> Awaitable[tuple[D1, D2]]: ...
@overload
def values(a: Expr[D1, Any], b: Expr[D2, Any], c: Expr[D3, Any], /) -> Awaitable[tuple[D1, D2, D3]]: ...
@overload
def values(
    a: Expr[D1, Any], b: Expr[D2, Any], c: Expr[D3, Any], d: Expr[D4, Any], /
) -> Awaitable[tuple[D1, D2, D3, D4]]: ...
@overload
def values(
    a: Expr[D1, Any], b: Expr[D2, Any], c: Expr[D3, Any], d: Expr[D4, Any], e: Expr[D5, Any], /
) -> Awaitable[tuple[D1, D2, D3, D4, D5]]: ...
@overload
def values(*layers: Expr[D1, Any]) -> Awaitable[tuple[D1, ...]]: ...
@overload  # (more than five, scalars and arrays: each either)
def values(*layers: Expr[float, float] | Expr[Array, Array]) -> Awaitable[tuple[float | Array, ...]]: ...
@overload
def values(*layers: Expr[Any, Any]) -> Awaitable[tuple[Any, ...]]: ...  # (more than five, of other kinds)
def values(*layers: Expr[Any, Any]) -> Awaitable[tuple[Any, ...]]:
    """Forward values of several layers at once, evaluated in parallel
    (use inside a `direct` function).

    A NumPy array among them is a read-only view of the evaluation's own
    array: what runs after the function returns reads it (the returned
    layer, the backward pass), and the value of a weight (or of a view of
    one) is the weight's memory. Writing into it raises NumPy's
    ``ValueError: assignment destination is read-only``; write into a copy
    (``h = h.copy()``) or build a new array (``np.where(mask, 0.0, h)``).
    The view stays read-only after the evaluation: copy a state carried to
    the next step before editing it in place.

    Without ``await`` it is an awaitable, not the values: an operator,
    ``if``, a conversion or NumPy on it raises a TypeError that says so,
    and one never awaited warns (a RuntimeWarning, as a coroutine does)
    where it is dropped. Inside an `monadl.operation` (traced, not async)
    it is refused with `OperandError`.

    >>> import anyio, numpy as np, monadl as ml
    >>> @direct
    ... async def reset(h: ml.ArrayLayer) -> ml.ScalarLayer:
    ...     (value,) = await values(h)
    ...     value = value.copy()
    ...     value[0] = 0.0
    ...     return ml.sum(h * value)
    >>> anyio.run(reset(ml.as_layer(np.array([1.0, 2.0]))).predict)
    np.float64(4.0)
    """
    if TRACING and get_ident() in TRACING:
        raise OperandError(
            f"operation {TRACING[get_ident()]}: the cell calls ml.values(...), which reads layers' values, "
            "while it is traced (once per signature, with no values, and a cell is no async def: nothing "
            "could await it): read values in an @ml.direct function outside the cell and pass what the cell "
            "branches on as an int or a string argument (each value its own trace), or leave the cell unmarked"
        )
    return AwaitLayers(layers, single=False, site=caller_site())


def direct(function: Callable[P, Coroutine[Any, Any, Expr[D, G]]]) -> Callable[P, Layer[D, G]]:
    """Turn ``async def f(...) -> Layer`` into ``def f(...) -> Layer``.

    The coroutine runs when (and each time) the returned layer is evaluated,
    once per evaluation however many consumers the layer has.
    """
    inner = inspect.unwrap(function)  # (a decorator's wrapper that returns the coroutine: its function)
    plain = inspect.isfunction(inner) or inspect.ismethod(inner)  # (not an object with an async __call__)
    if plain and not inspect.iscoroutinefunction(inner) and not inspect.iscoroutinefunction(function):
        raise TypeError(
            f"@ml.direct takes an async def (its awaits read layers' values); "
            f"{getattr(function, '__qualname__', function)!r} is not one"
        )

    @functools.wraps(function)
    def build(*args: P.args, **kwargs: P.kwargs) -> Layer[D, G]:
        return Layer(Do(DIRECT, functools.partial(function, *args, **kwargs)))

    return build
