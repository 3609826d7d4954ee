"""`Do` is a `returns` container: returns' own law checks pass on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast, get_args, get_origin

from hypothesis import strategies as st
from returns.contrib.hypothesis.containers import strategy_from_container
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

    def awaited(value: int) -> Do[int]:
        async def result() -> int:
            return value

        return Do.from_async(result)

    computations = st.integers().flatmap(lambda x: st.sampled_from([Do.pure(x), awaited(x), Do.pure(x).shared()]))
    return st.functions(like=lambda value: value, returns=computations, pure=True)


# returns types the keys as classes; Callable, a special form, is one it accepts.
CALLABLE = cast("type[object]", Callable)

check_all_laws(
    Do,
    container_strategy=strategy_from_container(Do),
    settings_kwargs={"max_examples": 30},
    type_strategies={CALLABLE: _kleisli_arrows},
)
