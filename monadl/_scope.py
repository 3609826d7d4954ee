"""A scope such as ``ml.settings(...)`` that says so when it is built and never entered.

``ml.settings(check_finite=True)`` on a line of its own (natural in a notebook
cell) builds a context manager and drops it: nothing changed, and nothing said
so. `entered_only` wraps such a factory so that what it returns warns, when it
is dropped without ever being entered, with the line that built it and what to
write instead; in a notebook, where the cell's last value is kept, its repr
says the same.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ContextDecorator
from functools import wraps
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar, cast, final

__all__ = ["Scope", "entered_only"]

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
Q = ParamSpec("Q")


@final
class Scope(Generic[T]):
    """A context manager that warns if it is dropped without being entered.

    >>> import monadl as ml
    >>> with ml.settings(check_finite=True) as s:
    ...     s.check_finite
    True
    """

    __slots__ = ("_call", "_context", "_entered", "_line")

    def __init__(self, context: AbstractContextManager[T], call: str, line: tuple[str, int]) -> None:
        self._context = context
        self._call = call
        self._line = line
        self._entered = False

    def __enter__(self) -> T:
        self._entered = True
        return self._context.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool | None:
        return self._context.__exit__(kind, error, traceback)

    def __call__(self, function: Callable[Q, R]) -> Callable[Q, R]:
        """As a decorator (``@ml.settings(check_finite=True)`` over a
        function), as contextlib's scopes are: in force during each call, and
        over an ``async def`` during each run of its coroutine (contextlib's
        entered and left it around making the coroutine: in force for none
        of it, in silence)."""
        self._entered = True
        if not isinstance(self._context, ContextDecorator):
            raise TypeError(f"{self._call} is not a decorator: use it in a with block")
        context = self._context
        if inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
            raise TypeError(
                f"{self._call} over a generator function would be in force while the generator is made, not "
                f"while it runs (its body runs at each next()); write `with {self._call}:` inside it"
            )
        if not inspect.iscoroutinefunction(function):
            return context(function)

        @wraps(function)
        async def scoped(*args: Q.args, **kwargs: Q.kwargs) -> Any:
            with context._recreate_cm():  # (a fresh one a call, as ContextDecorator does)
                return await function(*args, **kwargs)

        return cast(Callable[Q, R], scoped)

    def __repr__(self) -> str:
        state = "entered" if self._entered else f"not in force: write `with {self._call}:`"
        return f"<{self._call} scope, {state}>"

    def __del__(self) -> None:
        if self._entered or sys.is_finalizing():
            return
        filename, line = self._line  # (where it was built: where it is dropped may be a later line, or none)
        warnings.warn_explicit(
            f"{self._call} was never entered, so it changed nothing: it acts only inside a with block "
            f"(write `with {self._call}:` and indent what it is for)",
            UserWarning,
            filename,
            line,
        )


def entered_only(call: str) -> Callable[[Callable[P, AbstractContextManager[T]]], Callable[P, Scope[T]]]:
    """Wrap a context manager factory in a `Scope`; ``call``: how users call
    it, as its messages say it (``ml.settings(...)``, ``ml.loom()``)."""

    def wrap(factory: Callable[P, AbstractContextManager[T]]) -> Callable[P, Scope[T]]:
        @wraps(factory)
        def build(*args: P.args, **kwargs: P.kwargs) -> Scope[T]:
            caller = sys._getframe(1)
            return Scope(factory(*args, **kwargs), call, (caller.f_code.co_filename, caller.f_lineno))

        return build

    return wrap
