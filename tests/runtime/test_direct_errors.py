"""A direct-style function that returns something other than a layer is named, with its line."""

from __future__ import annotations

import re

import anyio
import numpy as np
import pytest

import monadl as ml

HERE = __file__

w = ml.Weight(np.ones(3))


@ml.direct
async def score(seq: list[float]) -> ml.ScalarLayer:  # SCORE
    if not seq:
        return 0.0  # type: ignore[return-value]  # the mistake under test
    return ml.sum(w * np.array(seq))


@ml.direct
async def forgets(seq: list[float]) -> ml.ScalarLayer:  # type: ignore[return]  # FORGETS: no return, the mistake under test
    ml.sum(w * np.array(seq))


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


@pytest.mark.parametrize("several", [False, True])
def test_a_direct_function_that_returns_a_number_is_named(several: bool) -> None:
    """Alone, and beside another example (the coroutines stepped together)."""
    loss = ml.sum(ml.stack([score([1.0, 2.0, 3.0]), score([])])) if several else score([])
    with pytest.raises(TypeError) as raised:
        anyio.run(loss.predict)
    assert str(raised.value) == (
        f"the @ml.direct function score (defined at {HERE}:{line_of('# SCORE') - 1}) returned a value of type float;"
        " it must return a Layer or a Weight (make plain data one with ml.as_layer(x))"
    )


def test_a_direct_function_without_a_return_is_named() -> None:
    with pytest.raises(
        TypeError, match=re.escape(f"forgets (defined at {HERE}:{line_of('# FORGETS') - 1}) returned None")
    ):
        anyio.run(forgets([1.0]).predict)
