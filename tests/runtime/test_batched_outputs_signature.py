"""Cells whose operands are other cells' outputs group by each operand's
count of outputs too: flattened, two operands of 4 and 3 outputs of one
shape read as 3 and 4, and the calls grouped together (a fuzzer's: an
IndexError in the backward, and a weight's gradient missing a call's share)."""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from tests.runtime._device_cases import cells_reading_one_shared_cell


def _gradient(loss: ml.ScalarLayer, weight: ml.Weight[Any, Any], batching: bool) -> tuple[float, Any]:
    with ml.settings(batching=batching):
        value, grads = anyio.run(ml.value_and_gradients, loss)
    return float(value), grads[weight]


def _row() -> ml.ArrayLayer:
    return ml.as_layer(np.array([[0.5, 0.5]]))


def test_operands_of_four_and_three_outputs_swapped_between_calls() -> None:
    w = ml.Weight(np.array([[1.0, 2.0], [3.0, 4.0]]))
    four = ml.operation(lambda a, b: (a @ w, b @ w, b @ w, b @ w))
    three = ml.operation(lambda a: (a @ w, a @ w, a @ w))
    two = ml.operation(lambda a, b: (b @ w, a @ w))
    p = three(_row())
    q, r = four(_row(), _row()), four(_row(), _row())
    d1 = two(r[2], p[2])
    d2 = two(p[2], q[2])
    loss = ml.sum(d1[1]) + ml.sum(d2[0])
    value, grad = _gradient(loss, w, True)  # (before: an IndexError in the backward)
    assert value == 54.0
    np.testing.assert_array_equal(grad, [[7.0, 11.0], [9.0, 13.0]])
    np.testing.assert_array_equal(_gradient(loss, w, False)[1], grad)


@pytest.mark.parametrize("loom", [False, True])
def test_operands_of_three_and_two_outputs_swapped_between_calls(loom: bool) -> None:
    """One producer runs call by call (a product by a 3-D weight); one
    consumer's sum is read under stop_gradient."""
    w = ml.Weight(np.array([[1.0, 2.0], [3.0, 4.0]]))
    w3 = ml.Weight(np.array([[[1.0, 0.0], [0.0, 1.0]]]))
    looped = ml.operation(lambda a, b: (ml.reshape((a @ w)[:, None, :] @ w3, (1, 2)), a @ w, b @ w))
    plain = ml.operation(lambda a: (a @ w, a @ w))
    two = ml.operation(lambda a, b: (b @ w, a @ w))
    with ml.loom() if loom else contextlib.nullcontext():
        p, q, s = looped(_row(), _row()), looped(_row(), _row()), plain(_row())
        d1 = two(s[0], q[1])
        d2 = two(p[0], s[1])
    loss = ml.sum(d1[0]) + ml.sum(ml.stop_gradient(d2[1])) + ml.sum(q[2])
    value, grad = _gradient(loss, w, True)
    assert value == 59.0
    np.testing.assert_array_equal(grad, [[4.0, 6.0], [5.0, 7.0]])  # (before: [[3.5, 5.5], [4.5, 6.5]])
    np.testing.assert_array_equal(_gradient(loss, w, False)[1], grad)


@pytest.mark.parametrize("reads", ["first output", "either output"])
def test_calls_that_all_read_one_earlier_cells_outputs_run_as_one_group(
    grouped: list[tuple[str, int]], reads: str
) -> None:
    """`cells_reading_one_shared_cell` (before: the shared node's value, an
    `Outputs`, was taken for another library's array, and the 40 calls ran
    one by one), with the gradients node by node: the encoder's weight's is
    the sum of all 40 calls' shares. `test_stand_in_device` runs it on the
    device's path."""
    weights, loss = cells_reading_one_shared_cell(np.asarray, either=reads == "either output")
    grads = {}
    for batching in (False, True):
        with ml.settings(batching=batching):
            grads[batching] = anyio.run(ml.value_and_gradients, loss)
    assert [n for name, n in grouped if "lambda" in name] == [40]  # (the decoder's; the encoder's node is one)
    assert float(grads[True][0]) == pytest.approx(float(grads[False][0]), rel=1e-12)
    for weight in weights:
        np.testing.assert_allclose(grads[True][1][weight], grads[False][1][weight], rtol=1e-12, atol=1e-14)
