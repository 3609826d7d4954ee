"""Every operation follows the array library of its inputs.

`array_api_strict` is the Python array API standard with nothing more: an
array of it refuses NumPy scalars, boolean arithmetic and every NumPy-only
function. Running the primitives and a training loop on it catches NumPy-only
calls in the core without a GPU; the same code then runs on CuPy
(tests/runtime/test_cuda.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import anyio
import array_api_strict as xs
import numpy as np
import pytest

import monadl as ml
from monadl._namespace import namespace

RNG = np.random.default_rng(7)
Build = Callable[[list[Any], Callable[[Any], Any]], Any]  # (weights, asarray for indices) -> layer


def _strict(a: np.ndarray) -> Any:
    return xs.asarray(a)


# Each case: operand arrays (float64) and a function of the operand weights
# that returns a layer. The loss is the sum of the layer times a fixed random
# projection, so the whole vector-Jacobian product is compared.
CASES: dict[str, tuple[list[np.ndarray], Build]] = {
    "arithmetic": (
        [RNG.normal(size=(3, 4)), RNG.normal(size=(4,))],
        lambda w, ix: (w[0] * w[1] - w[1]) / (2.0 + w[0] * w[0]),
    ),
    "power": ([RNG.uniform(0.5, 2, size=(3,)), RNG.uniform(0.5, 2, size=(3,))], lambda w, ix: w[0] ** w[1]),
    "unary": (
        [RNG.uniform(0.5, 2, size=(2, 3))],
        lambda w, ix: ml.exp(w[0]) + ml.log(w[0]) + ml.sqrt(w[0]) + ml.abs(-w[0]) + ml.sin(w[0]) * ml.cos(w[0]),
    ),
    "activations": ([RNG.normal(size=(2, 5))], lambda w, ix: ml.tanh(w[0]) + ml.sigmoid(w[0]) + ml.relu(w[0])),
    "stable_logistic_losses": (
        [RNG.normal(size=(2, 5)) * 30, RNG.uniform(size=(2, 5)), RNG.uniform(0.5, 2, size=(5,))],
        lambda w, ix: ml.softplus(w[0]) * ml.log_sigmoid(w[0]) + ml.binary_cross_entropy_with_logits(w[0], w[1], w[2]),
    ),
    "maximum_minimum": (
        [RNG.normal(size=(6,)), RNG.normal(size=(6,))],
        lambda w, ix: ml.maximum(w[0], w[1]) * ml.minimum(w[0], 0.1),
    ),
    "matmul_2d": ([RNG.normal(size=(3, 4)), RNG.normal(size=(4, 2))], lambda w, ix: w[0] @ w[1]),
    "matmul_vector": (
        [RNG.normal(size=(4,)), RNG.normal(size=(4, 2)), RNG.normal(size=(2,))],
        lambda w, ix: (w[0] @ w[1]) @ w[2] + (w[1] @ w[2]) @ w[0],
    ),
    "reductions": (
        [RNG.normal(size=(3, 4))],
        lambda w, ix: ml.sum(w[0], axis=0) + ml.mean(w[0], axis=0) + ml.max(w[0], axis=0) + ml.sum(w[0]),
    ),
    "logsumexp_softmax": (
        [RNG.normal(size=(3, 4))],
        lambda w, ix: ml.logsumexp(w[0], axis=1) + ml.sum(ml.softmax(w[0]) * ml.log_softmax(w[0]), axis=1),
    ),
    "shapes": ([RNG.normal(size=(2, 3, 4))], lambda w, ix: ml.transpose(ml.reshape(w[0], (6, 4)), (1, 0)) * 2.0),
    "getitem": ([RNG.normal(size=(5, 3))], lambda w, ix: w[0][1:4, ::2] * 3.0),
    "getitem_fancy_repeated": (
        [RNG.normal(size=(5, 3))],
        lambda w, ix: w[0][ix([0, 2, 2, 4]), ix([1, 0, 0, 2])] + w[0][ix([3, 3, 1, 0]), 1],
    ),
    "concatenate_stack": (
        [RNG.normal(size=(2, 3)), RNG.normal(size=(2, 3))],
        lambda w, ix: ml.concatenate([w[0], ml.stack([w[1], w[0]], axis=1)[:, 0, :]], axis=-1),
    ),
    "conv2d": (
        [RNG.normal(size=(2, 2, 5, 5)), RNG.normal(size=(3, 2, 3, 3))],
        lambda w, ix: ml.conv2d(w[0], w[1], stride=2, padding=1),
    ),
    "max_pool2d": ([RNG.normal(size=(1, 2, 4, 4))], lambda w, ix: ml.max_pool2d(w[0], 2)),
    "cross_entropy": ([RNG.normal(size=(4, 3))], lambda w, ix: ml.cross_entropy(w[0], ix([0, 2, 1, 2]))),
    "cross_entropy_options": (
        [RNG.normal(size=(4, 3))],
        lambda w, ix: ml.cross_entropy(
            w[0], ix([0, 2, 1, 2]), weight=ix(np.array([0.5, 2.0, 1.0])), ignore_index=1, label_smoothing=0.1
        ),
    ),
    "segment_sum": (
        [RNG.normal(size=(5, 3)), RNG.normal(size=(4,))],
        lambda w, ix: (
            ml.segment_sum(w[0], ix([2, 0, 2, 3, 0]), 4) + ml.reshape(ml.segment_sum(w[1], ix([1, 1, 0, 2]), 4), (4, 1))
        ),
    ),
    # A mask of two axes picks elements, not rows (its gradient gave whole rows, once per element picked).
    "getitem_mask_2d": ([RNG.normal(size=(3, 4))], lambda w, ix: w[0][ix(np.arange(12).reshape(3, 4) % 3 == 0)] * 1.0),
    "getitem_mask_rows": ([RNG.normal(size=(3, 4))], lambda w, ix: w[0][ix(np.array([True, False, True]))] * 1.0),
}


async def _value_and_grads(
    arrays: list[Any], build: Build, asarray: Callable[[Any], Any], projection: Any
) -> tuple[Any, list[Any]]:
    weights = [ml.Weight(a) for a in arrays]
    out = build(weights, asarray)
    loss = ml.sum(out * projection) if projection is not None else out
    value = await loss.predict()
    return value, await ml.gradients(loss, weights)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_primitive_gives_numpys_values_and_gradients_on_a_strict_array_api_library(name: str) -> None:
    arrays, build = CASES[name]
    shape = anyio.run(lambda: build([ml.Weight(a) for a in arrays], np.asarray).predict())
    projection = RNG.normal(size=np.shape(shape))

    async def both() -> tuple[Any, ...]:
        host = await _value_and_grads(arrays, build, np.asarray, projection)
        strict = await _value_and_grads([_strict(a) for a in arrays], build, xs.asarray, _strict(projection))
        return host, strict

    (host_value, host_grads), (strict_value, strict_grads) = anyio.run(both)
    assert namespace(strict_value) is xs
    np.testing.assert_allclose(np.asarray(strict_value), host_value, rtol=1e-12, atol=1e-12)
    for h, s in zip(host_grads, strict_grads):
        assert namespace(s) is xs, type(s)
        np.testing.assert_allclose(np.asarray(s), h, rtol=1e-12, atol=1e-12)


def _mlp_losses(
    make: Callable[[np.ndarray], Any], steps: int, optimizer: Callable[[], ml.optim.GradientTransformation]
) -> tuple[list[float], list[np.ndarray]]:
    rng = np.random.default_rng(3)
    w1 = ml.Weight(make(rng.normal(size=(6, 8)).astype(np.float32) * 0.5), optimizer=optimizer())
    b1 = ml.Weight(make(np.zeros(8, np.float32)), optimizer=optimizer())
    w2 = ml.Weight(make(rng.normal(size=(8, 3)).astype(np.float32) * 0.5), optimizer=optimizer())
    x = make(rng.normal(size=(16, 6)).astype(np.float32))
    labels = make(rng.integers(0, 3, 16))

    async def train() -> list[float]:
        losses = []
        for _ in range(steps):
            hidden = ml.relu(ml.matmul(x, w1) + b1)
            losses.append(float(await ml.cross_entropy(ml.tanh(hidden) @ w2, labels).train()))
        return losses

    losses = anyio.run(train)
    return losses, [np.asarray(w.data) for w in (w1, w2, b1)]


@pytest.mark.filterwarnings("ignore:divide by zero encountered")
def test_an_infinite_delta_and_a_nan_stay_where_numpy_has_them_on_a_strict_library() -> None:
    # Without a scatter, a one-hot product spread 0 * inf as NaN to rows not picked; relu hid a NaN.
    async def both(asarray: Callable[[Any], Any]) -> list[Any]:
        w = ml.Weight(asarray(np.array([0.0, 1.0, 4.0])))
        [picked] = await ml.gradients(ml.sum(ml.sqrt(w[asarray(np.array([0, 1, 1]))])), [w])
        [masked] = await ml.gradients(ml.sum(ml.sqrt(w[asarray(np.array([True, False, True]))])), [w])
        relu = await ml.sum(ml.relu(ml.Weight(asarray(np.array([np.nan, 2.0]))))).predict()
        return [np.asarray(picked), np.asarray(masked), np.asarray(relu)]

    host, strict = anyio.run(both, np.asarray), anyio.run(both, xs.asarray)
    for h, s in zip(host, strict):
        np.testing.assert_array_equal(s, h)
    assert np.isinf(host[0][0]) and np.isnan(host[2])


@pytest.mark.parametrize("optimizer", [lambda: ml.optim.sgd(0.1), lambda: ml.optim.adam(1e-2)], ids=["sgd", "adam"])
def test_a_model_trains_with_weights_held_as_strict_array_api_arrays(
    optimizer: Callable[[], ml.optim.GradientTransformation],
) -> None:
    host_losses, host_weights = _mlp_losses(np.asarray, 30, optimizer)
    strict_losses, strict_weights = _mlp_losses(xs.asarray, 30, optimizer)
    assert strict_losses[-1] < 0.7 * strict_losses[0]  # it learns
    np.testing.assert_allclose(strict_losses, host_losses, rtol=1e-5)
    for s, h in zip(strict_weights, host_weights):
        assert s.dtype == np.float32
        np.testing.assert_allclose(s, h, rtol=1e-5, atol=1e-6)


def test_weights_stay_in_their_library_and_dtype_after_a_step() -> None:
    w = ml.Weight(xs.asarray([1.0, 2.0], dtype=xs.float32), optimizer=ml.optim.momentum(0.1, 0.9))
    anyio.run(ml.sum(w * w * 0.5).train)
    assert namespace(w.data) is xs and w.data.dtype == xs.float32
    np.testing.assert_allclose(np.asarray(w.data), [0.9, 1.8], rtol=1e-6)


def test_an_embedding_table_of_a_library_without_scatter_steps_the_rows_looked_up() -> None:
    table = ml.Weight(xs.asarray(np.arange(8.0).reshape(4, 2)), optimizer=ml.optim.sgd(1.0))
    anyio.run(ml.sum(ml.embedding(table, xs.asarray([1, 1, 3]))).train)
    np.testing.assert_array_equal(np.asarray(table.data), [[0, 1], [0, 1], [4, 5], [5, 6]])


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "decay"])
def test_an_embedding_step_of_a_library_without_scatter_leaves_the_rows_not_looked_up(optimizer: str) -> None:
    """Their values and their optimizer state (momentum, Adam's moments) stay
    as they were, as NumPy's lazy step leaves them; the dense step moved
    row 0 on its second step by its momentum, and decayed every row."""
    makers: dict[str, Callable[[], ml.optim.GradientTransformation]] = {
        "momentum": lambda: ml.optim.momentum(0.1, 0.9),
        "adam": lambda: ml.optim.adam(0.1),
        "decay": lambda: ml.optim.chain(ml.optim.add_decayed_weights(0.1), ml.optim.sgd(0.1)),
    }
    make = makers[optimizer]
    values = []
    for library in (np.asarray, _strict):
        table = ml.Weight(library(np.arange(1.0, 9.0).reshape(4, 2)), optimizer=make())
        for row in (0, 1):
            anyio.run(ml.sum(ml.embedding(table, library(np.array([row])))).train)
        values.append(np.asarray(table.data))
    np.testing.assert_allclose(values[1], values[0], rtol=1e-12)
    np.testing.assert_array_equal(values[1][2:], [[5.0, 6.0], [7.0, 8.0]])


def test_an_embedding_step_on_a_table_of_another_device_stays_on_it() -> None:
    device = xs.Device("device1")
    table = ml.Weight(xs.asarray(np.ones((5, 2)), device=device), optimizer=ml.optim.momentum(0.1, 0.9))
    anyio.run(ml.sum(ml.embedding(table, np.array([1, 1, 3]))).train)
    assert table.data.device == device
    column = np.asarray(xs.asarray(table.data, device=xs.Device("CPU_DEVICE")))[:, 0]
    np.testing.assert_allclose(column, [1.0, 0.8, 1.0, 0.9, 1.0])


def test_a_segment_sum_of_data_on_another_device_takes_numpy_ids_and_stays_on_it() -> None:
    # The ids are host data (a graph's edges): checked there and copied over, as an embedding's indices.
    device = xs.Device("device1")
    data = ml.Weight(xs.asarray(np.arange(6.0).reshape(3, 2), device=device))
    sums = ml.segment_sum(data, np.array([2, 0, 2]), 3)
    [grad] = anyio.run(ml.gradients, ml.sum(sums * ml.as_layer(xs.asarray(np.eye(3, 2), device=device))), [data])
    value = anyio.run(sums.predict)
    assert value.device == grad.device == device
    host = xs.Device("CPU_DEVICE")
    np.testing.assert_array_equal(np.asarray(xs.asarray(value, device=host)), [[2, 3], [0, 0], [4, 6]])
    np.testing.assert_array_equal(np.asarray(xs.asarray(grad, device=host)), [[0, 0], [1, 0], [0, 0]])


@pytest.mark.parametrize("kind", ["layers", "marked cell", "direct style"])
def test_a_graph_of_strict_arrays_that_batching_would_group_runs_node_by_node(kind: str) -> None:
    """Batching indexes stacked arrays by an int and by NumPy index arrays,
    which the array API leaves to each library (array_api_strict refuses
    them: every batched run raised IndexError); such arrays run node by node,
    with NumPy's values and gradients, batching forced or not."""
    rng = np.random.default_rng(0)
    w0, xs0 = rng.normal(size=(4, 4)), [rng.normal(size=(1, 4)) for _ in range(16)]

    def value_and_gradient(library: Callable[[np.ndarray], Any]) -> tuple[float, np.ndarray]:
        w = ml.Weight(library(w0))

        @ml.direct
        async def chosen(x: ml.ArrayLayer) -> ml.ArrayLayer:
            return ml.tanh(x @ w) if float(await ml.sum(x)) > 0.0 else x @ w

        steps: dict[str, Callable[[Any], Any]] = {
            "layers": lambda x: ml.tanh(x @ w),
            "marked cell": ml.operation(lambda x: ml.tanh(x @ w)),
            "direct style": chosen,
        }
        step = steps[kind]
        loss = ml.sum(ml.concatenate([step(step(ml.as_layer(library(x)))) for x in xs0], axis=0))
        with ml.settings(batching=True):
            (grad,) = anyio.run(ml.gradients, loss, [w])
            return float(np.asarray(anyio.run(loss.predict))), np.asarray(grad)

    results = [value_and_gradient(library) for library in (np.asarray, _strict)]
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-12)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-10)


def test_a_numpy_scalar_weight_meets_a_strict_array() -> None:
    scale = ml.Weight(2.0)  # NumPy float64: given to the strict library as a Python float
    x = xs.asarray([1.0, 3.0])
    loss = ml.sum(scale * ml.as_layer(x))
    assert float(anyio.run(loss.predict)) == 8.0
    (g,) = anyio.run(ml.gradients, loss, [scale])
    assert float(g) == 4.0


def test_mixing_numpy_and_another_library_is_an_error_that_names_both() -> None:
    w = ml.Weight(np.ones(3))
    with pytest.raises(
        ml.DeviceError, match=r"multiply: operands mix an array of numpy \(host\) and an array of array_api_strict"
    ) as info:
        line = sys._getframe().f_lineno + 1
        anyio.run((w * xs.asarray([1.0, 2.0, 3.0])).predict)
    assert "move one explicitly" in str(info.value)
    assert str(info.value).endswith(f"layer built at {__file__}:{line}")  # (the user's line, as other errors)
    assert w.data.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ml.DeviceError, match="concatenate"):
        anyio.run(ml.concatenate([w, xs.asarray([1.0])]).predict)


def test_strict_operands_of_two_float_dtypes_are_refused_like_numpys() -> None:
    w = ml.Weight(xs.asarray([1.0, 2.0], dtype=xs.float32))
    with pytest.raises(ml.DTypeError, match="add: operands array_api_strict float32"):
        anyio.run((w + xs.asarray([1.0, 2.0], dtype=xs.float64)).predict)


def test_a_strict_integer_array_is_not_a_weight_and_non_numbers_are_not_operands() -> None:
    with pytest.raises(ml.OperandError, match="float array"):
        ml.Weight(xs.asarray([1, 2]))
    with pytest.raises(ml.OperandError, match="integers"):
        ml.cross_entropy(ml.as_layer(xs.zeros((2, 3))), xs.asarray([0.0, 1.0]))


def test_non_finite_checks_run_in_the_strict_library() -> None:
    w = ml.Weight(xs.asarray([0.0, 1.0]))
    with ml.settings(check_finite=True), np.errstate(divide="ignore"), pytest.raises(ml.NonFiniteError, match="log"):
        anyio.run(ml.sum(ml.log(w)).train)


@pytest.mark.parametrize("data", ["rows", "data arguments"])
def test_a_looms_calls_over_another_librarys_arrays_are_built_as_nodes(data: str) -> None:
    """A loom stacks NumPy's and CuPy's arrays only: calls over another library's
    (weights, rows, data) are built as nodes, with the nodes' values and gradients."""
    rng = np.random.default_rng(6)
    start, xs_ = rng.normal(size=(3, 3)), [rng.normal(size=(1, 3)) for _ in range(4)]

    def loss(loom: bool) -> tuple[ml.ScalarLayer, ml.ArrayWeight]:
        w = ml.Weight(xs.asarray(start))
        step = ml.operation(lambda h: ml.tanh(h @ w))
        step2 = ml.operation(lambda h, x: ml.tanh(h @ w + x))
        with ml.loom() if loom else contextlib.nullcontext():
            if data == "rows":
                ends = [step(step(ml.as_layer(xs.asarray(x)))) for x in xs_]
            else:
                ends = [step2(ml.as_layer(xs.asarray(x)), xs.asarray(2 * x)) for x in xs_]
        return ml.sum(ml.concatenate(ends, axis=0)), w

    async def run(value: ml.ScalarLayer, weight: ml.ArrayWeight) -> tuple[Any, Any]:
        (grad,) = await ml.gradients(value, [weight])
        return await value.predict(), grad

    want, want_grad = anyio.run(run, *loss(False))
    got, grad = anyio.run(run, *loss(True))
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-12)
