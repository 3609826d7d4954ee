"""What a layer refuses while its graph is built: it has no value yet.

A branch on a layer's truth or order would take the same path for every
value (inside an `monadl.operation`, for every call of its trace), and
iterating one would never end (its lazy index raises no ``IndexError``),
and a layer read as a number or an array (``float()``, an index,
``np.asarray``) has none to give. So `Unvalued`, a base of
`monadl.layers._layer.Expr`, raises `OperandError` for them, with what to
do instead (a weight, which has a value, points at ``w.data``). Equality
stays identity: the runtime and users keep layers in lists and dicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Never, NoReturn

from monadl.errors import OperandError

__all__ = ["Unvalued"]

_NO_VALUE: Final = (
    "a layer has no value while the graph is built, so {} cannot be read: to choose by a value, bind "
    "the layer's computation (ml.Layer(layer.forward().bind(f))) or await it in an @ml.direct function; inside an ml.operation, a float "
    "argument is data (a layer): pass what the cell branches on as an int, a string or another static "
    "argument (each value its own trace)"
)


class Unvalued:
    """Refuses truth, order and iteration (see the module)."""

    __slots__ = ()

    def __bool__(self) -> NoReturn:
        raise OperandError(_NO_VALUE.format("its truth"))

    if not TYPE_CHECKING:  # (to mypy a layer stays no Iterable, so that no Sequence parameter takes one)

        def __iter__(self) -> NoReturn:
            if type(self).__name__ == "Layer":
                raise OperandError(
                    "a layer is not iterated while the graph is built (its length is not known): index it "
                    "(layer[i]) or cut it into parts (ml.split)"
                )
            raise OperandError(
                "a weight is not iterated (an item of it is a layer, its value not known while the graph is "
                "built): index it (weight[i]), cut it into parts (ml.split), or iterate its value (weight.data)"
            )

    def __lt__(self, other: Never) -> NoReturn:  # (Never: mypy rejects a comparison)
        raise OperandError(_NO_VALUE.format("a comparison (<)"))

    def __le__(self, other: Never) -> NoReturn:
        raise OperandError(_NO_VALUE.format("a comparison (<=)"))

    def __gt__(self, other: Never) -> NoReturn:
        raise OperandError(_NO_VALUE.format("a comparison (>)"))

    def __ge__(self, other: Never) -> NoReturn:
        raise OperandError(_NO_VALUE.format("a comparison (>=)"))

    if not TYPE_CHECKING:  # (to mypy it stays no number and no array: float(layer) is rejected)

        def __float__(self) -> NoReturn:  # (math's functions call it: math.exp(layer) is ml.exp(layer))
            self._unread("float() (math.exp and math's other functions read one: use ml.exp, ml.log, ... on layers)")

        def __int__(self) -> NoReturn:
            self._unread("int()")

        def __index__(self) -> NoReturn:
            self._unread("an index")

        def __complex__(self) -> NoReturn:
            self._unread("complex()")

        def __round__(self, ndigits: object = None) -> NoReturn:  # (round(layer): "doesn't define __round__")
            self._unread("round()")

        def __array__(self, *args: object, **kwargs: object) -> NoReturn:  # (np.asarray made an object array)
            self._unread("an array (np.asarray, an index into an array)")

    def _unread(self, what: str) -> NoReturn:
        """Refuse to read the value as ``what`` (a weight says where its value is)."""
        raise OperandError(_NO_VALUE.format(what))
