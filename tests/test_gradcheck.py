"""`check_grads` on a marked cell (`ml.operation`): it called the function on plain arrays first, and a
cell refuses data that its operators would compute on, so a user's correct cell was refused."""

from __future__ import annotations

import functools
import gc
import warnings
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml


def cell(a: Any, b: Any) -> Any:
    return ml.tanh(a @ b) * ml.sigmoid(b[0])


marked = ml.operation(cell)
rng = np.random.default_rng(0)
A, B = rng.random((2, 3)), rng.random((3, 4))


def test_check_grads_checks_a_marked_cell_as_the_unmarked_function() -> None:
    ml.check_grads(marked, A, B)  # (OperandError: a data argument of the cell went into a NumPy computation)
    ml.check_grads(cell, A, B)
    weights = [ml.Weight(A), ml.Weight(B)]
    by_cell = anyio.run(ml.gradients, ml.sum(marked(*weights)), weights)
    by_function = anyio.run(ml.gradients, ml.sum(cell(*weights)), weights)
    for got, expected in zip(by_cell, by_function, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_check_grads_still_finds_a_wrong_gradient_in_a_marked_cell() -> None:
    half: Any = ml.operation(lambda a: a * ml.stop_gradient(a))  # (its backward misses one of the two factors)
    with pytest.raises(AssertionError, match="gradient of argument 0"):
        ml.check_grads(half, np.array([0.5, -1.5]))


def test_check_grads_checks_a_marked_cell_behind_a_wrapper() -> None:
    # A lambda or a partial over the cell is no Operation: it was called on plain arrays, and refused.
    ml.check_grads(lambda a, b: marked(a, b) * 2.0, A, B)
    ml.check_grads(functools.partial(marked, A), B)


def test_gradients_are_data_so_a_penalty_through_them_trains_nothing_and_one_by_hand_matches_pytorch() -> None:
    """As the docs say (`ml.gradients`, the tour's "Gradients of gradients"): first order only. A
    WGAN-GP penalty built from ``ml.gradients`` in an ``@ml.direct`` step has PyTorch's value and no
    gradient for the critic; the input gradient written as layers has ``create_graph=True``'s."""
    torch = pytest.importorskip("torch")
    g = np.random.default_rng(0)
    w0, x0 = g.normal(size=(2, 1)), g.normal(size=(4, 2))
    w = ml.Weight(w0.copy())

    @ml.direct
    async def through_gradients(xd: ml.Array) -> ml.ScalarLayer:
        x = ml.Weight(xd)
        (gx,) = await ml.gradients(ml.sum(ml.tanh(x @ w)), [x])
        return ml.as_layer(float(np.mean((np.linalg.norm(gx, axis=1) - 1.0) ** 2)))

    def by_hand(x: ml.Array) -> ml.ScalarLayer:
        gx = (1.0 - ml.tanh(x @ w) ** 2.0) @ ml.transpose(w)  # d sum(tanh(x @ w)) / dx
        return ml.mean((ml.sqrt(ml.sum(gx * gx, axis=1)) - 1.0) ** 2.0)

    tw, tx = torch.tensor(w0, requires_grad=True), torch.tensor(x0, requires_grad=True)
    (tg,) = torch.autograd.grad(torch.tanh(tx @ tw).sum(), tx, create_graph=True)
    want = ((tg.norm(dim=1) - 1) ** 2).mean()
    want.backward()
    value, grads = anyio.run(ml.value_and_gradients, through_gradients(x0))
    assert value == pytest.approx(want.item(), rel=1e-14) and grads == {}
    value, grads = anyio.run(ml.value_and_gradients, by_hand(x0))
    assert value == pytest.approx(want.item(), rel=1e-14)
    np.testing.assert_allclose(grads[w], tw.grad.numpy(), rtol=1e-13)


def test_check_grads_of_a_model_that_awaits_says_to_await_and_leaves_no_coroutine_unawaited() -> None:
    # A new user's check_grads of a direct-style model with a foreign await: the message said to run it
    # inside an event loop (it was: check_grads is synchronous), and its coroutine was never awaited.
    u = ml.Weight(np.ones(4))

    @ml.direct
    async def f(x: ml.ArrayLayer) -> ml.ScalarLayer:
        (v,) = await ml.values(ml.sum(x * u))
        await anyio.sleep(0.0001)  # (a foreign await)
        return ml.sum(x * u) * (1.0 if v > 0 else 2.0)

    async def main() -> None:
        with pytest.raises(RuntimeError, match=r"ml.check_grads, gradients_sync and predict_sync are synchronous"):
            ml.check_grads(lambda w: f(w * 1.0), np.ones(4))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        anyio.run(main)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
