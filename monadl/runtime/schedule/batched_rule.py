"""The cost rule of dynamic batching, per graph: whether a graph goes to the
batching scheduler (`monadl.runtime.schedule.batched`) at all, decided by
cheap checks only, before any signature is computed.

A graph that is a chain (each node uses the one before: nothing is ever ready
with anything else) or smaller than `MIN_NODES` runs as before (unless it is a
merge of `MIN_ALIKE` fibers' graphs alike). A graph (by the line that built
its last node, and its size) found not worth it, here or by the scheduler
(whose analysis batched nothing), is not analysed again for `REPROBE`
evaluations: the check costs one lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from monadl.layers._site import Site
    from monadl.runtime.evaluation import Evaluation

__all__ = ["MIN_ALIKE", "MIN_NODES", "REPROBE", "remember", "worth_batching"]

MIN_NODES: Final = 256
"""Automatic mode leaves smaller graphs alone: what batching could save there
(a few microseconds a node) is about what analysing and stacking cost (the
columns benchmark, 30-200 nodes of coarse matrix products, ran 8-10% slower
batched with a limit of 16)."""

MIN_ALIKE: Final = 2
"""A merge of fibers' graphs with this many alike (built at one line, with as
many nodes: the same step of the same model) is analysed below `MIN_NODES`:
each of their operations has that many members of one signature."""


def worth_batching(ev: Evaluation, order: list[Any], alike: int = 1) -> bool:
    """Whether to run ``order`` through the batching scheduler: cheap checks
    only, none that computes a signature.

    ``alike``: for a merge of several fibers' graphs
    (`monadl.runtime.schedule.fibers`), how many of them were built at one
    line with as many nodes; from `MIN_ALIKE` on, their equal signatures pay
    however small the graphs.

    >>> import monadl as ml
    >>> from monadl.runtime.evaluation import Evaluation
    >>> x = ml.Weight(1.0)
    >>> chain = [x * 2.0]
    >>> for _ in range(300):
    ...     chain.append(chain[-1] + 1.0)
    >>> worth_batching(Evaluation(train=True), chain)
    False
    """
    forced = current_settings().batching
    if forced is False or ev.check_finite or len(order) < 2:
        return False
    if forced:
        return True
    if len(order) < MIN_NODES and alike < MIN_ALIKE:
        return False
    key = (order[-1]._site, len(order))
    verdict = _verdicts.get(key)
    if verdict is not None and verdict[1] % REPROBE:
        _verdicts[key] = (verdict[0], verdict[1] + 1)
        return verdict[0]
    worth = not _is_chain(order)
    remember(key, worth)
    return worth


def _is_chain(order: list[Any]) -> bool:
    """Each node uses the one before: one node per depth, nothing to group."""
    previous = order[0]
    for node in order[1:]:
        for x in node._inputs:
            if x is previous:
                break
        else:
            return False
        previous = node
    return True


REPROBE: Final = 32
"""A graph found not worth batching is analysed again once in this many evaluations."""

_VERDICTS_LIMIT: Final = 4096
_verdicts: dict[tuple[Site, int], tuple[bool, int]] = {}  # (last site, nodes) -> (worth it, evaluations since)


def remember(key: tuple[Site, int], worth: bool) -> None:
    """The verdict on a graph built at the same line with as many nodes, for
    the next evaluations (models rebuild the same graph every step)."""
    if len(_verdicts) >= _VERDICTS_LIMIT:
        _verdicts.clear()
    _verdicts[key] = (worth, 1)
