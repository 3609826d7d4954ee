"""What a layer refuses while its graph is built: it has no value yet.

A branch on a layer's truth or order would take the same path for every
value (inside an `monadl.operation`, for every call of its trace), and
iterating one would never end (its lazy index raises no ``IndexError``),
and a layer read as a number or an array (``float()``, an index,
``np.asarray``) has none to give. So `Unvalued`, a base of
`monadl.layers._layer.Expr`, raises `OperandError` for them, with what to
do instead (a weight, which has a value, points at ``w.data``). Equality
stays identity: the runtime and users keep layers in lists and dicts; only
a cell's float argument, compared with a number while the cell is traced
(``k == 4.0``: the same answer for every call), is refused.
"""

from __future__ import annotations

from threading import get_ident
from typing import TYPE_CHECKING, Final, NoReturn

import numpy as np

from monadl.errors import OperandError
from monadl.layers._traced_now import NUMBERS, TRACING

__all__ = ["Unvalued"]

_NO_VALUE: Final = (
    "a layer has no value while the graph is built, so {} cannot be read: {}to choose by a value, bind "
    "the layer's computation (ml.Layer(layer.forward().bind(f))) or await it in an @ml.direct function; inside an ml.operation, a float "
    "argument is data (a layer): pass what the cell branches on as an int, a string or another static "
    "argument (each value its own trace)"
)
_AWAITED: Final = (
    "; here, in a step of an @ml.direct function, await a layer for its value (v = await layer), and an "
    "await takes the nearest operand alone (await a @ w awaits a, and the product is a layer): write "
    "await (a @ w)"
)
_NUMBER: Final = (int, float, complex, np.number)


def _no_value(what: str, instead: str) -> str:
    """`_NO_VALUE` for ``what``; inside a step of an ``@ml.direct`` function,
    with what an ``await`` there takes (a new user's ``await ml.as_layer(x) @
    w``, a layer, compared with a number two lines down)."""
    from monadl.direct import inside_direct  # (at the error alone: monadl.direct imports the layers)

    text = _NO_VALUE.format(what, instead)
    return text + _AWAITED if inside_direct.get().live else text


_SHAPED: Final = frozenset({"shape", "dtype", "ndim", "size"})
_WEIGHTS_OWN: Final = frozenset({"data", "state", "optimizer"})
_NO_ORDER: Final = (
    "for the larger or the smaller of layers (what max(a, b) and min(a, b) compare for), write "
    "ml.maximum(a, b) or ml.minimum(a, b) (elementwise; the largest element of one layer is ml.max(x)); "
)


class Unvalued:
    """Refuses truth, order and iteration (see the module)."""

    __slots__ = ()

    def __bool__(self) -> bool:  # (not NoReturn: see below)
        raise OperandError(_no_value("its truth", ""))

    # Typed NoReturn, __bool__ made mypy take the code after `if layer:` or `assert layer` as
    # unreachable, and mypy --strict checked none of it; hidden, it did the same (Layer and Weight
    # are final: without __bool__ they are always true), so it is typed bool, and the truth test
    # is refused only when it runs (mypy has no check that rejects it: the README's Types section).
    # Hidden from mypy: iteration, so that a layer stays no Iterable and no Sequence parameter
    # takes one; order, because even taking Never these made a layer SupportsRichComparison, and
    # max(a, b), min(...) and sorted(...) of layers passed mypy: unseen, they are rejected as
    # `a < b` is.
    if not TYPE_CHECKING:

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

        def __lt__(self, other: object) -> NoReturn:
            raise OperandError(_no_value("a comparison (<)", _NO_ORDER))

        def __le__(self, other: object) -> NoReturn:
            raise OperandError(_no_value("a comparison (<=)", _NO_ORDER))

        def __gt__(self, other: object) -> NoReturn:
            raise OperandError(_no_value("a comparison (>)", _NO_ORDER))

        def __ge__(self, other: object) -> NoReturn:
            raise OperandError(_no_value("a comparison (>=)", _NO_ORDER))

        def __eq__(self, other: object) -> bool:
            """Identity (NotImplemented: Python compares identities), but for the
            placeholder of a number a cell is being traced with, compared with a
            number: ``k == 4.0`` would be False at every call, whatever ``k``."""
            if NUMBERS and isinstance(other, _NUMBER):
                numbers = NUMBERS.get(get_ident())
                if numbers is not None and id(self) in numbers:
                    raise OperandError(
                        f"operation {TRACING.get(get_ident())}: a float argument is data, a layer inside the cell, "
                        "with no value while the cell is traced, so a comparison of it with a number (==, != or "
                        "in) cannot be read (it would compare the layer, not the value, the same for every call): "
                        "pass what the cell branches on as an int, a string or another static argument (each "
                        "value its own trace)"
                    )
            return NotImplemented

        __hash__ = object.__hash__  # (by identity, as before: layers are keys of the runtime's dicts)

    if not TYPE_CHECKING:  # (to mypy a layer has no shape: `layer.shape` is rejected before it runs)

        def __format__(self, spec: str) -> str:
            """``f"{layer}"`` is its repr; a number's format (``f"{loss:.3f}"``) has
            no value to format: said as float() says it (a bare TypeError before)."""
            if not spec:
                return repr(self)
            if type(self).__name__ == "Weight":
                raise OperandError(f"a weight is formatted by its value: format weight.data (a format {spec!r})")
            raise OperandError(_no_value(f"a format ({spec!r})", "format the value predict() gives; "))

        def __getattr__(self, name: str) -> NoReturn:
            """Called only for an attribute a layer does not have: for its shape
            and dtype, and for a weight's own data, state and optimizer, what to
            read instead (a weight inside a marked cell is a layer: its ``.shape``
            and ``.data`` were bare AttributeErrors there, where mypy, seeing a
            weight parameter, accepted them)."""
            made = getattr(type(self), name, None)
            if isinstance(made, property) and made.fget is not None:  # (a weight's, failing inside: its own error)
                made.fget(self)
            if name in _SHAPED and any(c.__name__ == "Layer" for c in type(self).__mro__):
                raise AttributeError(
                    f"a layer's {name} is not known while the graph is built (a layer is lazy: its shape is "
                    f"found when it runs); read it from the data (an array's .{name}) or a weight's "
                    f"(w.shape, w.data.dtype); inside an ml.operation, a weight argument is a layer too: read "
                    f"its .{name} outside and pass it as an int, or let the cell close over the weight"
                )
            if name in _WEIGHTS_OWN and any(c.__name__ == "Layer" for c in type(self).__mro__):
                cell = TRACING.get(get_ident())
                whose = (
                    " (its value is not known while the graph is built: await layer.predict() gives it)"
                    if name == "data"
                    else ", a weight's own"
                )
                raise AttributeError(
                    f"a layer has no .{name}{whose}; inside "
                    f"{'an ml.operation' if cell is None else f'the operation {cell}, being traced'}, a weight "
                    f"argument is a layer too, a placeholder for each call's weight: compute with it as a layer "
                    f"(h - w; ml.stop_gradient(w) where no gradient may reach it), or read w.{name} outside the "
                    f"cell and pass what the cell needs as an argument (an array, such as w.data, is data there, "
                    f"read at each call)"
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        raise OperandError(_no_value(what, ""))
