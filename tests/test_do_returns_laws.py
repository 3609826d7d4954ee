"""`Do` is a `returns` container: returns' own law checks pass on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast, get_args, get_origin

from hypothesis import strategies as st
from returns.contrib.hypothesis.laws import check_all_laws
from returns.primitives.hkt import KindN

from monadl import Do


def _kleisli_arrows(thing: type[Any]) -> st.SearchStrategy[Any]:
    """Functions that return "a container kind" return Do computations here.

    Hypothesis cannot know that returns' KindN only emulates higher kinds, so
    the strategy for such callables is given explicitly (as returns' own tests
    of custom containers do). Registering it replaces the default for every
    callable, so plain functions are pure functions to integers.
    """
    args = get_args(thing)
    if len(args) != 2 or get_origin(args[1]) is not KindN:  # a plain function: pure, to integers
        return st.functions(like=lambda value: value, returns=st.integers(), pure=True)

    return st.functions(like=lambda value: value, returns=_computations(Do), pure=True)


def _computations(_: type[Any]) -> st.SearchStrategy[Do[int]]:
    """Do computations of every kind a law can meet: pure, awaited, shared."""
    return st.integers().flatmap(lambda x: st.sampled_from([Do.pure(x), _awaited(x), Do.pure(x).shared()]))


def _awaited(value: int) -> Do[int]:
    async def result() -> int:
        return value

    return Do.from_async(result)


def _integers(_: type[Any]) -> st.SearchStrategy[int]:
    return st.integers()


# returns types the keys as classes; Callable, a special form, is one it
# accepts. So is TypeVar, the class of the laws' type variables: by default
# returns draws their values from every type Hypothesis can build (and clears
# Hypothesis' type cache before each example), which took 1-3 s a draw on a
# fresh clone with no example database and failed the health check. The laws
# hold for any value, so integers say as much.
CALLABLE = cast("type[object]", Callable)
VALUE_TYPES = {cast("type[object]", TypeVar): _integers}

check_all_laws(
    Do,
    container_strategy=_computations,
    settings_kwargs={"max_examples": 30},
    type_strategies={CALLABLE: _kleisli_arrows, **VALUE_TYPES},
)
