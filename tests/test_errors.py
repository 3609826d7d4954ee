"""Errors name the operation, the operands, and the user's line."""

from __future__ import annotations

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


def test_numpy_defers_to_monadl() -> None:
    w = ml.Weight(np.ones(3))
    assert isinstance(np.ones(3) * w, ml.Layer)
    assert isinstance(np.ones(3) - w, ml.Layer)
    assert isinstance(np.ones((2, 3)) @ w, ml.Layer)
    assert isinstance(2.0 ** ml.Weight(1.0), ml.Layer)


@pytest.mark.anyio
async def test_other_errors_keep_their_type_and_gain_a_note() -> None:
    w = ml.Weight(np.ones(3))
    bad = w[np.array([5])]  # BUILD-SITE-6
    with pytest.raises(IndexError) as info:
        await bad.predict()
    assert any(f":{line_of('BUILD-SITE-6')}" in note for note in info.value.__notes__)
