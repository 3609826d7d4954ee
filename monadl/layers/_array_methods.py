"""An expression's array methods, as NumPy's arrays have them: ``sum``,
``mean``, ``max``, ``reshape``, ``transpose`` and ``T``, each one primitive
node (the same as `monadl.sum` ... builds). `monadl.layers._layer.Expr`
takes them from `ArrayMethods`, and builds their nodes (`Expr._make`): a
layer and a weight have them alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from monadl.layers._axes import Axis, Integer, as_axis, as_shape
from monadl.layers._primitives import PRIMITIVES

if TYPE_CHECKING:
    from monadl.layers._arrays import Array
    from monadl.layers._layer import Layer
    from monadl.layers._primitives import Primitive

__all__ = ["ArrayMethods"]

D = TypeVar("D")
G = TypeVar("G")


class ArrayMethods(Generic[D, G]):
    """The array methods of `monadl.Expr` (see the module)."""

    __slots__ = ()

    if TYPE_CHECKING:  # (`Expr`'s: a primitive node built at the user's line)

        @classmethod
        def _make(cls, op: Primitive, inputs: tuple[Any, ...], params: tuple[Any, ...] = ()) -> Layer[Any, Any]: ...

    @overload
    def sum(self, axis: None = None, keepdims: Literal[False] = False) -> Layer[float, float]: ...
    @overload
    def sum(self, axis: None = None, *, keepdims: Literal[True]) -> Layer[Array, Array]: ...
    @overload
    def sum(self, axis: None, keepdims: Literal[True]) -> Layer[Array, Array]: ...
    @overload
    def sum(self, axis: Axis, keepdims: bool = False) -> Layer[Array, Array]: ...
    @overload
    def sum(self, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
    def sum(self, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
        """Sum over ``axis`` (all axes by default)."""
        return self._make(PRIMITIVES["sum"], (self,), (as_axis(axis, "sum"), bool(keepdims)))

    @overload
    def mean(self, axis: None = None, keepdims: Literal[False] = False) -> Layer[float, float]: ...
    @overload
    def mean(self, axis: None = None, *, keepdims: Literal[True]) -> Layer[Array, Array]: ...
    @overload
    def mean(self, axis: None, keepdims: Literal[True]) -> Layer[Array, Array]: ...
    @overload
    def mean(self, axis: Axis, keepdims: bool = False) -> Layer[Array, Array]: ...
    @overload
    def mean(self, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
    def mean(self, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
        """Mean over ``axis`` (all axes by default)."""
        return self._make(PRIMITIVES["mean"], (self,), (as_axis(axis, "mean"), bool(keepdims)))

    @overload
    def max(self, axis: None = None, keepdims: Literal[False] = False) -> Layer[float, float]: ...
    @overload
    def max(self, axis: None = None, *, keepdims: Literal[True]) -> Layer[Array, Array]: ...
    @overload
    def max(self, axis: None, keepdims: Literal[True]) -> Layer[Array, Array]: ...
    @overload
    def max(self, axis: Axis, keepdims: bool = False) -> Layer[Array, Array]: ...
    @overload
    def max(self, axis: None = None, keepdims: bool = False) -> Layer[Any, Any]: ...
    def max(self, axis: Axis | None = None, keepdims: bool = False) -> Layer[Any, Any]:
        """Maximum over ``axis``; tied maxima share the delta."""
        return self._make(PRIMITIVES["max"], (self,), (as_axis(axis, "max"), bool(keepdims)))

    @overload
    def reshape(self, shape: Sequence[Integer] | Array, /) -> Layer[Array, Array]: ...
    @overload
    def reshape(self, *shape: Integer) -> Layer[Array, Array]: ...
    def reshape(self, *shape: Any) -> Layer[Array, Array]:
        """A view of the same values in another shape: ``(3, 2)`` or ``3, 2``, as NumPy's method."""
        return self._make(PRIMITIVES["reshape"], (self,), (as_shape(shape, "reshape", "shape"),))

    @overload
    def transpose(
        self: ArrayMethods[Array, Array], axes: Sequence[Integer] | Array | None, /
    ) -> Layer[Array, Array]: ...
    @overload
    def transpose(self: ArrayMethods[Array, Array], *axes: Integer) -> Layer[Array, Array]: ...
    def transpose(self, *axes: Any) -> Layer[Array, Array]:
        """Permute axes (reverse them when none or None are given): ``(1, 0)`` or ``1, 0``, as NumPy's method.
        An array's (a scalar's transpose is the scalar, no array)."""
        reverse = not axes or (len(axes) == 1 and axes[0] is None)
        return self._make(PRIMITIVES["transpose"], (self,), (None if reverse else as_shape(axes, "transpose", "axes"),))

    @property
    def T(self: ArrayMethods[Array, Array]) -> Layer[Array, Array]:
        """The transpose (an array's: see `transpose`)."""
        return self._make(PRIMITIVES["transpose"], (self,), (None,))


# Named as `Expr`'s, which is what users call (an error of an argument read
# ``ArrayMethods.reshape() got an unexpected keyword argument``).
for _name in ("sum", "mean", "max", "reshape", "transpose"):
    getattr(ArrayMethods, _name).__qualname__ = f"Expr.{_name}"
    getattr(ArrayMethods, _name).__module__ = "monadl.layers._layer"  # (where pickle finds Expr.sum: Expr's)
ArrayMethods.T.fget.__qualname__ = "Expr.T"  # type: ignore[attr-defined]  # (a property's getter: typeshed's fget is Any | None)
ArrayMethods.T.fget.__module__ = "monadl.layers._layer"  # type: ignore[attr-defined]  # (as above)
