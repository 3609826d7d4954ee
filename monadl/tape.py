"""`Tape[Data, Delta]`: the closure-based dual number of the paper.

A tape pairs the value a forward pass computed with a `backward` closure that
takes the derivative of the final result with respect to that value. Calling
`backward` only *accumulates*: the delta is summed into the node that made the
tape, and the node sends the sum upstream once, when its last consumer
releases it (see `monadl.do`). A tape whose value reaches no trainable weight
has `backward=None`: nothing upstream wants a delta, so none is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Data = TypeVar("Data", covariant=True)
Delta = TypeVar("Delta", contravariant=True)

__all__ = ["Tape"]


@dataclass(frozen=True, slots=True)
class Tape(Generic[Data, Delta]):
    """A forward value and the closure that takes its delta.

    Args:
        data: the value computed by the forward pass.
        backward: adds a delta (the derivative of the final result with
            respect to ``data``) into the node that produced ``data``; ``None``
            when no trainable weight is upstream.

    >>> seen = []
    >>> t = Tape(2.0, seen.append)
    >>> t.backward(1.5) if t.backward else None
    >>> seen
    [1.5]
    """

    data: Data
    backward: Callable[[Delta], None] | None = None

    @property
    def wants_delta(self) -> bool:
        """Whether sending a delta to this tape can change any weight."""
        return self.backward is not None
