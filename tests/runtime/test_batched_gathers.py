"""Batched groups that read earlier groups' outputs by index (gather records):
rows read twice, rows from several groups, and every backward (the sweep, the
counted release, the worker pool's release) giving the unbatched gradients."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import monadl as ml
from monadl.runtime import entry
from monadl.runtime.evaluation import Evaluation, Record
from monadl.runtime.node import collect
from monadl.runtime.schedule import batched, inline, pool
from tests.runtime.test_batched import assert_same_gradients

RNG = np.random.default_rng(11)
W = ml.Weight(RNG.standard_normal((3, 3)))
V = ml.Weight(RNG.standard_normal((3, 3)))


@ml.operation
def mix(x: ml.ArrayOperand, y: ml.ArrayOperand) -> ml.ArrayLayer:
    return ml.tanh(x @ W) * y + ml.sigmoid(y @ V)


def graph() -> tuple[ml.ScalarLayer, list[ml.ArrayLayer]]:
    """Two groups of 8 (``a`` and ``b``, one signature each), then a group of
    ``mix`` whose first operands come from both groups (two sources) and whose
    second operands read ``a[0]`` and ``a[1]`` over and over (rows read twice)."""
    xs = [RNG.standard_normal((1, 3)) for _ in range(8)]
    a = [ml.tanh(x @ W) for x in xs]
    b = [ml.sigmoid(x @ V) for x in xs]
    firsts = [a[i] if i % 2 else b[i] for i in range(8)]
    mixed = [mix(firsts[i], a[i % 2]) for i in range(8)]
    return ml.sum(ml.concatenate(mixed, axis=0) * ml.concatenate(a, axis=0)), mixed


def sources_of(ev: Evaluation) -> list[list[Record]]:
    """The groups each gather record reads (its inputs: groups only, which have delta sinks)."""
    sinks = ev.records.sinks
    return [
        list(r.inputs)
        for key, r in ev.records.items()
        if type(key) is Record and key not in sinks and r.inputs and all(i in sinks for i in r.inputs)
    ]


def test_gathers_read_two_groups_and_repeated_rows_with_unbatched_gradients() -> None:
    loss, _ = graph()
    with ml.settings(batching=False):
        want_value, want = entry.gradients_sync(loss)
    with ml.settings(batching=True):
        got_value, got = entry.gradients_sync(loss)
    assert got_value == pytest.approx(want_value, rel=1e-12)
    assert_same_gradients(got, want, 1e-12)
    ev = Evaluation(train=True)
    with ml.settings(batching=True):
        batched.forward(ev, collect(ev, [loss]))
    inputs = sources_of(ev)
    assert sorted(len(i) for i in inputs)[-1] == 2  # one gathered operand reads two groups


@pytest.mark.anyio
async def test_counted_release_through_gathers() -> None:
    loss, mixed = graph()
    calls: list[int] = []

    def counted(tape: ml.Tape[Any, Any]) -> ml.Tape[Any, Any]:
        calls.append(1)
        return tape

    through_do = ml.Layer(mixed[3].forward().map(counted))  # a Do layer: the evaluation has effects
    total = loss + ml.sum(through_do)
    results = []
    for batching in (False, True):
        with ml.settings(batching=batching):
            results.append(await entry.gradients(total))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-12)
    assert_same_gradients(results[1][1], results[0][1], 1e-12)
    assert len(calls) == 2


def test_worker_pool_release_follows_a_gathers_members() -> None:
    """The pool's backward (taken when some graph of a pure evaluation forked)
    releases a batched graph's groups through the gather records that read
    them (their members, read only by index, have no records)."""
    loss, _ = graph()
    with ml.settings(batching=False):
        _, want = entry.gradients_sync(loss)
    ev = Evaluation(train=True)
    ev.deadline = math.inf  # no turns for the event loop: there is none
    order = collect(ev, [loss])
    with ml.settings(batching=True):
        batched.forward(ev, order)
        outcome, _ = inline.forward(ev, order, 0, True)
    assert outcome is None
    root = ev.records[loss]
    root.refcount += 1  # the caller's hold
    root.delta = np.ones_like(root.value)
    pool._backward(ev, root)
    got = ev.weight_gradients()
    assert_same_gradients({w: got[w] for w in want}, want, 1e-12)
    groups = [r for key, r in ev.records.items() if type(key) is Record]
    assert groups and all(r.refcount == 0 for r in groups)  # every group and gather released
