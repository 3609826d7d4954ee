"""`Do`: functor, applicative and monad laws; sharing and release order."""

from __future__ import annotations

import gc
import re
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.io import IO

import monadl as ml
from monadl import Do
from monadl.typeclasses import monad as laws

ints = st.integers(-1000, 1000)
functions: st.SearchStrategy[Callable[[int], int]] = st.sampled_from(
    [lambda x: x + 1, lambda x: x * 3, abs, lambda x: -x]
)


def run(d: Do[Any]) -> Any:
    return anyio.run(d.run)


def computations() -> st.SearchStrategy[Do[int]]:
    """Pure values, and values behind an await, a bind or a shared handle."""

    def awaited(x: int) -> Do[int]:
        async def value() -> int:
            return x

        return Do.from_async(value)

    return ints.flatmap(
        lambda x: st.sampled_from([Do.pure(x), awaited(x), Do.pure(x - 1).map(lambda v: v + 1), awaited(x).shared()])
    )


def kleisli(f: Callable[[int], int]) -> Callable[[int], Do[int]]:
    return lambda v: Do.pure(f(v))


@given(computations())
def test_functor_identity(m: Do[int]) -> None:
    assert laws.functor_identity(m, run)


@given(computations(), functions, functions)
def test_functor_composition(m: Do[int], f: Callable[[int], int], g: Callable[[int], int]) -> None:
    assert laws.functor_composition(m, f, g, run)


@given(computations(), ints, functions)
def test_applicative_laws(m: Do[int], x: int, f: Callable[[int], int]) -> None:
    assert laws.applicative_identity(m, run)
    assert laws.applicative_homomorphism(x, f, run)


@given(ints, functions)
def test_monad_left_identity(x: int, f: Callable[[int], int]) -> None:
    assert laws.monad_left_identity(x, kleisli(f), run)


@given(computations())
def test_monad_right_identity(m: Do[int]) -> None:
    assert laws.monad_right_identity(m, run)


@given(computations(), functions, functions)
def test_monad_associativity(m: Do[int], f: Callable[[int], int], g: Callable[[int], int]) -> None:
    assert laws.monad_associativity(m, kleisli(f), kleisli(g), run)


@pytest.mark.anyio
async def test_shared_runs_once_per_evaluation_and_releases_last() -> None:
    log: list[str] = []

    async def acquire() -> int:
        log.append("acquire")
        return 5

    async def release(v: int) -> None:
        log.append("release")

    shared = Do.resource(acquire, release).shared()
    both = Do.zip(shared.map(lambda v: v + 1), shared.map(lambda v: v * 2))
    assert await both.run() == (6, 10)
    assert log == ["acquire", "release"]
    assert await both.run() == (6, 10)  # a new evaluation runs it again
    assert log == ["acquire", "release"] * 2


@pytest.mark.anyio
async def test_unshared_resource_runs_per_use() -> None:
    count = 0

    async def acquire() -> int:
        nonlocal count
        count += 1
        return count

    plain = Do.from_async(acquire)
    assert sorted(await Do.zip(plain, plain).run()) == [1, 2]  # once each (concurrently: in any order)


@pytest.mark.anyio
async def test_bind_releases_inner_before_outer() -> None:
    log: list[str] = []

    def resource(name: str) -> Do[str]:
        async def acquire() -> str:
            log.append("open " + name)
            return name

        async def release(v: str) -> None:
            log.append("close " + name)

        return Do.resource(acquire, release)

    async with resource("outer").bind(lambda o: resource("inner")).acquire() as value:
        assert value == "inner"
        assert log == ["open outer", "open inner"]
    assert log == ["open outer", "open inner", "close inner", "close outer"]


@pytest.mark.anyio
async def test_gather_and_zip_keep_order() -> None:
    assert await Do.gather(Do.pure(i) for i in range(5)).run() == (0, 1, 2, 3, 4)
    assert await Do.zip(Do.pure(1), Do.pure("a"), Do.pure(2.0)).run() == (1, "a", 2.0)
    assert await Do.gather([]).run() == ()


@pytest.mark.anyio
async def test_bind_must_return_a_do() -> None:
    with pytest.raises(TypeError, match="not a Do"):
        await Do.pure(1).bind(lambda v: v).run()  # type: ignore[arg-type, return-value]  # the mistake under test
    w = ml.Weight(np.ones(2))

    def doubled(v: Any) -> Any:  # (a layer where its Do is due: the message says so)
        return w * 2.0

    with pytest.raises(
        TypeError, match=rf"doubled \({re.escape(__file__)}:\d+\) given to bind returned Layer, not a Do \(return"
    ):
        await ml.Layer(w.forward().bind(doubled)).predict()


def test_newcomers_mistakes_are_refused_where_the_do_is_built() -> None:
    """A coroutine given for its function (``from_async(fetch())``) failed when
    run, with "'coroutine' object is not callable" from the interpreter and a
    warning of a coroutine never awaited; an operand of gather that is no
    Do failed as an AttributeError of the interpreter's."""

    async def fetch() -> int:
        return 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the coroutine is closed: no "never awaited")
        with pytest.raises(TypeError, match=r"Do.from_async takes a function .* pass the async function, not its call"):
            Do.from_async(fetch())  # type: ignore[arg-type]  # the mistake under test
        with pytest.raises(TypeError, match=r"Do.resource takes a function"):
            Do.resource(fetch(), lambda h: fetch())  # type: ignore[arg-type, return-value]  # the mistake under test
        gc.collect()

    class Job:  # (both callable and awaitable: a job of one's own, taken as its function)
        def __call__(self) -> Any:
            return fetch()

        def __await__(self) -> Any:
            return fetch().__await__()

    assert anyio.run(Do.from_async(Job()).run) == 1
    with pytest.raises(TypeError, match=r"Do.gather: operand 1 is int, not a Do"):
        Do.gather([Do.pure(1), 2])  # type: ignore[arg-type]  # the mistake under test
    with pytest.raises(TypeError, match=r"Do.zip: operand 0 is Layer, not a Do \(a layer's Do is layer.forward\(\)\)"):
        Do.zip(ml.Weight(np.ones(2)) * 2.0)  # type: ignore[call-overload]  # the mistake under test


@pytest.mark.anyio
async def test_a_release_that_raises_after_a_failure_is_noted_on_it() -> None:
    """The failure stays the one raised; the release's error was dropped
    without a trace, and now is a note on it; the other releases run."""
    released: list[str] = []

    async def acquire() -> str:
        return "conn"

    async def broken(handle: str) -> None:
        released.append("broken")
        raise OSError("close failed: data not flushed")

    async def fine(handle: str) -> None:
        released.append("fine")

    def boom(_: Any) -> Do[int]:
        raise ValueError("the original failure")

    both = Do.zip(Do.resource(acquire, fine), Do.resource(acquire, broken))
    with pytest.raises(ValueError, match="the original failure") as info:
        await both.bind(boom).run()
    assert sorted(released) == ["broken", "fine"]
    assert info.value.__notes__ == [
        "monadl: while releasing after this failure, a resource's release raised OSError: close failed: data not flushed"
    ]


@pytest.mark.anyio
async def test_building_computes_nothing() -> None:
    calls: list[int] = []

    def record(v: int) -> int:
        calls.append(v)
        return v

    d = Do.pure(1).map(record)
    assert calls == []
    await d.run()
    assert calls == [1]


@pytest.mark.anyio
async def test_one_do_awaited_from_two_tasks_at_once() -> None:
    """Unlike returns' Future, a Do is a description: each await runs it anew."""
    runs = 0

    async def slow() -> int:
        nonlocal runs
        runs += 1
        await anyio.sleep(0.01)
        return 7

    d = Do.from_async(slow).map(lambda v: v * 6)
    results: list[object] = []

    async def await_it() -> None:
        results.append(await d)

    async with anyio.create_task_group() as tg:
        tg.start_soon(await_it)
        tg.start_soon(await_it)
    assert [r == IO(42) for r in results] == [True, True]
    assert runs == 2
    assert await d.run() == 42


@pytest.mark.anyio
async def test_a_resource_release_is_not_cut_short_by_a_cancellation() -> None:
    """A timeout that came during a release on the normal path cancelled it
    half way, and a release marked done is never tried again."""
    log: list[str] = []

    async def acquire() -> str:
        return "connection"

    async def release(handle: str) -> None:
        log.append("release started")
        await anyio.sleep(0.05)  # (flushing a buffer, closing politely)
        log.append("release finished")

    w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
    loss = ml.sum(ml.Layer(ml.Do.resource(acquire, release).bind(lambda h: (w * 2.0).forward())))
    with anyio.move_on_after(0.01):
        await loss.train()
    assert log == ["release started", "release finished"]


@pytest.mark.anyio
async def test_a_direct_function_whose_cleanup_awaits_fails_with_the_original_error() -> None:
    """A finally that awaits, in an example stopped by a sibling's failure:
    'coroutine ignored GeneratorExit' stood in for the sibling's error, and
    no resource was released."""
    released: list[str] = []

    async def acquire() -> str:
        return "connection"

    async def release(handle: str) -> None:
        released.append(handle)

    w = ml.Weight(np.ones(3))

    @ml.direct
    async def careful() -> ml.ScalarLayer:
        try:
            await ml.values(ml.Layer(ml.Do.resource(acquire, release).bind(lambda h: (w * 2.0).forward())))
            await ml.values(ml.sum(w) * 1.0)
        finally:
            await anyio.lowlevel.checkpoint()  # (an async cleanup: a lock, a log)
        return ml.sum(w)

    @ml.direct
    async def failing() -> ml.ScalarLayer:
        raise KeyError("the sibling's own error")

    with pytest.raises(KeyError, match="the sibling's own error"):
        await (careful() + failing()).predict()
    assert released == ["connection"]
