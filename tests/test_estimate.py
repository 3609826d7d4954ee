"""Estimate and replace: Gumbel-softmax, the combinator, frozen estimators."""

from __future__ import annotations

from collections.abc import Generator
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

import monadl as ml
from monadl.estimate import (
    _numbers,  # (the check of a black box's result)
    diversity_penalty,
    entropy_penalty,
    estimate_and_replace,
    estimator_loss,
    frozen,
    gumbel_softmax,
    harden,
    label_smoothing,
)

pytestmark = pytest.mark.anyio


async def test_hard_gumbel_softmax_is_one_hot_forward_and_soft_backward() -> None:
    logits = ml.Weight(np.array([[0.5, 1.0, -0.3], [2.0, 0.0, 0.1]]))
    projection = np.array([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0]])
    hard = gumbel_softmax(logits, 0.7, np.random.default_rng(0))
    value = await hard.predict()
    assert set(np.unique(value)) <= {0.0, 1.0} and np.all(value.sum(axis=1) == 1.0)
    [g_hard] = await ml.gradients(ml.sum(gumbel_softmax(logits, 0.7, np.random.default_rng(1)) * projection), [logits])
    [g_soft] = await ml.gradients(
        ml.sum(gumbel_softmax(logits, 0.7, np.random.default_rng(1), hard=False) * projection), [logits]
    )
    np.testing.assert_allclose(g_hard, g_soft, rtol=1e-12)
    assert np.abs(g_soft).sum() > 0


async def test_estimate_in_training_replace_at_inference() -> None:
    calls: list[Any] = []

    def black_box(choice: ml.Array) -> float:
        calls.append(choice)
        return float(np.array([10.0, 20.0, 30.0]) @ choice)

    logits = ml.Weight(np.array([0.1, 2.0, 0.3]))
    estimator_weight = ml.Weight(np.array([9.0, 21.0, 29.0]))

    def estimator(p: ml.ArrayLayer) -> ml.ScalarLayer:
        return ml.sum(p * estimator_weight)

    probabilities = ml.softmax(logits)
    trained = estimate_and_replace(black_box, estimator, [probabilities], training=True)
    assert await trained.predict() == pytest.approx(
        float(np.exp([0.1, 2.0, 0.3]) / np.exp([0.1, 2.0, 0.3]).sum() @ [9, 21, 29])
    )
    assert calls == []
    replaced = estimate_and_replace(black_box, estimator, [probabilities], training=False)
    assert await replaced.predict() == 20.0
    np.testing.assert_array_equal(calls[0], [0.0, 1.0, 0.0])
    grads = await ml.gradients(replaced, [logits, estimator_weight])
    assert all(np.all(g == 0) for g in grads)  # a black box has no gradient


async def test_frozen_estimator_weights_get_no_delta_from_the_task_loss() -> None:
    logits = ml.Weight(np.array([0.0, 0.5]))
    w = ml.Weight(np.array([1.0, 3.0]))
    [frozen_w] = frozen([w])
    task = (ml.sum(ml.softmax(logits) * frozen_w) - 3.0) ** 2.0
    g_logits, g_w = await ml.gradients(task, [logits, w])
    assert np.all(g_w == 0) and np.abs(g_logits).sum() > 0


async def test_confidence_regularisers() -> None:
    confident = np.array([[0.98, 0.01, 0.01]])
    uniform = np.full((1, 3), 1 / 3)
    assert await entropy_penalty(confident, threshold=0.5).predict() == 0.0
    assert await entropy_penalty(uniform, threshold=0.5).predict() == pytest.approx(np.log(3) - 0.5)
    smoothed = label_smoothing(np.eye(3), 0.3)
    np.testing.assert_allclose(smoothed.sum(axis=1), 1.0)
    assert smoothed[0, 0] == pytest.approx(0.8)
    np.testing.assert_array_equal(harden(np.array([[0.2, 0.5, 0.3]])), [[0, 1, 0]])
    with pytest.raises(ValueError, match="temperature"):
        gumbel_softmax(np.zeros(3), 0.0, np.random.default_rng(0))


async def test_the_diversity_penalty_is_log_n_minus_the_entropy_of_the_mean_distribution() -> None:
    batch = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    mean = batch.mean(axis=0)
    expected = np.log(3) + np.sum(mean * np.log(mean))
    assert await diversity_penalty(batch).predict() == pytest.approx(expected)
    assert await diversity_penalty(batch.T, axis=0).predict() == pytest.approx(expected)  # classes along axis 0
    sequences = np.stack([batch, batch[::-1]])  # (2, 2, 3): the mean is over both leading axes
    assert await diversity_penalty(sequences).predict() == pytest.approx(expected)
    assert await diversity_penalty(np.full((4, 5), 0.2)).predict() == pytest.approx(0.0, abs=1e-9)


async def test_the_diversity_penalty_raises_a_class_that_no_row_chooses() -> None:
    # Both rows put almost nothing on class 2: the penalty's descent direction raises its logit in each row.
    logits = ml.Weight(np.array([[4.0, 0.0, -6.0], [0.0, 4.0, -6.0]]))
    [g] = await ml.gradients(diversity_penalty(ml.softmax(logits)), [logits])
    assert np.all(g[:, 2] < 0)


async def test_a_tiny_estinet_learns_through_its_estimator() -> None:
    """Pick which of 4 inputs makes the black box answer 7, knowing it only
    through an estimator fitted to the black box's own outputs."""
    table = np.array([3.0, 7.0, 1.0, 5.0])

    def black_box(choice: ml.Array) -> float:
        return float(table @ choice)

    rng = np.random.default_rng(0)
    estimator_w = ml.Weight(np.zeros(4), optimizer=ml.optim.sgd(0.1))
    for _ in range(300):  # offline: fit the estimator on the black box's own outputs
        sample = np.eye(4)[rng.integers(0, 4)]
        await ((ml.sum(sample * estimator_w) - black_box(sample)) ** 2.0).train()
    np.testing.assert_allclose(estimator_w.data, table, atol=1e-3)

    logits = ml.Weight(np.zeros(4), optimizer=ml.optim.sgd(0.05))
    [fixed] = frozen([estimator_w])
    for _ in range(200):  # the task, through the frozen estimator only
        p = ml.softmax(logits)
        estimate = estimate_and_replace(black_box, lambda q: ml.sum(q * fixed), [p], training=True)
        await ((estimate - 7.0) ** 2.0 + 0.1 * entropy_penalty(p, threshold=0.1)).train()
    answer = await estimate_and_replace(
        black_box, lambda q: ml.sum(q * fixed), [ml.softmax(logits)], training=False
    ).predict()
    assert answer == 7.0


async def test_squared_error_refuses_shapes_that_would_broadcast() -> None:
    from monadl.estimate import estimator_loss, squared_error

    assert await squared_error(np.array([1.0, 3.0]), np.array([0.0, 1.0])).predict() == 2.5
    # An estimator's (n, 1) column against a black box's (n,) outputs: (n, n) pairs, a wrong loss, before.
    w = ml.Weight(np.array([[1.0], [2.0], [3.0]]))
    loss = estimator_loss(lambda p: p @ np.array([1.0, 2.0, 3.0]), lambda p: p @ w, [np.eye(3)])
    with pytest.raises(ml.ShapeError, match=r"prediction has shape \(3, 1\), the target \(3,\)") as raised:
        await loss.predict()
    assert "test_estimate.py" in str(raised.value)  # the user's line that built the loss
    fitted = estimator_loss(lambda p: p @ np.array([1.0, 2.0, 3.0]), lambda p: ml.reshape(p @ w, (3,)), [np.eye(3)])
    assert await fitted.predict() == 0.0
    [g] = await ml.gradients(squared_error(ml.reshape(np.eye(3) @ w, (3,)), np.zeros(3)), [w])
    np.testing.assert_allclose(g, 2.0 / 3.0 * np.array([[1.0], [2.0], [3.0]]))


async def test_a_black_box_that_returns_no_numbers_is_refused_at_inference() -> None:
    digit = ml.as_layer(np.array([0.1, 0.7, 0.2]))

    def forgot_return(p: Any) -> None:
        p @ np.array([0.0, 1.0, 2.0])

    with pytest.raises(TypeError, match=r"black box 'test_a_black_box.*forgot_return' returned NoneType"):
        await estimate_and_replace(forgot_return, lambda p: p, [digit], training=False).predict()
    with pytest.raises(TypeError, match="returned str"):
        await estimate_and_replace(lambda p: "one", lambda p: p, [digit], training=False).predict()
    with pytest.raises(TypeError, match="returned ndarray of dtype complex128, not numbers"):
        await estimate_and_replace(lambda p: p + 1j, lambda p: p, [digit], training=False).predict()


async def test_hardening_refuses_what_is_no_probability_vector_and_arrays_are_arguments_too() -> None:
    """A real-valued argument was hardened to a one-hot (the black box got a
    wrong question), and NaN probabilities to a valid-looking one; an array
    argument at inference raised an internal function's refusal."""
    value = lambda p: p @ np.array([0.0, 1.0, 2.0])  # noqa: E731
    for bad in ([0.3, 2.5, 1.0], [np.nan, 0.5, 0.5], [0.2, 0.2, 0.2]):
        layer = estimate_and_replace(value, value, [ml.as_layer(np.array(bad))], training=False)
        with pytest.raises(ValueError, match=r"argument 0 is no probability vector .* harden_arguments=False"):
            await layer.predict()
    real = estimate_and_replace(
        value, value, [ml.as_layer(np.array([0.3, 2.5, 1.0]))], training=False, harden_arguments=False
    )
    assert float(await real.predict()) == pytest.approx(4.5)
    on_data = estimate_and_replace(value, value, [np.array([0.1, 0.7, 0.2])], training=False)  # type: ignore[list-item]
    assert float(await on_data.predict()) == 1.0


async def test_a_black_box_that_makes_a_coroutine_is_called_each_time_the_loss_is_trained() -> None:
    """A plain function returning a coroutine (``lambda x: anyio.to_thread.run_sync(f, x)``,
    as the docstring advises for a blocking box) was called once when the loss
    was built: the second train() raised "cannot reuse already awaited coroutine"."""
    import anyio.to_thread

    calls: list[int] = []

    def blocking(p: Any) -> Any:
        calls.append(1)
        return p @ np.array([1.0, 2.0, 3.0])

    w = ml.Weight(np.zeros(3), optimizer=ml.optim.sgd(0.5))
    loss = estimator_loss(lambda p: anyio.to_thread.run_sync(blocking, p), lambda p: p @ w, [np.eye(3)])
    for _ in range(3):
        await loss.train()
    assert len(calls) == 3


@pytest.mark.parametrize("answer", [np.float32, np.float64, np.int64, bool])
async def test_the_black_boxs_answer_takes_the_arguments_float_dtype(answer: Any) -> None:
    # A float32 model trained through its estimator failed at inference: the
    # answer was cast to float64, which the float32 layers after it refused.
    digit = ml.as_layer(np.array([[0.1, 0.7, 0.2]], np.float32))
    head = ml.Weight(np.ones(1, np.float32))

    def box(p: Any) -> Any:
        return np.argmax(p, axis=-1).astype(answer)[:, None]

    for training in (True, False):
        out = estimate_and_replace(box, lambda q: q @ np.ones((3, 1), np.float32), [digit], training=training) * head
        assert (await out.predict()).dtype == np.float32


class _done:
    """An awaitable of a value at once (a Future, a Task, an object with ``__await__``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        yield from ()  # (a generator that yields nothing: done at once)
        return self.value


async def test_an_async_black_box_is_awaited_and_the_examples_calls_overlap() -> None:
    # A remote service: it returned a coroutine, refused as 'not numbers' with a warning
    # that it was never awaited; the estimator's loss took it as an object array.
    import anyio

    calls: list[Any] = []
    everyone = anyio.Event()

    async def service(p: Any) -> Any:  # (answers once four calls wait: only calls that overlap end)
        calls.append(p)
        if len(calls) >= 4:
            everyone.set()
        await everyone.wait()
        return p @ np.array([0.0, 1.0, 2.0])

    digits = [ml.as_layer(np.eye(3)[k]) for k in (1, 2, 0, 1)]
    answers = [estimate_and_replace(service, lambda p: p, [d], training=False) for d in digits]
    with anyio.fail_after(60):  # (a guard against a hang, not a timing)
        assert (await ml.stack(answers).predict()).tolist() == [1.0, 2.0, 0.0, 1.0]
    w = ml.Weight(np.zeros(3), optimizer=ml.optim.sgd(0.5))
    loss = estimator_loss(service, lambda p: p @ w, [np.eye(3)])
    assert float(await loss.train()) == pytest.approx(5.0 / 3.0)
    assert w.data.tolist() == pytest.approx([0.0, 1.0 / 3.0, 2.0 / 3.0])
    # A Future (run_in_executor: a blocking box in a thread) too; and numbers of other types.
    loop_future = estimator_loss(lambda p: _done(p @ np.array([0.0, 1.0, 2.0])), lambda p: p @ w, [np.eye(3)])
    assert float(await loop_future.predict()) == pytest.approx(float(await loss.predict()))
    assert (_numbers(service, [Fraction(1, 2), Decimal("2.5"), 2**70]) == [0.5, 2.5, 2.0**70]).all()
    with pytest.raises(TypeError, match=r"returned str, not numbers"):  # ("12" was taken as 12.0)
        await estimate_and_replace(lambda p: "12", lambda p: p, [digits[0]], training=False).predict()
    with pytest.raises(TypeError, match=r"returned NoneType, not numbers \(a missing return\?\)"):
        estimator_loss(lambda p: None, lambda p: p @ w, [np.eye(3)])  # (it said: shapes (3,) and ())


def test_a_nan_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature must be positive, got nan"):
        gumbel_softmax(np.zeros((1, 3)), float("nan"), np.random.default_rng(0))


async def test_scalars_and_empty_batches_are_refused_with_what_they_need() -> None:
    with pytest.raises(ValueError, match="harden: a one-hot needs a distribution"):
        harden(np.float64(0.3))  # type: ignore[arg-type]  # a scalar, on purpose (it was an IndexError)
    with pytest.raises(ValueError, match="harden: a one-hot needs"):
        await estimate_and_replace(lambda p: p, lambda p: p, [ml.as_layer(0.3)], training=False).predict()
    with pytest.raises(ml.ShapeError, match=r"diversity_penalty: the distributions have shape \(0, 3\)"):
        await diversity_penalty(np.zeros((0, 3))).predict()  # (it was NaN)
