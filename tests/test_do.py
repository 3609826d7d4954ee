"""`Do`: functor, applicative and monad laws; sharing and release order."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from monadl import Do

ints = st.integers(-1000, 1000)
functions: st.SearchStrategy[Callable[[int], int]] = st.sampled_from([lambda x: x + 1, lambda x: x * 3, abs, lambda x: -x])


def run(d: Do[object]) -> object:
    return anyio.run(d.run)


@given(ints)
def test_functor_identity(x: int) -> None:
    assert run(Do.pure(x).map(lambda v: v)) == x


@given(ints, functions, functions)
def test_functor_composition(x: int, f: Callable[[int], int], g: Callable[[int], int]) -> None:
    assert run(Do.pure(x).map(f).map(g)) == run(Do.pure(x).map(lambda v: g(f(v))))


@given(ints, functions)
def test_monad_left_identity(x: int, f: Callable[[int], int]) -> None:
    def k(v: int) -> Do[int]:
        return Do.pure(f(v))

    assert run(Do.pure(x).bind(k)) == run(k(x))


@given(ints)
def test_monad_right_identity(x: int) -> None:
    assert run(Do.pure(x).bind(Do.pure)) == x


@given(ints, functions, functions)
def test_monad_associativity(x: int, f: Callable[[int], int], g: Callable[[int], int]) -> None:
    def kf(v: int) -> Do[int]:
        return Do.pure(f(v))

    def kg(v: int) -> Do[int]:
        return Do.pure(g(v))

    m = Do.pure(x)
    assert run(m.bind(kf).bind(kg)) == run(m.bind(lambda v: kf(v).bind(kg)))


@given(ints, functions)
def test_applicative_homomorphism_and_apply(x: int, f: Callable[[int], int]) -> None:
    assert run(Do.pure(x).apply(Do.pure(f))) == f(x)
    assert run(Do.pure(x).apply(Do.pure(lambda v: v))) == x


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
    assert await Do.zip(plain, plain).run() == (1, 2)


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
