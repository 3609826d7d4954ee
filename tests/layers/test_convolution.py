"""``conv2d`` and ``max_pool2d`` against PyTorch's, and the layout they hand on.

Values and every gradient are compared in float64 over a table of the shapes
the rules treat apart: stride 2, padding, a kernel larger than its stride,
non-square inputs and kernels, one channel in or out, and pooling windows
that tie (the first maximum of a window takes its whole delta, as in PyTorch).
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

try:  # (the comparisons need PyTorch, the bench extra; the NaN rule and the layout do not)
    import torch

    F = torch.nn.functional
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed (pip install -e '.[bench]')")


async def _value_and_grads(out: Any, weights: list[Any], projection: np.ndarray) -> tuple[Any, list[Any]]:
    loss = ml.sum(out * projection)
    return await out.predict(), await ml.gradients(loss, weights)


def _torch_value_and_grads(out: Any, tensors: list[Any], projection: np.ndarray) -> tuple[Any, list[Any]]:
    (out * torch.as_tensor(projection)).sum().backward()
    return out.detach().numpy(), [t.grad.numpy() for t in tensors]


def _compare(got: tuple[Any, list[Any]], want: tuple[Any, list[Any]]) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


CONV_SHAPES = {  # (input NCHW, kernel OCKK, stride, padding)
    "plain": ((2, 3, 6, 6), (4, 3, 3, 3), 1, 0),
    "stride 2, padding 1": ((2, 3, 7, 7), (4, 3, 3, 3), 2, 1),
    "kernel larger than stride, non-square": ((3, 2, 9, 5), (2, 2, 4, 3), 2, 2),
    "stride larger than kernel": ((2, 2, 7, 8), (3, 2, 2, 2), 3, 0),
    "one channel in and out": ((4, 1, 5, 7), (1, 1, 3, 3), 1, 1),
    "one sample, 1x1 kernel": ((1, 3, 4, 5), (2, 3, 1, 1), 1, 0),
    "kernel as large as the padded input": ((2, 2, 3, 2), (3, 2, 5, 4), 1, 1),
}


@needs_torch
@pytest.mark.parametrize("case", sorted(CONV_SHAPES))
def test_conv2d_gives_pytorchs_values_and_gradients(case: str) -> None:
    x_shape, k_shape, stride, padding = CONV_SHAPES[case]
    rng = np.random.default_rng(len(case))
    x, k = rng.standard_normal(x_shape), rng.standard_normal(k_shape)
    weights = [ml.Weight(x.copy()), ml.Weight(k.copy())]
    out = ml.conv2d(weights[0], weights[1], stride=stride, padding=padding)
    tensors = [torch.tensor(x, requires_grad=True), torch.tensor(k, requires_grad=True)]
    want_out = F.conv2d(tensors[0], tensors[1], stride=stride, padding=padding)
    projection = rng.standard_normal(tuple(want_out.shape))
    _compare(
        anyio.run(_value_and_grads, out, weights, projection),
        _torch_value_and_grads(want_out, tensors, projection),
    )


POOL_SHAPES = {  # (input NCHW, kernel, stride)
    "2x2": ((2, 3, 6, 8), 2, 2),
    "odd side, cropped": ((2, 2, 7, 5), 2, 2),
    "kernel larger than stride": ((1, 2, 7, 6), 3, 2),
    "stride 1": ((2, 1, 5, 5), 2, 1),
    "stride larger than kernel": ((1, 3, 8, 7), 2, 3),
}


@needs_torch
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", sorted(POOL_SHAPES))
def test_max_pool2d_gives_pytorchs_values_and_gradients(case: str, ties: bool) -> None:
    shape, kernel, stride = POOL_SHAPES[case]
    rng = np.random.default_rng(len(case))
    # Ties: few values, so most windows hold their maximum more than once.
    x = rng.integers(0, 3, size=shape) / 2.0 if ties else rng.permutation(np.prod(shape)).reshape(shape) / 7.0
    weight = ml.Weight(x.copy())
    tensor = torch.tensor(x, requires_grad=True)
    want_out = F.max_pool2d(tensor, kernel, stride)
    projection = rng.standard_normal(tuple(want_out.shape))
    _compare(
        anyio.run(_value_and_grads, ml.max_pool2d(weight, kernel, stride), [weight], projection),
        _torch_value_and_grads(want_out, [tensor], projection),
    )


def test_a_window_holding_nan_gives_its_first_nan_the_delta() -> None:
    # NumPy's argmax convention, which the rule kept when it stopped calling
    # argmax; PyTorch's CPU kernel gives the delta to the last NaN instead.
    x = np.array([[[[1.0, np.nan, 3.0, np.nan], [5.0, np.nan, 7.0, 8.0]]]])
    weight = ml.Weight(x.copy())
    out, (grad,) = anyio.run(_value_and_grads, ml.max_pool2d(weight, 2), [weight], np.array([[[[2.0, 3.0]]]]))
    assert np.isnan(out).all()
    np.testing.assert_array_equal(grad, [[[[0.0, 2.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]]]])


def test_a_nan_or_an_infinity_of_the_delta_goes_to_the_windows_maximum_alone() -> None:
    """It was multiplied by each position's 0/1 mask, and 0 * NaN, 0 * inf
    are NaN: the whole window's delta was NaN (PyTorch gives the maximum it)."""
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    weight = ml.Weight(x.copy())
    for bad in (np.nan, np.inf):
        delta = np.array([[[[bad, 1.0], [1.0, 1.0]]]])
        _, (grad,) = anyio.run(_value_and_grads, ml.max_pool2d(weight, 2), [weight], delta)
        want = np.zeros((4, 4))
        want[1, 1], want[1, 3], want[3, 1], want[3, 3] = bad, 1.0, 1.0, 1.0
        np.testing.assert_array_equal(grad[0, 0], want)


def test_an_nhwc_image_is_told_the_layout() -> None:
    kernel = ml.Weight(np.ones((4, 3, 3, 3)))
    nhwc = np.ones((2, 8, 8, 3))
    with pytest.raises(ml.ShapeError, match=r"input has 8 channels, kernel expects 3 \(NCHW: is it an NHWC image"):
        anyio.run(ml.conv2d(nhwc, kernel).predict)


@needs_torch
def test_a_small_conv_net_gives_pytorchs_gradients() -> None:
    # conv (pad 1) -> relu -> pool -> conv -> relu -> pool -> sum: each rule
    # receives its delta in the layout the one after it hands back.
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((5, 1, 8, 6)), rng.standard_normal((3, 1, 3, 3)), rng.standard_normal((4, 3, 3, 3))]
    weights = [ml.Weight(a.copy()) for a in arrays]
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    hidden = ml.max_pool2d(ml.relu(ml.conv2d(weights[0], weights[1], padding=1)), 2)
    out = ml.max_pool2d(ml.relu(ml.conv2d(hidden, weights[2], padding=1)), 2)
    want_hidden = F.max_pool2d(F.relu(F.conv2d(tensors[0], tensors[1], padding=1)), 2)
    want_out = F.max_pool2d(F.relu(F.conv2d(want_hidden, tensors[2], padding=1)), 2)
    projection = rng.standard_normal(tuple(want_out.shape))
    _compare(
        anyio.run(_value_and_grads, out, weights, projection),
        _torch_value_and_grads(want_out, tensors, projection),
    )


def test_conv2d_hands_on_its_batch_last_layout_through_elementwise_operations() -> None:
    # The output is an NCHW view of (O, OH, OW, N) memory; ReLU keeps that
    # layout, so the next convolution's batch-last view of it needs no copy.
    x, k = np.ones((4, 2, 5, 5)), np.ones((3, 2, 3, 3))
    out = anyio.run(ml.relu(ml.conv2d(x, k, padding=1)).predict)
    assert out.shape == (4, 3, 5, 5)
    assert np.transpose(out, (1, 2, 3, 0)).flags.c_contiguous


def test_a_kernel_trained_by_plain_sgd_keeps_its_c_order() -> None:
    """Its gradient was a transposed view, which plain SGD's in-place step
    made the kernel's data: non-contiguous from the first step on (a
    safetensors file of it, written by another library, scrambled)."""
    kernel = ml.Weight(np.ones((64, 32, 3, 3), np.float32), optimizer=ml.optim.sgd(0.1))  # (72 KiB: a step in place)
    loss = ml.sum(ml.conv2d(np.ones((2, 32, 6, 6), np.float32), kernel, padding=1))
    anyio.run(loss.train)
    assert kernel.data.flags.c_contiguous
