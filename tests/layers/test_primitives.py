"""Every primitive's backward against central finite differences, float64,
over a table of shapes that includes broadcasting."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.gradcheck import check_grads, check_grads_over_shapes
from monadl.layers import _products
from monadl.layers._primitives import PRIMITIVES


def line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


BROADCAST_PAIRS: list[list[tuple[int, ...]]] = [
    [(), ()],
    [(3,), (3,)],
    [(2, 3), (3,)],
    [(3,), (2, 3)],
    [(2, 1), (1, 3)],
    [(2, 3), ()],
    [(), (2, 3)],
    [(4, 1, 3), (2, 1)],
]
SHAPES: list[list[tuple[int, ...]]] = [[()], [(4,)], [(2, 3)], [(2, 3, 2)]]

Fn = Callable[..., Any]

BINARY: list[tuple[str, Fn, float]] = [
    ("add", lambda a, b: a + b, -2.0),
    ("subtract", lambda a, b: a - b, -2.0),
    ("multiply", lambda a, b: a * b, -2.0),
    ("divide", lambda a, b: a / b, 0.5),
    ("power", lambda a, b: a**b, 0.5),
    ("maximum", ml.maximum, -2.0),
    ("minimum", ml.minimum, -2.0),
]

UNARY: list[tuple[str, Fn, float]] = [
    ("negative", lambda a: -a, -2.0),
    ("exp", ml.exp, -2.0),
    ("log", ml.log, 0.5),
    ("sqrt", ml.sqrt, 0.5),
    ("abs", ml.abs, -2.0),
    ("sin", ml.sin, -4.0),
    ("cos", ml.cos, -4.0),
    ("tanh", ml.tanh, -2.0),
    ("sigmoid", ml.sigmoid, -4.0),
    ("relu", ml.relu, -2.0),
    ("softplus", ml.softplus, -4.0),
    ("log_sigmoid", ml.log_sigmoid, -4.0),
    ("sum", lambda a: ml.sum(a), -2.0),
    ("mean", lambda a: ml.mean(a), -2.0),
    ("max", lambda a: ml.max(a), -2.0),
    ("logsumexp", lambda a: ml.logsumexp(a), -2.0),
]


@pytest.mark.parametrize(("name", "fn", "low"), BINARY, ids=[b[0] for b in BINARY])
def test_binary_primitives_match_finite_differences(name: str, fn: Fn, low: float) -> None:
    assert check_grads_over_shapes(fn, BROADCAST_PAIRS, low=low, high=2.0) == len(BROADCAST_PAIRS)


@pytest.mark.parametrize(("name", "fn", "low"), UNARY, ids=[u[0] for u in UNARY])
def test_unary_primitives_match_finite_differences(name: str, fn: Fn, low: float) -> None:
    assert check_grads_over_shapes(fn, SHAPES, low=low, high=2.0) == len(SHAPES)


AXIS_CASES: list[tuple[str, Fn, tuple[int, ...]]] = [
    ("sum axis 0", lambda a: ml.sum(a, axis=0), (3, 4)),
    ("sum axis -1 keepdims", lambda a: ml.sum(a, axis=-1, keepdims=True), (3, 4)),
    ("sum axes (0, 2)", lambda a: ml.sum(a, axis=(0, 2)), (2, 3, 4)),
    ("mean axis 1", lambda a: ml.mean(a, axis=1), (3, 4)),
    ("mean keepdims", lambda a: ml.mean(a, axis=0, keepdims=True), (3, 4)),
    ("max axis 1", lambda a: ml.max(a, axis=1), (3, 4)),
    ("max keepdims", lambda a: ml.max(a, axis=0, keepdims=True), (3, 4)),
    ("logsumexp axis 1", lambda a: ml.logsumexp(a, axis=1), (3, 4)),
    ("logsumexp keepdims", lambda a: ml.logsumexp(a, axis=0, keepdims=True), (3, 4)),
    ("softmax", lambda a: ml.softmax(a, axis=-1), (3, 4)),
    ("softmax axis 0", lambda a: ml.softmax(a, axis=0), (3, 4)),
    ("log_softmax", lambda a: ml.log_softmax(a), (3, 4)),
    ("reshape", lambda a: ml.reshape(a, (4, 3)) * np.arange(12.0).reshape(4, 3), (3, 4)),
    ("method reshape", lambda a: a.reshape(2, 6), (3, 4)),
    ("transpose", lambda a: ml.transpose(a, (2, 0, 1)), (2, 3, 4)),
    (".T", lambda a: a.T, (3, 4)),
    ("basic index", lambda a: a[1:, ::2], (3, 4)),
    ("integer index", lambda a: a[1], (3, 4)),
    ("fancy index with repeats", lambda a: a[np.array([0, 2, 0, 0])], (3, 4)),
    ("pick", lambda a: a[np.arange(3), np.array([1, 0, 1])], (3, 4)),
    ("split", lambda a: ml.concatenate([p * float(k + 1) for k, p in enumerate(ml.split(a, 2))], axis=-1), (3, 4)),
    ("split sizes axis 0, one part", lambda a: ml.split(a, [1, 2], axis=0)[1], (3, 4)),
    ("split_part", lambda a: ml.split(a, 3, axis=1)[2], (2, 3, 4)),
]


@pytest.mark.parametrize(("name", "fn", "shape"), AXIS_CASES, ids=[c[0] for c in AXIS_CASES])
def test_axis_and_shape_primitives(name: str, fn: Fn, shape: tuple[int, ...]) -> None:
    check_grads(fn, np.random.default_rng(1).standard_normal(shape))


MATMUL_SHAPES: list[list[tuple[int, ...]]] = [
    [(3,), (3,)],
    [(2, 3), (3,)],
    [(3,), (3, 4)],
    [(2, 3), (3, 4)],
    [(5, 2, 3), (3, 4)],
    [(2, 3), (5, 3, 4)],
    [(5, 2, 3), (5, 3, 4)],
    [(3,), (5, 3, 4)],
    [(5, 2, 3), (3,)],
]


def test_matmul_over_shapes() -> None:
    assert check_grads_over_shapes(lambda a, b: a @ b, MATMUL_SHAPES) == len(MATMUL_SHAPES)
    check_grads(ml.dot, np.arange(3.0), np.ones(3))


@pytest.mark.parametrize(("left", "right"), [((1, 1), (3, 2)), ((3, 1), (3, 2)), ((3, 1), (2,))])
def test_matmul_of_an_inner_size_of_one_refuses_what_numpy_refuses(
    left: tuple[int, ...], right: tuple[int, ...]
) -> None:
    # The one-column product is a broadcast multiplication: (3, 1) @ (3, 2) gave the
    # elementwise product, with gradients, where NumPy raises.
    with pytest.raises(ValueError):
        np.ones(left) @ np.ones(right)
    with pytest.raises(ml.ShapeError, match="do not fit together"):
        anyio.run(ml.matmul(ml.as_layer(np.ones(left)), ml.as_layer(np.ones(right))).predict)
    with pytest.raises(ml.ShapeError, match="do not fit together"):
        anyio.run(ml.dense(np.ones(left), ml.Weight(np.ones(right)), ml.Weight(np.zeros(right[-1]))).predict)
    check_grads(lambda a, b: a @ b, np.arange(3.0).reshape(3, 1), np.arange(2.0).reshape(1, 2))


def test_a_one_operand_refusal_names_its_operand_not_a_fit() -> None:
    # 'max: operands float64[0, 4] do not fit together' said of one operand.
    with pytest.raises(ml.ShapeError) as caught:
        anyio.run(ml.max(ml.as_layer(np.ones((0, 4))), axis=0).predict)
    message = str(caught.value)
    assert message.startswith("max: cannot take float64[0, 4] (zero-size array to reduction operation maximum")
    assert "fit together" not in message and "test_primitives.py" in message


def test_concatenate_and_stack() -> None:
    rng = np.random.default_rng(2)
    a, b, c = rng.standard_normal((2, 3)), rng.standard_normal((1, 3)), rng.standard_normal((4, 3))
    check_grads(lambda x, y, z: ml.concatenate([x, y, z], axis=0), a, b, c)
    check_grads(lambda x, y: ml.concatenate([x, y], axis=1), a, rng.standard_normal((2, 2)))
    check_grads(lambda x, y: ml.stack([x, y], axis=1), a, rng.standard_normal((2, 3)))


def test_cross_entropy_against_closed_form_and_differences() -> None:
    rng = np.random.default_rng(3)
    logits, labels = rng.standard_normal((4, 5)), np.array([0, 4, 2, 2])
    check_grads(lambda z: ml.cross_entropy(z, labels), logits)
    expected = -np.mean([logits[i, k] - np.log(np.exp(logits[i]).sum()) for i, k in enumerate(labels)])
    got = anyio.run(ml.cross_entropy(logits, labels).predict)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("stride", "padding"), [(1, 0), (2, 1), (1, 2)])
def test_conv2d(stride: int, padding: int) -> None:
    rng = np.random.default_rng(4)
    x, k = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 2))
    check_grads(lambda a, b: ml.conv2d(a, b, stride=stride, padding=padding), x, k)


def test_conv2d_matches_direct_loops() -> None:
    rng = np.random.default_rng(5)
    x, k = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3))
    got = anyio.run(ml.conv2d(x, k, stride=2, padding=1).predict)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.zeros((1, 3, 3, 3))
    for o in range(3):
        for p in range(3):
            for q in range(3):
                want[0, o, p, q] = np.sum(xp[0, :, 2 * p : 2 * p + 3, 2 * q : 2 * q + 3] * k[o])
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize(("kernel", "stride"), [(2, 2), (3, 1), (2, 1)])
def test_max_pool2d(kernel: int, stride: int) -> None:
    x = np.random.default_rng(6).permutation(2 * 2 * 6 * 6).reshape(2, 2, 6, 6) / 7.0  # no ties
    check_grads(lambda a: ml.max_pool2d(a, kernel, stride), x)
    out = anyio.run(ml.max_pool2d(x, kernel, stride).predict)
    assert out[0, 0, 0, 0] == x[0, 0, :kernel, :kernel].max()


def test_float32_is_kept_and_close_to_float64() -> None:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    w = ml.Weight(rng.standard_normal((4, 2)).astype(np.float32))
    out = anyio.run(ml.tanh(a @ w * 2.0 + 1.0).predict)
    assert out.dtype == np.float32
    [grad] = anyio.run(ml.gradients, ml.sum(ml.tanh(a @ w)), [w])
    assert np.asarray(grad).dtype == np.float32
    w64 = ml.Weight(w.data.astype(np.float64))
    [grad64] = anyio.run(ml.gradients, ml.sum(ml.tanh(a.astype(np.float64) @ w64)), [w64])
    np.testing.assert_allclose(grad, grad64, rtol=1e-5, atol=1e-6)
    # A plain number as the base of a power: its log in the value's dtype, not float64's.
    [grad] = anyio.run(ml.gradients, ml.sum(2.0**w), [w])
    assert np.asarray(grad).dtype == np.float32
    np.testing.assert_allclose(grad, np.log(2.0) * 2.0**w.data, rtol=1e-6)


def test_ties_share_the_delta() -> None:
    w = ml.Weight(np.array([1.0, 3.0, 3.0]))
    [g] = anyio.run(ml.gradients, ml.max(w), [w])
    np.testing.assert_array_equal(g, [0.0, 0.5, 0.5])
    v = ml.Weight(np.array([2.0]))
    [g] = anyio.run(ml.gradients, ml.sum(ml.maximum(v, np.array([2.0]))), [v])
    np.testing.assert_array_equal(g, [0.5])


def test_check_grads_catches_a_wrong_rule() -> None:
    from monadl.layers._layer import Layer
    from monadl.layers._primitives import Primitive

    wrong = Primitive("wrong_square", lambda a: (a * a, (lambda g: g * a,)))  # misses the factor 2

    with pytest.raises(AssertionError, match="disagrees with finite differences"):
        check_grads(lambda a: Layer._make(wrong, (a,)), np.array([1.0, 2.0]))


def test_dense_against_matmul_plus_bias_and_differences() -> None:
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    for b in (rng.standard_normal(2), rng.standard_normal((1, 2)), rng.standard_normal((4, 2)), np.array(0.5)):
        check_grads(ml.dense, x, w, b)
        got = anyio.run(ml.dense(x, w, b).predict)
        np.testing.assert_array_equal(got, x @ w + b)
    check_grads(ml.dense, rng.standard_normal(3), w, rng.standard_normal(2))  # a single sample
    # The output's shape is what x @ w + b gives; its dtype the arrays' (a float64 scalar bias takes
    # float32, as a 0-d tensor in PyTorch: NumPy alone would promote to float64).
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    assert anyio.run(ml.dense(x32, w32, np.array(0.5, np.float32)).predict).dtype == np.float32
    assert anyio.run(ml.dense(x32, w32, np.array(0.5)).predict).dtype == np.float32
    assert anyio.run(ml.dense(x32, w32, np.zeros((3, 4, 2), np.float32)).predict).shape == (3, 4, 2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 16, 48, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_by_their_fast_forms_equal_the_plain_product(rows: int, dtype: type[np.floating[Any]]) -> None:
    """`product` computes one row, a few rows times a large weight (one gemv a
    row), or a few float32 rows times a large transposed weight, by other NumPy
    products: C order, dtype kept, and within the tolerance times the
    product's scale of the exact product, as the plain product is (the forms
    sum in other orders, so an entry near zero differs in its last bits)."""
    from monadl.layers._products import by_rows, product

    rng = np.random.default_rng(rows)
    g = rng.standard_normal((rows, 1024)).astype(dtype)
    w = rng.standard_normal((512, 1024)).astype(dtype)  # 512K elements: the fast forms from two rows
    column = rng.standard_normal((rows, 1)).astype(dtype)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    for x, y in ((g, w.mT), (g, np.ascontiguousarray(w.mT)), (column, rng.standard_normal((1, 300)).astype(dtype))):
        got, plain = product(x, y), x @ y
        assert got.dtype == dtype and got.shape == plain.shape and got.flags.c_contiguous
        exact = x.astype(np.longdouble) @ y.astype(np.longdouble)
        scale = float(np.abs(exact).max())
        for form in (got, plain):
            assert float(np.abs(form - exact).max()) <= tolerance * scale
    # Row by row, each row is the one-row product, bit for bit.
    each = by_rows(g, w.mT)
    assert each.flags.c_contiguous and all((each[i] == g[i] @ w.mT).all() for i in range(rows))


@pytest.mark.parametrize("rows", [2, 3, 5])
def test_few_rows_by_rows_from_any_layout(rows: int) -> None:
    """The few-row form takes rows from strided and Fortran-ordered arrays
    and leaves other dtypes and small weights to the plain product."""
    from monadl.layers import _products
    from monadl.layers._products import product

    rng = np.random.default_rng(rows)
    w = rng.standard_normal((1024, 1024)).astype(np.float32)
    wide = rng.standard_normal((rows, 2048)).astype(np.float32)
    for x in (wide[:, ::2], np.asfortranarray(wide[:, :1024]), wide[:, 1024:]):
        got = product(x, w)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        each = np.stack([row @ w for row in x])
        if _products._OPENBLAS:  # (the form is taken with NumPy's OpenBLAS only: then row for row, bit for bit)
            np.testing.assert_array_equal(got, each)
        else:
            np.testing.assert_allclose(got, each, rtol=1e-4, atol=1e-4)
    mixed = product(wide[:, :1024].astype(np.float64), w)  # dtypes differ: the plain product's promotion
    assert mixed.dtype == np.float64
    np.testing.assert_allclose(mixed, wide[:, :1024].astype(np.float64) @ w, rtol=1e-12)


@pytest.mark.skipif(not _products._OPENBLAS, reason="the few-row forms are NumPy's OpenBLAS's")
def test_few_row_forms_of_the_grid() -> None:
    """Where the grid of `benchmarks/transposed_products.py` found another form
    faster: float64 rows times a transposed weight of 512K elements, 2 to 6 of
    them (1.2-4.4x), of 256K, 3 to 6 (1.3-3.2x), and 2 or 3 times a plain
    one of 512K; float32 3 to 6 rows times a transposed weight of 256K
    (1.9-4.0x); float32 deltas of 5 or more rows times a 256 x 256 weight's
    transpose (1.4-2.1x), 12 or more for one 128 wide; and where it did not."""
    rng = np.random.default_rng(0)
    for dtype, shape, rows, form in [
        (np.float64, (512, 1024), 2, "rows"),
        (np.float64, (512, 1024), 4, "rows"),
        (np.float64, (512, 1024), 6, "rows"),
        (np.float64, (512, 1024), 8, "plain"),
        (np.float64, (512, 512), 2, "plain"),
        (np.float64, (512, 512), 3, "rows"),
        (np.float64, (512, 512), 6, "rows"),
        (np.float64, (512, 512), 8, "plain"),
        (np.float64, (256, 256), 4, "plain"),
        (np.float32, (512, 512), 2, "plain"),
        (np.float32, (512, 512), 3, "rows"),
        (np.float32, (512, 512), 6, "rows"),
        (np.float32, (512, 512), 8, "transposed"),
        (np.float32, (256, 256), 5, "transposed"),
        (np.float32, (256, 256), 4, "plain"),
        (np.float32, (256, 256), 6, "transposed"),
        (np.float32, (256, 256), 32, "transposed"),
        (np.float32, (128, 512), 8, "plain"),
        (np.float32, (128, 512), 12, "transposed"),
        (np.float32, (128, 128), 16, "plain"),
    ]:
        w = rng.standard_normal(shape).astype(dtype)
        g = rng.standard_normal((rows, shape[1])).astype(dtype)
        assert _products.form_of(g, w.mT) == form, (dtype, shape, rows)
        got, plain = _products.product(g, w.mT), g @ w.mT
        assert got.flags.c_contiguous and got.dtype == dtype
        np.testing.assert_allclose(got, plain, rtol=1e-4 if dtype == np.float32 else 1e-10, atol=1e-4)
    x = rng.standard_normal((3, 512))
    assert _products.form_of(x, rng.standard_normal((512, 1024))) == "rows"  # float64, plain: 2 and 3 rows
    assert _products.form_of(rng.standard_normal((4, 512)), rng.standard_normal((512, 1024))) == "plain"
    assert _products.form_of(x, rng.standard_normal((512, 512))) == "plain"  # (plain and 256K: as fast)


def test_a_dense_layer_s_input_delta_by_the_transposed_product() -> None:
    """A float32 MLP with 16 rows and a 512 x 512 weight takes the fast form in
    its backward; its input's delta equals NumPy's ``g @ w.T`` to float32
    rounding. Both sum 512 terms, in orders the BLAS kernel chooses, so the
    bound is relative to the sum of the terms' magnitudes: an entry where the
    terms cancel differs by more than 1e-5 of itself on some CPUs (an H100
    machine's BLAS did)."""
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((512, 512)).astype(np.float32))
    x = ml.Weight(rng.standard_normal((16, 512)).astype(np.float32))
    loss = ml.sum(ml.dense(x, w, np.zeros(512, np.float32)) * 0.5)
    (dx,) = anyio.run(ml.gradients, loss, [x])
    g = np.full((16, 512), 0.5, np.float32)
    error = np.abs(dx.astype(np.float64) - (g @ w.data.T).astype(np.float64))
    np.testing.assert_array_less(error, 1e-6 * (np.abs(g) @ np.abs(w.data.T)).astype(np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_fast_path_is_the_stable_formula_bit_for_bit(dtype: Any) -> None:
    edges = [-1000.0, -100.0, -88.0, -20.0, -1e-30, -0.0, 0.0, 1e-30, 20.0, 88.0, 1000.0, np.inf, -np.inf, np.nan]
    a = np.concatenate([np.array(edges), np.random.default_rng(0).normal(0.0, 8.0, 1000)]).astype(dtype)
    strided = np.stack([a, a]).T[:, 1]  # (a view with a stride: as a gate slice is)
    e = np.exp(-np.abs(a))
    want = np.where(a >= 0, 1 / (1 + e), e / (1 + e))
    for x in (a, strided):
        got, _ = PRIMITIVES["sigmoid"].rule(x)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_without_overflow_is_within_4_ulps_of_the_exact_function(dtype: Any) -> None:
    """Where no ``exp(-a)`` overflows, sigmoid is ``1 / (1 + exp(-a))`` in four
    passes: as accurate as the stable formula (3.3 ulps at most in float32),
    on contiguous arrays and gate slices alike, with no warning."""
    low = -85.0 if dtype == np.float32 else -700.0
    a = np.concatenate([np.linspace(low, 110.0, 200_001), np.random.default_rng(1).normal(0.0, 8.0, 10_000)])
    a = a.astype(dtype)
    exact = 1 / (1 + np.exp(-a.astype(np.longdouble)))
    spacing = np.spacing(exact.astype(dtype)).astype(np.longdouble)
    for x in (a, np.stack([a, a]).T[:, 1]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got, _ = PRIMITIVES["sigmoid"].rule(x)
        assert got.dtype == dtype
        assert np.max(np.abs(got.astype(np.longdouble) - exact) / spacing) <= 4.0


def test_sigmoid_keeps_the_subnormal_tail_where_exp_overflows() -> None:
    """Past -88 in float32 ``exp(-a)`` overflows: the stable formula computes
    that array, so the tail is ``exp(a)``'s subnormals, not 0, and no warning."""
    a = np.array([-100.0, -90.0, 0.0, 3.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _ = PRIMITIVES["sigmoid"].rule(a)
    assert 0 < got[0] < got[1] < 1e-38
    np.testing.assert_allclose(
        got[:2], np.exp(a[:2].astype(np.float64)), rtol=0, atol=3e-45
    )  # (a subnormal step: 1.4e-45)
    np.testing.assert_allclose(got[2:], [0.5, 1 / (1 + np.exp(-3.0))], rtol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tanh_and_sigmoid_deltas_of_large_arrays_in_one_buffer_equal_the_closed_form(dtype: Any) -> None:
    """From 4,096 elements the deltas are computed in place in one fresh array
    (below, as three): the same values as ``g * (1 - t**2)`` and ``g * s * (1 - s)``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 128)).astype(dtype)
    g = rng.standard_normal((64, 128)).astype(dtype)
    t, (tanh_vjp,) = PRIMITIVES["tanh"].rule(a)
    s, (sigmoid_vjp,) = PRIMITIVES["sigmoid"].rule(a)
    for got, want in ((tanh_vjp(g), g * (1 - t * t)), (sigmoid_vjp(g), g * s * (1 - s))):
        assert got.dtype == dtype and got.shape == a.shape
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-14)
    np.testing.assert_allclose(tanh_vjp(np.asarray(2.0, dtype)), 2 * (1 - t * t), rtol=1e-6)  # a broadcast delta


@pytest.mark.anyio
async def test_an_infinite_delta_reaches_only_the_chosen_operand() -> None:
    # sqrt'(0) is infinite: times a 0/1 factor it was NaN for what relu, maximum and minimum did not choose.
    # And without a warning (RuntimeWarnings are errors here): a new user's sqrt(relu(w)) warned, its gradient right.
    w = ml.Weight(np.array([-1.0, 2.0]))
    losses: list[ml.ScalarLayer] = [
        ml.sum(ml.sqrt(ml.relu(w))),
        ml.sum(ml.sqrt(ml.maximum(w, 0.0))),
        ml.sum(ml.sqrt(-ml.minimum(-w, 0.0))),
    ]
    for loss in losses:
        [g] = await ml.gradients(loss, [w])
        np.testing.assert_allclose(g, [0.0, 0.5 / np.sqrt(2.0)])
    tie = ml.Weight(np.array([1.0, 1.0]))
    [g] = await ml.gradients(ml.sum(ml.maximum(tie, np.ones(2)) * 3.0), [tie])
    np.testing.assert_array_equal(g, [1.5, 1.5])  # (a tie splits the delta)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:divide by zero encountered")  # (0 ** -1 where an exponent is 0: masked)
async def test_the_power_of_zero_has_gradient_zero_at_zero() -> None:
    w = ml.Weight(np.array([0.0, 1.0]))
    [g] = await ml.gradients(ml.sum(w**0.0), [w])  # (0 * 0 ** -1: NaN)
    np.testing.assert_array_equal(g, [0.0, 0.0])
    e = ml.Weight(np.array([0.0, 2.0]))
    [ga, ge] = await ml.gradients(ml.sum(w**e), [w, e])
    np.testing.assert_array_equal(ga, [0.0, 2.0])
    np.testing.assert_array_equal(ge, [0.0, 0.0])  # (w ** e * log(w): 0 where w == 0, and log(1))


@pytest.mark.anyio
async def test_softmax_and_logsumexp_of_an_empty_axis_are_pytorchs() -> None:
    w = ml.Weight(np.zeros((2, 0)))
    assert (await ml.logsumexp(w, axis=1).predict()).tolist() == [-np.inf, -np.inf]
    assert (await ml.softmax(w, axis=1).predict()).shape == (2, 0)
    assert (await ml.log_softmax(w, axis=1).predict()).shape == (2, 0)
    [g] = await ml.gradients(ml.sum(ml.softmax(w, axis=1)), [w])
    assert g.shape == (2, 0)


@pytest.mark.anyio
async def test_a_float32_weight_of_no_dimensions_keeps_integer_data_float32() -> None:
    w = ml.Weight(np.array(0.5, np.float32))
    assert (await (w * np.array([1, 2])).predict()).dtype == np.float32  # (float64, NumPy's promotion)
    [g] = await ml.gradients(ml.sum(w * np.array([1, 2])), [w])
    assert g.dtype == np.float32


@pytest.mark.anyio
async def test_a_row_of_minus_infinity_and_a_negative_base_warn_of_nothing() -> None:
    """Their values are PyTorch's (-inf; NaN deltas), and NumPy's warnings of
    them pointed into monadl's files (the suite turns warnings into errors)."""
    w = ml.Weight(np.array([[-np.inf, -np.inf], [0.0, 1.0]]))
    loss = ml.sum(ml.logsumexp(w, axis=1))
    (delta,) = await ml.gradients(loss, [w])
    assert await loss.predict() == -np.inf and np.isnan(delta[0]).all()
    base, power = ml.Weight(np.array([-2.0, 3.0])), ml.Weight(np.array([2.0, 2.0]))
    (_, d_power) = await ml.gradients(ml.sum(base**power), [base, power])
    assert np.isnan(d_power[0]) and d_power[1] == 9.0 * np.log(3.0)


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda: ml.conv2d(np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3)), stride=(1, 2)), "stride is an int"),  # type: ignore[arg-type]
        (lambda: ml.conv2d(np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3)), padding="same"), "(k - 1) // 2"),  # type: ignore[arg-type]
        (lambda: ml.conv2d(np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3)), stride=2.0), "got 2.0"),  # type: ignore[arg-type]
        (lambda: ml.max_pool2d(np.ones((1, 1, 4, 4)), 2.0), "kernel is an int"),  # type: ignore[arg-type]
        (lambda: ml.max_pool2d(np.ones((1, 1, 4, 4)), (2, 2)), "a pair is not taken"),  # type: ignore[arg-type]
    ],
)
def test_a_window_argument_of_pytorchs_other_forms_is_refused_where_it_is_given(build: Any, said: str) -> None:
    # A tuple raised "'<' not supported", a float failed at the run without the layer's line.
    with pytest.raises(ml.OperandError, match=re.escape(said)):
        build()


@pytest.mark.parametrize(("scalar", "casts"), [(np.float64(0.5), 0), (np.float32(0.5), 1), (np.int64(2), 1)])
def test_a_numpy_float_of_the_arrays_dtype_is_taken_without_the_dtype_walk(
    scalar: Any, casts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `w * (1 / np.sqrt(d))` is a NumPy float64: each such node took the generic walk
    # (and found its line for an error it did not raise), 1.8-2.3x a Python float's node.
    from monadl.runtime import node

    walks: list[int] = []
    check = node._check_dtypes

    def counted(n: Any, args: Any) -> Any:
        walks.append(1)
        return check(n, args)

    monkeypatch.setattr(node, "_check_dtypes", counted)
    w = ml.Weight(np.ones(3))
    out = anyio.run((w * scalar).predict)
    assert len(walks) == casts and out.dtype == np.float64
    np.testing.assert_array_equal(out, np.ones(3) * float(scalar))


def test_where_of_arrays_of_one_dtype_is_taken_without_the_dtype_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every `where` node took the walk (about 5 us, beside 0.9 us for np.where), which casts nothing for two
    # NumPy arrays of one dtype: a mask in an RNN cell's step. Sides that differ still take it.
    from monadl.runtime import node

    walks: list[int] = []
    check = node._check_dtypes

    def counted(n: Any, args: Any) -> Any:
        walks.append(1)
        return check(n, args)

    monkeypatch.setattr(node, "_check_dtypes", counted)
    a = ml.Weight(np.ones((4, 4), np.float32))
    b = ml.Weight(np.full((4, 4), 0.5, np.float32))
    mask = np.eye(4, dtype=bool)
    x: Any = a * 1.0
    for _ in range(3):
        x = ml.where(mask, x, b)
    out = anyio.run(x.predict)
    assert not walks and out.dtype == np.float32
    np.testing.assert_array_equal(out, np.where(mask, 1.0, 0.5))
    half = ml.Weight(np.array(0.5, np.float16))  # (a 0-d float16 tensor beside a float32 one: float32)
    chosen: Any = anyio.run(ml.where(True, half * 1.0, ml.sum(a)).predict)
    assert walks == [1] and type(chosen) is np.float32 and chosen == 0.5


@pytest.mark.anyio
async def test_where_chooses_and_sends_each_side_its_delta() -> None:
    rng = np.random.default_rng(5)
    condition = rng.random((3, 4)) > 0.5
    check_grads(lambda a, b: ml.where(condition, a, b), rng.normal(size=(3, 4)), rng.normal(size=(4,)))
    check_grads(lambda a: ml.where(condition[0], a, 2.0), rng.normal(size=(3, 4)))  # (a condition broadcast)
    # An infinite side (a -inf mask) sends no NaN to the other, where a mask added or multiplied in would.
    scores = ml.Weight(np.array([[1.0, 2.0, 3.0]], np.float32))
    mask = np.array([[True, True, False]])
    attention = ml.softmax(ml.where(mask, scores, -np.inf), axis=-1)
    [g] = await ml.gradients(ml.sum(attention * np.array([1.0, 0.0, 5.0], np.float32)), [scores])
    p = np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum()
    np.testing.assert_allclose(g, [[p[0] * p[1], -p[0] * p[1], 0.0]], rtol=1e-6)
    assert g.dtype == np.float32 and (await attention.predict()).dtype == np.float32


def test_a_layers_shape_is_refused_with_what_to_read_instead() -> None:
    """A weight argument of a marked cell is a layer there: its ``.shape``
    raised a bare AttributeError (a new user's attention cell read Wq.shape)."""
    w = ml.Weight(np.ones((3, 2)))

    def scaled(x: ml.ArrayOperand, weight: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.dense(x, weight) * (1.0 / weight.shape[1])  # type: ignore[union-attr, no-any-return]  # the mistake

    assert anyio.run(ml.sum(scaled(np.ones((4, 3)), w)).predict) == pytest.approx(12.0)  # (unmarked: a weight)
    with pytest.raises(AttributeError, match=r"a layer's shape is not known while the graph is built .* pass it as"):
        ml.operation(scaled)(np.ones((4, 3)), w)
    with pytest.raises(AttributeError, match=r"'Layer' object has no attribute 'colour'"):
        _ = (w * 2.0).colour  # type: ignore[attr-defined]  # (any other name: Python's own message)
    assert not hasattr(w * 2.0, "dtype") and w.dtype == np.float64
    with pytest.raises(ml.OperandError, match=r"so a format \('.3f'\) cannot be read: format the value predict"):
        _ = f"{w * 2.0:.3f}"
    with pytest.raises(ml.OperandError, match=r"a weight is formatted by its value: format weight.data"):
        _ = f"{w:.3f}"
    assert f"{w * 2.0}".startswith("Layer(multiply, built at ")
    broken = ml.Weight(np.ones(2))
    broken._data = [1.0, 2.0]  # (a weight's own property failing inside: its error)
    with pytest.raises(AttributeError, match=r"'list' object has no attribute 'shape'"):
        _ = broken.shape


def test_a_weight_arguments_data_in_a_cell_is_refused_with_what_to_do_instead() -> None:
    """A weight argument of a marked cell is a layer there: its ``.data``
    (typed as a weight's, so mypy accepted it) raised a bare
    AttributeError, 'Layer' object has no attribute 'data' (a new user's
    batch norm); ``.state`` and ``.optimizer`` alike."""
    running_mean = ml.Weight(np.zeros(2), optimizer=ml.optim.sgd(0.0))

    @ml.operation
    def center(h: ml.ArrayLayer, mean: ml.ArrayWeight) -> ml.ArrayLayer:
        return h - mean.data

    with pytest.raises(AttributeError) as raised:
        center(ml.as_layer(np.ones((2, 2))), running_mean)
    assert str(raised.value) == (
        "a layer has no .data (its value is not known while the graph is built: await layer.predict() gives it); "
        f"inside the operation {center.__name__}, being traced, a weight argument is a layer too, a placeholder for "
        "each call's weight: compute with it as a layer (h - w; ml.stop_gradient(w) where no gradient may reach "
        "it), or read w.data outside the cell and pass what the cell needs as an argument (an array, such as "
        "w.data, is data there, read at each call)"
    )
    for name in ("state", "optimizer"):
        with pytest.raises(AttributeError, match=rf"^a layer has no .{name}, a weight's own; inside an ml.operation, "):
            getattr(running_mean * 2.0, name)
    assert not hasattr(running_mean * 2.0, "data") and hasattr(running_mean, "data")


def test_where_refuses_a_condition_that_is_not_a_boolean_array() -> None:
    w = ml.Weight(np.ones(3))
    with pytest.raises(ml.OperandError, match=r"where: the condition is a layer or a weight.*ml.direct"):
        ml.where(w, w, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ml.OperandError, match=r"must be a boolean array, got float64\[3\]; compare to make one"):
        ml.where(np.ones(3), w, 0.0)
    assert ml.where([True, False, True], w, 0.0)._op is PRIMITIVES["where"]  # (a list of bools: an array)


@pytest.mark.anyio
async def test_where_refuses_float32_beside_float64_as_a_binary_op_does() -> None:
    """Its two sides take one float dtype, as ``a * b``'s do: float32 and
    float64 arrays refused at the where's own line (it promoted silently,
    and the matmul after it failed instead); a NumPy float beside a float32
    array takes its dtype; a Python or NumPy bool is a 0-d condition."""
    w32 = ml.Weight(np.ones((2, 2), np.float32))
    mask = np.array([[True, False], [False, True]])
    layer = ml.where(mask, w32, np.zeros((2, 2)))  # WHERE-MIX
    with pytest.raises(ml.DTypeError, match=rf"where: operands .* mix float32 and float64.*:{line_of('WHERE-MIX')}$"):
        await layer.predict()
    assert (await ml.where(mask, w32, np.float64(0.0)).predict()).dtype == np.float32

    @ml.operation
    def cell(a: ml.ArrayOperand, b: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.where(mask, a, b) * 2.0  # WHERE-IN-CELL

    called = cell(w32, np.zeros((2, 2)))  # WHERE-CALLED
    with pytest.raises(
        ml.DTypeError,
        match=rf"mix float32 and float64 arrays; .*; layer built at .*:{line_of('WHERE-IN-CELL')}, inside the "
        rf"operation .*cell called at .*:{line_of('WHERE-CALLED')}$",
    ):
        await called.predict()
    for condition in (True, np.True_, np.False_):
        got = await ml.where(condition, w32, 0.0).predict()
        np.testing.assert_array_equal(got, np.ones((2, 2)) * bool(condition))


@pytest.mark.anyio
async def test_a_numpy_float_beside_a_0d_float32_array_takes_its_dtype() -> None:
    """PyTorch's rule for a number beside a 0-d tensor: a NumPy float is a number there too."""
    w = ml.Weight(np.array(2.0, np.float32))
    assert (await (w + np.float64(1.0)).predict()).dtype == np.float32
    assert (await (w + np.array(1.0)).predict()).dtype == np.float64  # (two 0-d arrays: NumPy's promotion)


def test_where_with_per_example_masks_batches_to_the_same_gradients() -> None:
    rng = np.random.default_rng(6)
    w = ml.Weight(rng.normal(size=(4, 4)))
    lengths = [3, 1, 4, 2] * 80  # (320 examples: the cost rule batches them)
    xs = [rng.normal(size=(1, 4)) for _ in lengths]

    def loss() -> ml.ScalarLayer:
        parts = [
            ml.logsumexp(ml.where(np.arange(4) < n, ml.tanh(x @ w), -np.inf), axis=-1) for x, n in zip(xs, lengths)
        ]
        return ml.sum(ml.concatenate(parts, axis=0))

    results = []
    for batching in (False, True):
        with ml.settings(batching=batching):
            results.append(anyio.run(ml.value_and_gradients, loss()))
    (v0, g0), (v1, g1) = results
    np.testing.assert_allclose(v1, v0, rtol=1e-12)
    np.testing.assert_allclose(g1[w], g0[w], rtol=1e-12)


def test_a_minus_infinity_mask_under_check_finite_is_refused_with_what_to_mask_with() -> None:
    scores = ml.Weight(np.array([[1.0, 2.0, 3.0]]))
    masked = ml.softmax(ml.where(np.array([[True, True, False]]), scores, -np.inf), axis=-1)
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as caught:
        anyio.run(ml.sum(masked).predict)
    assert str(caught.value).startswith("where's operand 2 (float -inf) already holds a NaN or an infinity")
    assert str(caught.value).endswith("mask with a large negative number (-1e9) instead of -inf")
    unchecked = anyio.run(masked.predict)
    with ml.settings(check_finite=True):  # (as it advises)
        finite = ml.softmax(ml.where(np.array([[True, True, False]]), scores, -1e9), axis=-1)
        np.testing.assert_allclose(anyio.run(finite.predict), unchecked, atol=1e-300)
