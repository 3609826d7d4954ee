"""A scope called without ``with`` says so: a user's ``ml.settings(check_finite=True)`` on a line of its
own in a notebook cell, ``ml.optim.using_default(adam)`` or ``ml.loom()``, changed nothing, silently."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import AsyncIterator, Iterator

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import monadl as ml
from monadl.runtime.settings import current_settings


def test_settings_called_without_with_warns_at_its_line_with_what_to_write() -> None:
    with pytest.warns(UserWarning, match=r"never entered.*`with ml\.settings\(\.\.\.\):`") as caught:
        line = sys._getframe().f_lineno + 1
        ml.settings(check_finite=True)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert not ml.current_settings().check_finite


def test_using_default_called_without_with_warns() -> None:
    with pytest.warns(UserWarning, match=r"`with ml\.optim\.using_default\(\.\.\.\):`") as caught:
        line = sys._getframe().f_lineno + 1
        scope = ml.optim.using_default(ml.optim.adam(1e-3))
        del scope  # (as a later cell's assignment drops it: the warning names the line that built it)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_a_loom_called_without_with_warns_at_its_line() -> None:
    """``ml.loom()`` on a line of its own (a new user's) records no call: the
    calls after it are nodes, as outside a block, and it says so."""
    w = ml.Weight(np.ones((2, 2)))
    cell = ml.operation(lambda h: ml.tanh(h @ w))
    with pytest.warns(UserWarning, match=r"ml\.loom\(\) was never entered.*`with ml\.loom\(\):`") as caught:
        line = sys._getframe().f_lineno + 1
        ml.loom()
        out = cell(ml.as_layer(np.ones((1, 2))))
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert anyio.run(out.predict).round(3).tolist() == [[0.964, 0.964]]


def test_a_scope_entered_says_nothing_and_acts() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ml.settings(check_finite=True) as s:
            assert s.check_finite and ml.current_settings().check_finite
        with ml.optim.using_default(ml.optim.sgd(0.5)):
            w = ml.Weight(np.zeros(1))
        scope = ml.settings(workers=2)  # (entered by hand, as a script may do for its whole run)
        scope.__enter__()
        scope.__exit__(None, None, None)
        del scope
    update, _ = w.optimizer.update(np.ones(1), w.optimizer.init(w.data), w.data)
    np.testing.assert_allclose(update, [-0.5])


def test_a_scope_not_entered_says_so_in_its_repr() -> None:
    # A notebook keeps a cell's last value (Out[n]), so the scope is not dropped: its repr is what is seen.
    scope = ml.settings(check_finite=True)
    assert "not in force: write `with ml.settings(...):`" in repr(scope)
    with scope:
        assert "not in force" not in repr(scope)


def test_a_scope_decorates_a_function_as_contextlibs_do() -> None:
    """``@ml.settings(...)`` over a function worked before scopes warned
    (contextlib's scopes are decorators): it raised 'Scope' object is not
    callable, after a false warning of a scope never entered."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @ml.settings(check_finite=True)
        def inside() -> bool:
            return current_settings().check_finite

        @ml.optim.using_default(ml.optim.adam(0.1))
        def weight() -> ml.ArrayWeight:
            return ml.Weight(np.zeros(2))

        assert inside() and inside()
        assert not current_settings().check_finite
        assert len(weight().state) == 2 and len(weight().state) == 2
        gc.collect()


@pytest.mark.anyio
async def test_a_scope_decorates_an_async_function_during_its_run() -> None:
    """contextlib's decorator entered and left the scope around making the
    coroutine: an async train step under @ml.settings(finite_steps=False) was
    refused all the same."""

    @ml.settings(check_finite=True)
    async def inside() -> bool:
        await anyio.lowlevel.checkpoint()
        return current_settings().check_finite

    @ml.optim.using_default(ml.optim.adam(0.1))
    async def weight() -> ml.ArrayWeight:
        return ml.Weight(np.zeros(2))

    assert await inside() and await inside()
    assert not current_settings().check_finite
    assert len((await weight()).state) == 2


def test_a_scope_over_a_generator_function_is_refused_with_what_to_write() -> None:
    """Over a generator function it was in force while the generator was made,
    not while its body ran, in silence."""

    def numbers() -> Iterator[int]:
        yield 1

    async def stream() -> AsyncIterator[int]:
        yield 1

    for function in (numbers, stream):
        with pytest.raises(TypeError, match=r"over a generator function .* write `with ml.settings\(...\):` inside it"):
            ml.settings(check_finite=True)(function)
