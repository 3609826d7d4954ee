"""Layers, weights and the differentiable functions over them."""

from monadl.layers._functions import (
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
from monadl.layers._layer import (
    Array,
    ArrayLayer,
    ArrayOperand,
    ArrayWeight,
    AsArray,
    AsScalar,
    Layer,
    Operand,
    ScalarLayer,
    ScalarOperand,
    ScalarWeight,
    Weight,
)
from monadl.layers._primitives import Primitive, unbroadcast

__all__ = [
    "Array", "ArrayLayer", "ArrayOperand", "ArrayWeight", "AsArray", "AsScalar", "Layer", "Operand", "Primitive",
    "ScalarLayer", "ScalarOperand", "ScalarWeight", "Weight", "abs", "concatenate", "conv2d",
    "cross_entropy", "dense", "dot", "embedding", "exp", "log", "log_softmax", "logsumexp", "matmul", "max",
    "max_pool2d", "maximum", "mean", "minimum", "relu", "reshape", "sigmoid", "softmax", "sqrt",
    "stack", "stop_gradient", "sum", "tanh", "transpose", "unbroadcast",
]
