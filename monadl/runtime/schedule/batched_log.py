"""The DEBUG log of dynamic batching (the ``monadl.batching`` logger): a
graph the cost rule leaves unbatched and why (`unbatched`), one kept out of
the merges across examples (`held_apart`), what a batched run or a merge
grouped (`ran`, `merged`), and a group that ran node by node although its
size would batch (`declined`)."""

from __future__ import annotations

import logging
from typing import Any, Final

from monadl.layers._primitives import shown
from monadl.layers._program import Program, batching_rule
from monadl.layers._site import site_text

__all__ = ["FORCES", "HELD", "declined", "held_apart", "merged", "ran", "unbatched"]

_log: Final = logging.getLogger("monadl.batching")

FORCES: Final = "; ml.settings(batching=True) forces it"
HELD: Final = " (alone: it holds a layer built from a Do, as said above; batching=True would not merge it)"


def unbatched(order: list[Any], why: str, advice: str = FORCES) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a graph the cost rule leaves to run node by node."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "a graph of %d nodes (its last built at %s) runs unbatched: %s%s",
            len(order),
            site_text(order[-1]._site),
            why,
            advice,
        )


def held_apart(order: list[Any], do: Any) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a fiber's graph that runs
    without waiting for the other examples' graphs, and the layer built from
    a ``Do`` that keeps it so (a new user's log blamed MIN_NODES and
    suggested ``batching=True``, which batched each such graph alone).
    Not a graph of such layers only (an ``await`` of one): it has nothing
    to batch."""
    if _log.isEnabledFor(logging.DEBUG) and any(node._op is not None for node in order):
        _log.debug(
            "a graph of %d nodes (its last built at %s) runs alone, not merged with other examples' graphs: "
            "it holds the layer built at %s from a Do (a bind, an @ml.direct call, a forward() of your own), "
            "which batching across examples cannot see into, and ml.settings(batching=True) does not change "
            "that; to batch it, build the graph of primitives only (ml.as_layer of a weight is one), or await "
            "that layer first and build on it after",
            len(order),
            site_text(order[-1]._site),
            site_text(do._site),
        )


def ran(order: list[Any], groups: int, members: int) -> None:
    """Log (at DEBUG, to ``monadl.batching``) what a batched run of a graph
    grouped: how many nodes ran in how many groups, the rest one by one (a
    new user forced batching on examples of different lengths, which never
    group, and the log said nothing)."""
    if _log.isEnabledFor(logging.DEBUG) and not groups:  # (forced, and no two nodes alike)
        _log.debug(
            "a graph of %d nodes (its last built at %s) went through batching, and no two of its nodes were alike: "
            "all ran one by one",
            len(order),
            site_text(order[-1]._site),
        )
    elif _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "a graph of %d nodes (its last built at %s) ran batched: %d nodes in %d groups, %d one by one",
            len(order),
            site_text(order[-1]._site),
            members,
            groups,
            len(order) - members,
        )


def merged(order: list[Any], fibers: int) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a merge of fibers' graphs that
    runs batched: batching across control flow, one line a merge."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "a merge of %d fibers' graphs (%d nodes, the last built at %s) runs batched",
            fibers,
            len(order),
            site_text(order[-1]._site),
        )


def declined(members: list[Any], why: str | None) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a group of equal signature that
    runs node by node although its size would batch, and why."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    node = members[0]
    if why is None:
        step = node._op.rule.declined if type(node._op.rule) is Program else None
        if step is None:
            why = "its batching rule does not take these operands"
        else:
            why = f"its step {shown(step.op)} at {site_text(step.site)} " + (
                "has no batching rule" if batching_rule(step.op) is None else "does not batch with these operands"
            )
    _log.debug(
        "%d nodes of %s built at %s ran one by one: %s", len(members), shown(node._op), site_text(node._site), why
    )
