"""NumPy ufuncs meeting layers and weights: ``array op layer`` builds a layer,
anything else (``np.exp(w)``) is refused with monadl's spelling of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final, overload

import numpy as np

from monadl.layers._primitives import PRIMITIVES

if TYPE_CHECKING:
    from monadl.layers._layer import Expr, Layer

__all__ = ["DIFFERENTIABLE", "UfuncHook", "array_function"]


# The operators a NumPy ufunc stands for when an array is on the left of a
# layer (`x * w` calls `np.multiply(x, w)`, which calls `__array_ufunc__`).
_OPERATOR_UFUNCS: dict[Any, str] = {
    np.add: "add",
    np.subtract: "subtract",
    np.multiply: "multiply",
    np.true_divide: "divide",
    np.power: "power",
    np.matmul: "matmul",
}
# NumPy ufuncs whose differentiable counterpart has another spelling in monadl.
_UFUNC_HINTS: dict[Any, str] = {
    np.absolute: "ml.abs(x)",
    np.negative: "-x",
    np.positive: "x",
    np.square: "x ** 2.0",
    np.reciprocal: "1.0 / x",
    np.float_power: "x ** y",
}


_COMPARISONS: Final = frozenset({np.less, np.less_equal, np.greater, np.greater_equal})


def _array_ufunc(self: Expr[Any, Any], ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Layer[Any, Any] | bool:
    """A NumPy ufunc met a layer or a weight: an operator with an array on the
    left builds a layer; anything else is refused with the monadl spelling."""
    from monadl.layers._layer import binary  # (at call time: layers import this module)

    plain = method == "__call__" and not kwargs and len(inputs) == 2
    name = _OPERATOR_UFUNCS.get(ufunc)
    if name is not None and plain:
        return binary(PRIMITIVES[name], *inputs)
    if plain and (ufunc is np.equal or ufunc is np.not_equal):
        # As before and as for any object: an array is not a layer (`layer in [x, ...]` works).
        return ufunc is np.not_equal
    what = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
    if kwargs.get("out") is not None:  # `x += layer` on an array, or out=
        hint = "a layer is lazy and cannot be written into an array: write `x = x + layer`"
    elif ufunc in _COMPARISONS:
        hint = f"layers are not compared; compare forward values ({_read()})"
    elif ufunc in _UFUNC_HINTS:
        hint = f"use {_UFUNC_HINTS[ufunc]}"
    elif ufunc.__name__ in DIFFERENTIABLE:
        hint = f"use ml.{ufunc.__name__}(...), its differentiable counterpart"
    else:
        hint = (
            "monadl has no differentiable counterpart: compose one from monadl's functions, "
            f"or compute on a forward value ({_read()})"
        )
    raise TypeError(f"{what} cannot take a monadl {type(self).__name__}: {hint}")


def array_function(self: Expr[Any, Any], func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """``__array_function__`` of layers and weights: a NumPy function
    (``np.sum(w)``, ``np.concatenate([a, b])``) refused with monadl's
    spelling; without it NumPy called ``w.sum(out=None)`` or made an array of
    the objects, with errors that named neither."""
    import monadl.layers as layers  # (at call time: layers import this module)

    name = func.__name__
    if name in ("shape", "ndim", "size"):
        if hasattr(self, name):  # (a weight: its data's)
            return getattr(self, name)
        hint = f"a layer's {name} is known when it runs ({_read()}); a weight has .{name}"
    elif hasattr(layers, name):
        hint = f"use ml.{name}(...), its differentiable counterpart"
    else:
        hint = (
            "monadl has no differentiable counterpart: compose one from monadl's functions, "
            f"or compute on a forward value ({_read()}; a weight's is w.data)"
        )
    raise TypeError(f"np.{name} cannot take a monadl {type(self).__name__}: {hint}")


def _read() -> str:
    """How to read a layer's value where the refusal happens: inside an
    ``@ml.direct`` function, by awaiting it (its ``predict()`` would run a
    second evaluation, which the tour forbids there); elsewhere, ``predict()``."""
    from monadl.direct import inside_direct  # (at call time, on an error's path: direct imports layers)

    if inside_direct.get().live:
        return "inside @ml.direct: (value,) = await ml.values(layer)"
    return "await layer.predict()"


# NumPy ufuncs with a monadl function of the same name (a test keeps this true).
DIFFERENTIABLE: Final = frozenset({"exp", "log", "sqrt", "sin", "cos", "tanh", "maximum", "minimum", "matmul"})


@final
class UfuncHook:
    """``__array_ufunc__`` of layers and weights, read two ways.

    NumPy looks it up on the type (``__get__(None, cls)``) and gets
    `_array_ufunc`: with an array on the left, ``x * w`` becomes
    ``np.multiply(x, w)``, which we turn into a layer, and ``np.exp(w)`` gets
    a hint instead of NumPy's generic error. CuPy reads it from the instance
    and, when it is None, calls the reflected operator (``w.__rmul__(x)``),
    as NumPy's protocol (NEP 13) intends: so the instance gets None.

    NumPy's ufunc override costs about 2 us more per ``array op layer`` than
    deferring with ``__array_ufunc__ = None`` did (measured: 4.3 against 2.3
    us to build ``x * w``); a layer is built once per use, so the hint wins.
    """

    __slots__ = ()

    @overload
    def __get__(self, instance: None, owner: type) -> Callable[..., Layer[Any, Any] | bool]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> None: ...
    def __get__(self, instance: object, owner: type) -> Callable[..., Layer[Any, Any] | bool] | None:
        return _array_ufunc if instance is None else None
