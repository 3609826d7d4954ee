"""What ``ml.values(...)`` does without its ``await``: it is an awaitable,
not the values.

A forgotten ``await`` (``p = ml.values(ml.max(h))``, then ``if p > 0.5:``)
raised Python's bare ``'>' not supported between instances of
'AwaitLayers' and 'float'``, and NumPy made an object array of it
(``np.argmax(ml.values(p))`` was silently 0, which routed every example to
expert 0). So `Unawaited`, a base of `monadl.direct.AwaitLayers`, refuses
what a user would do to the values (an operator, a comparison, truth, a
conversion, iteration, NumPy, an attribute), saying what was done and what
to write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final, NoReturn

__all__ = ["Unawaited"]

_NOT_THE_VALUES: Final = (
    "ml.values(...) is an awaitable, not the values: write `(value,) = await ml.values(layer)` "
    "(or `value = await layer`) inside the @ml.direct function"
)


def _refused(what: str) -> Callable[..., NoReturn]:
    """A method that refuses ``what`` was done to the awaitable (a TypeError)."""

    def refuse(self: Unawaited, *_: object) -> NoReturn:
        raise TypeError(f"{what} on ml.values(...), not awaited (a forgotten await?): {_NOT_THE_VALUES}")

    return refuse


class Unawaited:
    """Refuses use as values (see the module)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<ml.values(...): an awaitable; await it for the values>"

    __array__ = _refused("NumPy's conversion (np.asarray, np.argmax, ...)")
    __bool__ = _refused("a truth test (if, and, or, not, bool())")
    __iter__ = __contains__ = _refused("iteration (for, unpacking, list(), in)")
    __len__ = _refused("len()")
    __getitem__ = __setitem__ = _refused("indexing")
    __float__ = _refused("float()")
    __int__ = __index__ = _refused("int() (or use as an index)")
    __complex__ = _refused("complex()")
    __round__ = _refused("round()")
    __trunc__ = __floor__ = __ceil__ = _refused("rounding (math.trunc, math.floor, math.ceil)")
    __lt__ = _refused("a comparison (<)")
    __le__ = _refused("a comparison (<=)")
    __gt__ = _refused("a comparison (>)")
    __ge__ = _refused("a comparison (>=)")
    __neg__ = _refused("a negation (-)")
    __pos__ = _refused("unary +")
    __abs__ = _refused("abs()")
    __invert__ = _refused("an inversion (~)")
    __add__ = __radd__ = _refused("arithmetic (+)")
    __sub__ = __rsub__ = _refused("arithmetic (-)")
    __mul__ = __rmul__ = _refused("arithmetic (*)")
    __truediv__ = __rtruediv__ = _refused("arithmetic (/)")
    __floordiv__ = __rfloordiv__ = _refused("arithmetic (//)")
    __mod__ = __rmod__ = __divmod__ = __rdivmod__ = _refused("arithmetic (%, divmod)")
    __pow__ = __rpow__ = _refused("arithmetic (**)")
    __matmul__ = __rmatmul__ = _refused("a matrix product (@)")
    __and__ = __rand__ = _refused("a logical and (&)")
    __or__ = __ror__ = _refused("a logical or (|)")
    __xor__ = __rxor__ = _refused("a logical xor (^)")

    if not TYPE_CHECKING:  # (hidden from mypy: the machine's reads of the awaitable's fields stay checked)
        __eq__ = _refused("a comparison (==)")
        __ne__ = _refused("a comparison (!=)")
        __hash__ = object.__hash__  # (by identity, as before)
        __format__ = _refused("formatting (f-string, format())")

        def __getattr__(self, name: str) -> NoReturn:
            """Called only for an attribute it does not have (``p.max()``,
            ``p.shape``)."""
            raise AttributeError(f"`.{name}` on ml.values(...), not awaited (a forgotten await?): {_NOT_THE_VALUES}")
