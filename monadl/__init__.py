"""monadl: differentiable programming in the monadic style.

A model is plain Python that builds lazy `Layer`s over trainable `Weight`s;
``await loss.train()`` runs one forward and one backward pass and steps every
weight it reaches once; ``await layer.predict()`` runs the forward pass.
"""

from monadl import _allocator, optim  # noqa: F401 - _allocator tunes malloc on import
from monadl._settings import Settings, current_settings, settings
from monadl.direct import direct, values
from monadl.do import Do
from monadl.errors import DeviceError, DTypeError, MonadlError, NonFiniteError, OperandError, ShapeError
from monadl.gradcheck import check_grads, gradients
from monadl.layers import (
    Array,
    ArrayLayer,
    ArrayOperand,
    ArrayWeight,
    DeviceArray,
    AsArray,
    AsScalar,
    Layer,
    Operand,
    ScalarLayer,
    ScalarOperand,
    ScalarWeight,
    Weight,
    abs,
    concatenate,
    conv2d,
    cross_entropy,
    dense,
    dot,
    embedding,
    exp,
    log,
    log_softmax,
    logsumexp,
    matmul,
    max,
    max_pool2d,
    maximum,
    mean,
    minimum,
    relu,
    reshape,
    sigmoid,
    softmax,
    sqrt,
    stack,
    stop_gradient,
    sum,
    tanh,
    transpose,
)
from monadl.tape import Tape
from monadl.typeclasses import DeepLearning, as_layer, forward

__version__ = "0.1.0"

__all__ = [
    "Array", "ArrayLayer", "DeepLearning", "as_layer", "forward", "ArrayOperand", "ArrayWeight", "AsArray", "AsScalar", "DeviceArray", "DeviceError", "DTypeError", "Do", "Layer",
    "MonadlError", "NonFiniteError", "Operand", "OperandError", "ScalarLayer", "ScalarOperand",
    "ScalarWeight", "Settings", "ShapeError", "Tape", "Weight", "abs", "check_grads",
    "concatenate", "conv2d", "cross_entropy", "current_settings", "dense", "direct", "dot", "embedding", "exp",
    "gradients", "log", "log_softmax", "logsumexp", "matmul", "max", "max_pool2d", "maximum",
    "mean", "minimum", "optim", "relu", "reshape", "settings", "sigmoid", "softmax", "sqrt",
    "stack", "stop_gradient", "sum", "tanh", "transpose", "values",
]
