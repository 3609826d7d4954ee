"""Errors name the operation, the operands, and the user's line."""

from __future__ import annotations

import collections
import contextvars
import operator
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
import numpy as np
import pytest

import monadl as ml

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


@pytest.mark.anyio
async def test_shape_mismatch_names_op_shapes_dtypes_and_line() -> None:
    w = ml.Weight(np.ones((2, 3), np.float32))
    bad = w + np.ones((4,), np.float32)  # BUILD-SITE-1
    with pytest.raises(ml.ShapeError) as info:
        await ml.sum(bad).train()
    message = str(info.value)
    assert "add" in message
    assert "float32[2, 3]" in message and "float32[4]" in message
    assert f"{HERE}:{line_of('BUILD-SITE-1')}" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.anyio
async def test_matmul_mismatch() -> None:
    w = ml.Weight(np.ones((3, 5)))
    bad = np.ones((2, 4)) @ w  # BUILD-SITE-2
    with pytest.raises(
        ml.ShapeError, match=rf"matmul: operands float64\[2, 4\], float64\[3, 5\].*:{line_of('BUILD-SITE-2')}"
    ):
        await bad.predict()


@pytest.mark.anyio
async def test_mixed_float_dtypes_are_refused() -> None:
    w = ml.Weight(np.ones(3, np.float32))
    bad = w * np.ones(3, np.float64)  # BUILD-SITE-3
    with pytest.raises(ml.DTypeError, match=rf"multiply.*float32 and float64.*:{line_of('BUILD-SITE-3')}"):
        await bad.predict()


@pytest.mark.anyio
async def test_finite_check_is_opt_in_and_names_the_op() -> None:
    w = ml.Weight(np.array([1.0, 0.0]))
    blows_up = ml.log(w)  # BUILD-SITE-4
    with np.errstate(divide="ignore"):
        assert np.isneginf((await blows_up.predict())[1])
        with (
            ml.settings(check_finite=True),
            pytest.raises(ml.NonFiniteError, match=rf"log produced a NaN.*:{line_of('BUILD-SITE-4')}"),
        ):
            await blows_up.predict()


@pytest.mark.anyio
async def test_finite_check_covers_backward() -> None:
    w = ml.Weight(np.array([0.0]))
    root = ml.sqrt(w)  # BUILD-SITE-5
    with (
        np.errstate(divide="ignore"),
        ml.settings(check_finite=True),
        pytest.raises(ml.NonFiniteError, match=rf"backward of sqrt.*:{line_of('BUILD-SITE-5')}"),
    ):
        await ml.sum(root).train()
    np.testing.assert_array_equal(w.data, [0.0])


def test_bad_operands_fail_when_the_layer_is_built() -> None:
    w = ml.Weight(np.ones(3))
    with pytest.raises(ml.OperandError, match="str"):
        w + "1"  # type: ignore[operator]  # the mistake under test
    with pytest.raises(ml.OperandError, match=r"np\.asarray"):
        w * [1.0, 2.0, 3.0]  # type: ignore[operator]  # the mistake under test
    with pytest.raises(ml.OperandError, match=r"join its layers with ml\.stack"):
        ml.sum([w, w])  # type: ignore[call-overload]  # the mistake under test
    with pytest.raises(ml.OperandError, match="dtype <U1"):
        w * np.array(["a", "b", "c"])
    with pytest.raises(ml.OperandError, match="plain data"):
        ml.Weight(w)  # type: ignore[call-overload]  # the mistake under test
    with pytest.raises(ml.OperandError, match="float array"):
        ml.Weight(np.arange(3))
    with pytest.raises(ml.OperandError, match="integer"):
        ml.cross_entropy(np.zeros((2, 3)), np.array([0.5, 1.0]))
    with pytest.raises(ml.OperandError, match="Do"):
        ml.Layer(3)  # type: ignore[arg-type]  # the mistake under test


def test_a_layers_truth_and_order_are_refused_while_building() -> None:
    # Without a value, `if layer:` would always take one branch (in an operation: for every call).
    x = ml.Weight(np.zeros(2)) * 1.0
    with pytest.raises(ml.OperandError, match=r"its truth cannot be read.*bind"):
        bool(x)
    for compare in ("x > 0.5", "x <= 0.5", "0.5 < x", "x >= x"):  # (mypy rejects them: written as text)
        with pytest.raises(ml.OperandError, match="a comparison"):
            eval(compare)
    assert x in [x] and x == x  # (identity: layers stay usable in containers)
    # max(), min() and sorted() compare (mypy rejects them): what max(a, b) meant is ml.maximum.
    for pick in ("max(x, x * 2.0)", "min([x, x * 2.0])", "sorted([x, x])"):
        with pytest.raises(ml.OperandError, match=r"comparison \([<>]\) .* write ml\.maximum\(a, b\) or ml\.minimum"):
            eval(pick)

    # A number or an array read from one: it was a bare TypeError, or np.asarray an array of the object.
    for read in ("float(x)", "int(x)", "complex(x)", "np.asarray(x)", "[1, 2][x]"):  # (mypy rejects most)
        with pytest.raises(ml.OperandError, match="no value while the graph is built"):
            eval(read)
    with pytest.raises(ml.OperandError, match=r"math.exp and math's other functions read one: use ml.exp"):
        eval("math.exp(x)", {"math": __import__("math"), "x": x})  # (a user's cell: what to use instead)
    for read in ("float(w)", "np.asarray(w)", "[1, 2][w]"):  # a weight has a value, read through .data
        with pytest.raises(ml.OperandError, match=r"its value now is w\.data"):
            eval(read, {"np": np, "w": ml.Weight(np.ones(2))})

    @ml.operation
    def cell(h: ml.ArrayLayer, t: float) -> ml.ArrayLayer:
        return h * 2.0 if t else h * 1.0

    with pytest.raises(ml.OperandError, match="a float argument is data"):
        cell(ml.Weight(np.ones(2)) * 1.0, 0.0)


def test_a_float_arguments_equality_with_a_number_is_refused_while_its_cell_is_traced() -> None:
    """``k == 4.0`` on a float argument compared the placeholder's identity:
    False for every call, so a new user's cell took its other branch with
    no word (``k > 3`` was refused)."""
    h = ml.as_layer(np.ones(3))
    for compare in (
        lambda k: k == 4.0,
        lambda k: k != 4.0,
        lambda k: operator.eq(4.0, k),  # (the number on the left: its reflected comparison)
        lambda k: k == np.float32(4.0),
        lambda k: k == 4,
        lambda k: k in (1.0, 4.0),
    ):

        def eq(h: ml.ArrayLayer, k: float, compare: Callable[[Any], bool] = compare) -> ml.ArrayLayer:
            return h * 2.0 if compare(k) else h

        with pytest.raises(ml.OperandError) as caught:
            ml.operation(eq)(h, 4.0)
        assert str(caught.value).startswith(
            "operation test_a_float_arguments_equality_with_a_number_is_refused_while_its_cell_is_traced.<locals>"
            ".eq: a float argument is data, a layer inside the cell, with no value while the cell is traced, so a "
            "comparison of it with a number (==, != or in) cannot be read"
        ), caught.value
        assert "pass what the cell branches on as an int, a string or another static argument" in str(caught.value)
    with pytest.raises(ml.OperandError, match="comparison of it with a number"):
        ml.operation(lambda h, k: h * 2.0 if k == 4.0 else h)(h, np.float64(4.0))  # (NumPy's float too)

    def branch(h: ml.ArrayLayer, k: int) -> ml.ArrayLayer:
        return h * 2.0 if k == 4 else h

    assert anyio.run(ml.sum(ml.operation(branch)(h, 4)).predict) == 6.0  # (an int is static: its value)


def test_layers_stay_hashable_and_compare_by_identity_outside_that_case() -> None:
    h = ml.as_layer(np.ones(3))
    g = ml.tanh(h)
    assert h == h and h != g and operator.eq(h, 4.0) is False and operator.ne(4.0, h)
    assert operator.contains((1.0, 4.0), h) is False
    assert {h: 1, g: 2}[g] == 2 and {h, g, h} == {h, g}
    seen: list[Any] = []

    @ml.operation
    def cell(x: ml.ArrayLayer, k: Any) -> ml.ArrayLayer:
        # The placeholders as keys, and looked up in dicts of other objects and of numbers (a
        # lookup calls __eq__ only where the hashes are equal: a layer's, by identity, never a
        # number's): found, or not, as outside a trace.
        table = {x: "x", k: "k", "name": "n", g: "g"}
        seen.extend([table[x], table[k], {None: 0, "a": 1, g: 2}.get(k), {1.0: "one"}.get(k)])
        seen.append(operator.eq(x, 4.0))  # (a layer argument: identity, as outside a trace)
        out: ml.ArrayLayer = x * k
        return out

    assert anyio.run(ml.sum(cell(h, 2.0)).predict) == 6.0
    assert seen == ["x", "k", None, None, False]
    assert h == h and operator.eq(h, 4.0) is False  # (the trace over: identity again)


@pytest.mark.parametrize(
    "build",
    [
        lambda x: ml.transpose(x, (1, 2)),
        lambda x: ml.transpose(x, (0, -3)),
        lambda x: ml.split(x, 2, axis=2)[0],
        lambda x: ml.concatenate([x, x], axis=2),
    ],
)
def test_an_axis_out_of_range_is_refused_not_wrapped(build: Any) -> None:
    x = ml.Weight(np.arange(6.0).reshape(2, 3))
    with pytest.raises(ml.ShapeError, match=r"axis -?[23] is out of bounds for an array of 2 dimensions"):
        anyio.run(build(x).predict)


def test_a_layer_is_not_iterated() -> None:
    # Its lazy index never runs out: `list(layer)` looped forever.
    for x in (ml.Weight(np.ones((2, 3))) * 1.0, ml.Weight(np.ones(2))):
        with pytest.raises(ml.OperandError, match="not iterated"):
            list(x)  # type: ignore[call-overload]  # the mistake under test


def test_numpy_defers_to_monadl() -> None:
    w = ml.Weight(np.ones(3))
    assert isinstance(np.ones(3) * w, ml.Layer)
    assert isinstance(np.ones(3) - w, ml.Layer)
    assert isinstance(np.ones((2, 3)) @ w, ml.Layer)
    assert isinstance(2.0 ** ml.Weight(1.0), ml.Layer)


@pytest.mark.anyio
async def test_other_errors_keep_their_type_and_gain_a_note() -> None:
    # (An index out of range was the example here; it is now `ml.IndexRangeError`, naming its line in its
    # message: `tests/test_index_range.py`. Too many indices is still NumPy's own IndexError.)
    w = ml.Weight(np.ones(3))
    bad = w[0, 1]  # BUILD-SITE-6
    with pytest.raises(IndexError) as info:
        await bad.predict()
    assert type(info.value) is IndexError
    assert any(f":{line_of('BUILD-SITE-6')}" in note for note in info.value.__notes__)


# ---- no silent wrong answers (issue 16, section 5) ------------------------------------------
@pytest.mark.anyio
async def test_cross_entropy_refuses_fewer_labels_than_rows() -> None:
    w = ml.Weight(np.zeros((3, 4)))
    loss = ml.cross_entropy(w, np.array([0, 1]))  # BUILD-SITE-7
    for run in (loss.predict, loss.train):
        with pytest.raises(ml.ShapeError, match=rf"cross_entropy.*2 labels for 3 rows.*:{line_of('BUILD-SITE-7')}"):
            await run()
    np.testing.assert_array_equal(w.data, np.zeros((3, 4)))


@pytest.mark.anyio
@pytest.mark.parametrize(("label", "shown"), [(-1, "; negative labels are refused, not counted from the end"), (4, "")])
async def test_cross_entropy_refuses_labels_out_of_range(label: int, shown: str) -> None:
    loss = ml.cross_entropy(np.zeros((2, 4)), np.array([0, label]))  # BUILD-SITE-8
    with pytest.raises(ml.IndexRangeError) as info:
        await loss.predict()
    assert str(info.value) == (
        f"cross_entropy: label {label} at labels[1] out of range for 4 classes (labels must lie in [0, 4){shown});"
        f" layer built at {HERE}:{line_of('BUILD-SITE-8')}"
    )


@pytest.mark.anyio
async def test_cross_entropy_wants_a_batch_of_rows() -> None:
    with pytest.raises(ml.ShapeError, match=r"shape \(batch, classes\)"):
        await ml.cross_entropy(np.zeros(4), np.array([1])).predict()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("index", "shown"), [(-1, "; negative indices are refused, not counted from the end"), (3, "")]
)
async def test_embedding_refuses_indices_out_of_range(index: int, shown: str) -> None:
    w = ml.Weight(np.arange(6.0).reshape(3, 2))  # TABLE-SITE-9
    rows = ml.embedding(w, np.array([2, index]))  # BUILD-SITE-9
    with pytest.raises(ml.IndexRangeError) as info:
        await ml.sum(rows).train()
    assert str(info.value) == (
        f"embedding: index {index} at indices[1] out of range for a table of 3 rows (indices must lie in [0, 3){shown});"
        f" layer built at {HERE}:{line_of('BUILD-SITE-9')};"
        f" operand 0 is the weight float64[3, 2] built at {HERE}:{line_of('TABLE-SITE-9')}"
    )
    np.testing.assert_array_equal(w.data, np.arange(6.0).reshape(3, 2))


@pytest.mark.anyio
async def test_stack_takes_a_number_first() -> None:
    w = ml.Weight(1.5)
    loss = ml.sum(ml.stack([2.0, w]) * np.array([1.0, 3.0]))
    [grad] = await ml.gradients(loss, [w])
    assert float(await loss.predict()) == 6.5
    assert float(grad) == 3.0
    assert float(await ml.sum(ml.stack([w, 2.0]) * np.array([1.0, 3.0])).predict()) == 7.5
    np.testing.assert_array_equal(await ml.stack([2.0, 3.0]).predict(), [2.0, 3.0])


@pytest.mark.anyio
async def test_concatenate_refuses_numbers_with_a_clear_error() -> None:
    with pytest.raises(ml.ShapeError, match=r"zero-dimensional operands cannot be concatenated \(ml.stack"):
        await ml.concatenate([2.0, ml.as_layer(np.float64(3.0))]).predict()  # type: ignore[list-item]  # the mistake under test
    # A number among arrays: ml.stack would not join them either; what to give instead (a new user's
    # isolated node: Python's sum() of its no messages, the int 0, beside a row).
    with pytest.raises(ml.ShapeError) as info:
        await ml.concatenate([2.0, ml.Weight(np.ones(2))]).predict()  # type: ignore[list-item]  # the mistake under test
    assert str(info.value).startswith(
        "concatenate: operands float 2.0, float64[2] do not fit together (part 0 (float 2.0) is zero-dimensional "
        "and part 1 (float64[2]) is not: concatenate joins parts of one number of dimensions (Python's sum() of "
        "no layers is the int 0: where there is nothing to sum, give zeros of the sum's shape))"
    ), str(info.value)


def test_a_marked_cells_failing_step_is_the_error_not_its_calls_operands() -> None:
    # The cell's operands fit (a row and a weight): its concatenate of the int 0 (an isolated node's
    # sum() of no messages) and a row does not. The message said the call's "operands float64[1, 4],
    # float64[8, 4] do not fit together", and to join with ml.stack.
    w = ml.Weight(np.ones((8, 4)) * 0.1)

    @ml.operation
    def update(h: ml.ArrayLayer, m: Any) -> ml.ArrayLayer:
        return ml.tanh(ml.concatenate([m, h], axis=-1) @ w)

    with pytest.raises(ml.ShapeError) as info:
        anyio.run(update(ml.as_layer(np.ones((1, 4))), sum([])).predict)
    assert str(info.value).startswith(
        "test_a_marked_cells_failing_step_is_the_error_not_its_calls_operands.<locals>.update (called on "
        f"float64[1, 4], float64[8, 4]): concatenate of int 0, float64[1, 4] at {__file__}:"
        f"{line_of('ml.concatenate([m, h], axis=-1) @ w')}: part 0 (int 0) is zero-dimensional and part 1 "
        "(float64[1, 4]) is not: concatenate joins parts of one number of dimensions (Python's sum() of no layers "
        "is the int 0: where there is nothing to sum, give zeros of the sum's shape); layer built at "
    ), str(info.value)


def test_numpy_functions_on_layers_name_the_monadl_function() -> None:
    w = ml.Weight(np.ones(3))
    layer = w * 2.0
    hinted: list[tuple[Any, str]] = [
        (np.exp, "ml.exp"),
        (np.log, "ml.log"),
        (np.tanh, "ml.tanh"),
        (np.sin, "ml.sin"),
        (np.cos, "ml.cos"),
        (np.absolute, "ml.abs"),
    ]
    for ufunc, name in hinted:  # (mypy rejects each of these calls: Any lets them run)
        with pytest.raises(TypeError, match=rf"np\.{ufunc.__name__} cannot take a monadl Weight: use {name}\("):
            ufunc(w)
        with pytest.raises(TypeError, match=rf"np\.{ufunc.__name__} cannot take a monadl Layer"):
            ufunc(layer)
    with pytest.raises(TypeError, match=r"np\.arctan .*no differentiable counterpart"):
        np.arctan(w)  # type: ignore[call-overload]  # the mistake under test
    with pytest.raises(TypeError, match=r"layers are not compared"):
        np.ones(3) < w  # type: ignore[operator]  # noqa: B015  # the mistake under test
    x = np.ones(3)
    with pytest.raises(TypeError, match=r"write `x = x \+ layer`"):
        x += w  # type: ignore[call-overload]  # the mistake under test
    np.testing.assert_array_equal(x, np.ones(3))
    # As for any object: an array is not equal to a layer, so `in` works.
    assert (np.ones(3) == w) is False and (np.ones(3) != w) is True
    assert w in [np.ones(3), w]


def test_numpy_functions_on_layers_and_weights_say_the_monadl_spelling() -> None:
    w = ml.Weight(np.ones(3))
    layer = ml.tanh(w)
    f: Any = np  # (mypy rejects each of these calls: Any lets them run)
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: f.sum(w), r"np\.sum cannot take a monadl Weight: use ml\.sum\(\.\.\.\)"),  # (was: no 'out')
        (lambda: f.mean(layer), r"np\.mean cannot take a monadl Layer: use ml\.mean"),  # (was: no 'dtype')
        (lambda: f.concatenate([w, layer]), r"np\.concatenate .* use ml\.concatenate"),  # (was: 'zero-dimensional')
        (lambda: f.linalg.norm(w), r"np\.norm .*no differentiable counterpart.*a weight's is w\.data"),
        (lambda: f.shape(layer), r"np\.shape cannot take a monadl Layer: a layer's shape is known when it runs"),
    ]
    for call, message in calls:
        with pytest.raises(TypeError, match=message):
            call()
    assert f.shape(w) == w.shape == (3,) and f.ndim(w) == 1 and f.size(w) == 3  # (a weight's are its data's)


def test_every_hinted_ufunc_has_its_monadl_function() -> None:
    from monadl.layers._ufunc import DIFFERENTIABLE as _DIFFERENTIABLE

    for name in _DIFFERENTIABLE:
        assert callable(getattr(ml, name)) and isinstance(getattr(np, name), np.ufunc)


@pytest.mark.anyio
async def test_arrays_on_the_left_give_the_same_layers_as_on_the_right() -> None:
    w = ml.Weight(np.array([1.0, 2.0]))
    x = np.array([3.0, 4.0])
    for left, right in [(x * w, w * x), (x + w, w + x), (x - w, -(w - x)), (x / w, 1.0 / (w / x))]:
        np.testing.assert_allclose(await left.predict(), await right.predict())
    assert float(await (x @ w).predict()) == 11.0
    np.testing.assert_array_equal(await (x**w).predict(), [3.0, 16.0])
    np.testing.assert_array_equal(await (np.float64(2.0) * w).predict(), [2.0, 4.0])
    assert (x * w)._site[0] is test_arrays_on_the_left_give_the_same_layers_as_on_the_right.__code__


def test_cupy_sees_no_array_ufunc_and_calls_the_reflected_operator() -> None:
    # CuPy reads `__array_ufunc__` from the instance and defers to `__rmul__` when it is None
    # (NEP 13); NumPy reads it from the type.
    w = ml.Weight(np.ones(3))
    assert w.__array_ufunc__ is None and (w * 2.0).__array_ufunc__ is None
    assert callable(type(w).__array_ufunc__) and callable(ml.Layer.__array_ufunc__)


@pytest.mark.anyio
async def test_float_scalars_take_the_arrays_float_dtype(tmp_path: Any) -> None:
    # As PyTorch's 0-d tensors: a float64 scalar weight (a bias), a NumPy float64 or a 0-d array
    # beside float32 arrays computes in float32 (NumPy alone would promote the model to float64).
    def build() -> dict[str, Any]:
        return {
            "w": ml.Weight(np.ones((3, 2), np.float32), optimizer=ml.optim.adam(0.1)),
            "b": ml.Weight(0.0, optimizer=ml.optim.adam(0.1)),
        }

    x = np.ones((4, 3), np.float32)
    model = build()
    loss = ml.sum(ml.tanh(x @ model["w"] + model["b"]) * np.float64(0.5) / np.array(2.0))
    assert np.asarray(await loss.predict()).dtype == np.float32
    await loss.train()
    assert model["w"].data.dtype == np.float32 and model["b"].data.dtype == np.float64
    ml.save(tmp_path / "m.safetensors", model)
    ml.load(tmp_path / "m.safetensors", build())  # (the optimizer's state kept its weights' dtypes)


@pytest.mark.anyio
async def test_a_numpy_float_beside_a_scalar_layer_takes_the_layers_dtype() -> None:
    # A new user's KL annealing, ``beta * kl`` with beta from np.linspace (np.float64) and kl an ml.sum of a
    # float32 model's, came out float64: a scalar layer's value is a NumPy scalar, which the rule read as one
    # more NumPy float. As PyTorch's 0-d tensor beside a number, a layer's or a weight's value sets the dtype.
    w = ml.Weight(np.array([1.0, 2.0, 3.0], np.float32), optimizer=ml.optim.sgd(0.1))
    w0 = ml.Weight(np.float32(2.0))  # (its value: a NumPy scalar too)
    x = np.array([[1.0, 0.5, 2.0]], np.float32)
    beta = np.float64(0.3)
    b32 = np.float32(beta)
    tensors: dict[str, Any] = {
        "sum": ml.sum(w * 2.0),
        "mean": ml.mean(w * 2.0),
        "cross_entropy": ml.cross_entropy(x * w, np.array([1])),
        "0-d weight": w0,
    }
    for name, t in tensors.items():
        value = await ml.as_layer(t).predict()
        assert type(value) is np.float32, name
        for built, want in [
            (beta * t, b32 * value),
            (t * beta, value * b32),
            (t + beta, value + b32),
            (beta - t, b32 - value),
            (t / beta, value / b32),
            (ml.where(True, t, beta), value),
            (ml.where(False, t, beta), b32),
        ]:
            got = await built.predict()
            assert type(got) is np.float32 and got == want, (name, got, want)
    # Two tensors of no dimensions promote as NumPy's (and PyTorch's) do; a number beside them takes theirs.
    w64 = ml.Weight(np.ones(2, np.float64))
    w16 = ml.Weight(np.ones(2, np.float16))
    assert type(await (ml.sum(w) * ml.sum(w64)).predict()) is np.float64
    joined = await ml.stack([ml.sum(w16), ml.sum(w), beta]).predict()  # float16 and float32 tensors, a float64
    assert joined.dtype == np.float32 and joined.tolist() == [2.0, 6.0, float(b32)]
    loss = ml.sum(w * 2.0) * beta
    assert np.asarray(await loss.train()).dtype == np.float32 and w.data.dtype == np.float32


@pytest.mark.anyio
async def test_integer_data_takes_the_float_weights_dtype() -> None:
    w = ml.Weight(np.ones(3, np.float32), optimizer=ml.optim.sgd(0.5))
    loss = ml.sum(w * np.array([1, 2, 3]))  # int64 data: float32 as PyTorch does, not float64 as NumPy would
    value = await loss.train()
    assert np.asarray(value).dtype == np.float32 and value == 6.0
    assert w.data.dtype == np.float32
    np.testing.assert_array_equal(w.data, np.array([0.5, 0.0, -0.5], np.float32))
    with pytest.raises(ml.DTypeError, match="mix float32 and float64"):
        await ml.sum(w * np.ones(3)).predict()  # float64 data: refused, as before


@pytest.mark.anyio
async def test_gradients_wants_a_list_of_weights() -> None:
    w = ml.Weight(np.ones(2))
    with pytest.raises(TypeError, match=r"a list of Weights \(\[w\] for one\), got a Weight"):
        await ml.gradients(ml.sum(w), w)  # type: ignore[call-overload]  # one weight, not a list: on purpose
    with pytest.raises(TypeError, match="got ndarray among them"):
        await ml.gradients(ml.sum(w), [np.ones(2)])  # type: ignore[list-item]  # an array for a weight: on purpose
    assert [g.tolist() for g in await ml.gradients(ml.sum(w * w), iter([w]))] == [[2.0, 2.0]]  # type: ignore[call-overload]
    model = {"w": w, "b": ml.Weight(np.zeros(2))}
    with pytest.raises(TypeError) as refused:  # a dict of a model's weights: 'got str among them', and no hint
        await ml.gradients(ml.sum(w * w), model)  # type: ignore[call-overload]  # a dict, not a list: on purpose
    assert str(refused.value) == (
        "gradients(loss, weights): weights is a list of Weights, got a dict (keyed by str, which is what iterating "
        "it gives); pass its weights, list(model.values()), and the gradients come in their order "
        "(dict(zip(model, grads)) keys them by name again), or call ml.value_and_gradients(loss), which keys each "
        "gradient by its Weight"
    )
    grads = await ml.gradients(ml.sum(w * w), list(model.values()))
    assert {k: g.tolist() for k, g in zip(model, grads, strict=True)} == {"w": [2.0, 2.0], "b": [0.0, 0.0]}


def test_settings_of_the_wrong_type_are_refused_where_they_are_made() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"workers": 2.5}, "workers must be an int, got float 2.5"),  # (failed deep in the pool, later)
        ({"workers": True}, "workers must be an int, got bool"),
        ({"cuda_streams": 2.5}, "cuda_streams must be an int"),
        ({"check_finite": "no"}, "check_finite must be True or False, got str 'no'"),  # (it turned the check on)
        ({"finite_steps": "off"}, "finite_steps must be True or False"),
        ({"pause_gc": "x"}, "pause_gc must be True or False"),
        ({"batching": "yes"}, r"batching must be True, False or None"),
        ({"fork_threshold_s": "1"}, "fork_threshold_s must be a number of seconds"),
    ]
    for wrong, message in cases:
        with pytest.raises(TypeError, match=message), ml.settings(**wrong):
            pass
    with (
        pytest.raises(ValueError, match="fork_threshold_s must be >= 0, got nan"),
        ml.settings(fork_threshold_s=float("nan")),
    ):
        pass
    with ml.settings(fork_threshold_s=float("inf"), yield_interval_s=float("inf")) as never:  # (never fork or yield)
        assert never.fork_threshold_s == never.yield_interval_s == float("inf")
    numpy_kinds: Any = {"workers": np.int64(2), "check_finite": np.bool_(True)}  # (NumPy's ints and bools are fine)
    with ml.settings(**numpy_kinds, batching=None) as chosen:
        assert chosen.workers == 2 and chosen.check_finite


def test_one_settings_object_serves_several_blocks_nested_and_in_tasks() -> None:
    """``s = ml.settings(...)`` entered twice raised AttributeError (a
    generator's context manager is used once); each entry now overrides the
    settings where it is entered, and each exit restores them."""
    from monadl.runtime.settings import current_settings

    forced, finite = ml.settings(batching=True), ml.settings(check_finite=True)
    base = current_settings()
    for _ in range(2):
        with forced as s:
            assert s.batching is True and s.check_finite == base.check_finite
            with finite, forced as both:  # (the same object inside itself: over the settings there)
                assert both.batching is True and both.check_finite
            assert current_settings() is s
        assert current_settings() is base

    async def task(ready: anyio.Event, other: anyio.Event) -> None:
        with forced:
            ready.set()
            await other.wait()  # (both tasks inside the block at once)
        assert current_settings() is base

    async def main() -> None:
        a, b = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(task, a, b)
            tg.start_soon(task, b, a)

    anyio.run(main)
    assert current_settings() is base

    errors: list[BaseException] = []

    @ml.settings(check_finite=True)
    def decorated() -> bool:
        return current_settings().check_finite

    def calls() -> None:  # (one object, decorating a function called from several threads at once)
        try:
            for _ in range(2_000):
                assert decorated() and not current_settings().check_finite
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=calls) for _ in range(4)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads interleave inside enter and exit)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors

    async def left_elsewhere() -> None:
        with forced:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, forced.__exit__, None, None, None)

    with pytest.raises(BaseExceptionGroup) as raised:  # (it must end where it began: here, it stays in force)
        anyio.run(left_elsewhere)
    assert raised.group_contains(RuntimeError, match=r"left in a thread or task that did not enter it")
    assert current_settings() is base

    def failing_elsewhere() -> None:  # (the body's own failure stays the one raised, with a note)
        try:
            raise KeyError("the real failure")
        except KeyError as failure:
            forced.__exit__(KeyError, failure, None)
            raise

    def entered_here() -> None:
        forced.__enter__()
        thread = threading.Thread(target=lambda: errors.append(_raised(failing_elsewhere)))
        thread.start()
        thread.join()
        forced.__exit__(None, None, None)

    errors.clear()
    entered_here()
    (failure,) = errors
    assert isinstance(failure, KeyError) and "left in a thread or task" in failure.__notes__[0]
    assert current_settings() is base
    before = len(contextvars.copy_context())
    for _ in range(1_000):  # (a ContextVar per object stayed in the context for good: 116 bytes a block)
        with ml.settings(check_finite=True):
            pass
    assert len(contextvars.copy_context()) == before


def _raised(f: Callable[[], None]) -> BaseException:
    """What ``f`` raised, to look at."""
    try:
        f()
    except BaseException as error:
        return error
    raise AssertionError(f"{f.__name__} raised nothing")


def test_a_wrong_monadl_workers_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from monadl.runtime.settings import _default

    for text in ("abc", "0"):
        monkeypatch.setenv("MONADL_WORKERS", text)
        with pytest.raises(ValueError, match=rf"environment variable MONADL_WORKERS must be an int >= 1, got '{text}'"):
            _default()


def test_check_grads_wants_the_point_as_data() -> None:
    w = ml.Weight(np.ones(2))
    with pytest.raises(TypeError, match=r"check_grads: the point is floats or float arrays.*got a Weight"):
        ml.check_grads(lambda x: ml.tanh(x), w)
    ml.check_grads(lambda x: ml.tanh(x), w.data)


def test_iterating_a_weight_or_a_layer_says_what_to_do_instead() -> None:
    weight = ml.Weight(np.ones(3))
    with pytest.raises(ml.OperandError, match=r"a weight is not iterated .*\(weight\[i\]\)"):
        list(weight)  # type: ignore[call-overload]
    with pytest.raises(ml.OperandError, match=r"a layer is not iterated .*its length is not known"):
        list(weight * 1.0)  # type: ignore[call-overload]


def test_a_shape_error_of_hundreds_of_operands_shows_the_first_ones_and_counts_the_rest() -> None:
    parts = [ml.as_layer(np.ones((1, 4))) for _ in range(200)]
    layer = ml.concatenate([ml.as_layer(np.ones((120, 10))), *parts], axis=1)
    with pytest.raises(ml.ShapeError, match=r"float64\[1, 4\], \.\.\. and 189 more \(189 float64\[1, 4\]\)") as caught:
        anyio.run(layer.predict)
    assert len(str(caught.value)) < 700


def test_a_shape_error_in_a_shared_helper_names_the_weight_that_does_not_fit() -> None:
    # The helper's line is every layer's: the message named it alone, not which weight was wrong.
    def linear(x: ml.Array | ml.ArrayLayer, w: ml.ArrayWeight) -> ml.ArrayLayer:
        return ml.dense(x, w)

    good = ml.Weight(np.ones((4, 8)))
    wrong = ml.Weight(np.ones((9, 8)))  # WRONG-WEIGHT
    with pytest.raises(
        ml.ShapeError, match=rf"; operand 1 is the weight float64\[9, 8\] built at .*:{line_of('WRONG-WEIGHT')}$"
    ):
        anyio.run(ml.sum(linear(linear(np.ones((3, 4)), good), wrong)).predict)


def test_a_shape_error_of_a_cell_shows_its_operand_cells_outputs_by_shape() -> None:
    """A marked cell given an earlier cell's several outputs (an `Outputs`
    operand) and an input of the wrong width: the message shows the outputs'
    shapes, not their values (at H = 256 it printed 20,000 characters of them),
    as another call's outputs (it showed the tuple's type, ``Outputs (...)``),
    and the operands of the step that failed: the output it read."""

    @ml.operation
    def cell(x: ml.ArrayOperand, state: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        h, c = state
        return ml.tanh(x + h), c * 2.0

    zeros = ml.as_layer(np.zeros((1, 256)))
    state = cell(np.ones((1, 256)), (zeros, zeros))
    with pytest.raises(ml.ShapeError) as caught:
        anyio.run(ml.sum(cell(np.ones((1, 257)), state)[0]).predict)
    message = str(caught.value)
    assert message.startswith(
        "test_a_shape_error_of_a_cell_shows_its_operand_cells_outputs_by_shape.<locals>.cell (called on "
        "float64[1, 257], outputs (float64[1, 256], float64[1, 256]) of another operation's call): add of "
        f"float64[1, 257], float64[1, 256] at {__file__}:{line_of('return ml.tanh(x + h)')}: "
    ), message
    assert "array(" not in message
    assert len(message) < 700


def test_an_input_or_a_kernel_of_another_rank_is_told_what_to_write() -> None:
    """A CHW image (PyTorch takes one unbatched) gave Python's 'not enough
    values to unpack (expected 4, got 3)'."""
    kernel = np.ones((2, 3, 3, 3))
    with pytest.raises(ml.ShapeError, match=r"an NCHW input \(4-D\).*got shapes \(3, 8, 8\) and .*x\[None\]"):
        anyio.run(ml.conv2d(np.ones((3, 8, 8)), kernel).predict)
    with pytest.raises(ml.ShapeError, match=r"\(out, in, kh, kw\) kernel \(4-D\).*\(3, 3\).*w\[None, None\]"):
        anyio.run(ml.conv2d(np.ones((1, 1, 8, 8)), np.ones((3, 3))).predict)
    with pytest.raises(ml.ShapeError, match=r"max_pool2d: an NCHW input \(4-D\), got shape \(8, 8\)"):
        anyio.run(ml.max_pool2d(np.ones((8, 8)), 2).predict)


def test_a_join_of_no_list_says_what_it_takes() -> None:
    """A generator gave "object of type 'generator' has no len()"; a layer, "has no len()" too."""
    parts = [ml.as_layer(np.ones(2)), ml.as_layer(np.zeros(2))]
    with pytest.raises(ml.OperandError, match=r"concatenate: takes a list or tuple of operands .*got a generator"):
        ml.concatenate(p for p in parts)  # type: ignore[arg-type]
    with pytest.raises(ml.OperandError, match=r"stack: takes a list or tuple of operands .*got a Layer"):
        ml.stack(parts[0])  # type: ignore[arg-type]
    with pytest.raises(ml.OperandError, match=r"stack: needs at least one operand"):
        ml.stack([])
    assert anyio.run(ml.stack(collections.deque(parts)).predict).shape == (2, 2)  # (any sequence, as before)
    assert anyio.run(ml.concatenate(np.ones((2, 3))).predict).shape == (6,)  # type: ignore[arg-type]  # (its rows)


def test_a_backward_of_ones_own_that_sends_a_delta_of_another_shape_is_refused() -> None:
    """A Tape's backward that stacked its delta gave a weight a gradient of
    another shape, and a step then gave the weight that shape, in silence."""
    w = ml.Weight(np.ones((4, 3)), optimizer=ml.optim.sgd(0.1))

    def stacked(t: ml.Tape[ml.Array, ml.Array]) -> ml.Tape[ml.Array, ml.Array]:
        back = t.backward
        assert back is not None
        return ml.Tape(t.data, lambda d: back(np.stack([d, d])))

    mine: ml.ArrayLayer = ml.Layer(ml.as_layer(w).forward().map(stacked))  # BACKWARD-OF-ONES-OWN
    with pytest.raises(
        ml.ShapeError, match=r"sent a delta of shape \(2, 4, 3\) to the layer built at .*, of shape \(4, 3\)"
    ):
        anyio.run(ml.sum(mine).train)
    assert w.data.shape == (4, 3) and (w.data == 1.0).all()

    def number(t: ml.Tape[ml.Array, ml.Array]) -> ml.Tape[ml.Array, ml.Array]:
        back = t.backward
        assert back is not None
        return ml.Tape(t.data, lambda d: back(1.0))  # type: ignore[arg-type]

    scalar: ml.ArrayLayer = ml.Layer(ml.exp(w).forward().map(number))
    with pytest.raises(ml.ShapeError, match=r"sent a delta of shape \(\) to the layer"):  # (a number, broadcast before)
        anyio.run(ml.sum(scalar).train)


@pytest.mark.parametrize(("sent", "shown"), [([2.0, 2.0, 2.0], "a list"), (None, "None"), ("2", "a str")])
def test_a_backward_of_ones_own_that_sends_no_array_is_named_for_what_it_sent(sent: Any, shown: str) -> None:
    """A list of 3 was reported as a gradient of shape (), and None as a
    delta of shape ()."""
    w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))  # WEIGHT-SENT-TO

    def sends(t: ml.Tape[ml.Array, ml.Array]) -> ml.Tape[ml.Array, ml.Array]:
        back = t.backward
        assert back is not None
        return ml.Tape(t.data * 2.0, lambda d: back(sent))

    mine: ml.ArrayLayer = ml.Layer(ml.forward(w).map(sends))
    with pytest.raises(ml.OperandError) as caught:
        anyio.run(ml.sum(mine).train)
    assert str(caught.value) == (
        f"a backward of your own (a Tape's) sent {shown}, not an array, to the weight built at "
        f"{__file__}:{line_of('WEIGHT-SENT-TO')}, of shape (3,): a delta is an array of its operand's shape (a "
        "number where its operand is one)"
    )
    assert (w.data == 1.0).all()


def test_a_tape_whose_data_is_no_array_names_its_layers_line() -> None:
    """A Tape of a list was refused by the next operation, as 'builtins.list
    is not an array of a known array library', with no layer or line."""
    w = ml.Weight(np.ones(3))

    def listed_data(t: ml.Tape[ml.Array, ml.Array]) -> ml.Tape[ml.Array, ml.Array]:
        return ml.Tape(list(t.data), t.backward)  # type: ignore[arg-type]  # (the mistake under test)

    listed: ml.ArrayLayer = ml.Layer(ml.forward(w).map(listed_data))  # LIST-DATA
    with pytest.raises(ml.OperandError) as caught:
        anyio.run(ml.sum(listed).predict)
    assert str(caught.value) == (
        f"the layer built at {__file__}:{line_of('LIST-DATA')} from a Do (a Tape of your own, bind, ml.direct) "
        "holds a list, not an array or a number: a Tape's data is an array or a number (np.asarray of a list)"
    )


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (lambda g: g, r"returned ndarray, not \(update, state\)"),
        (lambda g: (g[0], None), r"update of shape \(3,\) and dtype float64, for \(4, 3\)"),
        (lambda g: (np.stack([g, g]), None), r"update of shape \(2, 4, 3\)"),
        (lambda g: (g + 1j, None), r"dtype complex128"),
    ],
)
def test_an_optimizers_update_of_another_shape_or_kind_is_refused(update: Any, message: str) -> None:
    """A transformation of one's own that returned a row for a matrix added it
    to every row; one of another shape gave the weight that shape; a complex
    one lost its imaginary part; one that returned no state said 'too many
    values to unpack'."""
    mine = ml.optim.GradientTransformation(lambda p: None, lambda g, s, p: update(g))
    w = ml.Weight(np.ones((4, 3)), optimizer=mine)
    with pytest.raises((TypeError, ml.ShapeError), match=rf"the optimizer of the weight built at .*{message}"):
        anyio.run(ml.sum(w * 2.0).train)
    assert w.data.shape == (4, 3) and (w.data == 1.0).all()


def test_a_state_that_cannot_be_stored_says_what_can(tmp_path: Any) -> None:
    """Found where the optimizer's init makes it (it was at the first save,
    after however long a run), in the words save has for one."""
    mine = ml.optim.GradientTransformation(lambda p: {"count": 0}, lambda g, s, p: (-0.1 * g, s))
    with pytest.raises(TypeError, match=r"\(dict at 'state'\).*None, a number, an array, or a tuple or NamedTuple"):
        ml.Weight(np.ones(2), optimizer=mine)
    w = ml.Weight(np.ones(2))
    w._state = {"count": 0}  # (put past the checks: save still refuses it)
    with pytest.raises(ml.CheckpointError, match=r"type dict .*None, a number, an array, or a tuple or NamedTuple"):
        ml.save(tmp_path / "w.safetensors", {"w": w})


def test_an_object_with_a_forward_as_an_operand_is_told_to_lift_it() -> None:
    class Affine:  # (a DeepLearning instance of one's own)
        def forward(self) -> ml.Do[ml.Tape[ml.Array, ml.Array]]:
            return ml.as_layer(np.ones(2)).forward()

    with pytest.raises(ml.OperandError, match=r"operand of type Affine .*lift it with ml\.as_layer\(x\)"):
        ml.sum(Affine())  # type: ignore[call-overload]


def test_an_embedding_tables_update_is_checked_as_a_dense_weights() -> None:
    """A table's sparse step added its update unchecked: a stacked one failed
    half way through the commit's writes, the first table already stepped."""
    mine = ml.optim.GradientTransformation(lambda p: None, lambda g, s, p: (np.stack([g, g]), s))
    first = ml.Weight(np.ones((4, 2)), optimizer=ml.optim.sgd(0.1))
    second = ml.Weight(np.ones((4, 2)), optimizer=mine)
    loss = ml.sum(ml.embedding(first, np.array([0, 1]))) + ml.sum(ml.embedding(second, np.array([2])))
    with pytest.raises(ml.ShapeError, match=r"the optimizer of the weight built at .*update of shape \(2, 1, 2\)"):
        anyio.run(loss.train)
    assert (first.data == 1.0).all() and (second.data == 1.0).all()


def test_an_optimizer_may_return_its_pair_as_a_named_tuple_or_a_list() -> None:
    class Stepped(NamedTuple):
        update: Any
        state: Any

    def named(g: Any, s: Any, p: Any) -> Any:
        return Stepped(-0.5 * g, s)

    def listed(g: Any, s: Any, p: Any) -> Any:
        return [-0.5 * g, s]

    for update in (named, listed):
        w = ml.Weight(np.ones(2), optimizer=ml.optim.GradientTransformation(lambda p: None, update))
        anyio.run(ml.sum(w * 2.0).train)
        assert w.data.tolist() == [0.0, 0.0]


def test_check_finite_names_a_tape_of_ones_own_that_makes_a_nan() -> None:
    """A NaN made by a backward of one's own (or its forward) was blamed on
    the next primitive: 'sum's operand 0 already holds a NaN', 'the backward
    of multiply produced a NaN'."""
    w = ml.Weight(np.array([1.0, 0.0]), optimizer=ml.optim.sgd(0.1))

    def logged(t: ml.Tape[ml.Array, ml.Array]) -> ml.Tape[ml.Array, ml.Array]:
        back = t.backward
        assert back is not None
        with np.errstate(divide="ignore"):
            return ml.Tape(np.log(t.data), lambda d: back(d / t.data))

    def divided(t: ml.Tape[ml.Array, ml.Array]) -> ml.Tape[ml.Array, ml.Array]:
        back = t.backward
        assert back is not None

        def backward(d: ml.Array) -> None:
            with np.errstate(divide="ignore"):
                back(d / t.data)

        return ml.Tape(t.data * 1.0, backward)

    mine: ml.ArrayLayer = ml.Layer((w * 1.0).forward().map(logged))  # FORWARD-OF-ONES-OWN
    with (
        ml.settings(check_finite=True),
        pytest.raises(ml.NonFiniteError, match=rf":{line_of('FORWARD-OF-ONES-OWN')} from a Do"),
    ):
        anyio.run(ml.sum(mine).train)
    through: ml.ArrayLayer = ml.Layer((w * 1.0).forward().map(divided))
    with (
        ml.settings(check_finite=True),
        pytest.raises(ml.NonFiniteError, match=r"a backward of your own .* sent a NaN or an"),
    ):
        anyio.run(ml.sum(through).train)
    assert w.data.tolist() == [1.0, 0.0]


def test_a_methods_wrong_argument_names_expr_as_users_call_it() -> None:
    """The array methods and the running ones live in bases of `Expr`; an
    argument error names ``Expr.reshape()``, not a base no page documents."""
    x = ml.as_layer(np.ones((2, 3)))
    with pytest.raises(TypeError, match=r"^Expr\.reshape\(\) got an unexpected keyword argument 'shape'"):
        x.reshape(shape=(3, 2))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"^Expr\.mean\(\) got an unexpected keyword argument 'dtype'"):
        x.mean(dtype=np.float32)  # type: ignore[call-overload]
    assert ml.Layer.train.__qualname__ == "Expr.train"  # (a coroutine never awaited is said by it)
    import functools
    import pickle

    for method in (ml.Expr.sum, ml.Expr.reshape, ml.Expr.train):
        assert pickle.loads(pickle.dumps(method)) is method  # (found where Expr is, as before the move)
    mean = pickle.loads(pickle.dumps(functools.partial(ml.Expr.mean, axis=0)))  # (one sent to a worker process)
    assert mean.func is ml.Expr.mean and mean.keywords == {"axis": 0}


@pytest.mark.parametrize("data", [np.ones(3, complex), np.array(["a", "b"]), np.array([object(), 1.0])])
def test_an_array_of_no_real_numbers_is_refused_saying_which_numbers_monadl_computes_with(data: Any) -> None:
    # Complex data was refused with "monadl computes with numbers", which a new user found odd: complex are numbers.
    with pytest.raises(ml.OperandError) as raised:
        ml.sum(data)
    assert str(raised.value) == (
        f"sum: array operand has dtype {data.dtype}; monadl computes with real numbers (booleans, integers and "
        "floats; not complex ones, nor objects or strings)"
    )
