"""Which weights a batched backward reaches: exactly those it reaches node by node.

A group holds members that get a delta and members that get none (their
results feed ``stop_gradient``, or are read and left out of the loss). The
group's delta is made dense with zeros for the second kind; those zeros are
no delta, and must not reach the weights behind those members: such a weight
gets no gradient, takes no step, and its optimizer state stays as it is, with
batching on exactly as off. Each test compares the gradients' keys and the
weights that one ``train()`` stepped (Adam's step counts) under both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

Build = Callable[[list[ml.Weight[Any, Any]]], ml.ScalarLayer]


def _weights(count: int, shape: tuple[int, ...] = (4, 4)) -> list[ml.Weight[Any, Any]]:
    rng = np.random.default_rng(0)
    return [ml.Weight(rng.normal(size=shape) / 2, optimizer=ml.optim.adam(0.1)) for _ in range(count)]


def _reached(build: Build, count: int, batching: bool | None) -> tuple[list[int], list[int], list[Any]]:
    """The weights ``value_and_gradients`` lists, those one ``train()`` stepped
    (their Adam step counts), by index; and the gradients, in index order."""
    ws = _weights(count)

    async def go() -> tuple[list[int], list[int], list[Any]]:
        with ml.settings(batching=batching):
            _, grads = await ml.value_and_gradients(build(ws))
            await build(ws).train()
        listed = [i for i, w in enumerate(ws) if w in grads]
        stepped = [i for i, w in enumerate(ws) if w.state[0].step]
        return listed, stepped, [grads[ws[i]] for i in listed]

    return anyio.run(go)


def _assert_same_reach(build: Build, count: int, want: list[int], batching: bool | None = True) -> None:
    off = _reached(build, count, False)
    on = _reached(build, count, batching)
    assert off[0] == off[1] == want
    assert (on[0], on[1]) == (want, want)
    for a, b in zip(on[2], off[2]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def _target_network(examples: int) -> Build:
    xs = np.random.default_rng(1).normal(size=(examples, 1, 4))

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        online, target = ws
        terms = [ml.sum((ml.tanh(x @ online) - ml.stop_gradient(ml.tanh(x @ target))) ** 2.0) for x in xs]
        return ml.sum(ml.stack(terms))

    return build


@pytest.mark.parametrize(("examples", "batching"), [(12, True), (100, None)])
def test_a_target_network_under_stop_gradient_is_not_stepped(
    examples: int, batching: bool | None, grouped: list[tuple[str, int]]
) -> None:
    """One group of ``tanh`` holds the online and the target network's rows;
    only the online's get a delta (with the default rule from 100 examples)."""
    _assert_same_reach(_target_network(examples), 2, [0], batching)
    assert ("tanh", 2 * examples) in grouped


def test_a_target_weights_decay_leaves_it_as_it_was() -> None:
    """The report's case: a decayed weight behind ``stop_gradient`` kept its
    data with batching off and shrank with it on."""
    xs = np.random.default_rng(1).normal(size=(12, 1, 4))
    rng = np.random.default_rng(0)
    for batching in (False, True):
        online = ml.Weight(rng.normal(size=(4, 4)), optimizer=ml.optim.adam(0.1))
        decayed = ml.optim.chain(ml.optim.add_decayed_weights(0.1), ml.optim.sgd(0.1))
        target = ml.Weight(rng.normal(size=(4, 4)), optimizer=decayed)
        before = target.data.copy()
        terms = [ml.sum((ml.tanh(x @ online) - ml.stop_gradient(ml.tanh(x @ target))) ** 2.0) for x in xs]
        with ml.settings(batching=batching):
            anyio.run(ml.sum(ml.stack(terms)).train)
        np.testing.assert_array_equal(target.data, before)


def _read_candidates(examples: int) -> Build:
    """Every example reads three candidates' values, and its loss holds the first."""
    xs = np.random.default_rng(1).normal(size=(examples, 1, 4))

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        def example(x: Any) -> ml.ScalarLayer:
            outs = [ml.tanh(x @ w) for w in ws]
            return ml.Layer(ml.Do.gather([o.forward() for o in outs]).bind(lambda _: ml.sum(outs[0] ** 2.0).forward()))

        return ml.mean(ml.stack([example(x) for x in xs]))

    return build


@pytest.mark.parametrize(("examples", "batching"), [(12, True), (12, None), (1, True)])
def test_values_read_and_left_out_of_the_loss_reach_no_weight(
    examples: int, batching: bool | None, grouped: list[tuple[str, int]]
) -> None:
    _assert_same_reach(_read_candidates(examples), 3, [0], batching)
    assert ("tanh", 3 * examples) in grouped


def test_a_weight_the_loss_leaves_keeps_its_adam_state_and_data() -> None:
    """Weight 0 trained, then a loss of weight 1 alone: Adam's moments would
    move weight 0 on a zero gradient; nothing moves it, on or off."""
    x = np.ones((2, 4))

    def loss(ws: list[ml.Weight[Any, Any]], pick: int) -> ml.ScalarLayer:
        outs = [ml.tanh(x @ w) for w in ws]
        return ml.Layer(ml.Do.gather([o.forward() for o in outs]).bind(lambda _: ml.sum(outs[pick] ** 2.0).forward()))

    for batching in (False, True):
        ws = _weights(3)
        with ml.settings(batching=batching):
            anyio.run(loss(ws, 0).train)
            data, state = ws[0].data.copy(), ws[0].state
            anyio.run(loss(ws, 1).train)
        np.testing.assert_array_equal(ws[0].data, data)
        assert ws[0].state[0].step == state[0].step == 1
        assert [w.state[0].step for w in ws] == [1, 1, 0]


def test_stacked_operands_of_members_without_a_delta_send_none(grouped: list[tuple[str, int]]) -> None:
    """Each member's operand ran alone (a weight of its own, scaled): the group
    stacks them, and its stack's rows go back only to the members that got a delta."""

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        h = [ml.tanh(w * 2.0) for w in ws]  # (one group, stacking four products that ran alone)
        return ml.sum(h[0] + ml.stop_gradient(h[1])) + ml.sum(h[2] * 0.0) + ml.sum(ml.stop_gradient(h[3]))

    _assert_same_reach(build, 4, [0, 2])
    assert ("tanh", 4) in grouped and "multiply" not in [name for name, _ in grouped]


def test_a_group_none_of_whose_members_got_a_delta_sends_nothing(grouped: list[tuple[str, int]]) -> None:
    """The two concatenations run as one group, and only the first's rows
    get a delta: the target's ``sigmoid`` group, read by the second alone,
    gets nothing, and its weight neither."""
    xs = np.random.default_rng(1).normal(size=(6, 1, 4))

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        online, target = ws
        guesses = ml.concatenate([ml.tanh(x @ online) for x in xs], axis=0)
        targets = ml.concatenate([ml.sigmoid(x @ target) for x in xs], axis=0)
        return ml.sum((guesses - ml.stop_gradient(targets)) ** 2.0)

    _assert_same_reach(build, 2, [0])
    assert ("concatenate", 2) in grouped


def _cell(weight: ml.Weight[Any, Any]) -> Callable[[Any], tuple[ml.ArrayLayer, ml.ScalarLayer]]:
    v = np.random.default_rng(2).normal(size=(4, 4)) / 2

    @ml.operation
    def cell(h: ml.ArrayOperand) -> tuple[ml.ArrayLayer, ml.ScalarLayer]:
        out = ml.tanh(h @ weight)
        return out, ml.sum(out * v)

    return cell


def test_marked_cells_under_stop_gradient_reach_no_weight(grouped: list[tuple[str, int]]) -> None:
    """One group of marked cells (`ml.operation`): the online network's, and
    the target's under ``stop_gradient``; the cells' own weight is reached
    through the first."""
    xs = np.random.default_rng(1).normal(size=(6, 1, 4))

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        online, target, cell_w = ws
        cell = _cell(cell_w)

        def example(x: Any) -> ml.ScalarLayer:
            ours, _ = cell(ml.tanh(x @ online))
            theirs, _ = cell(ml.tanh(x @ target))
            return ml.sum(ours * 2.0) + ml.sum(ml.stop_gradient(theirs))

        return ml.sum(ml.stack([example(x) for x in xs]))

    _assert_same_reach(build, 3, [0, 2])
    assert 12 in [n for name, n in grouped if ".cell#" in name]  # (the two cells of each example, one group)


def test_marked_cells_whose_outputs_are_only_read_reach_no_weight(grouped: list[tuple[str, int]]) -> None:
    """One group of marked cells whose outputs a first graph reads (both
    outputs of each), and a second graph's loss uses one cell's of each example."""
    xs = np.random.default_rng(1).normal(size=(6, 1, 4))

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        online, read, cell_w = ws
        cell = _cell(cell_w)

        def example(x: Any) -> ml.ScalarLayer:
            ours, ours_score = cell(ml.tanh(x @ online))
            seen, seen_score = cell(ml.tanh(x @ read))
            probe = ml.stack([ml.sum(ours), ours_score, ml.sum(seen), seen_score])
            return ml.Layer(probe.forward().bind(lambda _: (ml.sum(ours * 2.0) + ours_score).forward()))

        return ml.sum(ml.stack([example(x) for x in xs]))

    _assert_same_reach(build, 3, [0, 2])
    assert 12 in [n for name, n in grouped if ".cell#" in name]  # (the two cells of each example, one group)


def test_a_marked_cell_whose_one_output_is_used_reaches_the_weights_behind_it(
    grouped: list[tuple[str, int]],
) -> None:
    """A member that got a delta in one of its outputs is reached (its other
    output's rows are zeros), as a cell alone is: one used output is enough."""
    xs = np.random.default_rng(1).normal(size=(6, 1, 4))

    def build(ws: list[ml.Weight[Any, Any]]) -> ml.ScalarLayer:
        a, b, cell_w = ws
        cell = _cell(cell_w)
        terms = []
        for x in xs:
            first, _ = cell(ml.tanh(x @ a))
            _, second = cell(ml.tanh(x @ b))
            terms.append(ml.sum(first) + second)
        return ml.sum(ml.stack(terms))

    _assert_same_reach(build, 3, [0, 1, 2])
    assert 12 in [n for name, n in grouped if ".cell#" in name]  # (the two cells of each example, one group)
