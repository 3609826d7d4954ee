"""How an expression runs: `Runnable.forward`, the paper's lazy
``Do[Tape[Data, Delta]]``, and the entry points that run it, ``train()``,
``predict()``, and ``await`` inside an `monadl.direct` function.
`monadl.layers._layer.Expr` takes them from `Runnable`: a layer and a
weight run alike (`monadl.runtime` does the work)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Generic, TypeVar

from monadl.do import FORWARD, Do
from monadl.tape import Tape

__all__ = ["Runnable"]

D = TypeVar("D")
G = TypeVar("G")


class Runnable(Generic[D, G]):
    """What runs an expression (see the module)."""

    __slots__ = ()

    def forward(self) -> Do[Tape[D, G]]:
        """The paper's ``forward``: a lazy ``Do[Tape[Data, Delta]]``."""
        return Do(FORWARD, self)

    async def train(self) -> D:
        """One forward and one backward pass; every weight reached takes one
        optimizer step. Returns the forward value (the loss).

        If anything fails or is cancelled, no weight changes.
        """
        from monadl.runtime import entry

        return await entry.train(self)  # type: ignore[no-any-return]

    def __await__(self) -> Generator[Any, Any, D]:
        """``await layer`` inside an `monadl.direct` function: its forward value
        in the running evaluation."""
        from monadl.direct import AwaitLayers

        awaited: tuple[Any, ...] = (self,)  # (an `Expr`: this class is one of its bases, and only its)
        return AwaitLayers(awaited, single=True).__await__()

    async def predict(self) -> D:
        """The forward pass only; returns the value."""
        from monadl.runtime import entry

        return await entry.predict(self)  # type: ignore[no-any-return]


# Named as `Expr`'s, which is what users call (a coroutine never awaited is
# said as ``coroutine 'Expr.train' was never awaited``, not ``Runnable.train``).
for _name in ("forward", "train", "predict", "__await__"):
    getattr(Runnable, _name).__qualname__ = f"Expr.{_name}"
    getattr(Runnable, _name).__module__ = "monadl.layers._layer"  # (where pickle finds Expr.train: Expr's)
