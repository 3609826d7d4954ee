"""A long commit: the steps of optimizers with state are computed ahead, one
weight at a time with turns for the event loop in between, and written at
once; a step computed ahead is taken only if nothing wrote its weight since.

No assertion depends on the machine's speed: turns are counted by a task
that records them, with the runtime giving one at every look at the clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import monadl as ml
from monadl.optim import apply
from monadl.runtime import entry

pytestmark = pytest.mark.anyio


def adam_weights(n: int = 4) -> list[ml.ArrayWeight]:
    rng = np.random.default_rng(0)
    return [ml.Weight(rng.standard_normal((3, 3)), optimizer=ml.optim.adam(0.1)) for _ in range(n)]


def loss_of(weights: list[ml.ArrayWeight]) -> ml.ScalarLayer:
    h: ml.ArrayLayer = ml.as_layer(np.ones((2, 3)))
    for w in weights:
        h = ml.tanh(h @ w)
    return ml.sum(h)


@pytest.fixture
def ahead(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every stateful step computed ahead (the model is small); the events of
    each step computed ahead ("step") in order."""
    monkeypatch.setattr(entry, "PREPARE_ELEMENTS", 0)
    events: list[str] = []

    def prepare(weight: Any, grad: Any) -> apply.Prepared:
        events.append("step")
        return apply.prepare(weight, grad)

    monkeypatch.setattr(entry, "prepare", prepare)
    return events


async def test_a_long_commit_gives_the_event_loop_turns_between_its_steps(
    ahead: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 Adam weights of 512 x 512 held the loop 33 ms in one commit (a user's service).
    checkpoint = anyio.lowlevel.checkpoint

    async def turn() -> None:
        ahead.append("turn")
        await checkpoint()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", turn)
    with ml.settings(yield_interval_s=1e-9):
        await loss_of(adam_weights()).train()
    steps = [i for i, e in enumerate(ahead) if e == "step"]
    assert len(steps) == 4
    assert all("turn" in ahead[a:b] for a, b in itertools.pairwise(steps))


async def test_steps_computed_ahead_equal_those_computed_at_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    at_commit, computed_ahead = adam_weights(), adam_weights()
    for _ in range(3):
        await loss_of(at_commit).train()
    monkeypatch.setattr(entry, "PREPARE_ELEMENTS", 0)
    for _ in range(3):
        await loss_of(computed_ahead).train()
    for a, b in zip(at_commit, computed_ahead):
        np.testing.assert_array_equal(a.data, b.data)
        adam_a, adam_b = a.state[0], b.state[0]
        assert adam_a.step == adam_b.step == 3
        np.testing.assert_array_equal(adam_a.mu, adam_b.mu)
        np.testing.assert_array_equal(adam_a.nu, adam_b.nu)


def test_a_step_computed_ahead_of_a_weight_written_since_is_computed_again() -> None:
    # Another commit between the step computed ahead and its write: taking the
    # step as computed would drop that commit's update.
    w, twin = (ml.Weight(np.ones(3), optimizer=ml.optim.adam(0.1)) for _ in range(2))
    g, other = np.array([1.0, 2.0, 3.0]), np.array([-1.0, 0.5, 4.0])
    ready = {w: apply.prepare(w, g)}
    ml.optim.apply_gradients({w: other})
    apply.consume_gradients({w: g.copy()}, ready=ready)
    ml.optim.apply_gradients({twin: other})
    ml.optim.apply_gradients({twin: g})
    np.testing.assert_array_equal(w.data, twin.data)
    assert w.state[0].step == twin.state[0].step == 2


async def test_a_commit_cancelled_between_its_steps_changes_nothing(
    ahead: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = adam_weights()
    before = [(w.data.copy(), w.state) for w in weights]
    with anyio.CancelScope() as scope, ml.settings(yield_interval_s=1e-9):
        original: Callable[[Any, Any], apply.Prepared] = vars(entry)["prepare"]  # (the fixture's: it records)

        def cancel_after_the_first(weight: Any, grad: Any) -> apply.Prepared:
            scope.cancel()
            return original(weight, grad)

        monkeypatch.setattr(entry, "prepare", cancel_after_the_first)
        await loss_of(weights).train()
    assert scope.cancelled_caught and ahead == ["step"]
    for w, (data, state) in zip(weights, before):
        np.testing.assert_array_equal(w.data, data)
        assert w.state is state


async def test_a_non_finite_step_computed_ahead_writes_no_weight(ahead: list[str]) -> None:
    weights = adam_weights()
    sgd = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
    before = [w.data.copy() for w in [*weights, sgd]]
    loss = loss_of(weights) + ml.sum(sgd) * float("inf")
    with pytest.raises(ml.NonFiniteError):
        await loss.train()
    assert ahead == ["step"] * 4
    for w, data in zip([*weights, sgd], before):
        np.testing.assert_array_equal(w.data, data)


async def test_a_step_computed_ahead_that_another_commit_made_stale_is_computed_again_ahead(
    ahead: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two train()s on one loop: the other's commit lands between this one's steps
    # computed ahead; they were computed again inside the commit, in one stretch.
    weights = adam_weights()
    recorded: Callable[[Any, Any], apply.Prepared] = vars(entry)["prepare"]

    first: list[Any] = []

    def another_commit_after_the_first(weight: Any, grad: Any) -> apply.Prepared:
        done = recorded(weight, grad)
        if not first:
            first.append(weight)
            ml.optim.apply_gradients({weight: np.ones((3, 3))})
        return done

    monkeypatch.setattr(entry, "prepare", another_commit_after_the_first)
    computed_in_the_commit: list[object] = []
    step = apply.step

    def counted(weight: Any, grad: Any) -> tuple[Any, Any]:
        computed_in_the_commit.append(weight)
        return step(weight, grad)

    monkeypatch.setattr(apply, "step", counted)
    await loss_of(weights).train()
    assert len(ahead) == 5  # the first weight's step again, ahead
    assert len(computed_in_the_commit) == 6  # (the other commit's, and five ahead: none in the commit)
    assert first[0].state[0].step == 2


def test_a_step_computed_ahead_of_a_weight_given_another_optimizer_since_is_computed_again() -> None:
    w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(ml.optim.constant_schedule(0.1)))
    ready = {w: apply.prepare(w, np.ones(2))}
    w.optimizer = ml.optim.sgd(ml.optim.constant_schedule(10.0))  # (its fresh state: the same small int)
    apply.consume_gradients({w: np.ones(2)}, ready=ready)
    np.testing.assert_array_equal(w.data, [-9.0, -9.0])
