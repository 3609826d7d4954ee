"""This rank's part of a data-parallel step, before any exchange: its forward
and backward (`monadl.runtime.entry.gradients`: gradients, no step), each
gradient handed to the overlap (`monadl.distributed._overlap`) the moment it
is final, and a failure kept as the problem this rank tells the others, not
raised: every rank must still take part in the step's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, final

import anyio

from monadl.distributed._overlap import Overlap
from monadl.layers import Weight
from monadl.layers._layer import Expr
from monadl.runtime import entry

__all__ = ["RankGradients", "rank_gradients"]


@final
@dataclass(slots=True)
class RankGradients:
    """What this rank's backward gave: its loss value, its gradients, the
    weights in the order their gradients became final here, and the problem
    it met ("" if none) with the exception behind it."""

    value: Any = None
    grads: dict[Weight[Any, Any], Any] = field(default_factory=dict)
    order: list[Weight[Any, Any]] = field(default_factory=list)
    problem: str = ""
    cause: Exception | None = None


async def rank_gradients(loss: Expr[Any, Any], overlap: Overlap | None) -> RankGradients:
    """Run this rank's forward and backward of ``loss``, feeding ``overlap`` (if
    any); an exception becomes the result's problem. On cancellation, the
    overlap's started buckets end before any other collective may start."""
    out = RankGradients()
    order = out.order

    def final(weight: Weight[Any, Any], grad: Any) -> None:
        order.append(weight)
        if overlap is not None:
            overlap.final(weight, grad)

    try:
        out.value, out.grads = await entry.gradients(loss, final, None if overlap is None else overlap.reached)
    except Exception as error:
        out.problem, out.cause = f"{type(error).__name__}: {error}", error
    except BaseException:  # cancelled: the started buckets end before any other collective may start
        if overlap is not None:
            overlap.finish({})
            with anyio.CancelScope(shield=True):
                await overlap.wait()
        raise
    if overlap is not None:
        overlap.finish(out.grads)
    return out
