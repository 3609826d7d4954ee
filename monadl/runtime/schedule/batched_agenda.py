"""DyNet's agenda, the batching scheduler's other grouping
(`monadl.runtime.schedule.batched`, ``STRATEGY``): of the groups ready, run
the one whose kind of operation lies earliest in the graph on average (the
largest on ties); then the consumers it made ready join the agenda."""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Protocol

from monadl.layers._layer import Layer
from monadl.runtime.schedule.batched_signature import signature

__all__ = ["agenda"]


class Scheduler(Protocol):
    """What the agenda asks of a scheduler's run (`batched_run.Run`)."""

    records: Any
    groups: Any

    def each(self, nodes: list[Any]) -> None: ...

    def group(self, members: list[Any]) -> None: ...


def agenda(run: Scheduler, levels: list[list[Any]], depth: dict[Any, int]) -> None:
    """Run the graph of ``levels`` (by depth, ``depth`` of each node) by the agenda."""
    kinds: dict[str, list[int]] = {}
    waiting: dict[Any, int] = {}
    consumers: dict[Any, list[Any]] = {}
    for level in levels:
        for node in level:
            total = kinds.setdefault(node._op.name, [0, 0])
            total[0] += depth[node]
            total[1] += 1
            count = 0
            for i, x in enumerate(node._inputs):
                if type(x) is Layer and x in depth and all(y is not x for y in node._inputs[:i]):
                    consumers.setdefault(x, []).append(node)
                    count += 1
            waiting[node] = count
    mean = {name: s / c for name, (s, c) in kinds.items()}
    ready: dict[Any, list[Any]] = {}
    arrived = list(levels[0]) if levels else []
    while True:
        while arrived:  # iterative: a long run of unbatchable nodes must not recurse
            node = arrived.pop()
            sig = signature(run.records, node, run.groups.where)
            if sig is not None:
                ready.setdefault(sig, []).append(node)
                continue
            run.each([node])
            arrived.extend(_released([node], consumers, waiting))
        if not ready:
            return
        best = min(ready, key=lambda s: (mean[s[0]], -len(ready[s])))
        members = ready.pop(best)
        members.sort(key=_serial)  # construction order, so that consumers can reuse the stack
        run.group(members)
        arrived.extend(_released(members, consumers, waiting))


_serial = attrgetter("_serial")


def _released(done: list[Any], consumers: dict[Any, list[Any]], waiting: dict[Any, int]) -> list[Any]:
    now = []
    for node in done:
        for c in consumers.get(node, ()):
            waiting[c] -= 1
            if not waiting[c]:
                now.append(c)
    return now
