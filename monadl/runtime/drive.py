"""Driving an interpreter generator on the event loop, and cleaning up after it.

The interpreter yields five kinds of request: an awaitable (awaited here,
in this task), `CHECKPOINT` (the event loop is due a turn: other tasks run,
and a cancellation or Ctrl-C takes effect here), `Spawn` (a fiber's await, to
run concurrently in a task of this evaluation's task group), `Steps`
(fibers' direct-style coroutine steps, one after another in the order
asked for, in one task at a time: `_Stepper`), `NEXT` (no
fiber can run: wait for the next completion). The task group opens only when the first
fiber spawns, so an evaluation without concurrent effects costs no task. A failure of an awaited thing goes back into the interpreter, which
may hand it to a direct-style coroutine that awaited it; a failure that
leaves the interpreter cancels every spawned task and surfaces as itself.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import Any, Final, final

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from monadl._unawaited import abandon_suspended
from monadl.layers._traced_now import refuse_evaluating
from monadl.runtime.evaluation import READING, Evaluation
from monadl.runtime.process import advance
from monadl.runtime.requests import NEXT, Spawn, Steps
from monadl.runtime.schedule.inline import CHECKPOINT
from monadl.runtime.settings import current_settings
from monadl.runtime.stepping import step_each
from monadl.runtime.turns import TURNS, take_turn

__all__ = ["abort", "drive", "drive_sync", "synchronous"]

_synchronous: ContextVar[bool] = ContextVar("monadl_synchronous", default=False)


def synchronous() -> bool:
    """Whether the evaluation running here is driven with no event loop
    (`drive_sync`: ``check_grads``, ``predict_sync``): nothing may be awaited."""
    return _synchronous.get()


Machine = Generator[Any, Any, Any]


async def drive(ev: Evaluation, machine: Machine) -> Any:
    """Run ``machine`` (an interpreter generator of ``ev``) to its result."""
    refuse_evaluating()
    settings = current_settings()
    pause = settings.pause_gc and settings.tune_process
    interval = ev.yield_interval_s
    now = time.perf_counter()
    if now > TURNS.last + interval:  # (before anything is computed: a cancellation changes nothing)
        await take_turn()
        TURNS.last = now = time.perf_counter()
    ev.deadline = now + interval
    exits = AsyncExitStack()
    tasks: TaskGroup | None = None
    done: tuple[MemoryObjectSendStream[Any], MemoryObjectReceiveStream[Any]] | None = None
    stepper: _Stepper | None = None
    failure: BaseException | None = None
    ev.reads(True)
    reading = READING.set(ev)
    try:
        request = advance(machine.send, None, pause)
        while True:
            if request is CHECKPOINT:
                await take_turn()
                TURNS.last = time.perf_counter()
                ev.deadline = TURNS.last + interval
                request = advance(machine.send, None, pause)
            elif type(request) is Spawn or type(request) is Steps:
                if tasks is None:
                    done = anyio.create_memory_object_stream[Any](math.inf)
                    exits.push_async_callback(done[1].aclose)
                    exits.push_async_callback(done[0].aclose)
                    tasks = await exits.enter_async_context(anyio.create_task_group())
                    stepper = _Stepper(tasks, done[0].send_nowait, ev)
                assert done is not None and stepper is not None
                if isinstance(request, Spawn):
                    tasks.start_soon(_complete, done[0], request.fiber, request.awaitable)
                else:
                    stepper.ask(request.items)
                request = advance(machine.send, None, pause)
            elif request is NEXT:
                assert done is not None
                try:  # one already back: no turn of the event loop for it
                    completion = done[1].receive_nowait()
                except anyio.WouldBlock:
                    completion = await done[1].receive()
                    TURNS.last = time.perf_counter()
                    ev.deadline = TURNS.last + interval
                try:
                    request = advance(machine.send, completion, pause)
                finally:
                    completion = None  # (it may hold a step's failure: this frame would keep it in a cycle)
            else:
                try:
                    result = await request
                except BaseException as exc:
                    request = advance(machine.throw, exc, pause)
                else:
                    request = advance(machine.send, result, pause)
                TURNS.last = time.perf_counter()  # (an await that suspended, or not: as a turn)
                ev.deadline = TURNS.last + interval
    except StopIteration as stop:
        return stop.value
    except BaseException as exc:
        failure = exc
        if done is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
            _note_others(exc, done[1])
        raise
    finally:
        with contextlib.suppress(ValueError):  # (closed in another context: a coroutine its loop left, at exit)
            READING.reset(reading)
        ev.reads(False)
        machine.close()
        if stepper is not None:
            stepper.close()
        if tasks is not None:
            tasks.cancel_scope.cancel()  # siblings of a failure stop; their cancellation is not the error
        try:
            await exits.aclose()
        except anyio.get_cancelled_exc_class():
            # (the group's scope, closing while this task was cancelled from outside, raised a
            # cancellation of its own, 'Cancelled via cancel scope ...': the caller's, with its
            # message, task.cancel('why'), is the one to hand on)
            if not isinstance(failure, anyio.get_cancelled_exc_class()):
                raise
            raise failure from None
        finally:
            # The failure's traceback holds this frame: held here too, it made a cycle that kept the
            # whole evaluation (its records and arrays) until a full collection, which the tuned
            # collector runs rarely (a new user's failed steps: 60 of them held 4 GiB).
            failure = None


@final
class _Stepper:
    """Steps direct-style coroutines (`step_each`) in the order the
    interpreter asked for them, in one task at a time. A task per request
    stepped them in the order the event loop ran those tasks, random on
    trio: examples that drew from one random generator, or appended to one
    list, drew in another order every run. A step that awaits something
    foreign keeps its task; the steps after it, and those asked for later,
    go on in a new one, so none waits for another's await. A task whose
    steps are done waits for the next request (`ask` wakes it) until the
    evaluation ends (`close`): a task started every round cost two examples
    of 800 steps 10-15%."""

    __slots__ = ("ev", "idle", "queue", "report", "running", "tasks")

    def __init__(
        self,
        tasks: TaskGroup,
        report: Callable[[tuple[Any, bool | None, Any]], None],
        ev: Evaluation,
    ) -> None:
        self.ev = ev  # (whose deadline says when the steps give the event loop a turn)
        self.tasks = tasks
        self.report = report
        self.queue: deque[tuple[Any, Any, Any, Any]] = deque()
        self.running = False  # (a task steps the queue, or will: the next request joins it)
        self.idle: anyio.Event | None = None  # (set to wake the task that waits for the next request)

    def ask(self, items: list[tuple[Any, Any, Any, Any]]) -> None:
        self.queue.extend(items)
        if not self.running:
            self.running = True
            if self.idle is not None:  # (the task that stepped the last request: no new task a round)
                idle, self.idle = self.idle, None
                idle.set()
            else:
                self.tasks.start_soon(self._run)

    async def _run(self) -> None:
        handed = False

        def elsewhere(rest: list[tuple[Any, Any, Any, Any]]) -> None:
            nonlocal handed  # (this task waits for something foreign: a new one steps the rest)
            handed = True
            self.queue.extendleft(reversed(rest))
            self.tasks.start_soon(self._run)

        while True:
            while self.queue and not handed:
                items = list(self.queue)
                self.queue.clear()
                await step_each(items, self.report, elsewhere, self.ev)
            if handed:
                return
            self.running = False
            wake = self.idle = anyio.Event()
            await wake.wait()
            if not self.queue:  # (`close`: the evaluation is over)
                return

    def close(self) -> None:
        """End the task waiting for a request, as it would end after its last
        one: a task cancelled there held the evaluation in a cycle (its
        cancellation's traceback, its frame, this stepper) until a collection."""
        if self.idle is not None:
            idle, self.idle = self.idle, None
            idle.set()


SHOWN_OTHERS: Final = 3
"""How many of the other failures `_note_others` quotes."""


def _note_others(failure: BaseException, done: MemoryObjectReceiveStream[Any]) -> None:
    """Note on ``failure``, which is raised, the failures of other fibers
    already back (examples evaluated together whose direct-style steps ran
    in one task, each to its end: all of a step's failures are back when
    the interpreter meets the first). A new user's two failing examples of
    32 said nothing of the second. Those still running are cancelled, and
    unknown."""
    others: list[tuple[BaseException, str | None]] = []
    while True:
        try:
            fiber, ok, result = done.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            break
        if ok is False and result is not failure:
            others.append((result, fiber.example()))
    if others:
        shown = "; ".join(
            _first_line(error) + ("" if example is None else f", in {_path(example)}")
            for error, example in others[:SHOWN_OTHERS]
        )
        more = f", the first {SHOWN_OTHERS}" if len(others) > SHOWN_OTHERS else ""
        failure.add_note(
            f"monadl: {len(others)} other example{'s' if len(others) > 1 else ''} evaluated with this one "
            f"failed too{more}: {shown}"
        )
    others.clear()  # (their tracebacks hold frames: not kept past here)


def _path(example: str) -> str:
    """A fiber's `example` in short, each level's number alone: ``example 7,
    its example 1`` (examples evaluated inside an example, a recursion's
    calls, told apart from the outer examples: before, ``example 7`` each)."""
    return ", its ".join(part.split(" (")[0] for part in example.split("; in its "))


def _first_line(error: BaseException) -> str:
    """An error's type, the first line of its message and where it was raised."""
    lines = str(error).splitlines()
    text = type(error).__name__ + (f": {lines[0]}" if lines else "")
    tb = error.__traceback__
    if tb is None:
        return text
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{text} (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"


async def _complete(done: MemoryObjectSendStream[Any], fiber: Any, awaitable: Awaitable[Any]) -> None:
    try:
        value = await awaitable
    except anyio.get_cancelled_exc_class():
        raise
    except BaseException as exc:  # handed to the interpreter: the original error (Ctrl-C too), not a group of one
        done.send_nowait((fiber, False, exc))
    else:
        done.send_nowait((fiber, True, value))


def drive_sync(ev: Evaluation, machine: Machine) -> Any:
    """Run a machine that needs no event loop (a graph of primitives)."""
    settings = current_settings()
    ev.deadline = math.inf  # no event loop to give a turn to
    token = _synchronous.set(True)
    ev.reads(True)
    reading = READING.set(ev)
    try:
        request = advance(machine.send, None, settings.pause_gc and settings.tune_process)
    except StopIteration as stop:
        return stop.value
    finally:
        READING.reset(reading)
        ev.reads(False)
        _synchronous.reset(token)
    machine.close()
    close: Callable[[], Any] | None = getattr(getattr(request, "awaitable", request), "close", None)
    if close is not None:
        close()
    for made in ev.coroutines:  # (an @ml.direct function's, begun or not: closed, not left 'never awaited')
        made.coroutine.close()
    ev.coroutines.clear()
    raise RuntimeError(
        "this computation awaits something (an @ml.direct function's step, or an awaited effect), and it is "
        "evaluated with no event loop (ml.check_grads, gradients_sync and predict_sync are synchronous): "
        "evaluate it with await inside an event loop (await ml.gradients(loss, weights), await layer.predict())"
    )


async def abort(ev: Evaluation, failure: BaseException | None = None) -> None:
    """After ``failure``: close every direct-style coroutine still suspended and
    every resource still open, newest first. A release that raises is noted
    on ``failure`` (which stays the one raised) and every other release runs."""
    for direct in reversed(ev.coroutines):
        # (a finally or an async with that awaits in the closing coroutine: 'coroutine ignored
        # GeneratorExit', which stood in for the original failure and skipped every release below;
        # closed in its own context, where its `with` blocks and context variables are)
        with contextlib.suppress(Exception):
            abandon_suspended(direct.coroutine)  # (what it held unawaited, given up by the failure: no warning)
            try:
                direct.context.run(direct.coroutine.close)
            except RuntimeError:  # (its context entered: a failure raised from inside it) closed here
                direct.coroutine.close()
    pending = [held for held in reversed(ev.open) if not held.done]
    if not pending:  # (nothing to await: an abandoned coroutine closed at exit, with no event loop, ends here)
        return
    with anyio.CancelScope(shield=True):
        for held in pending:
            if not held.done:
                held.done = True
                try:
                    await held.release(held.value)
                except Exception as error:  # (the original failure is the one to report: this one beside it)
                    if failure is not None:
                        failure.add_note(
                            f"monadl: while releasing after this failure, a resource's release raised "
                            f"{type(error).__name__}: {error}"
                        )
