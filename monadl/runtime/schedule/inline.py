"""The inline scheduler: a graph's nodes one after another on the event loop's thread.

Forward: the nodes in construction order (topological), each computed by
`node.compute`. Backward, two ways that call the same `backprop`:

* `sweep`, the fast path: a graph of primitives and weights only (no layer
  built from a ``Do``, no shared ``Do``, no resource, no direct style) is
  back-propagated in one reverse pass over the evaluation's records, whose
  insertion order is topological: each record is reached after all its
  consumers, so its delta is complete. No reference counting.
* `release`, the paper's counted release: a record whose last consumer lets
  go back-propagates once with the summed delta, then releases its operands;
  resources and shared computations are finalised on the way.

Both give the event loop a turn every ``yield_interval_s`` of work (a
`CHECKPOINT` request to the driver), so a long step stays cancellable.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Final

import anyio

from monadl.deltas import Outer
from monadl.runtime.backward import backprop
from monadl.runtime.evaluation import Evaluation, Record, Shared, UserRelease
from monadl.runtime.node import compute
from monadl.runtime.requests import CHECKPOINT

__all__ = ["CHECKPOINT", "SUSPENDED", "forward", "release", "sweep", "sweep_notifying"]

SUSPENDED: Final = object()
"""`forward` met a layer built from a ``Do``: evaluate that first, then resume."""

Machine = Generator[Any, Any, Any]


def forward(ev: Evaluation, order: list[Any], start: int, resumed: bool) -> tuple[Any, int]:
    """Compute ``order[start:]`` inline, until done, a ``Do`` layer, or the time is up.

    Returns ``(outcome, index)``: ``(None, len)`` when done; ``(SUSPENDED, i)``
    when ``order[i]`` is a layer built from a ``Do``; ``(CHECKPOINT, i)`` when
    the event loop is due a turn before ``order[i]``.
    """
    records = ev.records
    places = records.places  # (batched groups' members: computed, with records or not yet)
    end = len(order)
    i = start
    started = time.perf_counter()
    while i < end:  # in chunks, so that looking at the clock costs nothing per node
        stop = min(i + ev.stride, end)
        for j in range(i, stop):
            node = order[j]
            if resumed and (node in records or node in places):  # a Do evaluated meanwhile may have computed it
                continue
            if node._op is None:
                return SUSPENDED, j
            records[node] = compute(ev, node, True)
        i = stop
        if i < end:
            now = time.perf_counter()
            ev.paced(started, now)
            started = now
            if now > ev.deadline:
                return CHECKPOINT, i
    return None, end


def sweep(ev: Evaluation) -> Machine:
    """Back-propagate a pure evaluation in one reverse pass over its records."""
    records = reversed(ev.records.values())
    while backprop(records, ev.check_finite, pace=ev, drop=True):
        yield CHECKPOINT


def sweep_notifying(ev: Evaluation) -> Machine:
    """`sweep`, telling ``ev.on_gradient`` each weight's gradient the moment it is final.

    A weight's gradient is final once its first consumer in the forward order
    (the last one the reverse sweep reaches) is back-propagated; deltas flow
    only along records' inputs, so the inputs say which record that is. The
    sweep runs in segments that end at such records. Only a listener pays
    for finding them (one look at every record's inputs) and for the segments.
    """
    notify = ev.on_gradient
    assert notify is not None
    records = list(ev.records.values())
    final_after: dict[int, list[Record]] = {}
    seen: set[Record] = set()
    for i, rec in enumerate(records):
        for r in rec.inputs or ():
            if r is not None and r.is_weight and r not in seen:
                seen.add(r)
                final_after.setdefault(i, []).append(r)
    backwards = records[::-1]
    start = 0
    for i in sorted(final_after, reverse=True):
        stop = len(records) - i  # backwards[:stop] ends with records[i]
        segment = iter(backwards[start:stop])
        while backprop(segment, ev.check_finite, pace=ev, drop=True):
            yield CHECKPOINT
        start = stop
        for weight in final_after[i]:
            if weight.delta is not None:
                if type(weight.delta) is Outer:  # kept as factors: a listener reads arrays
                    weight.delta = weight.delta.dense()
                notify(weight.node, weight.delta)
        if time.perf_counter() > ev.deadline:  # short segments never reach backprop's own look at the clock
            yield CHECKPOINT
    rest = iter(backwards[start:])
    while backprop(rest, ev.check_finite, pace=ev, drop=True):
        yield CHECKPOINT


def release(ev: Evaluation, token: Any, backward: bool) -> Machine:
    """Release a token; a record whose last hold goes back-propagates once.

    A token is a record, a shared value, a resource's release, a tuple of
    tokens, or None.
    """
    check = ev.check_finite
    work = [token]
    n = 0
    started = time.perf_counter()
    while work:
        t = work.pop()
        if t is None:  # an operand that is not a layer's (data)
            continue
        kind = type(t)
        if kind is Record:
            t.refcount -= 1
            if t.refcount:
                continue
            if backward and t.delta is not None:
                backprop((t,), check)
                if t.is_weight and ev.on_gradient is not None:  # its last consumer let go: the gradient is final
                    if type(t.delta) is Outer:  # (factors: multiplied for the listener; else by the commit)
                        t.delta = t.delta.dense()
                    ev.on_gradient(t.node, t.delta)
            elif not t.is_weight:  # (or no delta reached it, as batched members read by index: nothing to send)
                t.vjps = None
            work.extend(t.inputs)
            if t.release is not None:
                work.append(t.release)
            n += 1
            if n >= ev.stride:
                now = time.perf_counter()
                ev.paced(started, now)
                started, n = now, 0
                if now > ev.deadline:
                    yield CHECKPOINT
        elif kind is tuple:
            work.extend(t)
        elif kind is Shared:
            t.count -= 1
            if t.count == 0:
                work.append(t.release)
        elif kind is UserRelease:
            if not t.done:
                t.done = True
                yield _shielded(t.release, t.value)
        else:
            raise AssertionError(t)


async def _shielded(release: Callable[[Any], Awaitable[Any]], value: Any) -> None:
    """A resource's release, which a cancellation does not cut short: marked
    done, it is never tried again (`monadl.runtime.drive.abort` shields its
    releases likewise), so a timeout during it left it half done."""
    with anyio.CancelScope(shield=True):
        await release(value)
