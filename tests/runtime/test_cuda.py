"""The GPU backend on CuPy. Skipped where CuPy or a CUDA device is absent (CI).

On a machine with a GPU: ``pip install -e '.[cuda,test]'`` and run this file.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import monadl as ml
from tests.runtime._device_cases import cells_reading_one_shared_cell, joint_reading_two_output_cells
from tests.runtime._tree_lstm_reference import host_reference, loom_calls
from tests.test_namespaces import CASES, RNG, _value_and_grads

cupy = pytest.importorskip("cupy")
cupyx = pytest.importorskip("cupyx")


def _devices() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device
        return 0


pytestmark = pytest.mark.skipif(_devices() == 0, reason="no CUDA device")


def _mlp(xp: Any, steps: int) -> tuple[list[float], list[np.ndarray]]:
    rng = np.random.default_rng(3)
    w1 = ml.Weight(xp.asarray(rng.normal(size=(32, 64)).astype(np.float32) * 0.2), optimizer=ml.optim.adam(1e-2))
    w2 = ml.Weight(xp.asarray(rng.normal(size=(64, 4)).astype(np.float32) * 0.2), optimizer=ml.optim.adam(1e-2))
    x = xp.asarray(rng.normal(size=(128, 32)).astype(np.float32))
    labels = xp.asarray(rng.integers(0, 4, 128))

    async def train() -> list[float]:
        return [float(await ml.cross_entropy(ml.relu(ml.as_layer(x) @ w1) @ w2, labels).train()) for _ in range(steps)]

    losses = anyio.run(train)
    return losses, [cupy.asnumpy(w.data) if xp is cupy else w.data for w in (w1, w2)]


def test_a_model_trains_on_the_gpu_as_on_the_cpu() -> None:
    gpu_losses, gpu_weights = _mlp(cupy, 20)
    cpu_losses, cpu_weights = _mlp(np, 20)
    assert gpu_losses[-1] < 0.8 * gpu_losses[0]
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for g, c in zip(gpu_weights, cpu_weights):
        np.testing.assert_allclose(g, c, rtol=1e-3, atol=1e-5)


def test_weights_stay_on_the_device_and_training_without_the_finite_check_never_synchronises() -> None:
    """The commit's finite check (`ml.settings(finite_steps=...)`, on by default)
    reads one flag per step back from the device; without it nothing waits."""
    w = ml.Weight(cupy.ones((256, 256), cupy.float32), optimizer=ml.optim.momentum(1e-3, 0.9))
    x = cupy.ones((64, 256), cupy.float32)

    async def steps() -> None:
        for _ in range(5):
            # No hidden host <-> device copy: CuPy raises on any synchronising transfer.
            with cupyx.allow_synchronize(False), ml.settings(finite_steps=False):
                await ml.sum(ml.tanh(ml.as_layer(x) @ w)).train()

    anyio.run(steps)
    assert isinstance(w.data, cupy.ndarray) and w.data.dtype == cupy.float32


def test_a_step_that_would_write_an_infinity_is_refused_on_the_gpu_too() -> None:
    w = ml.Weight(cupy.ones((4, 4), cupy.float32), optimizer=ml.optim.sgd(1.0))
    before = w.data.copy()
    x = cupy.full((2, 4), 3e38, cupy.float32)  # its product overflows float32: an infinite gradient and step
    with pytest.raises(ml.NonFiniteError):
        anyio.run(ml.sum(ml.as_layer(x) @ w * 10.0).train)
    np.testing.assert_array_equal(cupy.asnumpy(w.data), cupy.asnumpy(before))


def test_mixing_host_and_device_arrays_is_an_error_that_says_so() -> None:
    w = ml.Weight(cupy.ones(3))
    with pytest.raises(
        ml.DeviceError, match=r"mix an array of cupy \(.*\) and an array of numpy \(host\).*move one explicitly"
    ):
        anyio.run((w * ml.as_layer(np.ones(3))).predict)


def test_device_memory_does_not_grow_over_1000_steps() -> None:
    w1 = ml.Weight(cupy.asarray(np.random.default_rng(0).normal(size=(128, 128)).astype(np.float32) * 0.1))
    w2 = ml.Weight(cupy.asarray(np.random.default_rng(1).normal(size=(128, 128)).astype(np.float32) * 0.1))
    x = cupy.ones((32, 128), cupy.float32)
    pool = cupy.get_default_memory_pool()

    def loss() -> ml.ScalarLayer:
        left, right = ml.relu(ml.as_layer(x) @ w1), ml.tanh(ml.as_layer(x) @ w2)  # two branches, two streams
        return ml.sum((left + right) * (left + right))

    async def train(steps: int) -> None:
        for _ in range(steps):
            await loss().train()

    anyio.run(train, 20)
    after_warm_up = pool.total_bytes()
    anyio.run(train, 1000)
    assert pool.total_bytes() <= after_warm_up


def test_independent_branches_get_their_own_streams_and_agree_with_one_stream() -> None:
    rng = np.random.default_rng(0)
    ws = [ml.Weight(cupy.asarray(rng.normal(size=(256, 256)).astype(np.float32) * 0.05)) for _ in range(4)]
    x = cupy.asarray(rng.normal(size=(64, 256)).astype(np.float32))

    def loss() -> ml.ScalarLayer:
        branches = [ml.tanh(ml.tanh(ml.as_layer(x) @ w) @ w) for w in ws]
        return ml.sum(ml.concatenate(branches, axis=1))

    async def both() -> tuple[Any, Any]:
        with ml.settings(cuda_streams=1):
            one = await ml.gradients(loss(), ws)
        many = await ml.gradients(loss(), ws)
        return one, many

    one, many = anyio.run(both)
    for a, b in zip(one, many):
        np.testing.assert_allclose(cupy.asnumpy(a), cupy.asnumpy(b), rtol=1e-5, atol=1e-6)


def test_waiting_for_the_gpu_leaves_the_event_loop_free() -> None:
    """The GPU's work must outlast the host's launches: on an H200, twenty
    products of 4096 ended before the first run's launches (its kernels
    compiled then) did, and the ticker never ran, at any commit. The
    kernels are compiled first now, and the products are of 8192."""
    size = 8192
    w = ml.Weight(cupy.ones((size, size), cupy.float32) * 1e-4)
    ticks = []

    def heavy(n: int = size) -> ml.ScalarLayer:
        h = ml.as_layer(cupy.ones((n, size), cupy.float32))
        for _ in range(20):
            h = ml.tanh(h @ w)
        return ml.sum(h)

    anyio.run(heavy(8).predict)  # (compiles the kernels and starts the BLAS library)

    async def main() -> None:
        async def ticker() -> None:
            while True:
                ticks.append(time.perf_counter())
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await heavy().predict()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(ticks) > 10  # the ticker ran while predict() waited for the GPU


@pytest.mark.parametrize("function", [ml.tanh, ml.sigmoid, ml.relu], ids=lambda f: f.__name__)
def test_the_fused_kernels_give_what_the_portable_rules_give(function: Any) -> None:
    # On CuPy, tanh, sigmoid and relu run as single fused kernels; on NumPy as array-API steps.
    a = np.random.default_rng(5).normal(size=(64, 33)) * 4
    a[0, :3] = [0.0, 40.0, -40.0]  # relu's kink, sigmoid's saturation on both sides

    def value_and_gradient(xp: Any) -> tuple[np.ndarray, np.ndarray]:
        w = ml.Weight(xp.asarray(a))
        value = anyio.run(function(w).predict)
        (grad,) = anyio.run(ml.gradients, ml.sum(function(w) * xp.asarray(np.cos(a))), [w])
        return (cupy.asnumpy(value), cupy.asnumpy(grad)) if xp is cupy else (value, grad)

    gpu_value, gpu_grad = value_and_gradient(cupy)
    cpu_value, cpu_grad = value_and_gradient(np)
    np.testing.assert_allclose(gpu_value, cpu_value, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(gpu_grad, cpu_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("operation", [False, True], ids=["every-op-a-layer", "cell-as-operation"])
def test_batching_on_the_gpu_gives_the_gradients_of_the_cpu(operation: bool) -> None:
    """The Tree-LSTM of the GPU benchmark (lookups on the device, outside the
    operation), batched and node by node on CuPy, against NumPy node by node."""
    from benchmarks import treelstm_cuda

    weights, trees, want_loss, want = host_reference(8)
    for name in ("monadl cell off", "monadl cell") if operation else ("monadl", "monadl batching"):
        variant = treelstm_cuda.VARIANTS[name](weights)
        assert variant is not None
        loss, grads = anyio.run(variant.loss_and_gradients, trees)
        assert loss == pytest.approx(want_loss, rel=1e-10)
        for weight, g in want.items():
            np.testing.assert_allclose(grads[weight], g, rtol=1e-8, atol=1e-10, err_msg=f"{name}: {weight}")


def test_the_marked_cell_runs_as_groups_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batching applies on the device: a group's operands may be operation
    outputs (the children's states) beside device arrays."""
    from benchmarks import treelstm, treelstm_cuda
    from examples.tree_lstm import init_weights
    from monadl.layers._program import Program

    alone = []
    call = Program.__call__

    def counted(self: Program, *args: Any) -> Any:
        alone.append(self)
        return call(self, *args)

    monkeypatch.setattr(Program, "__call__", counted)
    variant = treelstm_cuda.VARIANTS["monadl cell"](init_weights(8))
    assert variant is not None
    anyio.run(variant.train, treelstm.make_batches(4, 1, balanced=False, seed=2)[0])
    assert len(alone) <= 2  # (of 4 x 255 cells: at most a lone root)


def test_the_examples_cell_takes_host_symbols_with_weights_on_the_gpu() -> None:
    """`examples.tree_lstm` as written (lookups inside the marked cell, host symbols), on CuPy."""
    from examples.tree_lstm import Cells, labels, tree_logits

    weights, trees, want_loss, want = host_reference(8)
    w = {k: ml.Weight(cupy.asarray(v)) for k, v in weights.items()}
    loss = ml.cross_entropy(tree_logits(w, 8, trees, Cells.of(w, 8, operation=True)), labels(trees))
    with ml.settings(batching=True):
        grads = anyio.run(ml.gradients, loss, list(w.values()))
        value = anyio.run(loss.predict)
    assert float(value) == pytest.approx(want_loss, rel=1e-10)
    for name, g in zip(w, grads):
        dense = g.to_dense() if hasattr(g, "to_dense") else g
        np.testing.assert_allclose(cupy.asnumpy(dense), want[name], rtol=1e-8, atol=1e-10, err_msg=name)


def test_a_loom_runs_the_tree_lstms_cells_by_depth_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's cells in an ``ml.loom()`` block with weights on CuPy: its groups run
    batched on the device, with NumPy's loss and gradients (float64)."""
    from examples.tree_lstm import TreeLSTM

    weights, trees, want_loss, want = host_reference(8)
    calls = loom_calls(monkeypatch)
    model = TreeLSTM(weights, device="cuda", loom=True)
    with ml.settings(batching=True):
        grads = anyio.run(ml.gradients, model.loss(trees), list(model.w.values()))
        value = anyio.run(model.loss(trees).predict)
    assert float(value) == pytest.approx(want_loss, rel=1e-10)
    for name, g in zip(model.w, grads):
        dense = g.to_dense() if hasattr(g, "to_dense") else g
        assert type(dense) is cupy.ndarray
        np.testing.assert_allclose(cupy.asnumpy(dense), want[name], rtol=1e-8, atol=1e-10, err_msg=name)
    assert sum(calls) == 2 * 765 and len(calls) < 80  # (two runs of 3 trees of 255 cells, by depth)


@pytest.mark.parametrize("ids_on", ["host", "device"])
def test_segment_sums_batched_on_the_gpu_give_the_cpus(ids_on: str) -> None:
    """Per-graph sums of messages into nodes, grouped into one scatter, with
    the ids NumPy (checked on the host, copied over) or CuPy."""
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=(3, 4))
    graphs = [(rng.normal(size=(6, 3)), rng.integers(0, 5, 6)) for _ in range(16)]

    def value_and_gradient(xp: Any) -> tuple[float, np.ndarray]:
        w = ml.Weight(xp.asarray(w0))
        ids = [xp.asarray(i) if ids_on == "device" else i for _, i in graphs]
        sums = [ml.segment_sum(ml.as_layer(xp.asarray(x)) @ w, i, 5) for (x, _), i in zip(graphs, ids)]
        loss = ml.sum(ml.stack([ml.sum(ml.tanh(s) ** 2.0) for s in sums]))
        with ml.settings(batching=True):
            [g] = anyio.run(ml.gradients, loss, [w])
            value = anyio.run(loss.predict)
        return float(value), cupy.asnumpy(g) if xp is cupy else g

    gpu_value, gpu_grad = value_and_gradient(cupy)
    cpu_value, cpu_grad = value_and_gradient(np)
    assert gpu_value == pytest.approx(cpu_value, rel=1e-12)
    np.testing.assert_allclose(gpu_grad, cpu_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_primitive_gives_numpys_values_and_gradients_on_cupy(name: str) -> None:
    """`tests/test_namespaces.py`'s cases (every primitive, checked there on
    a strict array API library) on the device: the same values and
    gradients as NumPy's, every gradient a device array."""
    arrays, build = CASES[name]
    shape = anyio.run(lambda: build([ml.Weight(a) for a in arrays], np.asarray).predict())
    projection = RNG.normal(size=np.shape(shape))

    async def both() -> tuple[Any, Any]:
        host = await _value_and_grads(arrays, build, np.asarray, projection)
        device = await _value_and_grads(
            [cupy.asarray(a) for a in arrays], build, cupy.asarray, cupy.asarray(projection)
        )
        return host, device

    (host_value, host_grads), (value, grads) = anyio.run(both)
    np.testing.assert_allclose(cupy.asnumpy(value), host_value, rtol=1e-12, atol=1e-12)
    for h, d in zip(host_grads, grads):
        assert type(d) is cupy.ndarray
        np.testing.assert_allclose(cupy.asnumpy(d), h, rtol=1e-10, atol=1e-12)


def test_a_joint_gather_of_two_output_cells_gives_the_hosts_finite_gradient_on_cupy() -> None:
    """`joint_reading_two_output_cells` on CuPy, batched: the gradient NumPy
    gives node by node (finite: each output of the joint gather narrowed to
    the rows that reach it)."""
    gradients: list[Any] = []
    for asarray, batching in ((np.asarray, False), (cupy.asarray, True), (cupy.asarray, False)):
        w, loss = joint_reading_two_output_cells(asarray)
        with ml.settings(batching=batching), np.errstate(divide="ignore", invalid="ignore"):
            gradients.append(anyio.run(ml.value_and_gradients, loss)[1][w])
    host, batched, alone = gradients
    assert np.isfinite(host).all() and type(batched) is cupy.ndarray
    np.testing.assert_allclose(cupy.asnumpy(batched), host, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cupy.asnumpy(alone), host, rtol=1e-12, atol=1e-14)


def test_calls_that_all_read_one_earlier_cells_outputs_batch_on_cupy() -> None:
    """`cells_reading_one_shared_cell` on CuPy, batched: NumPy's gradients node by node."""
    host_weights, host_loss = cells_reading_one_shared_cell(np.asarray, either=True)
    with ml.settings(batching=False):
        want = anyio.run(ml.value_and_gradients, host_loss)[1]
    weights, loss = cells_reading_one_shared_cell(cupy.asarray, either=True)
    with ml.settings(batching=True):
        got = anyio.run(ml.value_and_gradients, loss)[1]
    for weight, host in zip(weights, host_weights):
        assert type(got[weight]) is cupy.ndarray
        np.testing.assert_allclose(cupy.asnumpy(got[weight]), want[host], rtol=1e-12, atol=1e-14)
