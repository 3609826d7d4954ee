"""The event loop's turns: when the runtime gives one, and how.

A driver (`monadl.runtime.drive`) gives a turn when its machine asks or its
evaluation's deadline has passed; between pieces of work done outside the
machine (a commit's steps) a turn is given when due (`turn_if_due`); and
before a ``train()`` commits, a cancellation or a deadline that passed is
raised, so that it commits nothing (`before_commit`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Final, final

import anyio
import anyio.lowlevel

from monadl.direct import inside_direct

if TYPE_CHECKING:
    from monadl.runtime.evaluation import Evaluation

__all__ = ["TURNS", "before_commit", "take_turn", "timer_due", "turn_if_due"]


@final
class _Turns:
    """When a driver last gave the event loop a turn (`time.perf_counter`),
    across evaluations: a loop of short ones (``await loss.train()`` of a
    fraction of a millisecond, again and again) never reaches one's own
    deadline and, awaiting nothing that suspends, would starve the loop."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0.0


TURNS: Final = _Turns()


async def turn_if_due(ev: Evaluation) -> None:
    """A turn for the event loop if ``ev``'s is due: between pieces of work
    done outside its machine (the commit's steps, `monadl.runtime.entry`)."""
    if time.perf_counter() > ev.deadline:
        await _turn_for(ev)


async def before_commit(ev: Evaluation) -> None:
    """Raise a cancellation that came before a ``train()``'s commit, so that
    it commits nothing: one asked for (`anyio.lowlevel.checkpoint_if_cancelled`),
    and a deadline that has passed, even in a stretch of work shorter than
    the yield interval, with no turn after it (a backward's last VJPs, fewer
    than a look at the clock waits for: a new user's trial, a deadline at 60%
    of a loom block's step, saw 3 of 3 steps commit and no timeout), which
    only a turn delivers: anyio's and trio's deadlines, and on asyncio a timer
    that is due (``asyncio.timeout``'s). Also the turn that is due
    (`turn_if_due`)."""
    loop = asyncio._get_running_loop()  # (None on trio)
    if (
        time.perf_counter() > ev.deadline
        or anyio.current_time() >= anyio.current_effective_deadline()
        or (loop is not None and timer_due(loop))
    ):
        await _turn_for(ev)
    await anyio.lowlevel.checkpoint_if_cancelled()


async def _turn_for(ev: Evaluation) -> None:
    """A turn, and ``ev``'s next one due an interval after it."""
    await take_turn()
    TURNS.last = time.perf_counter()
    ev.deadline = TURNS.last + ev.yield_interval_s


async def take_turn() -> None:
    """A turn for the event loop: other tasks run, and a timeout, a
    cancellation or Ctrl-C takes effect here (it raises).

    On asyncio a timer that came due while this task computed (a timeout's
    deadline) joins the loop's queue behind this task's own wake-up: after
    one turn the task went on, and the timeout's callback ran only after the
    next piece of work, 5 ms of it or the commit (a step of 5-10 ms under an
    expired deadline committed every time). Then, and only then, a second
    turn lets it run first; trio looks at its deadlines before it wakes a
    task.

    Inside a step of an ``@ml.direct`` function (an ``ml.gradients`` there)
    the turn is marked as the step's own wait (`monadl.direct.Step`): the
    examples evaluated beside it wait for the step, as for one that awaits
    nothing, whenever its turns come."""
    loop = asyncio._get_running_loop()  # (None on trio, and cheaply so)
    due = loop is not None and timer_due(loop)
    await _checkpoint()
    if due:
        await _checkpoint()


async def _checkpoint() -> None:
    """`anyio.lowlevel.checkpoint`, marked as the direct-style step's own
    wait where one runs this (`take_turn`)."""
    step = inside_direct.get()  # (each send of a step sets one of its own: this one's)
    step.own_turn = step.live
    try:
        await anyio.lowlevel.checkpoint()
    finally:
        step.own_turn = False  # (read as the send returned: past it, or raised before it yielded)


def timer_due(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether one of ``loop``'s timers is due: its earliest (asyncio's
    timers are a heap), or, on a loop that keeps them elsewhere (uvloop),
    whether the deadline of anyio's scopes around this task has passed.
    False where a loop of its own keeps other things there (items with no
    ``when()``): one turn, as before the second was added, and no error
    from a private attribute of asyncio's."""
    try:
        scheduled: list[asyncio.TimerHandle] | None = getattr(loop, "_scheduled", None)
        if scheduled is None:
            return anyio.current_effective_deadline() <= anyio.current_time()
        return bool(scheduled) and bool(scheduled[0].when() <= loop.time())
    except Exception:
        return False
