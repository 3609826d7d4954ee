"""A ``train()`` whose loss sends a gradient to no weight raises
`ml.NoGradientError`, naming the loss's line, and changes nothing; a loss
that reaches some weight trains as before, silently, whatever it does not
reach; ``gradients``, ``value_and_gradients`` and ``predict`` never raise it."""

from __future__ import annotations

import itertools
import sys
import warnings

import numpy as np
import pytest

import monadl as ml
from monadl.fold import Fold, Function, Identity, Record, Vector, Zeros

Series = list[list[float]]


def here() -> int:
    """The caller's line."""
    return sys._getframe(1).f_lineno


def next_value_loss(w: ml.ScalarWeight, batch: list[list[float]]) -> tuple[ml.ScalarLayer, int]:
    """A user's trial: the mean squared error of ``w * x_t`` against ``x_{t+1}``
    over a batch of series, by a Fold over each series' ``[x_t, x_{t+1}]``
    rows; a series of length 0 or 1 has no rows. Returns the loss and its line."""

    def step(acc_xy: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
        acc, xy = acc_xy
        err = xy[:, 0:1] * w - xy[:, 1:2]
        return acc + err * err

    fold = Fold(Record(Identity[ml.ArrayLayer](), Vector(2, np.float64)) >> Function(step), Zeros((1,), np.float64))
    rows: list[Series] = [[[a, b] for a, b in itertools.pairwise(s)] for s in batch]
    targets = sum(len(r) for r in rows)
    with np.errstate(invalid="ignore"):  # (NumPy's 0 / 0 warning: the loss is the NaN the error shows)
        line = here() + 1
        return ml.sum(ml.concatenate(fold.batch(rows), axis=0)) / float(targets), line


@pytest.mark.anyio
async def test_a_batch_of_series_too_short_to_have_targets_raises_naming_the_loss_and_steps_nothing() -> None:
    w = ml.Weight(0.5, optimizer=ml.optim.adam(0.1))
    state = w._state
    loss, line = next_value_loss(w, [[0.3], []])
    with np.errstate(invalid="ignore"), pytest.raises(ml.NoGradientError) as raised:
        await loss.train()
    message = str(raised.value)
    assert message.startswith(f"train() of the loss built at {__file__}:{line}: no gradient reaches any Weight, ")
    assert "its forward read no weight at all: the loss is a constant (nan: a mean over no elements" in message
    assert "catch ml.NoGradientError (its .value is the loss)" in message
    assert np.isnan(raised.value.value)
    assert isinstance(raised.value, ValueError)
    assert w.data == 0.5 and w._state is state
    # The same batch with one series long enough trains, the short ones adding nothing.
    loss, _ = next_value_loss(w, [[0.3], [], [1.0, 2.0]])
    assert await loss.train() == pytest.approx(1.5**2)
    assert w.data == pytest.approx(0.5 + 0.1)  # (Adam's first step: the rate, against the gradient's sign)


@pytest.mark.anyio
async def test_a_loss_of_no_weight_raises_with_its_value_and_changes_nothing() -> None:
    w = ml.Weight(np.ones(3))
    loss, line = ml.sum(ml.as_layer(np.arange(3.0))), here()
    with pytest.raises(ml.NoGradientError) as raised:
        await loss.train()
    assert str(raised.value) == (
        f"train() of the loss built at {__file__}:{line}: no gradient reaches any Weight, so nothing was stepped; "
        "its forward read no weight at all: the loss is a constant (3.0). Was the batch empty, or without anything "
        "to predict (series of length 0 or 1, no targets)? To skip batches that have nothing to train, test the "
        "batch before building its loss, or catch ml.NoGradientError (its .value is the loss); predict() gives a "
        "value without a step"
    )
    assert raised.value.value == 3.0
    assert w.data.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.anyio
async def test_weights_read_only_as_data_are_named() -> None:
    w, w_line = ml.Weight(np.ones(3), optimizer=ml.optim.adam(0.1)), here()
    v, v_line = ml.Weight(2.0), here()
    state = w._state
    loss = ml.sum(ml.stop_gradient(w * v))
    with pytest.raises(ml.NoGradientError, match=r"nothing was stepped; its forward read 2 weights \(made at ") as e:
        await loss.train()
    assert f"{__file__}:{w_line}" in str(e.value) and f"{__file__}:{v_line}" in str(e.value)
    assert "only as data, so the loss (6.0) is a constant to them: through ml.stop_gradient" in str(e.value)
    assert w.data.tolist() == [1.0, 1.0, 1.0] and w._state is state and v.data == 2.0


@pytest.mark.anyio
async def test_a_loss_reaching_some_weight_trains_silently_whatever_else_it_does_not_reach() -> None:
    """What stays as it was: a weight behind ``stop_gradient`` beside one
    that is reached, a zero gradient (a step of zero), a mask that selects
    nothing (the weight is reached, its gradient zero); and the entry points
    that answer with data rather than a step."""
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.5))
    frozen = ml.Weight(np.array([3.0, 4.0]), optimizer=ml.optim.adam(0.1))
    state = frozen._state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert await ml.sum(w * ml.stop_gradient(frozen)).train() == 11.0
        assert await ml.sum(w * 0.0).train() == 0.0
        assert await ml.sum(ml.where(np.zeros(2, bool), w, 0.0)).train() == 0.0
        constant = ml.sum(ml.as_layer(np.ones(2)))
        assert await constant.predict() == 2.0
        assert await ml.value_and_gradients(constant) == (2.0, {})
        [grad] = await ml.gradients(constant, [w])
        assert grad.tolist() == [0.0, 0.0]
    assert w.data.tolist() == [1.0 - 0.5 * 3.0, 2.0 - 0.5 * 4.0]
    assert frozen.data.tolist() == [3.0, 4.0] and frozen._state is state
