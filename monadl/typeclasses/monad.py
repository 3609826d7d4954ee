"""The functor, applicative and monad laws of `Do`, as code.

Two computations are equal when running them gives equal values; ``run``
says how to run one (``anyio.run(do.run)`` in tests). Each law returns whether
it held, so a property-based test can check it on generated values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from monadl.do import Do

__all__ = [
    "applicative_homomorphism",
    "applicative_identity",
    "functor_composition",
    "functor_identity",
    "monad_associativity",
    "monad_left_identity",
    "monad_right_identity",
]

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
Run = Callable[[Do[Any]], Any]


def functor_identity(m: Do[A], run: Run) -> bool:
    """``m.map(id) == m``."""
    return bool(run(m.map(lambda x: x)) == run(m))


def functor_composition(m: Do[A], f: Callable[[A], B], g: Callable[[B], C], run: Run) -> bool:
    """``m.map(f).map(g) == m.map(g . f)``."""
    return bool(run(m.map(f).map(g)) == run(m.map(lambda x: g(f(x)))))


def applicative_identity(m: Do[A], run: Run) -> bool:
    """``m.apply(pure(id)) == m``."""
    return bool(run(m.apply(Do.pure(lambda x: x))) == run(m))


def applicative_homomorphism(x: A, f: Callable[[A], B], run: Run) -> bool:
    """``pure(x).apply(pure(f)) == pure(f(x))``."""
    return bool(run(Do.pure(x).apply(Do.pure(f))) == run(Do.pure(f(x))))


def monad_left_identity(x: A, k: Callable[[A], Do[B]], run: Run) -> bool:
    """``pure(x).bind(k) == k(x)``."""
    return bool(run(Do.pure(x).bind(k)) == run(k(x)))


def monad_right_identity(m: Do[A], run: Run) -> bool:
    """``m.bind(pure) == m``."""
    return bool(run(m.bind(Do.pure)) == run(m))


def monad_associativity(m: Do[A], k: Callable[[A], Do[B]], h: Callable[[B], Do[C]], run: Run) -> bool:
    """``m.bind(k).bind(h) == m.bind(lambda x: k(x).bind(h))``."""
    return bool(run(m.bind(k).bind(h)) == run(m.bind(lambda x: k(x).bind(h))))
