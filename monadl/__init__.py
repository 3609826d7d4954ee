"""monadl: differentiable programming in the monadic style.

A model is plain Python that builds lazy `Layer`s over trainable `Weight`s;
``await loss.train()`` runs one forward and one backward pass and steps every
weight it reaches once; ``await layer.predict()`` runs the forward pass.
"""

from monadl import optim
from monadl._scope import entered_only as _entered_only
from monadl.checkpoint import load, save
from monadl.direct import direct, values
from monadl.do import Do
from monadl.errors import (
    CheckpointError,
    DeviceError,
    DTypeError,
    IndexRangeError,
    MonadlError,
    NonFiniteError,
    OperandError,
    ShapeError,
)
from monadl.gradcheck import check_grads, gradients, value_and_gradients
from monadl.graph import render_graph, to_dot
from monadl.layers import (
    Array,
    ArrayLayer,
    ArrayOperand,
    ArrayWeight,
    AsArray,
    AsScalar,
    DeviceArray,
    Expr,
    Layer,
    Operand,
    Operation,
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
    operation,
    relu,
    reshape,
    segment_sum,
    sigmoid,
    softmax,
    split,
    sqrt,
    stack,
    stop_gradient,
    sum,
    tanh,
    transpose,
    where,
)
from monadl.runtime.settings import Settings, current_settings
from monadl.runtime.settings import settings as _settings
from monadl.tape import Tape
from monadl.typeclasses import DeepLearning, as_layer, forward

__version__ = "0.1.0"

# Called without `with`, it warns that it changed nothing (monadl/_scope.py); the API page follows
# the wrapper to the docstring in runtime/settings.py.
settings = _entered_only("ml.settings")(_settings)

__all__ = [
    "Array",
    "ArrayLayer",
    "ArrayOperand",
    "ArrayWeight",
    "AsArray",
    "AsScalar",
    "CheckpointError",
    "DTypeError",
    "DeepLearning",
    "DeviceArray",
    "DeviceError",
    "Do",
    "Expr",
    "IndexRangeError",
    "Layer",
    "MonadlError",
    "NonFiniteError",
    "Operand",
    "OperandError",
    "Operation",
    "ScalarLayer",
    "ScalarOperand",
    "ScalarWeight",
    "Settings",
    "ShapeError",
    "Tape",
    "Weight",
    "abs",
    "as_layer",
    "check_grads",
    "concatenate",
    "conv2d",
    "cross_entropy",
    "current_settings",
    "dense",
    "direct",
    "dot",
    "embedding",
    "exp",
    "forward",
    "gradients",
    "load",
    "log",
    "log_softmax",
    "logsumexp",
    "matmul",
    "max",
    "max_pool2d",
    "maximum",
    "mean",
    "minimum",
    "operation",
    "optim",
    "relu",
    "render_graph",
    "reshape",
    "save",
    "segment_sum",
    "settings",
    "sigmoid",
    "softmax",
    "split",
    "sqrt",
    "stack",
    "stop_gradient",
    "sum",
    "tanh",
    "to_dot",
    "transpose",
    "value_and_gradients",
    "values",
    "where",
]
