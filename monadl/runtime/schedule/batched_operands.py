"""Where a batched group's operands come from (`Operand`), and a product's
weight delta as factors (`factor_products`): what the group's records
(`monadl.runtime.schedule.batched_records`) and its members run again
(`monadl.runtime.schedule.batched_again`) both read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, final

from monadl.layers._products import factored

if TYPE_CHECKING:
    from monadl.runtime.evaluation import Record
    from monadl.runtime.schedule.batched_groups import Source

__all__ = ["PRODUCTS", "Operand", "factor_products"]


PRODUCTS: Final = frozenset({"matmul", "dense"})  # their second operand is the matrix: rows @ w (+ bias)


def factor_products(vjps: tuple[Any, ...], operands: list[Operand], args: list[Any], always: bool) -> tuple[Any, ...]:
    """``vjps`` with a shared weight's (a matrix times the members' stacked
    rows) replaced by one that sends its delta as factors (an `Outer`):
    ``always`` (the merged runs of `monadl.runtime.schedule.fibers`), else
    where factors pay, as for one node (`monadl.layers._products.outer_rule`)."""
    w = operands[1].rec
    if w is None or not w.is_weight or operands[0].rec is not None:  # (a weight, times stacked rows)
        return vjps
    return factored(vjps, args[0], args[1], always)


@final
class Operand:
    """Where one operand position of a group comes from: a record shared by
    all members, the members' own operands ``stacked`` (their records, None
    for data), or ``sources``: rows of earlier groups' outputs."""

    __slots__ = ("rec", "sources", "stacked")

    def __init__(
        self, rec: Record | None, stacked: list[Record | None] | None, sources: list[Source] | None = None
    ) -> None:
        self.rec = rec
        self.stacked = stacked
        self.sources = sources
