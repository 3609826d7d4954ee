"""What ``ml.values(...)`` does without its ``await``: it is an awaitable,
not the values.

A forgotten ``await`` (``p = ml.values(ml.max(h))``, then ``if p > 0.5:``)
raised Python's bare ``'>' not supported between instances of
'AwaitLayers' and 'float'``, NumPy made an object array of it
(``np.argmax(ml.values(p))`` was silently 0, which routed every example to
expert 0), and ``ml.values(h)`` as a statement was dropped silently, in an
``@ml.direct`` function or in an ``@ml.operation`` cell. So `Unawaited`, a
base of `monadl.direct.AwaitLayers`, refuses what a user would do to the
values (an operator, a comparison, truth, a conversion, iteration, NumPy,
an attribute), saying what was done and what to write; and, as a coroutine
does, one dropped without being awaited warns (a RuntimeWarning), at the
line that called ``ml.values`` (where it is dropped is monadl's code or the
collector's: a new user's warning named ``monadl/runtime/stepping.py``).

No false warning: one whose await began does not warn (its evaluation
cancelled or failed there too), nor one whose misuse raised already, nor
one that a direct-style function held when it raised (its own error, or a
failure or a cancellation delivered to it: `abandon_raised`) or when a
failed evaluation closed it (`abandon_suspended`). Its cost is one
attribute written at each await of layers and a call of ``__del__``
(about 0.07 us, against some 13 us an await).
"""

from __future__ import annotations

import gc
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NoReturn

from monadl.layers._site import Site, site_place

__all__ = ["Unawaited", "abandon_raised", "abandon_suspended"]

_NOT_THE_VALUES: Final = (
    "ml.values(...) is an awaitable, not the values: write `(value,) = await ml.values(layer)` "
    "(or `value = await layer`) inside the @ml.direct function"
)


def _refused(what: str) -> Callable[..., NoReturn]:
    """A method that refuses ``what`` was done to the awaitable (a TypeError)."""

    def refuse(self: Unawaited, *_: object) -> NoReturn:
        self.pending = False  # (said here: no "never awaited" warning besides)
        raise TypeError(f"{what} on ml.values(...), not awaited (a forgotten await?): {_NOT_THE_VALUES}")

    return refuse


class Unawaited:
    """Refuses use as values, and warns when dropped while ``pending`` (see
    the module): the awaitable sets ``pending`` when made and clears it
    when its await begins."""

    __slots__ = ("pending", "site")

    pending: bool
    site: Site | None

    def __del__(self) -> None:
        try:
            pending = self.pending
        except AttributeError:  # (never set: its __init__ refused its arguments)
            return
        if pending:
            message = (
                "ml.values(...) was never awaited, so it read nothing: write `(value,) = await "
                "ml.values(layer)` (or `value = await layer`) inside the @ml.direct function"
            )
            if self.site is None:
                warnings.warn(message, RuntimeWarning, stacklevel=2, source=self)
                return
            # At the user's line that called ml.values (where it is dropped is monadl's, or the collector's).
            warnings.warn_explicit(message, RuntimeWarning, *site_place(self.site))

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
            ``p.shape``). Not taken as said (libraries probe attributes and
            catch the error): one never awaited still warns."""
            raise AttributeError(f"`.{name}` on ml.values(...), not awaited (a forgotten await?): {_NOT_THE_VALUES}")


def abandon_suspended(coroutine: Any) -> None:
    """Before a failed evaluation closes a suspended direct-style coroutine
    (`monadl.runtime.drive.abort`): the awaitables its frames hold unawaited
    (made before a foreign await, to be awaited after it) are given up by
    the failure, not forgotten, and do not warn."""
    awaiting = coroutine
    while awaiting is not None:
        _abandon(awaiting)
        awaiting = getattr(awaiting, "cr_await", None) or getattr(awaiting, "gi_yieldfrom", None)


def abandon_raised(error: BaseException) -> None:
    """After a step of a direct-style coroutine raised ``error`` (its own
    error, or a failure or a cancellation delivered to it: trio's is sent
    in, as a value its wait raises, not thrown): the awaitables that the
    frames it left held unawaited are given up by it, not forgotten, and do
    not warn. Its traceback holds those frames, and so them, until it goes:
    they were dropped long after, where nothing showed why."""
    traceback = error.__traceback__
    while traceback is not None:
        _abandon(traceback.tb_frame)
        traceback = traceback.tb_next


def _abandon(holder: object) -> None:
    """Mark the awaitables that a suspended coroutine or a finished frame
    holds (its locals and stack, and one level into a list, tuple, set,
    dict or closure cell they hold: ``reads = [ml.values(a), ml.values(b)]``)
    as given up; one nested deeper is not found, and still warns. Read as
    the garbage collector reads them: a frame's ``f_locals`` would keep a
    copy of them on the frame (one still running, such as the one that
    caught a failure before it was thrown in, holds the failure: a cycle,
    whose evaluation waited for a collection); a running frame shows none."""
    for held in gc.get_referents(holder):
        if isinstance(held, Unawaited):
            held.pending = False
        elif type(held) in _CONTAINERS:
            for inner in gc.get_referents(held):
                if isinstance(inner, Unawaited):
                    inner.pending = False


_CONTAINERS: Final[frozenset[type]] = frozenset({list, tuple, set, dict, types.CellType})
