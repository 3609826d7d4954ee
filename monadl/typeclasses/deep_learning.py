"""The paper's ``DeepLearning`` type class: anything with a forward pass.

``forward(x)`` gives the ``Do[Tape[Data, Delta]]`` of any differentiable
value: plain data (a constant: its tape takes no delta), a `Weight` or a
`Layer`, for the paper's nine built-in kinds (float32 scalars, float64
scalars and arrays, each plain, as a weight or as a layer), and for any user
type that has a ``forward()`` method (the `DeepLearning` protocol).

>>> import anyio, numpy as np
>>> tape = anyio.run(forward(np.float32(2.0)).run)
>>> tape.data, tape.backward is None
(np.float32(2.0), True)
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, overload, runtime_checkable

import numpy as np

from monadl.do import FORWARD, Do
from monadl.errors import OperandError
from monadl.layers._arrays import NumPyScalar
from monadl.layers._functions import data_layer, weight_layer
from monadl.layers._layer import Array, DeviceArray, Expr, Layer
from monadl.layers._weight import Weight
from monadl.tape import Tape

__all__ = ["DeepLearning", "as_layer", "forward"]

Data_co = TypeVar("Data_co", covariant=True)
Delta_contra = TypeVar("Delta_contra", contravariant=True)
D = TypeVar("D")
G = TypeVar("G")


@runtime_checkable
class DeepLearning(Protocol[Data_co, Delta_contra]):
    """A differentiable value: its forward pass is a ``Do[Tape[Data, Delta]]``.

    `Layer` and `Weight` are instances; so is any class of yours with such a
    ``forward`` method, and ``ml.Layer(x.forward())`` makes it a layer.
    """

    def forward(self) -> Do[Tape[Data_co, Delta_contra]]: ...


@overload
def forward(x: DeepLearning[D, G]) -> Do[Tape[D, G]]: ...
@overload
def forward(x: float | NumPyScalar) -> Do[Tape[float, float]]: ...
@overload
def forward(x: Array) -> Do[Tape[Array, Array]]: ...
def forward(x: Any) -> Do[Tape[Any, Any]]:
    """The forward pass of any differentiable value (see the module docs)."""
    if isinstance(x, Expr):
        return Do(FORWARD, x)
    if type(x) is np.ndarray and x.dtype.kind in "fiu":  # (before the protocol's isinstance: 4 us)
        return Do.pure(Tape(x))
    if isinstance(x, DeepLearning):
        result: Do[Tape[Any, Any]] = x.forward()
        return result
    if isinstance(x, (float, int, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return Do.pure(Tape(x if isinstance(x, np.generic) else np.float64(x)))
    if isinstance(x, np.ndarray) and x.dtype.kind in "fiu":
        return Do.pure(Tape(x))
    raise OperandError(
        f"forward: {type(x).__name__} is not differentiable (not data, a Weight, a Layer or a DeepLearning)"
    )


@overload
def as_layer(x: DeepLearning[D, G]) -> Layer[D, G]: ...
@overload
def as_layer(x: float | NumPyScalar) -> Layer[float, float]: ...
@overload
def as_layer(x: Array) -> Layer[Array, Array]: ...
@overload
def as_layer(x: DeviceArray) -> Layer[Any, Any]: ...
def as_layer(x: Any) -> Layer[Any, Any]:
    """Any differentiable value as a `Layer`: a layer as it is, a weight as
    its one node (`monadl.layers._functions.weight_layer`: it batches as the
    weight does; shared while a graph holds it, so its line in errors and
    `monadl.to_dot` is where it was first lifted), plain data as a constant, an object of yours by its
    ``forward()`` (a layer built from a ``Do``, which keeps its graph out of
    batching: lift its parts instead where you can).

    A polymorphic differentiable function lifts one operand so that its
    result is a layer whatever mix of data, weights and layers it is given:

    >>> import anyio, numpy as np, monadl as ml
    >>> def polymorphic(a: ml.AsArray, b: ml.AsArray, c: ml.AsArray, d: ml.AsArray) -> ml.ArrayLayer:
    ...     return as_layer(a) * b + c * d
    >>> anyio.run(polymorphic(np.ones(2), ml.Weight(np.ones(2)), np.ones(2), np.ones(2)).predict)
    array([2., 2.])
    """
    if isinstance(x, Layer):
        return x
    if isinstance(x, Weight):
        return weight_layer(x)
    # Plain data (NumPy's first: the protocol's isinstance walks its attributes, 4 us):
    # a constant node of the layer graph (it gets no delta).
    if type(x) is np.ndarray or (not isinstance(x, Expr) and not isinstance(x, DeepLearning)):
        return data_layer(x)
    return Layer(forward(x))
