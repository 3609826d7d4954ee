"""`Expr` (a differentiable expression) and `Layer` (a lazy one built from operands).

Building a layer computes nothing: it records the primitive, its operands and
the line of user code that built it (for error messages). This module holds
what builds layers: `Expr`'s operators and indexing, and how a node is made
(`binary`, `built_at`, `_build`). `forward()` gives the paper's
``Do[Tape[Data, Delta]]``, and `train()` and `predict()` run it
(`monadl.layers._runnable`); the array methods, ``sum`` to ``T``:
`monadl.layers._array_methods`.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Never, TypeAlias, TypeVar, final, overload

from monadl.do import Do
from monadl.errors import OperandError
from monadl.layers._array_methods import ArrayMethods
from monadl.layers._arrays import Array, DeviceArray, Gathering, Indexing, NumPyScalar, Parts, Slicing
from monadl.layers._operand import operand as _operand
from monadl.layers._primitives import PRIMITIVES, Primitive, shown
from monadl.layers._runnable import Runnable
from monadl.layers._site import PACKAGE_DIR, Site, caller_site, site_text
from monadl.layers._ufunc import UfuncHook, array_function
from monadl.layers._unvalued import Unvalued
from monadl.tape import Tape

__all__ = [
    "Array",
    "ArrayLayer",
    "AsArray",
    "AsScalar",
    "DeviceArray",
    "Expr",
    "Layer",
    "Operand",
    "ScalarLayer",
]

D = TypeVar("D")
G = TypeVar("G")

_serials = itertools.count()
# Bound once: building layers is a hot path of every model.
_next_serial = _serials.__next__
_getframe = sys._getframe
_new = object.__new__


class Expr(Unvalued, Runnable[D, G], ArrayMethods[D, G]):
    """A differentiable expression: what layers and weights share (``forward``,
    ``train``, ``predict``, the array methods, and the operators that build
    new layers).

    Abstract: only `Layer` and `Weight` are instantiated. Use it in
    annotations that take either, e.g. ``ml.Expr[ml.Array, ml.Array]``.
    Its truth, order and iteration are refused (`Unvalued`).
    """

    __slots__ = ()
    # NumPy sees methods (an array on an operator's left reaches monadl; other ufuncs and NumPy
    # functions raise a hint); CuPy sees None and calls our reflected operators (`_ufunc`).
    __array_ufunc__ = UfuncHook()
    __array_function__ = array_function

    @classmethod
    def _make(cls, op: Primitive, inputs: tuple[Any, ...], params: tuple[Any, ...] = ()) -> Layer[Any, Any]:
        """A node of ``op`` over ``inputs``, built at the line that called the method calling this."""
        return _build(op, inputs, params, 2)

    # ---- arithmetic (typed: scalars stay scalars, arrays win) -----------------
    # The overloads whose self is `Expr[Never, Never]` match only an expression of Any (a weight of
    # another library's array or of data NumPy's stubs type as Any, a layer indexed by an int); without
    # them mypy took the first that matched, the scalar one, and `v * 2.0` of a 4x3 weight was typed
    # ScalarLayer. With them it is `Layer[Any, Any]`, and with an array (not another such), arrays win.
    @overload
    def __add__(self: Expr[Never, Never], other: Expr[Never, Never]) -> Layer[Any, Any]: ...
    @overload
    def __add__(self: Expr[Never, Never], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __add__(self: Expr[Never, Never], other: Operand) -> Layer[Any, Any]: ...
    @overload
    def __add__(self: Expr[float, float], other: ScalarOperand) -> Layer[float, float]: ...
    @overload
    def __add__(self: Expr[float, float], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __add__(self: Expr[Array, Array], other: Operand) -> Layer[Array, Array]: ...
    def __add__(self, other: Operand) -> Layer[Any, Any]:
        return binary(_ADD, self, other)

    @overload
    def __radd__(self: Expr[Never, Never], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __radd__(self: Expr[Never, Never], other: float | NumPyScalar) -> Layer[Any, Any]: ...
    @overload
    def __radd__(self: Expr[float, float], other: float | NumPyScalar) -> Layer[float, float]: ...
    @overload
    def __radd__(self: Expr[float, float], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __radd__(self: Expr[Array, Array], other: Array | float | NumPyScalar) -> Layer[Array, Array]: ...
    def __radd__(self, other: Array | float | NumPyScalar) -> Layer[Any, Any]:
        return binary(_ADD, other, self)

    @overload
    def __sub__(self: Expr[Never, Never], other: Expr[Never, Never]) -> Layer[Any, Any]: ...
    @overload
    def __sub__(self: Expr[Never, Never], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __sub__(self: Expr[Never, Never], other: Operand) -> Layer[Any, Any]: ...
    @overload
    def __sub__(self: Expr[float, float], other: ScalarOperand) -> Layer[float, float]: ...
    @overload
    def __sub__(self: Expr[float, float], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __sub__(self: Expr[Array, Array], other: Operand) -> Layer[Array, Array]: ...
    def __sub__(self, other: Operand) -> Layer[Any, Any]:
        return binary(_SUB, self, other)

    @overload
    def __rsub__(self: Expr[Never, Never], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rsub__(self: Expr[Never, Never], other: float | NumPyScalar) -> Layer[Any, Any]: ...
    @overload
    def __rsub__(self: Expr[float, float], other: float | NumPyScalar) -> Layer[float, float]: ...
    @overload
    def __rsub__(self: Expr[float, float], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rsub__(self: Expr[Array, Array], other: Array | float | NumPyScalar) -> Layer[Array, Array]: ...
    def __rsub__(self, other: Array | float | NumPyScalar) -> Layer[Any, Any]:
        return binary(_SUB, other, self)

    @overload
    def __mul__(self: Expr[Never, Never], other: Expr[Never, Never]) -> Layer[Any, Any]: ...
    @overload
    def __mul__(self: Expr[Never, Never], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __mul__(self: Expr[Never, Never], other: Operand) -> Layer[Any, Any]: ...
    @overload
    def __mul__(self: Expr[float, float], other: ScalarOperand) -> Layer[float, float]: ...
    @overload
    def __mul__(self: Expr[float, float], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __mul__(self: Expr[Array, Array], other: Operand) -> Layer[Array, Array]: ...
    def __mul__(self, other: Operand) -> Layer[Any, Any]:
        return binary(_MUL, self, other)

    @overload
    def __rmul__(self: Expr[Never, Never], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rmul__(self: Expr[Never, Never], other: float | NumPyScalar) -> Layer[Any, Any]: ...
    @overload
    def __rmul__(self: Expr[float, float], other: float | NumPyScalar) -> Layer[float, float]: ...
    @overload
    def __rmul__(self: Expr[float, float], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rmul__(self: Expr[Array, Array], other: Array | float | NumPyScalar) -> Layer[Array, Array]: ...
    def __rmul__(self, other: Array | float | NumPyScalar) -> Layer[Any, Any]:
        return binary(_MUL, other, self)

    @overload
    def __truediv__(self: Expr[Never, Never], other: Expr[Never, Never]) -> Layer[Any, Any]: ...
    @overload
    def __truediv__(self: Expr[Never, Never], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __truediv__(self: Expr[Never, Never], other: Operand) -> Layer[Any, Any]: ...
    @overload
    def __truediv__(self: Expr[float, float], other: ScalarOperand) -> Layer[float, float]: ...
    @overload
    def __truediv__(self: Expr[float, float], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __truediv__(self: Expr[Array, Array], other: Operand) -> Layer[Array, Array]: ...
    def __truediv__(self, other: Operand) -> Layer[Any, Any]:
        return binary(_DIV, self, other)

    @overload
    def __rtruediv__(self: Expr[Never, Never], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rtruediv__(self: Expr[Never, Never], other: float | NumPyScalar) -> Layer[Any, Any]: ...
    @overload
    def __rtruediv__(self: Expr[float, float], other: float | NumPyScalar) -> Layer[float, float]: ...
    @overload
    def __rtruediv__(self: Expr[float, float], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rtruediv__(self: Expr[Array, Array], other: Array | float | NumPyScalar) -> Layer[Array, Array]: ...
    def __rtruediv__(self, other: Array | float | NumPyScalar) -> Layer[Any, Any]:
        return binary(_DIV, other, self)

    @overload
    def __pow__(self: Expr[Never, Never], other: Expr[Never, Never]) -> Layer[Any, Any]: ...
    @overload
    def __pow__(self: Expr[Never, Never], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __pow__(self: Expr[Never, Never], other: Operand) -> Layer[Any, Any]: ...
    @overload
    def __pow__(self: Expr[float, float], other: ScalarOperand) -> Layer[float, float]: ...
    @overload
    def __pow__(self: Expr[float, float], other: ArrayOperand) -> Layer[Array, Array]: ...
    @overload
    def __pow__(self: Expr[Array, Array], other: Operand) -> Layer[Array, Array]: ...
    def __pow__(self, other: Operand) -> Layer[Any, Any]:
        return binary(_POW, self, other)

    @overload
    def __rpow__(self: Expr[Never, Never], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rpow__(self: Expr[Never, Never], other: float | NumPyScalar) -> Layer[Any, Any]: ...
    @overload
    def __rpow__(self: Expr[float, float], other: float | NumPyScalar) -> Layer[float, float]: ...
    @overload
    def __rpow__(self: Expr[float, float], other: Array) -> Layer[Array, Array]: ...
    @overload
    def __rpow__(self: Expr[Array, Array], other: Array | float | NumPyScalar) -> Layer[Array, Array]: ...
    def __rpow__(self, other: Array | float | NumPyScalar) -> Layer[Any, Any]:
        return binary(_POW, other, self)

    def __matmul__(self: Expr[Array, Array], other: ArrayOperand) -> Layer[Array, Array]:  # (no scalar's)
        return binary(_MATMUL, self, other)

    def __rmatmul__(self: Expr[Array, Array], other: Array) -> Layer[Array, Array]:
        return binary(_MATMUL, other, self)

    def __neg__(self) -> Layer[D, G]:
        return Layer._make(PRIMITIVES["negative"], (self,))

    def __abs__(self) -> Layer[D, G]:
        return Layer._make(PRIMITIVES["abs"], (self,))

    @overload
    def __getitem__(self: Expr[Array, Array], index: Slicing | Gathering) -> Layer[Array, Array]: ...
    @overload
    def __getitem__(self: Expr[Array, Array], index: Indexing) -> Layer[Any, Any]: ...
    @overload
    def __getitem__(self: Expr[Array, Array], index: Parts) -> Layer[Array, Array]: ...
    def __getitem__(self, index: Any) -> Layer[Any, Any]:
        """Indexing and slicing; slices alone (with ``...`` and ``None``), an
        integer or boolean array or a list of ints, and a tuple with one first
        or second (``log_p[rows, labels]``, ``h[:, src]``; a list or a tuple
        beside it is one too) or of unknown length that may hold one keep an
        array an array. (A scalar layer has no index: mypy rejects one, as NumPy's
        IndexError would.)"""
        if isinstance(index, Expr):
            raise OperandError("getitem: an index must be plain data, not a Layer or a Weight")
        # A cell cuts its gates with several slices a node: built here, as `binary` builds.
        layer: Layer[Any, Any] = _new(Layer)
        layer._op = _GETITEM
        layer._inputs = (self,)
        layer._params = (index,)
        frame = _getframe(1)  # the caller of the operator
        while frame.f_code.co_filename.startswith(PACKAGE_DIR) and frame.f_back is not None:
            frame = frame.f_back
        layer._site = (frame.f_code, frame.f_lasti)
        layer._serial = _next_serial()
        return layer


ScalarOperand: TypeAlias = float | NumPyScalar | Expr[float, float]  # (not a string: `ml.AsScalar | None` runs)
ArrayOperand: TypeAlias = Array | Expr[Array, Array]
Operand: TypeAlias = Array | DeviceArray | float | NumPyScalar | Expr[Any, Any]
"""Anything a differentiable function accepts: plain data, weights and layers."""
AsArray: TypeAlias = ArrayOperand
"""An alias of `ArrayOperand` (a plain array, an array weight or an array layer), the paper's name."""
AsScalar: TypeAlias = ScalarOperand
"""An alias of `ScalarOperand` (a plain number, a scalar weight or a scalar layer), the paper's name."""


_ADD, _SUB, _MUL, _DIV, _POW, _MATMUL, _GETITEM = (
    PRIMITIVES[name] for name in ("add", "subtract", "multiply", "divide", "power", "matmul", "getitem")
)


def binary(op: Primitive, a: object, b: object) -> Layer[Any, Any]:
    """A layer of a binary primitive, built at the user's line (operators and NumPy's ufuncs call it)."""
    # The hot path of model building, so _build and _site are inlined here
    # (and _do, read only when _op is None, is left unset).
    kind = type(a)
    if kind is not Layer and kind is not float:
        a = _operand(a, op.name)
    kind = type(b)
    if kind is not Layer and kind is not float:
        b = _operand(b, op.name)
    layer: Layer[Any, Any] = _new(Layer)
    layer._op = op
    layer._inputs = (a, b)
    layer._params = ()
    frame = _getframe(2)  # the caller of the operator
    while frame.f_code.co_filename.startswith(PACKAGE_DIR) and frame.f_back is not None:
        frame = frame.f_back
    layer._site = (frame.f_code, frame.f_lasti)
    layer._serial = _next_serial()
    return layer


@final
class Layer(Expr[D, G]):
    """A lazy differentiable expression whose forward value is a ``D`` and
    whose delta is a ``G``.

    Layers come from operators and functions on weights, data and other
    layers, or from any ``Do[Tape[D, G]]`` (the paper's dynamic networks):

    >>> import anyio, numpy as np, monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]))
    >>> anyio.run((w * 3.0).sum().predict)
    np.float64(9.0)
    """

    __slots__ = ("__weakref__", "_do", "_inputs", "_op", "_params", "_serial", "_site")

    _op: Primitive | None
    _inputs: tuple[Any, ...]
    _params: tuple[Any, ...]
    _do: Do[Tape[D, G]] | None
    _site: Site
    _serial: int  # construction order: operands always have smaller serials

    def __init__(self, forward: Do[Tape[D, G]]) -> None:
        """A layer whose forward pass is ``forward`` (evaluated at most once
        per evaluation, however many consumers it has)."""
        if not isinstance(forward, Do):
            raise OperandError(f"Layer(...) takes a Do[Tape[...]], got {type(forward).__name__}")
        self._op = None
        self._inputs = ()
        self._params = ()
        self._do = forward
        self._site = caller_site()
        self._serial = next(_serials)

    def __repr__(self) -> str:
        what = shown(self._op) if self._op is not None else "from Do"
        return f"Layer({what}, built at {site_text(self._site)})"


def built_at(op: Primitive, inputs: tuple[Any, ...], site: Site) -> Layer[Any, Any]:
    """A primitive layer built at ``site``, found once by its caller (a Fold
    block's constant rows: its line, where the block was made), not per node."""
    layer: Layer[Any, Any] = _new(Layer)
    layer._op = op
    layer._inputs = inputs
    layer._params = ()
    layer._site = site
    layer._serial = _next_serial()
    return layer


def _build(op: Primitive, inputs: tuple[Any, ...], params: tuple[Any, ...], depth: int) -> Layer[Any, Any]:
    """A primitive layer; its site is found from the frame ``depth`` levels up
    from here (the first that may be the user's) outwards. ``_do``, read only
    when ``_op`` is None, is left unset."""
    layer: Layer[Any, Any] = _new(Layer)
    layer._op = op
    layer._inputs = inputs
    layer._params = params
    frame = _getframe(depth)
    while frame.f_code.co_filename.startswith(PACKAGE_DIR) and frame.f_back is not None:
        frame = frame.f_back
    layer._site = (frame.f_code, frame.f_lasti)
    layer._serial = _next_serial()
    return layer


ScalarLayer: TypeAlias = Layer[float, float]
"""A layer whose value and delta are floats (a loss, a sum)."""
ArrayLayer: TypeAlias = Layer[Array, Array]
"""A layer whose value and delta are NumPy arrays."""
