"""`Do[A]`: a lazy, asynchronous, reference-counted computation.

Building a `Do` computes nothing; it only describes. Running it inside an
*evaluation* acquires a value together with a release obligation; releasing
finalises it. The same evaluation memoises `shared()` computations and layer
forwards, so a node that several consumers acquire runs once and is released
(and, for a tape, back-propagated) once, when the last consumer lets go.

The constructors are few on purpose, and one iterative machine
(`monadl.runtime.interpret`) interprets them all with an explicit stack, so neither a
long chain of `bind`s nor a deep layer graph grows the Python stack.

>>> import anyio
>>> d = Do.pure(20).map(lambda x: x + 1).bind(lambda x: Do.pure(x * 2))
>>> anyio.run(d.run)
42
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Final, Never, TypeVar, final, overload

from returns.interfaces.container import Container1
from returns.interfaces.specific.future import AwaitableFutureN
from returns.io import IO
from returns.primitives.hkt import Kind1, SupportsKind1, dekind

A = TypeVar("A", covariant=True)
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")
T = TypeVar("T")

__all__ = ["Do"]

# Constructor tags. Small ints keep the machine's dispatch cheap.
PURE: Final = 0
MAP: Final = 1
BIND: Final = 2
ZIP: Final = 3
SHARED: Final = 4
EFFECT: Final = 5
FORWARD: Final = 6
DIRECT: Final = 7


@final
class Do(  # type: ignore[type-var]  # covariant A in returns' invariant kinds, as returns' own Future
    SupportsKind1["Do[Any]", A],
    Container1[A],
    AwaitableFutureN[A, Never, Never],
):
    """A lazy description of an asynchronous computation yielding an ``A``.

    Use the constructors (`pure`, `from_async`, `resource`, `zip`, `gather`)
    and combinators (`map`, `bind`, `apply`, `shared`); run with `run` or
    `acquire`. Layers give ``Do[Tape[Data, Delta]]`` through ``forward()``.
    """

    __slots__ = ("_a", "_b", "_kind")

    _kind: int
    _a: Any
    _b: Any

    def __init__(self, kind: int, a: Any = None, b: Any = None) -> None:
        self._kind = kind
        self._a = a
        self._b = b

    def __repr__(self) -> str:
        names = ("pure", "map", "bind", "zip", "shared", "effect", "forward", "direct")
        return f"Do.{names[self._kind]}(...)"

    # ---- constructors -------------------------------------------------
    @staticmethod
    def pure(value: T) -> Do[T]:
        """A computation that yields ``value`` and releases nothing.

        >>> import anyio
        >>> anyio.run(Do.pure(3).run)
        3
        """
        return Do(PURE, value)

    @classmethod
    def from_value(cls, inner_value: T) -> Do[T]:
        """The `returns` name for `pure`."""
        return Do(PURE, inner_value)

    @staticmethod
    def from_async(thunk: Callable[[], Awaitable[T]]) -> Do[T]:
        """Await ``thunk()`` when the computation runs (once per run).

        >>> import anyio
        >>> async def fetch() -> int:
        ...     return 7
        >>> anyio.run(Do.from_async(fetch).run)
        7
        """
        return Do(EFFECT, _thunk(thunk, "Do.from_async"), None)

    @staticmethod
    def resource(
        acquire: Callable[[], Awaitable[T]],
        release: Callable[[T], Awaitable[None]],
    ) -> Do[T]:
        """A value that must be finalised: ``release`` runs exactly once,
        when the consumer releases it, or when the evaluation fails.

        >>> import anyio
        >>> log = []
        >>> async def open_() -> str:
        ...     log.append("open"); return "handle"
        >>> async def close(h: str) -> None:
        ...     log.append("close " + h)
        >>> anyio.run(Do.resource(open_, close).map(len).run)
        6
        >>> log
        ['open', 'close handle']
        """
        return Do(EFFECT, _thunk(acquire, "Do.resource"), release)

    @overload
    @staticmethod
    def zip(a: Do[B], /) -> Do[tuple[B]]: ...
    @overload
    @staticmethod
    def zip(a: Do[B], b: Do[C], /) -> Do[tuple[B, C]]: ...
    @overload
    @staticmethod
    def zip(a: Do[B], b: Do[C], c: Do[D], /) -> Do[tuple[B, C, D]]: ...
    @overload
    @staticmethod
    def zip(a: Do[B], b: Do[C], c: Do[D], d: Do[E], /) -> Do[tuple[B, C, D, E]]: ...
    @staticmethod
    def zip(*dos: Do[Any]) -> Do[tuple[Any, ...]]:
        """The parallel applicative: independent computations, joined.

        The runtime may run the operands concurrently (it does when they are
        coarse enough to pay for a fork, see `monadl.settings`).

        >>> import anyio
        >>> anyio.run(Do.zip(Do.pure(1), Do.pure("a")).run)
        (1, 'a')
        """
        return Do(ZIP, _dos(dos, "Do.zip"))

    @staticmethod
    def gather(dos: Iterable[Do[B]]) -> Do[tuple[B, ...]]:
        """`zip` over any number of computations of one type.

        >>> import anyio
        >>> anyio.run(Do.gather(Do.pure(i) for i in range(3)).run)
        (0, 1, 2)
        """
        return Do(ZIP, _dos(dos, "Do.gather"))

    # ---- combinators --------------------------------------------------
    def map(self, function: Callable[[A], B]) -> Do[B]:
        """Apply a plain function to the value; the release is unchanged."""
        return Do(MAP, self, function)

    def bind(self, function: Callable[[A], Kind1[Do[Any], B]]) -> Do[B]:
        """Run ``function(value)`` next, in the same evaluation.

        The inner computation is released before the outer one, like nested
        ``async with`` blocks.
        """
        return Do(BIND, self, function)

    def apply(self, container: Kind1[Do[Any], Callable[[A], B]]) -> Do[B]:
        """Applicative application (`returns`' ``apply``): both sides are
        independent and may run concurrently."""
        return Do(ZIP, (dekind(container), self)).map(_call_pair)

    def shared(self) -> Do[A]:
        """A handle that runs this computation at most once per evaluation.

        Every consumer that acquires the returned handle gets the same value;
        the underlying release runs when the last consumer releases.
        """
        if self._kind == SHARED or self._kind == FORWARD:
            return self
        return Do(SHARED, self)

    # ---- running ------------------------------------------------------
    async def awaitable(self) -> IO[A]:
        """Run in a fresh evaluation; the value in `returns`' ``IO``, as
        `returns`' own futures give it (``run`` gives the plain value)."""
        return IO(await self.run())

    def __await__(self) -> Generator[Any, Any, IO[A]]:
        """``await do`` is `awaitable` (the `returns` convention)."""
        return self.awaitable().__await__()

    async def run(self) -> A:
        """Acquire in a fresh evaluation, release, and return the value."""
        from monadl.runtime import entry

        return await entry.run(self)  # type: ignore[no-any-return]

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[A]:
        """Acquire in a fresh evaluation; release on leaving the block.

        Inside the block the value is alive: any resources it holds are open.
        Gradients are not tracked here (use ``Layer.train`` for that).
        """
        from monadl.runtime import entry

        async with entry.acquire(self) as value:
            yield value


def _call_pair(pair: tuple[Callable[[B], C], B]) -> C:
    return pair[0](pair[1])


def _thunk(thunk: Any, name: str) -> Any:
    """``thunk``, a function that makes an awaitable when the computation
    runs; a coroutine already made (``fetch()`` for ``fetch``) is refused
    here, where it was given, and closed (it would run at most once, and
    Python warns of one never awaited)."""
    if inspect.isawaitable(thunk) and not callable(thunk):  # (an object that is both: a job of one's own, fine)
        if inspect.iscoroutine(thunk):
            thunk.close()
        made = f" {thunk.__qualname__}" if hasattr(thunk, "__qualname__") else ""
        raise TypeError(
            f"{name} takes a function that makes the awaitable each time the computation runs, and was given "
            f"{type(thunk).__name__}{made}: pass the async function, not its call "
            f"({name}(fetch), or lambda: fetch(x) for arguments)"
        )
    if not callable(thunk):
        raise TypeError(f"{name} takes a function that makes an awaitable, and was given {type(thunk).__name__}")
    return thunk


def _dos(dos: Iterable[Any], name: str) -> tuple[Do[Any], ...]:
    """``dos`` as a tuple, each a `Do`: another object refused here, by its place."""
    made = tuple(dos)
    for i, d in enumerate(made):
        if not isinstance(d, Do):
            hint = " (a layer's Do is layer.forward())" if hasattr(d, "forward") else ""
            raise TypeError(f"{name}: operand {i} is {type(d).__name__}, not a Do{hint}")
    return made
