"""Direct style: await inside an @ml.direct function."""

from __future__ import annotations

import re
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import monadl as ml

pytestmark = pytest.mark.anyio


async def test_awaited_and_used_layer_is_evaluated_and_backpropagated_once() -> None:
    forwards: list[int] = []
    backwards: list[int] = []
    w = ml.Weight(3.0, optimizer=ml.optim.sgd(0.1))

    def counted(tape: ml.Tape[float, float]) -> ml.Tape[float, float]:
        forwards.append(1)
        inner = tape.backward
        assert inner is not None

        def backward(delta: float) -> None:
            backwards.append(1)
            inner(delta)

        return ml.Tape(tape.data, backward)

    shared = ml.Layer((w * w).forward().map(counted))

    @ml.direct
    async def model(x: ml.ScalarLayer) -> ml.ScalarLayer:
        value = await x
        assert value == 9.0
        return x * 2.0 if value > 0 else x

    loss = await model(shared).train()
    assert loss == 18.0
    assert (len(forwards), len(backwards)) == (1, 1)
    assert w.data == pytest.approx(3.0 - 0.1 * 2.0 * 2 * 3.0)


async def test_values_evaluates_several_and_types_them() -> None:
    a = ml.Weight(np.array([1.0, 2.0]))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        total, first, array = await ml.values(ml.sum(a), a[0], a)
        assert (total, first) == (3.0, 1.0)
        assert isinstance(array, np.ndarray)
        return ml.sum(a) * float(total)

    assert await model().predict() == 9.0


async def test_other_awaits_reach_the_event_loop() -> None:
    w = ml.Weight(2.0)
    seen: list[str] = []

    @ml.direct
    async def model() -> ml.ScalarLayer:
        await anyio.sleep(0.001)
        seen.append("slept")
        value = await w
        await anyio.lowlevel.checkpoint()
        return w * value

    assert await model().predict() == 4.0
    assert seen == ["slept"]


async def test_a_failing_foreign_await_reaches_the_coroutine() -> None:
    w = ml.Weight(2.0)

    async def flaky() -> float:
        await anyio.lowlevel.checkpoint()
        raise ConnectionError("black box down")

    @ml.direct
    async def model() -> ml.ScalarLayer:
        try:
            fallback = await flaky()
        except ConnectionError:
            fallback = 1.0
        return w * fallback

    assert await model().predict() == 2.0


async def test_errors_are_clear() -> None:
    w = ml.Weight(1.0)
    with pytest.raises(RuntimeError, match=r"only inside an @ml\.direct function"):
        await w

    @ml.direct
    async def returns_a_number() -> ml.ScalarLayer:
        return 3.0  # type: ignore[return-value]  # the mistake under test

    with pytest.raises(TypeError, match="must return a Layer"):
        await returns_a_number().predict()


async def test_a_failure_inside_leaves_weights_and_closes_the_coroutine() -> None:
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    closed: list[bool] = []

    @ml.direct
    async def model() -> ml.ScalarLayer:
        try:
            await ml.sum(w + np.ones(3))  # a shape error inside the awaited layer
        finally:
            closed.append(True)
        return ml.sum(w)

    with pytest.raises(ml.ShapeError):
        await model().train()
    assert closed == [True]
    np.testing.assert_array_equal(w.data, [1.0, 2.0])


async def test_cancellation_inside_a_direct_layer() -> None:
    w = ml.Weight(np.array([1.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        await anyio.sleep(10)
        return ml.sum(w)

    with anyio.move_on_after(0.02) as scope:
        await model().train()
    assert scope.cancelled_caught
    np.testing.assert_array_equal(w.data, [1.0])


async def test_weights_forward_alone_and_zipped() -> None:
    w, v = ml.Weight(2.0), ml.Weight(np.array([1.0, 3.0]))
    tapes = await ml.Do.zip(w.forward(), v.forward()).run()
    assert tapes[0].data == 2.0
    np.testing.assert_array_equal(tapes[1].data, [1.0, 3.0])
    assert (await w.forward().run()).data == 2.0


async def test_a_step_that_waits_outside_does_not_hold_the_steps_asked_with_it() -> None:
    """Several examples' coroutine steps run one after another in one task;
    the first waits for an event that only the last one's step sets, so the
    steps after a foreign await must go on in a task of their own."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    ready = anyio.Event()
    order: list[str] = []

    @ml.direct
    async def waits() -> ml.ScalarLayer:
        await ready.wait()
        order.append("waited")
        return ml.sum(w * float((await w)[0]))

    @ml.direct
    async def plain() -> ml.ScalarLayer:
        order.append("plain")
        return ml.sum(w * float((await w)[1]))

    @ml.direct
    async def sets() -> ml.ScalarLayer:
        ready.set()
        order.append("set")
        return ml.sum(w * 2.0)

    with anyio.fail_after(60):  # a guard against a hang, not a timing
        value = await ml.sum(ml.stack([waits(), plain(), sets()])).train()
    assert float(value) == 3.0 + 6.0 + 6.0
    assert order.index("set") < order.index("waited")
    np.testing.assert_allclose(w.data, [1.0 - 0.1 * 5.0, 2.0 - 0.1 * 5.0])


async def test_a_failing_step_among_several_fails_the_evaluation_with_its_error() -> None:
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    stepped: list[str] = []

    @ml.direct
    async def fine(name: str) -> ml.ScalarLayer:
        stepped.append(name)
        return ml.sum(w * float((await w)[0]))

    @ml.direct
    async def fails() -> ml.ScalarLayer:
        raise ValueError("bad example")

    with pytest.raises(ValueError, match="bad example"):
        await ml.sum(ml.stack([fine("a"), fails(), fine("b")])).train()
    np.testing.assert_array_equal(w.data, [1.0, 2.0])  # nothing stepped


async def test_the_note_of_other_failures_tells_a_recursions_calls_apart() -> None:
    """Examples whose direct-style functions call themselves (a tree
    decoder's children): a failure in one example's nested calls is noted
    with its path (``example 1, its example 1``), not as ``example 1`` for
    each, which read as other examples of the batch (a new user's)."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def node(k: int, depth: int) -> ml.ScalarLayer:
        value = (await (w * float(k)))[0]
        if k == 1 and depth == 1:
            raise ValueError(f"node at depth {depth}")
        total = ml.sum(w * value)
        if depth < 1:
            total = total + ml.sum(ml.stack([node(k, depth + 1) for _ in range(2)]))
        return total

    with pytest.raises(ValueError) as raised:
        await ml.sum(ml.stack([node(k, 0) for k in range(3)])).train()
    notes = getattr(raised.value, "__notes__", [])
    assert notes[0].startswith("monadl: raised in example 1 (from 0, in the order built) of 3 evaluated together")
    assert "; in its example 0 (from 0, in the order built) of 2 evaluated together" in notes[0]
    assert notes[1].startswith("monadl: 1 other example evaluated with this one failed too: ValueError: node at")
    assert notes[1].endswith(", in example 1, its example 1")
    np.testing.assert_array_equal(w.data, [1.0, 2.0])


async def test_a_layer_built_from_a_do_alone_at_its_line_is_named_by_its_line_not_as_an_example() -> None:
    # A loss of the model's layers, a constant and a black box, each built from a Do at its own line: the
    # black box's error was noted "raised in example 1 (from 0, in the order built) of 2 evaluated together".
    w = ml.Weight(np.ones(3))

    def fails(_: Any) -> Any:
        raise ValueError("the black box failed")

    scale: ml.ScalarLayer = ml.Layer(ml.Do.pure(2.0).map(ml.Tape))
    box: ml.ScalarLayer = ml.Layer(ml.sum(w).forward().map(fails))  # BOX
    with pytest.raises(ValueError, match="the black box failed") as raised:
        await (ml.sum(w) * scale * box).train()
    assert raised.value.__notes__ == [f"monadl: raised in the layer built from a Do at {__file__}:{_line_of('# BOX')}"]
    np.testing.assert_array_equal(w.data, np.ones(3))


@pytest.mark.parametrize("batching", [None, False])
async def test_an_example_that_returns_no_layer_is_named_as_its_other_errors_are(batching: bool | None) -> None:
    # One of 12 examples returned None after an await: the TypeError said so, without the note naming which
    # example that every other error of a direct-style step has (a new user's).
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def example(k: int) -> Any:  # (Any: the mistake under test, which mypy rejects)
        (v,) = await ml.values(ml.sum(w * float(k)))
        return None if k == 7 else ml.sum(w) * v

    with ml.settings(batching=batching), pytest.raises(TypeError, match=r"returned None; it must return") as raised:
        await ml.sum(ml.stack([example(k) for k in range(12)])).train()  # RETURNS NONE
    assert raised.value.__notes__ == [
        f"monadl: raised in example 7 (from 0, in the order built) of 12 evaluated together, built at "
        f"{__file__}:{_line_of('# RETURNS NONE')}"
    ]
    np.testing.assert_array_equal(w.data, [1.0, 2.0])


async def test_examples_failing_together_raise_the_first_with_a_note_of_the_others() -> None:
    # A new user's batch where two examples of 32 failed at one step raised the first's
    # error and said nothing of the second.
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def example(k: int, failing: tuple[int, ...]) -> ml.ScalarLayer:
        value = (await (w * float(k)))[0]
        if k in failing:
            raise ValueError(f"example {k} failed\nits second line")  # RAISED
        return ml.sum(w * value)

    here = f"{__file__}:{_line_of('# RAISED')}"
    built = f"{__file__}:{_line_of('# BUILT')}"
    for failing, others in [
        ((5,), None),
        (
            (2, 6),
            f"monadl: 1 other example evaluated with this one failed too: ValueError: example 6 failed (at {here}), "
            "in example 6",
        ),
        (
            (2, 3, 4, 6, 7),
            "monadl: 4 other examples evaluated with this one failed too, the first 3: "
            + "; ".join(f"ValueError: example {k} failed (at {here}), in example {k}" for k in (3, 4, 6)),
        ),
    ]:
        with pytest.raises(ValueError) as raised:
            await ml.sum(ml.stack([example(k, failing) for k in range(8)])).train()  # BUILT
        assert str(raised.value) == f"example {failing[0]} failed\nits second line"  # the first in written order
        which = f"monadl: raised in example {failing[0]} (from 0, in the order built) of 8 evaluated together, built at {built}"
        assert getattr(raised.value, "__notes__", None) == [which] + ([others] if others else [])
        last = raised.tb
        while last.tb_next is not None:
            last = last.tb_next
        assert f"{last.tb_frame.f_code.co_filename}:{last.tb_lineno}" == here  # its own traceback
        np.testing.assert_array_equal(w.data, [1.0, 2.0])  # nothing stepped


@pytest.mark.parametrize("batching", [True, None, False])
async def test_a_nodes_error_in_a_merged_run_says_which_example_built_it(batching: bool | None) -> None:
    """An out-of-range token in one of 12 decoders whose graphs ran merged
    (a new user's): the error named the lines, one for every example, and
    not which; now the example whose graph held the node, as a step's error."""
    table = ml.Weight(np.ones((5, 4)))
    cell = ml.operation(lambda h, token: ml.tanh(h + ml.embedding(table, token)))

    @ml.direct
    async def decoder(tokens: list[int]) -> ml.ScalarLayer:
        h: ml.ArrayLayer = ml.as_layer(np.zeros((1, 4)))
        for token in tokens:
            h = cell(h, np.array([token]))
            await ml.values(h)
        return ml.sum(h)

    batch = [[1, 2, 3]] * 7 + [[1, 9, 2]] + [[0, 1, 4]] * 4
    built = f"{__file__}:{_line_of('# DECODERS')}"
    with ml.settings(batching=batching), pytest.raises(ml.IndexRangeError, match="index 9 out of range") as raised:
        await ml.sum(ml.stack([decoder(tokens) for tokens in batch])).train()  # DECODERS
    assert raised.value.__notes__ == [
        f"monadl: raised in example 7 (from 0, in the order built) of 12 evaluated together, built at {built}"
    ]
    np.testing.assert_array_equal(table.data, np.ones((5, 4)))


async def test_an_examples_error_says_which_example_raised_it() -> None:
    """Examples evaluated together run one function built at one line: a new
    user's 32 decoders, one raising, could not tell which from the traceback.
    A direct-style step's error (stepped beside others, or alone as the last
    one running) and a bind's say which example, by its place in the order
    the examples were built; an example alone gets no note."""
    w = ml.Weight(np.array([1.0, 2.0]))

    @ml.direct
    async def example(k: int, steps: int) -> ml.ScalarLayer:
        x = ml.sum(w * float(k))
        for step in range(steps):
            await ml.values(x)
            if k == 5 and step == steps - 1:
                raise LookupError(f"example {k}")
        return x

    def bound(k: int) -> ml.ScalarLayer:
        def decide(tape: ml.Tape[Any, Any]) -> ml.Do[ml.Tape[Any, Any]]:
            if k == 2:
                raise LookupError("bound 2")
            return ml.sum(w).forward()

        return ml.Layer(ml.sum(w * float(k)).forward().bind(decide))  # BOUND

    built = f"{__file__}:{_line_of('# EXAMPLES')}"
    for lengths in ([1] * 8, [1] * 5 + [6] + [1] * 2):  # (the second: example 5 raises after the others are done)
        with pytest.raises(LookupError) as raised:
            await ml.stack([example(k, n) for k, n in enumerate(lengths)]).predict()  # EXAMPLES
        assert raised.value.__notes__ == [
            f"monadl: raised in example 5 (from 0, in the order built) of 8 evaluated together, built at {built}"
        ]
    built = f"{__file__}:{_line_of('# BOUND')}"
    with pytest.raises(LookupError) as raised:
        await ml.stack([bound(k) for k in range(4)]).predict()
    assert raised.value.__notes__ == [
        f"monadl: raised in example 2 (from 0, in the order built) of 4 evaluated together, built at {built}"
    ]
    with pytest.raises(LookupError) as raised:
        await example(5, 1).predict()
    assert not hasattr(raised.value, "__notes__")

    @ml.direct
    async def outer(k: int) -> ml.ScalarLayer:  # (examples inside examples: the outer one first)
        inner = [example(5 if k == 2 and j == 1 else 0, 1) for j in range(3)]  # INNER
        await ml.values(*inner)
        return ml.sum(w)

    shared = LookupError("one object, raised again")  # (noted once, evaluation after evaluation)

    @ml.direct
    async def again(k: int) -> ml.ScalarLayer:
        await ml.values(ml.sum(w))
        if k == 1:
            raise shared
        return ml.sum(w)

    with pytest.raises(LookupError) as raised:
        await ml.stack([outer(k) for k in range(4)]).predict()  # OUTER
    assert raised.value.__notes__ == [
        f"monadl: raised in example 2 (from 0, in the order built) of 4 evaluated together, built at "
        f"{__file__}:{_line_of('# OUTER')}; in its example 1 (from 0, in the order built) of 3 evaluated together, "
        f"built at {__file__}:{_line_of('# INNER')}"
    ]
    for _ in range(3):
        with pytest.raises(LookupError):
            await ml.stack([again(k) for k in range(3)]).predict()
    assert len(shared.__notes__) == 1


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "_line_of" not in text)


async def test_cancellation_reaches_several_waiting_direct_layers() -> None:
    w = ml.Weight(np.array([1.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model(k: int) -> ml.ScalarLayer:
        await anyio.sleep(10 + k)
        return ml.sum(w)

    with anyio.move_on_after(0.05) as scope:
        await ml.sum(ml.stack([model(k) for k in range(3)])).train()
    assert scope.cancelled_caught
    np.testing.assert_array_equal(w.data, [1.0])


async def test_a_step_asked_for_starts_before_another_fiber_computes_its_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A direct-style step that a fiber asks for starts while another fiber
    computes a graph that cannot wait for it (here, with batching off), so
    what the step awaits outside overlaps that computation."""
    from monadl.runtime import graphs

    events: list[str] = []
    graph = graphs.run

    def traced(ev: Any, frame: Any, stack: list[Any]) -> Any:
        outcome = yield from graph(ev, frame, stack)
        events.append("graph done")
        return outcome

    monkeypatch.setattr(graphs, "run", traced)
    w = ml.Weight(np.array([1.0, 2.0]))
    m = ml.Weight(np.eye(3) * 0.5)

    @ml.direct
    async def waiter() -> ml.ScalarLayer:
        events.append("step")
        await anyio.lowlevel.checkpoint()  # something outside monadl
        return ml.sum(w * float((await w)[0]))

    x: ml.ArrayLayer = ml.as_layer(np.ones((1, 3)))
    for _ in range(40):
        x = ml.tanh(x @ m)
    with ml.settings(batching=False, yield_interval_s=1e-9):  # (a turn of the event loop at every chance)
        steps = waiter()._do  # (the direct-style Do itself: a fiber of its own beside the graph's)
        assert steps is not None
        await ml.Do.zip(steps, ml.sum(x).forward()).run()
    assert events.index("step") < events.index("graph done")


async def test_each_examples_step_keeps_its_context_variables_to_itself() -> None:
    """Steps that share a task run in their own copies of its context, as
    they would in a task each: what one example sets, the next does not see."""
    import contextvars

    mark: contextvars.ContextVar[int | None] = contextvars.ContextVar("mark", default=None)
    w = ml.Weight(np.array([1.0, 2.0]))
    seen: list[int | None] = []

    @ml.direct
    async def model(k: int) -> ml.ScalarLayer:
        seen.append(mark.get())
        mark.set(k)  # (never reset)
        return ml.sum(w * float((await w)[0]))

    await ml.sum(ml.stack([model(k) for k in range(4)])).predict()
    assert seen == [None] * 4


async def test_a_failed_evaluation_closes_each_coroutine_in_its_own_context() -> None:
    """Closed after a failure in the caller's context, a coroutine's
    ``finally`` read the caller's context variables, and a settings object
    entered by both left the caller's block reset midway."""
    import contextvars

    span: contextvars.ContextVar[str] = contextvars.ContextVar("span", default="caller's")
    w = ml.Weight(np.array([1.0, 2.0]))
    same = ml.settings(check_finite=True)
    seen: list[tuple[int, str]] = []

    @ml.direct
    async def model(k: int) -> ml.ScalarLayer:
        span.set(f"example {k}")
        with same:
            try:
                await ml.values(w * 2.0)
                if k == 1:
                    raise ValueError("example 1 fails")
                await ml.values(w * 3.0)
            finally:
                seen.append((k, span.get()))
        return ml.sum(w)

    with same:
        with pytest.raises(ValueError, match="example 1 fails"):
            await ml.sum(ml.stack([model(k) for k in range(2)])).predict()
        assert ml.current_settings().check_finite
    assert not ml.current_settings().check_finite
    assert sorted(seen) == [(0, "example 0"), (1, "example 1")]


@pytest.mark.parametrize("examples", [1, 32])
async def test_an_examples_context_variables_last_across_its_awaits_of_layers(examples: int) -> None:
    """Each example's steps ran in a fresh copy of the stepping task's
    context: what it set before ``await ml.values(...)`` was gone after it
    (31 of 32 examples), and a set reset across one (a tracing span, an
    ``ml.settings`` block) raised 'created in a different Context'. Its own
    context now, as in a task of its own; none of it reaches the caller."""
    import contextvars

    span: contextvars.ContextVar[str] = contextvars.ContextVar("span", default="none")
    w = ml.Weight(np.array([1.0, 2.0]))
    kept: list[bool] = []

    @ml.direct
    async def model(k: int) -> ml.ScalarLayer:
        token = span.set(f"span-{k}")
        with ml.settings(check_finite=True):
            (first,) = await ml.values(w * 2.0)
            await anyio.lowlevel.checkpoint()  # (a foreign await too)
            (second,) = await ml.values(w * 3.0)
            kept.append(span.get() == f"span-{k}" and ml.current_settings().check_finite)
        span.reset(token)
        return ml.sum(w * float(first[0] + second[0]))

    await ml.sum(ml.stack([model(k) for k in range(examples)])).predict()
    assert kept == [True] * examples
    assert span.get() == "none" and not ml.current_settings().check_finite


async def test_a_cancel_scope_inside_a_step_works_beside_other_examples() -> None:
    """A scope that cancels a wait inside one step (asyncio delivers the
    cancellation as a BaseException) reaches the user's coroutine, as it
    does with one example alone."""
    w = ml.Weight(np.array([1.0, 2.0]))
    timed_out: list[bool] = []

    @ml.direct
    async def model() -> ml.ScalarLayer:
        with anyio.move_on_after(0.01) as scope:
            await anyio.sleep(30)
        timed_out.append(scope.cancelled_caught)
        return ml.sum(w * float((await w)[0]))

    with anyio.fail_after(60):  # a guard against a hang, not a timing
        value = await ml.sum(ml.stack([model() for _ in range(3)])).predict()
    assert float(value) == 9.0
    assert timed_out == [True] * 3


@pytest.mark.parametrize("examples", [1, 4])
async def test_a_cancel_scope_around_an_await_of_layers_is_refused(examples: int) -> None:
    """With several examples the step after the await ran in another task,
    whose exit of the scope failed (asyncio: 'a cancel scope that isn't the
    current task's'; trio: its cancel scope stack corrupted); with one, a
    timeout that fired while the layers were computed cancelled monadl's own
    waits, and a bare cancellation left predict(). Refused inside the scope,
    so that it closes in its own task."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        h = w * 2.0
        with anyio.move_on_after(30):
            await h  # (the error's line)
        return ml.sum(h)

    with pytest.raises(ml.OperandError, match="awaits layers inside a cancel scope it opened") as info:
        await ml.sum(ml.stack([model() for _ in range(examples)])).train()
    assert "await h  # (the error's line)" in "".join(__import__("traceback").format_tb(info.tb))
    assert w.data.tolist() == [1.0, 2.0]
    assert float(await ml.sum(ml.stack([w * 1.0])).train()) == 3.0  # (the loop and monadl go on)


@pytest.mark.parametrize("examples", [1, 4])
@pytest.mark.parametrize("delay", [0.0, 30.0])
async def test_an_asyncio_timeout_around_an_await_of_layers_is_refused(
    anyio_backend: str, examples: int, delay: float
) -> None:
    """anyio's check did not see asyncio's own timeout: one that fired while
    the layers were computed cancelled monadl's wait, and a bare
    CancelledError left train() (one example), or cancelled the task that
    stepped the examples and was lost (several); one that did not fire
    passed unnoticed. Refused at the await, as anyio's scopes are, and its
    timer goes with it: nothing is cancelled later."""
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's own timeout")
    import asyncio
    import traceback

    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        h = w * 2.0
        async with asyncio.timeout(delay):
            await h  # (the error's line)
        return ml.sum(h)

    with pytest.raises(ml.OperandError) as info:
        await ml.sum(ml.stack([model() for _ in range(examples)])).train()
    assert str(info.value) == (
        "an @ml.direct function awaits layers inside an asyncio.timeout it opened: its cancellation would reach "
        "monadl's own waits, not this function, and with several examples the step after this await may run in "
        "another task, where it cannot close. Put a timeout around train() or predict(), or around other awaits "
        "only."
    )
    assert "await h  # (the error's line)" in "".join(traceback.format_tb(info.tb))
    assert w.data.tolist() == [1.0, 2.0]
    await anyio.sleep(0.01)  # (a timer left behind would cancel this task here)
    assert float(await ml.sum(ml.stack([w * 1.0])).train()) == 3.0


async def test_an_asyncio_timeout_around_other_awaits_still_times_them_out(anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's own timeout")
    import asyncio

    w = ml.Weight(np.array([1.0, 2.0]))
    timed_out: list[bool] = []

    @ml.direct
    async def model() -> ml.ScalarLayer:
        try:
            async with asyncio.timeout(0.01):
                await anyio.sleep(30)
        except TimeoutError:
            timed_out.append(True)
        return ml.sum(w * float((await w)[0]))

    with anyio.fail_after(60):  # a guard against a hang, not a timing
        assert float(await ml.sum(ml.stack([model() for _ in range(3)])).predict()) == 9.0
    assert timed_out == [True] * 3


OVERLAP_ADVICE = (
    "To overlap a service with the model's work, close the task group before this await, or make the service a "
    "layer, ml.Layer(ml.Do.from_async(service).map(ml.Tape)), and await it with the model's layers in one "
    "ml.values(...), which runs them concurrently."
)


@pytest.mark.parametrize("examples", [1, 4])
async def test_a_task_group_around_an_await_of_layers_is_refused_with_advice_for_task_groups(examples: int) -> None:
    """A task group is a cancel scope: refused as one, and the message said
    only how to place a timeout, which the user never wrote."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        h = w * 2.0
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep, 0)
            await h
        return ml.sum(h)

    with pytest.raises(BaseExceptionGroup) as info:
        await ml.sum(ml.stack([model() for _ in range(examples)])).train()
    errors = info.value.exceptions
    assert {type(e) for e in errors} == {ml.OperandError}
    message = str(errors[0])
    assert message.startswith(
        "an @ml.direct function awaits layers inside a cancel scope it opened (move_on_after, fail_after, "
        "CancelScope, or a task group or a nursery, which opens one): "
    )
    assert message.endswith(OVERLAP_ADVICE)
    assert w.data.tolist() == [1.0, 2.0]


async def test_an_asyncio_task_group_around_an_await_of_layers_is_refused(anyio_backend: str) -> None:
    """Its cancellation (a task of it failed) went to the task that stepped
    the function: monadl's own, as an asyncio.timeout's did."""
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's own task group")
    import asyncio

    w = ml.Weight(np.array([1.0, 2.0]))

    @ml.direct
    async def model() -> ml.ScalarLayer:
        h = w * 2.0
        async with asyncio.TaskGroup() as tg:
            tg.create_task(asyncio.sleep(0))
            await h
        return ml.sum(h)

    for examples in (1, 4):
        with pytest.raises(BaseExceptionGroup) as info:
            await ml.sum(ml.stack([model() for _ in range(examples)])).predict()
        (error,) = {type(e): e for e in info.value.exceptions}.values()
        assert isinstance(error, ml.OperandError)
        assert str(error).startswith("an @ml.direct function awaits layers inside an asyncio.TaskGroup it opened: ")
        assert str(error).endswith(OVERLAP_ADVICE)
        assert "Put a timeout" not in str(error)


async def test_the_advice_for_overlapping_a_service_computes_what_the_task_group_would() -> None:
    """The message's way: the service as a layer, awaited in one values(...)
    with the model's layer; both values are data, and the gradient reaches
    the weight through the returned layer only."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    async def service() -> np.ndarray:
        await anyio.sleep(0.001)
        return np.array([10.0, 20.0])

    @ml.direct
    async def model() -> ml.ScalarLayer:
        h = w * 2.0
        fetched, computed = await ml.values(ml.Layer(ml.Do.from_async(service).map(ml.Tape)), ml.sum(h))
        return ml.sum(h * np.asarray(fetched)) + float(computed)

    assert float(await ml.sum(ml.stack([model() for _ in range(2)])).train()) == 2 * (100.0 + 6.0)
    np.testing.assert_array_equal(w.data, [1.0 - 0.1 * 2 * 2 * 10.0, 2.0 - 0.1 * 2 * 2 * 20.0])


def test_direct_takes_an_async_def() -> None:
    def not_async(x: ml.ArrayLayer) -> ml.ArrayLayer:
        return x

    with pytest.raises(
        TypeError, match=r"@ml.direct takes an async def.*'test_direct_takes_an_async_def.<locals>.not_async'"
    ):
        ml.direct(not_async)  # type: ignore[arg-type]  # the mistake under test (it failed at train(): no 'close')


async def test_direct_takes_an_async_def_under_a_plain_decorator() -> None:
    import functools

    def logged(f: Any) -> Any:
        @functools.wraps(f)
        def wrapper(*args: Any) -> Any:
            return f(*args)  # (returns the coroutine)

        return wrapper

    @ml.direct
    @logged
    async def double(x: ml.ArrayLayer) -> ml.ArrayLayer:
        (value,) = await ml.values(x)
        return x * 2.0 if value[0] > 0 else x

    assert (await double(ml.Weight(np.array([1.0])) * 1.0).predict()).tolist() == [2.0]


async def test_a_task_started_inside_a_direct_function_may_not_await_layers() -> None:
    w = ml.Weight(np.array([1.0, -2.0]))

    @ml.direct
    async def model(x: ml.ArrayLayer) -> ml.ArrayLayer:
        got: dict[str, float] = {}

        async def read() -> None:
            got["a"] = await x[0]

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read)
        return x * got["a"]

    with pytest.raises(BaseExceptionGroup) as raised:  # (asyncio's 'Task got bad yield', before)
        await ml.sum(model(w * 1.0)).predict()
    assert raised.group_contains(RuntimeError, match=r"in the function's own task \(not in a task it starts\)")


async def test_train_inside_a_direct_function_is_refused_and_nothing_steps() -> None:
    """Its step was taken in the middle of the outer evaluation, which then
    read the weight half updated, and kept had the outer one failed."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model(h: ml.ArrayLayer) -> ml.ScalarLayer:
        inner = await ml.sum(w * 3.0).train()
        return ml.sum(h * inner)

    with pytest.raises(ml.OperandError, match=r"train\(\) inside an @ml.direct function"):
        await model(ml.as_layer(w)).train()
    np.testing.assert_array_equal(w.data, [1.0, 2.0])


_INSIDE = (
    r"train\(\) inside a running evaluation \(from a Do.from_async effect, a task that a model started, or a backward\)"
)


async def test_train_from_an_effect_inside_an_evaluation_is_refused_and_nothing_steps() -> None:
    """A train() from a Do.from_async in a bind ran, stepped mid-evaluation,
    and its step stayed when the outer train() failed (w became [0.8, 1.6])."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    def then(tape: ml.Tape[Any, Any]) -> ml.Do[ml.Tape[Any, Any]]:
        async def nested() -> Any:
            return await ml.sum(w * w).train()

        return ml.Do.from_async(nested).map(lambda _: tape)

    outer = ml.sum(ml.Layer((w * 1.0).forward().bind(then)) * np.array([1.0, np.nan]))
    with pytest.raises(ml.OperandError, match=_INSIDE):
        await outer.train()
    np.testing.assert_array_equal(w.data, [1.0, 2.0])


async def test_a_step_by_hand_from_an_effect_inside_a_train_is_refused_and_one_inside_a_predict_runs() -> None:
    """A reviewer's case: ml.gradients then apply_gradients, the step of one's own, stepped from an
    effect of a train() that then failed (w became [0.8, 1.6]). Inside a predict(), which reads the
    weights as they were when it began and changes none, a step is fine (train() there ran before)."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    def then(tape: ml.Tape[Any, Any]) -> ml.Do[ml.Tape[Any, Any]]:
        async def nested() -> Any:
            _, grads = await ml.value_and_gradients(ml.sum(w * w))
            ml.optim.apply_gradients(grads)

        return ml.Do.from_async(nested).map(lambda _: tape)

    outer = ml.sum(ml.Layer((w * 1.0).forward().bind(then)) * np.array([1.0, np.nan]))
    with pytest.raises(ml.OperandError, match=r"^apply_gradients inside a running evaluation"):
        await outer.train()
    np.testing.assert_array_equal(w.data, [1.0, 2.0])
    assert await ml.sum(ml.Layer((w * 1.0).forward().bind(then))).predict() == 3.0  # (the weights it began with)
    np.testing.assert_allclose(w.data, [0.8, 1.6])  # (the step inside the predict)


async def test_train_from_a_task_a_model_starts_is_refused_and_nothing_steps() -> None:
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))

    @ml.direct
    async def model(x: ml.ArrayLayer) -> ml.ScalarLayer:
        async def inner() -> None:
            await ml.sum(w * w).train()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(inner)
        return ml.sum(x * w)

    with pytest.raises(BaseExceptionGroup) as raised:
        await model(ml.as_layer(np.ones(2))).train()
    assert raised.group_contains(ml.OperandError, match=_INSIDE)
    np.testing.assert_array_equal(w.data, [1.0, 2.0])


async def test_train_from_inside_a_backward_is_refused() -> None:
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    v = ml.Weight(np.array([3.0, 4.0]), optimizer=ml.optim.sgd(0.1))
    errors: list[str] = []

    def by_hand(tape: ml.Tape[Any, Any]) -> ml.Tape[Any, Any]:
        inner = tape.backward
        assert inner is not None

        def backward(delta: Any) -> None:
            step = ml.sum(v * v).train()
            try:
                step.send(None)
            except ml.OperandError as error:
                errors.append(str(error))
            finally:
                step.close()
            inner(delta)

        return ml.Tape(tape.data, backward)

    await ml.sum(ml.Layer((w * 1.0).forward().map(by_hand))).train()
    assert len(errors) == 1 and re.match(_INSIDE, errors[0])
    np.testing.assert_array_equal(v.data, [3.0, 4.0])
    np.testing.assert_allclose(w.data, [0.9, 1.9])


async def test_predict_and_gradients_inside_an_evaluation_and_trains_side_by_side_are_allowed() -> None:
    """What changes no weight may run inside an evaluation (the eager style);
    train()s that the user's own tasks run side by side each step."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    seen: list[Any] = []

    def then(tape: ml.Tape[Any, Any]) -> ml.Do[ml.Tape[Any, Any]]:
        async def nested() -> None:
            seen.append(await ml.sum(w * w).predict())
            seen.append((await ml.gradients(ml.sum(w * w), [w]))[0].tolist())

        return ml.Do.from_async(nested).map(lambda _: tape)

    @ml.direct
    async def model(x: ml.ArrayLayer) -> ml.ScalarLayer:
        async def inner() -> None:
            seen.append(await ml.sum(w * 3.0).predict())

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(inner)
        return ml.sum(x * w)

    await (ml.sum(ml.Layer((w * 1.0).forward().bind(then))) + model(ml.as_layer(np.ones(2)))).train()
    assert sorted(seen, key=str) == [5.0, 9.0, [2.0, 4.0]]  # (the effect and the task in either order)
    np.testing.assert_allclose(w.data, [0.8, 1.8])
    async with anyio.create_task_group() as tasks:
        for _ in range(3):
            tasks.start_soon(ml.sum(w).train)
    np.testing.assert_allclose(w.data, [0.5, 1.5])


@pytest.mark.parametrize("settings", [{"batching": False}, {"workers": 2}, {}])
async def test_examples_step_in_the_order_written_on_either_event_loop(settings: dict[str, Any]) -> None:
    """Where examples are not parked (batching off, the worker pool), each
    request of steps had a task of its own, which trio runs in random order:
    twelve examples drawing from one generator drew in another order, and
    trained to other weights, run after run."""
    w = ml.Weight(np.linspace(-1.0, 1.0, 12).reshape(4, 3))
    runs: list[tuple[list[int], bytes]] = []
    order: list[int] = []
    rng = np.random.default_rng(0)

    @ml.direct
    async def episode(seed: int) -> ml.ScalarLayer:
        logp = ml.log_softmax(np.full((1, 4), float(seed)) @ w)
        terms = []
        for _ in range(3):
            await ml.values(logp)
            order.append(seed)
            terms.append(ml.sum(logp[:, int(rng.integers(3))]))
        return -ml.sum(ml.stack(terms))

    for _ in range(6):
        order, rng = [], np.random.default_rng(0)
        with ml.settings(**settings):
            _, grads = await ml.value_and_gradients(ml.sum(ml.stack([episode(s) for s in range(12)])))
        runs.append((order, grads[w].tobytes()))
    assert all(order == list(range(12)) * 3 for order, _ in runs)
    assert len({g for _, g in runs}) == 1


async def test_the_last_example_running_steps_in_the_evaluations_own_task() -> None:
    """Once the other examples of a batch are done, the one still running
    steps (and awaits what is foreign) in the task that evaluates, as one
    example alone does: a task per step made a long decode beside short ones
    1.6x slower a step than alone. Before that, while others run, its steps
    run in a task of their own, and the results are every example's."""
    w = ml.Weight(np.array([0.5, -0.25]))
    tasks: list[tuple[int, bool]] = []  # (the step's task, whether the short example is done)
    done = [False]

    @ml.direct
    async def example(steps: int) -> ml.ScalarLayer:
        x = ml.sum(w * 2.0)
        for _ in range(steps):
            (value,) = await ml.values(x)
            await anyio.lowlevel.checkpoint()  # (something foreign: awaited where the step runs)
            tasks.append((anyio.get_current_task().id, done[0]))
            x = x * float(value) + w[0]
        if steps == 1:
            done[0] = True
        return x

    own = anyio.get_current_task().id
    got = await ml.stack([example(1), example(6)]).predict()
    want = [0.5]
    for steps in (1, 6):
        x = 0.5
        for _ in range(steps):
            x = x * x + 0.5
        want.append(x)
    np.testing.assert_allclose(got, want[1:], rtol=1e-12)
    alone = [task for task, after in tasks if after][1:]  # (the first may share the short one's last task)
    assert len(alone) >= 4 and set(alone) == {own}
    assert any(task != own for task, after in tasks if not after)


async def test_examples_steps_share_one_task_round_after_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Examples evaluated together step in one task, which waits for the next
    round's request instead of ending: a task started every round made two
    examples of 800 steps 10-15% slower than with one for all rounds."""
    from monadl.runtime.drive import _Stepper

    started: list[int] = []
    run = _Stepper._run

    async def counted(self: _Stepper) -> None:
        started.append(1)
        await run(self)

    monkeypatch.setattr(_Stepper, "_run", counted)
    w = ml.Weight(np.array([0.5, -0.25]))
    steps: list[int] = []

    @ml.direct
    async def example() -> ml.ScalarLayer:
        x = ml.sum(w)
        for _ in range(5):
            await ml.values(x)
            steps.append(1)
            x = x * 0.5 + w[1]
        return x

    got = await ml.stack([example(), example()]).predict()
    assert got.tolist() == pytest.approx([-0.4765625] * 2, rel=1e-12)
    assert (len(steps), len(started)) == (10, 1)


async def test_a_step_that_waits_for_a_later_one_last_in_its_request_does_not_stop_it() -> None:
    """The last step of a request awaits an event that the next step of an
    earlier example sets. Steps run in one task at a time, in order: one
    that waits for something foreign hands the steps asked for later to a
    new task even where none follow it in its own request, else they wait
    behind it for ever."""
    event = anyio.Event()
    w = ml.Weight(2.0)

    @ml.direct
    async def setter() -> ml.ScalarLayer:
        value = await (w * 1.0)
        event.set()
        return w * value

    @ml.direct
    async def waiter() -> ml.ScalarLayer:
        await event.wait()
        return w * 3.0

    with anyio.fail_after(30):  # (a deadlock guard: this takes milliseconds)
        with ml.settings(batching=False):
            assert await (setter() + waiter()).predict() == 10.0


@pytest.mark.anyio
async def test_values_not_awaited_are_refused_where_they_are_used_as_values() -> None:
    # np.argmax(ml.values(p)) was 0 (an object array of one element): every example routed to expert 0.
    w = ml.Weight(np.array([0.0, 3.0, 1.0]))
    used: list[str] = []

    @ml.direct
    async def route(x: ml.Array) -> ml.ScalarLayer:
        probs = ml.softmax(w * x)
        pending: Any = ml.values(probs)  # (Any: the mistakes under test, which mypy rejects)
        for use in (np.argmax, bool, len, float, list):
            with pytest.raises(TypeError, match=r"ml.values\(\.\.\.\) is an awaitable, not the values: write"):
                use(pending)
            used.append(use.__name__)
        (p,) = await pending
        with pytest.raises(TypeError, match=r"inside @ml.direct: \(value,\) = await ml.values\(layer\)"):
            np.argmax(probs)  # type: ignore[call-overload]
        return ml.sum(probs) * float(np.argmax(p))

    assert await route(np.ones(3)).predict() == pytest.approx(1.0)
    assert used == ["argmax", "bool", "len", "float", "list"]
    with pytest.raises(TypeError, match=r"compute on a forward value \(await layer.predict\(\);"):
        np.argmax(w * 2.0)  # type: ignore[call-overload]  # (outside: predict)


_READ_ONLY_NOTE = (
    "ml.values(...) and `await layer` give an @ml.direct function read-only views of the evaluation's own "
    "arrays: what runs after the function returns (its backward pass too) reads them, and a weight's value is "
    "the weight's own memory. If the array written is one of them, write into a copy (`h = h.copy()`) or build "
    "a new array (`np.where(mask, 0.0, h)`)"
)


async def test_values_are_read_only_views_so_a_write_cannot_change_the_evaluation() -> None:
    # A new user's TBPTT reset, `h[ended] = 0` on the state ml.values gave, changed that chunk's loss
    # and gradients (sigmoid's backward reads its output), and `ml.values(w)` was the weight's own array.
    w = ml.Weight(np.array([[0.5, -1.0], [2.0, 0.3]]), optimizer=ml.optim.sgd(0.1))
    x = np.array([[1.0, 2.0], [0.5, -0.5]])
    kept: list[Any] = []

    @ml.direct
    async def loss(write: str) -> ml.ScalarLayer:
        s = ml.sigmoid(x @ w)
        value, weight = await ml.values(s, w)
        alone = await s
        assert not (value.flags.writeable or weight.flags.writeable or alone.flags.writeable)
        assert np.shares_memory(weight, w.data)  # (a view, not a copy)
        if write == "item":
            value[0] = 0.0
        elif write == "add":
            value += 1.0
        elif write == "weight":
            weight[0, 0] = 100.0
        elif write == "awaited":
            alone.fill(0.0)
        else:
            value = value.copy()
            value[0] = 0.0
        kept.append(value)
        return ml.sum(s * 3.0)

    for write, numpy_says in [
        ("item", "assignment destination is read-only"),
        ("add", "output array is read-only"),
        ("weight", "assignment destination is read-only"),
        ("awaited", "assignment destination is read-only"),
    ]:
        with pytest.raises(ValueError) as raised:
            await loss(write).train()
        assert str(raised.value) == numpy_says
        assert getattr(raised.value, "__notes__", None) == [_READ_ONLY_NOTE]
        np.testing.assert_array_equal(w.data, [[0.5, -1.0], [2.0, 0.3]])  # nothing stepped, nothing written
    assert w.data.flags.writeable

    (gradient,) = await ml.gradients(loss("copy"), [w])
    s = 1.0 / (1.0 + np.exp(-(x @ w.data)))
    np.testing.assert_allclose(gradient, x.T @ (3.0 * s * (1.0 - s)), rtol=1e-15, atol=0)
    np.testing.assert_allclose(kept[-1], np.where([[True], [False]], 0.0, s), rtol=1e-15, atol=0)
    assert kept[-1].flags.writeable


async def test_values_of_examples_evaluated_together_are_read_only_too() -> None:
    # Examples' values are views into their batch's stacked arrays; a step beside others runs in a task.
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    seen: list[tuple[bool, Any]] = []

    @ml.direct
    async def example(k: int, write: bool) -> ml.ScalarLayer:
        h = ml.tanh(w * float(k))
        (value,) = await ml.values(h)
        seen.append((value.flags.writeable, value.copy()))
        if write and k == 1:
            value[0] = 0.0
        return ml.sum(h)

    with pytest.raises(ValueError) as raised:
        await ml.sum(ml.stack([example(k, True) for k in range(4)])).train()
    assert str(raised.value) == "assignment destination is read-only"
    assert getattr(raised.value, "__notes__", [])[0] == _READ_ONLY_NOTE  # (then which example)
    np.testing.assert_array_equal(w.data, [1.0, 2.0])
    seen.clear()
    await ml.sum(ml.stack([example(k, False) for k in range(4)])).predict()
    assert [writeable for writeable, _ in seen] == [False] * 4
    np.testing.assert_allclose(np.stack([v for _, v in seen]), np.tanh(np.outer(range(4), [1.0, 2.0])), rtol=1e-15)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("examples", [1, 3])
def test_a_direct_call_that_awaits_a_layer_built_on_itself_is_refused_not_hung(backend: str, examples: int) -> None:
    # A cycle: the call awaits a sum that holds the call itself. One example raised a bare
    # AssertionError from the driver; three hung (a reviewer's).
    rng = np.random.default_rng(5)
    w = ml.Weight(rng.normal(size=(3, 3)) / 2)

    def example(x: ml.Array) -> ml.ScalarLayer:
        h = ml.tanh(ml.as_layer(x) @ w)
        holder: dict[str, ml.ScalarLayer] = {}

        @ml.direct
        async def reads_its_own_sum() -> ml.ScalarLayer:
            await holder["out"]
            return ml.sum(h)

        out = reads_its_own_sum() + ml.sum(h)  # CYCLE
        holder["out"] = out
        return out

    async def main() -> Any:
        with anyio.fail_after(30):
            return await ml.sum(ml.stack([example(rng.normal(size=(1, 3))) for _ in range(examples)])).predict()

    with pytest.raises(ml.OperandError) as info:
        anyio.run(main, backend=backend)
    with open(__file__) as source:
        line = next(i for i, text in enumerate(source.read().splitlines(), 1) if text.endswith("# CYCLE"))
    assert str(info.value).startswith(
        f"the evaluation cannot go on: the layer built from a Do at {__file__}:{line} waits for a layer built on "
        "itself (its bind or @ml.direct function reads a layer that holds it): a cycle"
    )


async def test_a_layer_read_in_a_step_says_what_an_await_takes() -> None:
    # A new user's `await ml.as_layer(x) @ w`: the await took the operand alone, the product was
    # a layer, and its comparison two lines down was refused with no word of the await.
    w = ml.Weight(np.eye(2))

    @ml.direct
    async def example(x: ml.Array) -> ml.ScalarLayer:
        v = await ml.as_layer(x) @ w  # meant: await (ml.as_layer(x) @ w)
        return ml.sum(w) if v[0, 0] > 0 else ml.sum(w * 2.0)

    with pytest.raises(
        ml.OperandError,
        match=r"await a layer for its value.*an await takes the nearest operand alone.*write await \(a @ w\)",
    ):
        await example(np.ones((1, 2))).train()
    with pytest.raises(ml.OperandError) as outside:  # (outside a step: no such word)
        bool(ml.as_layer(np.ones(2)))
    assert "await takes" not in str(outside.value)
