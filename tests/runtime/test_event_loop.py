"""The runtime as an anyio citizen: concurrent effects, turns for the event
loop, cancellation with nothing changed, atomic commits across threads.

No assertion here depends on how fast the machine is: concurrency is shown
by branches that can only finish together, turns by a task that counts them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from functools import partial
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import monadl as ml
from monadl.deltas import PIECE_BLOCK, PIECE_ROWS, Outer
from monadl.layers._layer import Layer
from monadl.layers._primitives import Primitive
from monadl.runtime import entry, turns
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import PIECE, collect, collecting
from monadl.runtime.requests import CHECKPOINT
from monadl.runtime.schedule import inline
from monadl.runtime.schedule.batched import _levels
from tests._threads import train_in_threads

T = TypeVar("T")

pytestmark = pytest.mark.anyio

DEADLOCK_GUARD_S = 30.0  # only a sequential (wrong) runtime would take this long


def meeting() -> tuple[Callable[[], Awaitable[float]], Callable[[], Awaitable[float]]]:
    """Two effects that finish only if they run at the same time: each waits
    for the other to have started."""
    a_started, b_started = anyio.Event(), anyio.Event()

    async def a() -> float:
        a_started.set()
        await b_started.wait()
        return 1.0

    async def b() -> float:
        b_started.set()
        await a_started.wait()
        return 2.0

    return a, b


def effect_layer(effect: Callable[[], Awaitable[float]]) -> ml.ScalarLayer:
    return ml.Layer(ml.Do.from_async(effect).map(lambda v: ml.Tape(v)))


async def test_zip_runs_independent_effects_concurrently() -> None:
    a, b = meeting()
    with anyio.fail_after(DEADLOCK_GUARD_S):
        assert await ml.Do.zip(ml.Do.from_async(a), ml.Do.from_async(b)).run() == (1.0, 2.0)


async def test_gather_of_four_effects_runs_them_together() -> None:
    arrived = 0
    everyone = anyio.Event()

    async def party(i: int) -> int:
        nonlocal arrived
        arrived += 1
        if arrived == 4:
            everyone.set()
        await everyone.wait()
        return i

    with anyio.fail_after(DEADLOCK_GUARD_S):
        result = await ml.Do.gather(ml.Do.from_async(partial(party, i)) for i in range(4)).run()
    assert result == (0, 1, 2, 3)


async def test_values_in_direct_style_evaluates_layers_concurrently() -> None:
    a, b = meeting()
    w = ml.Weight(3.0, optimizer=ml.optim.sgd(0.1))
    x, y = effect_layer(a), effect_layer(b)

    @ml.direct
    async def larger(w: ml.ScalarLayer) -> ml.ScalarLayer:
        vx, vy = await ml.values(x * w, y * w)
        return x * w if vx > vy else y * w

    with anyio.fail_after(DEADLOCK_GUARD_S):
        assert await larger(w * 1.0).train() == 6.0
    assert w.data == pytest.approx(3.0 - 0.1 * 2.0)


async def test_a_direct_layer_that_sleeps_runs_beside_its_sibling() -> None:
    a, b = meeting()

    @ml.direct
    async def waits_for_b(scale: float) -> ml.ScalarLayer:
        await a()  # a foreign await inside direct style, in a concurrent branch
        return ml.as_layer(scale)

    with anyio.fail_after(DEADLOCK_GUARD_S):
        left, right = await ml.Do.zip(waits_for_b(2.0).forward(), effect_layer(b).forward()).run()
    assert (left.data, right.data) == (2.0, 2.0)


async def test_a_failing_branch_cancels_its_siblings_and_surfaces_as_itself() -> None:
    log: list[str] = []
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    before = w.data.copy()
    started = anyio.Event()

    async def open_() -> float:
        log.append("open")
        started.set()
        return 1.0

    async def close(_: float) -> None:
        log.append("close")

    async def waits_forever() -> float:
        await anyio.sleep_forever()
        raise AssertionError("not reached")

    async def fails() -> float:
        await started.wait()
        raise KeyError("the black box is down")

    held: ml.ScalarLayer = ml.Layer(
        ml.Do.zip(ml.Do.resource(open_, close), ml.Do.from_async(waits_forever)).map(lambda v: ml.Tape(v[0]))
    )
    loss = ml.sum(w * held) + effect_layer(fails)
    with anyio.fail_after(DEADLOCK_GUARD_S), pytest.raises(KeyError, match="black box"):
        await ml.Layer(ml.Do.zip(loss.forward(), held.forward()).map(lambda t: t[0])).train()
    assert log == ["open", "close"]
    np.testing.assert_array_equal(w.data, before)


def long_chain(w: ml.ArrayWeight, n: int) -> ml.ScalarLayer:
    h = w * 1.0
    for _ in range(n):
        h = h + ml.tanh(h) * 0.001
    return ml.sum(h)


async def turns_during(step: Callable[[], Awaitable[object]]) -> int:
    """How many turns a task that only yields gets while ``step`` runs, with
    the runtime giving a turn at every look at the clock."""
    turns = 0
    running = True

    async def ticker() -> None:
        nonlocal turns
        while running:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        with ml.settings(yield_interval_s=1e-9):
            before = turns
            await step()
            during = turns - before
        running = False
    return during


async def test_a_long_step_gives_the_event_loop_turns() -> None:
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    loss = long_chain(w, 500)
    assert await turns_during(loss.train) >= 10  # 1,500 forward and as many backward nodes, a look every 32


async def test_a_loop_of_short_steps_gives_the_event_loop_turns() -> None:
    # Each step too short to reach its own deadline, and awaiting nothing that
    # suspends: a loop of them starved every other task, and a timeout or Ctrl-C
    # on asyncio waited for the loop's end (a user's trial: 0 turns in 3,000 steps).
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.0))

    async def steps() -> None:
        for _ in range(200):
            await ml.sum(w * 2.0).train()

    assert await turns_during(steps) >= 100
    done = 0
    with anyio.move_on_after(0.01) as scope:
        for _ in range(100_000):  # (minutes of steps: the timeout ends the loop long before)
            await ml.sum(w * 2.0).train()
            done += 1
    assert scope.cancelled_caught and done < 100_000


def test_the_clock_is_read_after_as_many_nodes_as_take_a_quarter_of_the_interval() -> None:
    # Every 32 nodes, as before, let nodes of a few milliseconds block the loop for 100 ms and more.
    from monadl.runtime.evaluation import STRIDE, Evaluation

    with ml.settings(yield_interval_s=0.004):
        ev = Evaluation(train=False)
    assert ev.stride < STRIDE  # (the first look comes early)
    ev.stride = STRIDE
    ev.paced(0.0, 0.032)  # 32 nodes of 1 ms: one a stride, a quarter of the interval
    assert ev.stride == 1
    for want in (2, 4, 8, 16, 32, 32):  # cheap nodes again: back up, twice a look at most
        ev.paced(0.0, 1e-7)
        assert ev.stride == want
    ev.paced(0.0, 0.0)
    assert ev.stride == STRIDE
    ev.yield_interval_s = float("inf")  # (never a turn: every stride fits; it overflowed an int)
    ev.paced(0.0, 1.0)
    assert ev.stride == STRIDE


async def test_a_batched_forward_gives_the_event_loop_turns_between_levels() -> None:
    # 16 chains side by side: 50 levels of 16 alike nodes, each level one batched group.
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    chains = []
    for i in range(16):
        h = w * float(i + 1)
        for _ in range(50):
            h = ml.tanh(h) * 0.5
        chains.append(ml.sum(h))
    loss = ml.sum(ml.stack(chains))
    with ml.settings(batching=True):
        assert await turns_during(loss.predict) >= 50  # (the forward alone: the backward has its own turns)


async def test_cancelling_a_long_pure_step_changes_no_weight() -> None:
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    before = w.data.copy()
    with anyio.move_on_after(0.0) as scope:
        await long_chain(w, 2000).train()
    assert scope.cancelled_caught
    np.testing.assert_array_equal(w.data, before)


async def test_a_small_cancelled_step_changes_no_weight() -> None:
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    loss = long_chain(w, 50)
    before = w.data.copy()
    with anyio.move_on_after(0.0) as scope:
        await loss.train()
    assert scope.cancelled_caught
    np.testing.assert_array_equal(w.data, before)
    await loss.train()  # and an uncancelled one steps
    assert not np.array_equal(w.data, before)


def slow_then_short(w: ml.ArrayWeight) -> ml.ScalarLayer:
    """A node that holds the thread 0.2 s (past any deadline set below, and
    past the 0.1 s yield interval: the look at the clock after it gives the
    loop a turn), then a rest of a millisecond or so, far less than the
    interval: no other turn comes before the commit."""

    def hold(tape: ml.Tape[np.ndarray, np.ndarray]) -> ml.Tape[np.ndarray, np.ndarray]:
        time.sleep(0.2)
        return tape

    h: ml.ArrayLayer = ml.Layer((w * 1.0).forward().map(hold))
    for _ in range(60):
        h = h + ml.tanh(h) * 0.001
    return ml.sum(h)


async def test_a_deadline_that_passes_during_a_step_stops_it_at_the_next_turn() -> None:
    # On asyncio the deadline's callback, due while the step computed, queued behind the
    # task's own wake-up: the step went on after the turn, and committed before the next
    # (a user's trial: 20 of 20 steps of 5-10 ms under a 0.5 ms deadline).
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    loss = slow_then_short(w)
    with ml.settings(yield_interval_s=0.1):
        with anyio.move_on_after(0.02) as scope:
            await loss.train()
        assert scope.cancelled_caught
        np.testing.assert_array_equal(w.data, np.ones(4))
        await loss.train()  # (and one with no deadline steps)
    assert not np.array_equal(w.data, np.ones(4))


async def test_asyncio_timeout_that_passes_during_a_step_stops_it_at_the_next_turn(anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's own timeout")
    import asyncio

    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    with ml.settings(yield_interval_s=0.1), pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await slow_then_short(w).train()
    np.testing.assert_array_equal(w.data, np.ones(4))


def own_loop(scheduled: object) -> asyncio.AbstractEventLoop:
    """A loop of its own making that keeps other things in ``_scheduled``
    (a stand-in: only what `timer_due` reads)."""
    return cast(asyncio.AbstractEventLoop, SimpleNamespace(_scheduled=scheduled, time=lambda: 0.0))


async def test_a_loop_whose_scheduled_items_are_not_asyncios_timers_gets_one_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The turn read the earliest of asyncio's private _scheduled timers with .when(): on a
    # loop keeping other things there, every step raised AttributeError.
    from monadl.runtime import turns

    class Due:
        def when(self) -> float:
            return -1.0

    assert turns.timer_due(own_loop([Due()]))  # (asyncio's way: a due timer)
    for scheduled in ([object()], [("when", 0.0)], 3, {"a": 1}):
        assert turns.timer_due(own_loop(scheduled)) is False
    monkeypatch.setattr(turns, "asyncio", SimpleNamespace(_get_running_loop=lambda: own_loop([object()])))
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    assert await turns_during(long_chain(w, 100).train) >= 2
    assert not np.array_equal(w.data, np.ones(4))


@pytest.mark.parametrize("examples", [1, 3])
async def test_a_cancelled_train_hands_on_the_callers_cancellation_with_its_message(
    anyio_backend: str, examples: int
) -> None:
    # With examples waiting in services beside each other, the task group they wait in
    # raised a cancellation of its own on closing: 'Cancelled via cancel scope 7f83... by
    # <Task ...>', not the CancelledError('user stopped the job') that task.cancel gave.
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's cancellation message")
    import asyncio

    w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.1))
    waiting = 0
    all_wait = anyio.Event()

    @ml.direct
    async def example(k: int) -> ml.ScalarLayer:
        nonlocal waiting
        waiting += 1
        if waiting == examples:
            all_wait.set()
        await anyio.sleep(DEADLOCK_GUARD_S)  # (a slow service)
        return ml.sum(w * float(k))

    task = asyncio.ensure_future(ml.sum(ml.stack([example(k) for k in range(examples)])).train())
    with anyio.fail_after(DEADLOCK_GUARD_S):
        await all_wait.wait()
    task.cancel("user stopped the job")
    with pytest.raises(asyncio.CancelledError) as info:
        await task
    assert info.value.args == ("user stopped the job",)
    np.testing.assert_array_equal(w.data, np.ones(2))


def test_two_threads_training_one_weight_lose_no_update() -> None:
    # The gradient is exactly 1 and the rate 1: every step subtracts exactly 1.0.
    w = ml.Weight(np.zeros(3), optimizer=ml.optim.sgd(1.0))
    loss = ml.sum(w)
    steps = 2000
    train_in_threads(lambda: loss, steps)
    np.testing.assert_array_equal(w.data, [-2.0 * steps] * 3)


CTRL_C_PROGRAM = """
import signal, sys, anyio, numpy as np, monadl as ml
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell's background job inherits Ctrl-C ignored)
w = ml.Weight(np.ones(64), optimizer=ml.optim.sgd(1e-3))
h = w * 1.0
for _ in range(3000):
    h = ml.tanh(h) * 0.5 + 0.25
loss = ml.sum(h)

async def main() -> None:
    committed = w.data.copy()
    print("training", flush=True)
    try:
        while True:
            await loss.train()
            committed = w.data.copy()
    finally:
        print("unchanged" if np.array_equal(w.data, committed) else "CHANGED", flush=True)

anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_interrupts_an_endless_training_loop(backend: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_PROGRAM, backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "training"
    time.sleep(0.5)  # a few steps in
    process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=DEADLOCK_GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("Ctrl-C did not stop the training loop") from None
    assert "KeyboardInterrupt" in err
    assert out.strip() == "unchanged"


async def test_a_shared_effect_awaited_by_two_branches_runs_once() -> None:
    runs = 0

    async def slow() -> float:
        nonlocal runs
        runs += 1
        await anyio.sleep(0.01)
        return 3.0

    shared = ml.Do.from_async(slow).shared()
    with anyio.fail_after(DEADLOCK_GUARD_S):
        assert await ml.Do.zip(shared.map(lambda v: v + 1), shared.map(lambda v: v * 2)).run() == (4.0, 6.0)
    assert runs == 1  # the second branch waited for the first one's value


async def test_a_do_layer_used_by_two_concurrent_branches_is_evaluated_once() -> None:
    runs = 0
    w = ml.Weight(2.0, optimizer=ml.optim.sgd(0.1))

    async def slow() -> float:
        nonlocal runs
        runs += 1
        await anyio.sleep(0.01)
        return 5.0

    x = effect_layer(slow)
    a, b = meeting()
    left = x * w + effect_layer(a)
    right = x * w + effect_layer(b)
    with anyio.fail_after(DEADLOCK_GUARD_S):
        assert await ml.Layer(ml.Do.zip(left.forward(), right.forward()).map(lambda t: t[0])).train() == 11.0
    assert runs == 1
    assert w.data == pytest.approx(2.0 - 0.1 * 5.0)


def test_a_step_its_event_loop_left_closes_cleanly_outside_any_loop() -> None:
    """A loop that died with a step suspended in it (trio after a KeyboardInterrupt from a
    non-SIGINT handler, a loop closed with a task pending) leaves its coroutine to be closed
    later, outside any loop: the abort asked anyio for a cancel scope (NoEventLoopError), then
    reset a context variable of another context (ValueError), and Python printed 'Exception
    ignored' with monadl's frames. With no resource to release it closes cleanly, nothing stepped."""
    import warnings

    w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        await ml.values(ml.sum(w))
        await anyio.sleep(10)
        return ml.sum(w * w)

    step = model().train()
    loop = asyncio.new_event_loop()
    task = loop.create_task(step)
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    step.close()  # (raised NoEventLoopError)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        del task
    np.testing.assert_array_equal(w.data, np.ones(3))


def drained(steps: Generator[object, None, T]) -> tuple[int, T]:
    """How many turns a machine's piece asks for (`CHECKPOINT`), and what it returns."""
    turns = 0
    while True:
        try:
            assert next(steps) is CHECKPOINT
        except StopIteration as done:
            return turns, done.value
        turns += 1


def test_a_large_graphs_walk_and_levels_give_turns_between_pieces() -> None:
    """The walk that finds a graph (`collecting`) and the batching
    scheduler's depths (`_levels`) ask for a turn between pieces of
    `PIECE` nodes once the deadline has passed, and find what they find
    without turns (a new user's 90,000-node chain: 34 and 42 ms with no
    turn, 35-45 ms late timeouts)."""
    w = ml.Weight(np.ones(4))
    loss = long_chain(w, PIECE)  # (3 nodes a link)
    roots = [loss]
    unpaced = Evaluation(train=False)
    order = collect(unpaced, roots)
    assert len(order) == 3 * PIECE + 2  # (4 pieces)
    due = Evaluation(train=False)
    due.deadline = 0.0
    turns, walked = drained(collecting(due, roots))
    assert (turns, walked) == (3, order)
    assert due.records.keys() == unpaced.records.keys()  # (the weight's record)
    turns, (levels, left, depth) = drained(_levels(due, order))
    assert turns == 3
    assert (levels, left, depth) == drained(_levels(unpaced, order))[1]
    assert len(levels) == 3 * PIECE + 2 and left == []  # (a chain: a level a node)
    unpaced.deadline = float("inf")
    assert drained(collecting(unpaced, roots))[0] == drained(_levels(unpaced, order))[0] == 0


async def test_a_sweep_frees_each_records_value_as_it_passes() -> None:
    """The backward's sweep drops each record's value and its links to its
    operands once the record is back-propagated, so a large graph's arrays
    go a piece at a time between turns (a 90,000-node chain's: 34 ms at
    the end with no turn); the gradients are those of the counted release,
    which keeps them to the end."""
    w = ml.Weight(np.linspace(0.1, 0.4, 4))
    loss = long_chain(w, 30)
    freed: list[int] = []
    sweep = inline.sweep

    def watched(ev: Evaluation) -> Generator[object, None, None]:
        records = list(ev.records.values())
        yield from sweep(ev)
        freed.extend(i for i, rec in enumerate(records) if rec.value is None and rec.inputs == ())
        assert all(rec.value is not None for rec in records if rec.is_weight)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inline, "sweep", watched)
        (value, grads) = await ml.value_and_gradients(loss)
    assert len(freed) == 3 * 30 + 2  # (every record but the weight's)
    counted = ml.Layer(ml.Do.pure(0.0).bind(lambda _: loss.forward()))  # (a Do layer: the counted release)
    value_counted, grads_counted = await ml.value_and_gradients(counted)
    assert value == value_counted
    np.testing.assert_array_equal(grads[w], grads_counted[w])


def _held_backward(x: np.ndarray) -> tuple[np.ndarray, tuple[Callable[[np.ndarray], np.ndarray]]]:
    """An identity whose VJP holds the thread 0.2 s."""

    def vjp(g: np.ndarray) -> np.ndarray:
        time.sleep(0.2)
        return g

    return x, (vjp,)


HELD_BACKWARD = Primitive("held_backward", _held_backward)


def held_last(w: ml.ArrayWeight) -> ml.ScalarLayer:
    """A pure graph whose backward's last VJP holds the thread 0.2 s, after
    300 cheap ones: one sweep, the held VJP in its last stride of records."""
    h = Layer._make(HELD_BACKWARD, (w * 1.0,))
    for _ in range(300):
        h = h * 1.0
    return ml.sum(h)


async def test_a_deadline_that_passes_in_the_last_stretch_of_a_step_stops_it_before_the_commit() -> None:
    # The backward's last VJPs, fewer than a look at the clock waits for, ran past the deadline:
    # the commit went ahead and no timeout was seen (a new user's trial: a deadline at 60% of a
    # loom block's step, batching off, 3 of 3 steps committed; 12 of 19 deadlines across such a
    # step, batching on).
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    loss = held_last(w)
    with ml.settings(yield_interval_s=10.0):  # (no turn is due by the interval: the deadline's look alone sees it)
        with anyio.move_on_after(0.05) as scope:
            await loss.train()
    assert scope.cancelled_caught
    np.testing.assert_array_equal(w.data, np.ones(4))
    await loss.train()  # (and one with no deadline steps)
    assert not np.array_equal(w.data, np.ones(4))


async def test_asyncio_timeout_that_passes_in_the_last_stretch_of_a_step_stops_it_before_the_commit(
    anyio_backend: str,
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's own timeout")
    import asyncio

    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.01))
    with ml.settings(yield_interval_s=10.0), pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await held_last(w).train()
    np.testing.assert_array_equal(w.data, np.ones(4))


@pytest.mark.parametrize(("batching", "least"), [(True, 400), (False, 1000)])
async def test_many_direct_examples_give_the_event_loop_turns_as_they_step_and_merge(
    batching: bool, least: int
) -> None:
    # A new user's 1,024 examples held the loop 30-80 ms at a time: their steps (one task steps them
    # all), the interpreter's rounds over them, and their merged runs' levels gave no turn when due.
    # With a turn at every look at the clock, 64 examples of one read each: 217 turns batched and 776
    # node by node before, 610 and 1,160 with those looks.
    w = ml.Weight(np.ones((1, 4)) * 0.1, optimizer=ml.optim.sgd(0.0))

    @ml.direct
    async def example(x: float) -> ml.ScalarLayer:
        h = ml.tanh(w * x)
        (v,) = await ml.values(ml.sum(h))
        return ml.sum(h * float(v))

    with ml.settings(batching=batching):
        loss = ml.sum(ml.stack([example(float(i)) for i in range(64)]))
        assert await turns_during(loss.train) >= least


async def test_a_commits_delta_of_many_rows_kept_as_factors_is_multiplied_ahead_with_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 400 one-row products by one 512 x 512 weight: its delta is kept as 400 rows of factors, 105M
    # multiply-adds, multiplied ahead of the commit in pieces (MULTIPLY_PIECE), a turn between them.
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((512, 512)) / 512, optimizer=ml.optim.sgd(0.1))
    xs = rng.standard_normal((400, 1, 512))
    before = w.data.copy()
    looks: list[str] = []
    turn = turns.turn_if_due

    async def counted(ev: Any) -> None:
        looks.append(sys._getframe(1).f_code.co_name)
        await turn(ev)

    monkeypatch.setattr(entry, "turn_if_due", counted)
    loss = ml.sum(ml.stack([ml.sum(ml.tanh(x @ w)) for x in xs]))
    with ml.settings(batching=False):
        (want,) = await ml.gradients(loss, [w])
        await loss.train()
    # (400 rows by the whole weight, 256 of them a piece: MULTIPLY_PIECE, 64M, is 256 rows by 512 x 512)
    assert entry.MULTIPLY_PIECE == 256 * 512 * 512
    assert looks.count("_multiplied_ahead") == 2
    np.testing.assert_allclose(w.data, before - 0.1 * np.asarray(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("rows", "m", "n", "others"),
    [
        (20_000, 32, 32, False),  # many rows by a small weight: pieces of rows, summed
        (300, 600, 700, True),  # a large weight: blocks of it, from 256 rows a piece
        (100, 600, 700, False),  # few rows: all of them a piece, each block written once
        (100, 1, 200_000, True),  # one row of the weight, many columns
        (40, 3, 5, True),  # smaller than a piece
        (0, 3, 5, True),  # no rows: zeros
        (7, 1, 1, False),
    ],
)
def test_factors_multiplied_in_pieces_are_their_product_in_pieces_of_bounded_work(
    rows: int, m: int, n: int, others: bool
) -> None:
    # A commit's delta kept as factors is multiplied ahead in pieces, a turn for the event loop between
    # them. Pieces of 4M multiply-adds were a few rows each, each product summed into a weight-sized
    # array: a 3,072 x 1,024 weight's delta of 228 rows took 1.3 s against one product's 9 ms. Now a
    # piece takes PIECE_ROWS rows or all there are, so that a block of the weight is added in once per
    # that many rows, and each piece's work is bounded.
    work = 1 << 22
    rng = np.random.default_rng(rows + m + n)
    half = rows // 2
    d = Outer(rng.standard_normal((half, m)), rng.standard_normal((half, n)))
    d = d + Outer(rng.standard_normal((rows - half, m)), rng.standard_normal((rows - half, n)))
    if others:
        d = d + rng.standard_normal((m, n)).astype(np.float32)
    pieces = d.pieces(work)
    shapes: list[tuple[int, int, int]] = []
    while True:
        try:
            shapes.append(next(pieces))
        except StopIteration as done:
            value = done.value
            break
    want = d.dense()
    assert value.dtype == want.dtype == np.float64 and value.shape == (m, n)
    np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-12)
    assert sum(r * t * w for r, t, w in shapes) == rows * m * n
    for r, t, w in shapes:
        assert r * t * w <= max(work, PIECE_ROWS * PIECE_BLOCK * PIECE_BLOCK)
    # (each entry of the weight written or summed into once per PIECE_ROWS rows at most)
    assert sum(t * w for _, t, w in shapes) <= m * n * max(1, -(-rows // PIECE_ROWS))


@pytest.mark.parametrize(
    ("case", "ahead"),
    [
        ("sgd", False),  # added into the weight's data in the commit, one pass
        ("adam", True),  # Adam needs the product: multiplied ahead, turns between its pieces
        ("sgd, a dense delta beside", True),  # factored_step declines a dense delta beside the factors
        ("sgd, long", True),  # more than FACTORS_IN_COMMIT: the commit would hold the event loop for it
    ],
)
async def test_plain_sgd_steps_from_a_few_rows_factors_in_the_commit(
    case: str, ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 rows by a 1,024 x 1,024 weight: 16M multiply-adds kept as factors. Plain SGD's commit adds
    # their product into the weight's data in one pass (factored_step); multiplied ahead, a product
    # into a fresh array read again to add, an MLP's step took 1.7-2x as long.
    rng = np.random.default_rng(3)
    sgd = case.startswith("sgd")
    w = ml.Weight(
        (rng.standard_normal((1024, 1024)) / 32).astype(np.float32),
        optimizer=ml.optim.sgd(0.1) if sgd else ml.optim.adam(0.1),
    )
    rows = 16
    if case == "sgd, long":
        rows = entry.FACTORS_IN_COMMIT // (1024 * 1024) + 1
        assert rows < PIECE_ROWS
    x = rng.standard_normal((rows, 1024)).astype(np.float32)
    multiplied: list[int] = []
    pieces = Outer.pieces

    def counted(self: Outer, work: int) -> Generator[tuple[int, int, int], None, Any]:
        multiplied.append(sum(left.shape[0] for left in self.lefts))
        return pieces(self, work)

    monkeypatch.setattr(Outer, "pieces", counted)
    loss = ml.sum(ml.tanh(x @ w))
    if case == "sgd, a dense delta beside":
        loss = loss + 1e-3 * ml.sum(w * w)
    before = w.data.copy()
    (want,) = await ml.gradients(loss, [w])
    await loss.train()
    assert multiplied == ([rows] if ahead else [])
    if sgd:
        np.testing.assert_allclose(w.data, before - 0.1 * np.asarray(want), rtol=1e-5, atol=1e-6)
    else:  # (Adam's first step: the rate times the gradient's sign, where it is not about 0)
        moved = np.abs(w.data - before)
        assert np.all((moved > 0.099) | (np.abs(np.asarray(want)) < 1e-6))
