"""A loom's group whose cell has a step that does not batch (a product by a
stack of matrices, a capsule's predictions): its calls run one by one as
one batched call (`monadl.fold._loom_looped.Looped`), the loom's other
groups batched, with the values, gradients and memory of the same calls
built as nodes."""

from __future__ import annotations

import contextlib
import logging
import tracemalloc
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import _loom_looped
from monadl.runtime.schedule import batched_signature
from tests.fold.test_loom_block import value_and_grads


def capsules(calls: int, seed: int = 2) -> tuple[ml.ArrayWeight, ml.ArrayWeight, Any, Any, Any]:
    """A stack of matrices, a square weight, the cell that predicts by the
    stack (no batching rule), a cell that batches, and the calls' inputs."""
    rng = np.random.default_rng(seed)
    stack = ml.Weight(rng.normal(size=(4, 3, 5)) / 3)
    w = ml.Weight(rng.normal(size=(5, 5)) / 3)
    predict = ml.operation(lambda u: ml.reshape(u[:, None, :] @ stack, (4, 5)))
    step = ml.operation(lambda h: ml.tanh(h @ w) + h)
    return stack, w, predict, step, rng.normal(size=(calls, 4, 3))


def test_a_cell_whose_step_has_no_batching_rule_runs_its_own_calls_one_by_one(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A product by a stack of matrices (a capsule's predictions) has no
    batching rule: its group's calls run one by one, the cell that reads
    them still batched (before: every call of the block ran one by one,
    3.5x the time of its nodes)."""
    stack, w, predict, step, us = capsules(8)
    losses = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            ends = [step(step(predict(ml.as_layer(u)))) for u in us]
        losses.append(ml.sum(ml.stack(ends) ** 2.0))
    monkeypatch.setattr(batched_signature, "_KINDS", {})  # (each kind of value is said once a process)
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        (v0, g0), (v1, g1) = (value_and_grads(loss, [stack, w]) for loss in losses)
    assert v1 == pytest.approx(v0, rel=1e-13)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "capsules.<locals>.<lambda> at depth 0 one by one: its step matmul does not batch here" in m for m in said
    )
    assert not any("runs its calls one by one" in m for m in said)
    assert not any("LoomValue" in m for m in said)  # (the loom's own value is no array of a foreign library)


def test_a_group_run_call_by_call_sends_what_its_calls_send_alone() -> None:
    """The calls of a cell with no batching rule (two outputs, the second a
    ``sqrt`` at 0 in half of them, read in the others; one call's sum under
    ``stop_gradient``): the loss and gradients of the same calls as nodes,
    finite."""
    rng = np.random.default_rng(2)
    stack = ml.Weight(rng.normal(size=(4, 3, 5)) / 3)
    w = ml.Weight(rng.normal(size=(5, 5)) / 3)
    two = ml.operation(
        lambda u: (ml.reshape(u[:, None, :] @ stack, (4, 5)), ml.sqrt(ml.sum(u * u, axis=1, keepdims=True)))
    )
    step = ml.operation(lambda h: ml.tanh(h @ w) + h)
    us = rng.normal(size=(8, 4, 3))
    us[::2] = 0.0
    losses = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            terms = []
            for k, u in enumerate(us):
                predicted, norm = two(ml.as_layer(u))
                term = ml.sum(step(predicted)) + (ml.sum(norm) if k % 2 else 0.0)
                terms.append(ml.stop_gradient(term) if k == 3 else term)
        losses.append(ml.sum(ml.stack(terms)))
    (v0, g0), (v1, g1) = (value_and_grads(loss, [stack, w]) for loss in losses)
    assert v1 == pytest.approx(v0, rel=1e-13)
    for a, b in zip(g0, g1):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)


def test_a_partly_read_group_runs_its_calls_forward_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call's sum under ``stop_gradient``: the others send their deltas
    through the VJPs their forward made (before: the 199 reached calls ran
    forward again in the backward)."""
    stack, _, predict, step, us = capsules(40)
    ran: list[int] = []
    call = _loom_looped.Looped._call

    def counted(self: Any, i: int) -> Any:
        ran.append(i)
        return call(self, i)

    monkeypatch.setattr(_loom_looped.Looped, "_call", counted)
    with ml.loom():
        terms = [ml.sum(step(predict(ml.as_layer(u)))) for u in us]
    terms[0] = ml.stop_gradient(terms[0])
    loss = ml.sum(ml.stack(terms))
    got = anyio.run(ml.value_and_gradients, loss)[1][stack]  # (one forward, one backward)
    assert sorted(ran) == list(range(40))
    with ml.settings(batching=False):
        want = anyio.run(ml.value_and_gradients, loss)[1][stack]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_group_run_call_by_call_holds_one_calls_weight_delta_at_a_time() -> None:
    """300 calls by a stack of 8 x 32 x 32 (a weight-sized delta each, 66 kB):
    the block's peak is near the same calls' as nodes (before: 3.6x, every
    call's delta held till the sum)."""

    def peak(loom: bool) -> int:
        rng = np.random.default_rng(0)
        stack = ml.Weight(rng.normal(size=(8, 32, 32)) / 6)
        w = ml.Weight(rng.normal(size=(32, 32)) / 6)
        predict = ml.operation(lambda u: ml.reshape(u[:, None, :] @ stack, (8, 32)))
        step = ml.operation(lambda h: ml.tanh(h @ w))
        with ml.loom() if loom else contextlib.nullcontext():
            ends = [step(predict(ml.as_layer(u))) for u in rng.normal(size=(300, 8, 32))]
        loss = ml.sum(ml.stack(ends) ** 2.0)
        tracemalloc.start()
        try:
            anyio.run(ml.value_and_gradients, loss)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(True) < 1.6 * peak(False)


@pytest.mark.parametrize("looped", [False, True])
def test_a_call_whose_outputs_read_do_not_reach_an_operand_sends_it_none(looped: bool) -> None:
    """In a block: a producer's first call at ``sqrt``'s 0 feeds a two-output
    cell whose first call reads only the output that does not depend on it
    (batched, or call by call: its step by a stack of matrices). The
    producer's first call gets no delta, as its node (before: a zero row,
    marked reached, and a NaN in ``w``'s gradient)."""
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(3, 3)))
    v = ml.Weight(rng.normal(size=(3, 3)))
    stack = ml.Weight(rng.normal(size=(1, 3, 3)) / 3)
    produce = ml.operation(lambda x: ml.sqrt((x @ w) * (x @ w)))
    if looped:
        read = ml.operation(lambda h, u: (ml.reshape(h[:, None, :] @ stack, (1, 3)), ml.tanh(u @ v)))
    else:
        read = ml.operation(lambda h, u: (ml.tanh(h @ v), ml.tanh(u @ v)))
    xs = [np.zeros((1, 3)), rng.normal(size=(1, 3)), rng.normal(size=(1, 3))]
    us = [rng.normal(size=(1, 3)) for _ in xs]
    losses = []
    for loom in (False, True):
        with ml.loom() if loom else contextlib.nullcontext():
            terms = []
            for k, (x, u) in enumerate(zip(xs, us)):
                a, b = read(produce(ml.as_layer(x)), ml.as_layer(u))
                terms.append(ml.sum(b) if k == 0 else ml.sum(a) + ml.sum(b))
        losses.append(ml.sum(ml.stack(terms)))
    weights = [w, v, stack] if looped else [w, v]
    (v0, g0), (v1, g1) = (value_and_grads(loss, weights) for loss in losses)
    assert v1 == pytest.approx(v0, rel=1e-13)
    for a, b in zip(g0, g1):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)
