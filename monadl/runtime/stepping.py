"""Stepping a direct-style coroutine: one `send`, or a run of them in the task
that awaits its foreign requests (trio ties a wait to the task that asked)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from monadl._unawaited import abandon_raised
from monadl.direct import (
    AwaitLayers,
    Passthrough,
    Step,
    asyncio_scope_around,
    cancel_scope,
    inside_direct,
    note_read_only,
    refused_scope,
)
from monadl.do import FORWARD, ZIP, Do
from monadl.errors import OperandError
from monadl.layers._layer import Layer
from monadl.layers._weight import Weight
from monadl.runtime import frames as F
from monadl.runtime.turns import turn_if_due

if TYPE_CHECKING:
    from monadl.runtime.evaluation import Evaluation

__all__ = ["direct_next", "step_direct", "step_each", "step_in_task"]


def step_direct(coroutine: Any, sending: Any, failure: BaseException | None, scope: object) -> tuple[bool, Any, bool]:
    """Send into a direct-style coroutine: ``(True, result, False)`` when it
    returned, else ``(False, what it yielded, own)``: an `AwaitLayers` or a
    request for the event loop, ``own`` where that is a turn that a monadl
    evaluation nested in the step gives the loop (`monadl.direct.Step`), a
    wait for nothing outside the step.
    ``scope``: the task's innermost cancel scope (`cancel_scope`) when the
    step began, before its first send (a foreign await may be inside a
    scope of its own when the step goes on: ``anyio.sleep`` on trio).

    An await of layers inside an ``asyncio.timeout`` or an
    ``asyncio.TaskGroup`` the coroutine opened is refused as anyio's scopes
    are (`AwaitLayers`), once it waits there, where its frame shows them:
    the error is raised at that await. NumPy's error for a write into a
    read-only array gets a note saying that the values it was given are
    read-only views (`note_read_only`)."""
    step = Step(True, scope)  # (not live once this step ends: a task the coroutine started may not await layers)
    flag = inside_direct.set(step)
    try:
        got = coroutine.send(sending) if failure is None else coroutine.throw(failure)
        while type(got) is AwaitLayers and (opened := asyncio_scope_around(coroutine)) is not None:
            got = coroutine.throw(OperandError(refused_scope(*opened)))
    except StopIteration as stop:
        return True, stop.value, False
    except ValueError as error:  # (a write into a value it was given: NumPy's message says not whose)
        note_read_only(error)
        abandon_raised(error)
        raise
    except BaseException as error:
        abandon_raised(error)
        raise
    finally:
        step.live = False
        inside_direct.reset(flag)
        failure = None  # (thrown in and raised again, its traceback holds this frame: a cycle of the evaluation)
    return False, got, step.own_turn


async def step_in_task(
    coroutine: Any,
    sending: Any,
    scope: object,
    before_waiting: Callable[[], None] | None = None,
    context: contextvars.Context | None = None,
) -> tuple[bool, Any]:
    """`step_direct` until the coroutine asks for layers or returns, awaiting
    its requests for the event loop in this task; ``before_waiting`` is
    called once, before the first that is foreign: not before a turn that
    an ``ml.gradients`` or ``predict()`` inside the step gives the loop, which
    waits for nothing outside the step (else the examples evaluated beside it
    went on without it, and which of their graphs merged, and so the last
    bits of the results, depended on when its turns came: on the clock).
    ``context``: where its sends run (a coroutine stepped beside others in
    one task keeps its context variables to itself, as in a task of its own). ``scope``: the task's innermost cancel
    scope (`cancel_scope`) as the step begins."""
    failure: BaseException | None = None
    while True:
        try:
            if context is None:
                done, got, own = step_direct(coroutine, sending, failure, scope)
            else:
                done, got, own = context.run(step_direct, coroutine, sending, failure, scope)
        finally:  # (raised again, its traceback holds this frame: held here, a cycle)
            failure = None
        if done or type(got) is AwaitLayers:
            return done, got
        if before_waiting is not None and not own:
            before_waiting()
            before_waiting = None
        try:
            sending, failure = await Passthrough(got), None
        except BaseException as exc:  # delivered to the coroutine, as the event loop would: a cancellation too
            sending, failure = None, exc


async def step_each(
    items: list[tuple[Any, Any, Any, contextvars.Context]],
    report: Callable[[tuple[Any, bool | None, Any]], None],
    elsewhere: Callable[[list[tuple[Any, Any, Any, contextvars.Context]]], None],
    ev: Evaluation | None = None,
) -> None:
    """Step the coroutines of ``items`` (``(fiber, coroutine, sending, context)``) one
    after another, in this task; ``report((fiber, ok, result))`` after each.
    A step that awaits something foreign says so first (``report((fiber,
    None, None))``) and goes on in this task, and the items after it (none,
    where it was the last) go to ``elsewhere`` (a task of their own), so
    every step still runs within one task and none waits for another's
    await. Each
    step runs in its coroutine's own context (`monadl.runtime.frames.Direct`),
    as it would in a task of its own: what one sets, the next coroutine does
    not see, and its own next step does.

    The interpreter waits for every step asked for but those that said so
    before it runs the parked graphs: which graphs run merged does not
    depend on the order the event loop runs its tasks in. Between two
    steps the event loop gets a turn where ``ev``'s is due (1,024 examples'
    steps held it 10-20 ms)."""
    scope = cancel_scope()  # (each step begins in it: read once for all)
    for k, (fiber, coroutine, sending, context) in enumerate(items):
        handed = False

        def hand_on(k: int = k, fiber: Any = fiber) -> None:
            nonlocal handed
            handed = True
            report((fiber, None, None))  # (its step waits for something foreign: no merged run waits for it)
            elsewhere(items[k + 1 :])

        try:
            result = await step_in_task(coroutine, sending, scope, hand_on, context)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:  # the interpreter hands it on: the original error (Ctrl-C too), not a group of one
            report((fiber, False, exc))
        else:
            report((fiber, True, result))
        if handed:
            return
        if ev is not None:
            await turn_if_due(ev)


def direct_next(frame: F.Direct, stack: list[Any], done: bool, got: Any) -> Do[Any]:
    """What a direct-style frame evaluates next: the layers it awaits, or the
    layer it returned."""
    if done:
        if not isinstance(got, (Layer, Weight)):
            raise TypeError(_not_a_layer(frame.coroutine, got))
        stack.append(F.DirectDone(tuple(frame.held)))
        return Do(FORWARD, got)
    frame.single = got.single
    stack.append(frame)
    layers = got.layers
    return Do(FORWARD, layers[0]) if got.single else Do(ZIP, tuple(Do(FORWARD, x) for x in layers))


def _not_a_layer(coroutine: Any, got: Any) -> str:
    """The message of a direct-style function that returned ``got``, not a
    layer: the function's name and line (its frame is gone: it returned)."""
    code = getattr(coroutine, "cr_code", None)
    name = "a direct-style layer function" if code is None else f"the @ml.direct function {code.co_qualname}"
    place = "" if code is None else f" (defined at {code.co_filename}:{code.co_firstlineno})"
    if got is None:
        return f"{name}{place} returned None; it must return a Layer or a Weight (a missing return?)"
    if type(got) is AwaitLayers:
        got.pending = False  # (said here: no "never awaited" warning besides)
        return (
            f"{name}{place} returned ml.values(...), an awaitable; it must return a Layer or a Weight (return "
            "the layer; `await ml.values(layer)` reads its value inside the function)"
        )
    return (
        f"{name}{place} returned a value of type {type(got).__name__}; it must return a Layer or a Weight"
        " (make plain data one with ml.as_layer(x))"
    )
