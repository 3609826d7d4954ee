"""The DeepLearning type class: forward for the nine built-in kinds and user types."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import monadl as ml
from monadl.deltas import SparseRows
from monadl.typeclasses import DeepLearning, forward

pytestmark = pytest.mark.anyio

VALUES: list[Any] = [np.float32(1.5), np.float64(2.5), np.ones(3)]


@pytest.mark.parametrize("value", VALUES, ids=["float32", "float64", "array"])
async def test_nine_built_in_kinds(value: Any) -> None:
    weight = ml.Weight(value)
    layer = weight * 1.0
    plain = await forward(value).run()
    assert plain.backward is None
    for kind in (value, weight, layer):
        tape = await forward(kind).run()
        np.testing.assert_array_equal(tape.data, value)
        assert np.asarray(tape.data).dtype == np.asarray(value).dtype
    assert isinstance(weight, DeepLearning) and isinstance(layer, DeepLearning)


class Doubled:
    """A user type: twice a weight, differentiable through its forward."""

    def __init__(self, weight: ml.ScalarWeight) -> None:
        self.weight = weight

    def forward(self) -> ml.Do[ml.Tape[float, float]]:
        return (self.weight * 2.0).forward()


async def test_a_user_type_is_an_instance_and_becomes_a_layer() -> None:
    w = ml.Weight(3.0)
    user = Doubled(w)
    assert isinstance(user, DeepLearning)
    assert (await forward(user).run()).data == 6.0
    [grad] = await ml.gradients(ml.Layer(forward(user)) * 5.0, [w])
    assert grad == 10.0


def test_non_differentiable_values_are_refused() -> None:
    with pytest.raises(ml.OperandError, match="not differentiable"):
        forward("x")  # type: ignore[call-overload]  # the mistake under test


def test_the_operand_aliases_are_types_at_runtime() -> None:
    """A user's module without ``from __future__ import annotations`` evaluates
    its annotations: ``ml.AsArray | None`` as a dataclass field's raised
    TypeError (the aliases were strings), and get_type_hints a NameError."""
    import typing

    for alias in (ml.AsArray, ml.AsScalar, ml.ArrayOperand, ml.ScalarOperand, ml.Operand):
        assert typing.get_origin(alias) is not None  # (a union, not a string)
        assert typing.get_args(alias | None)[-1] is type(None)

    def affine(x: ml.AsArray, w: ml.AsScalar) -> ml.ArrayLayer:
        return ml.as_layer(x) * w

    affine.__annotations__ = {"x": ml.AsArray, "w": ml.AsScalar, "return": ml.ArrayLayer}  # (as evaluated)
    assert typing.get_type_hints(affine)["x"] == ml.AsArray


def test_as_layer_goes_by_its_own_name_and_stop_gradient_by_its() -> None:
    # ml.as_layer(x) showed as Layer(stop_gradient, ...), in ml.to_dot too, and refused a ragged list as stop_gradient.
    x = ml.as_layer(np.ones((2, 3)))
    assert repr(x).startswith("Layer(as_layer, built at ")
    assert 'label="as_layer\\n' in ml.to_dot(ml.sum(x))
    ragged: Any = [[1.0, 2.0], [3.0]]  # (a GNN's messages; mypy refuses it, a notebook does not)
    with pytest.raises(ml.OperandError, match=r"^as_layer: operand of type list is not a Layer"):
        ml.as_layer(ragged)
    assert repr(ml.stop_gradient(np.ones(3))).startswith("Layer(stop_gradient, built at ")
    with pytest.raises(ml.OperandError, match=r"^stop_gradient: operand of type list is not a Layer"):
        ml.stop_gradient(ragged)


async def test_as_layer_of_a_weight_is_one_primitive_node_with_the_weights_value_and_delta() -> None:
    # It was a layer built from the weight's Do: opaque to batching (a graph holding it ran
    # alone, tests/runtime/test_batching_fibers.py) and refused inside a marked cell.
    import copy

    w = ml.Weight(np.array([1.0, -2.0]), optimizer=ml.optim.sgd(0.5))
    lifted = ml.as_layer(w)
    assert lifted is ml.as_layer(w) and lifted._op is not None and lifted._inputs == (w,)
    assert repr(lifted).startswith("Layer(as_layer, built at ")
    twin = copy.deepcopy(w)  # (its reference to the node is copied as it is: the original's)
    assert ml.as_layer(twin)._inputs[0] is twin
    value, grads = await ml.value_and_gradients(ml.sum(lifted * lifted * 3.0))
    assert value == 15.0
    np.testing.assert_array_equal(grads[w], [6.0, -12.0])
    cell = ml.operation(lambda x: ml.tanh(x * ml.as_layer(w)))
    value, grads = await ml.value_and_gradients(ml.sum(cell(np.array([0.5, 0.25]))))
    want_value, want = await ml.value_and_gradients(ml.sum(ml.tanh(np.array([0.5, 0.25]) * w)))
    assert value == want_value
    np.testing.assert_array_equal(grads[w], want[w])
    await ml.sum(lifted).train()
    np.testing.assert_array_equal(w.data, [0.5, -2.5])


@pytest.mark.anyio
async def test_a_lifted_table_steps_its_looked_up_rows_alone() -> None:
    # The lifted table's node turned its rows' delta dense: Adam then moved every row, and a step of a
    # 200,000-row table took 170x as long as the table's own (a new user's trial).
    rng = np.random.default_rng(0)
    tables = [ml.Weight(rng.standard_normal((50, 4)), optimizer=ml.optim.adam(0.1)) for _ in range(2)]
    tables[1].data = tables[0].data
    ids = np.array([1, 3, 3])
    _, grads = await ml.value_and_gradients(ml.sum(ml.embedding(ml.as_layer(tables[1]), ids) ** 2.0))
    assert type(grads[tables[1]]) is SparseRows
    for step in range(3):
        for used in (tables[0], ml.as_layer(tables[1])):
            await ml.sum(ml.embedding(used, ids if step == 0 else np.array([7])) ** 2.0).train()
    np.testing.assert_array_equal(tables[1].data, tables[0].data)  # (row 1 moved at the first step only)
