"""Which parked graphs run together, and in which levels (`monadl.runtime.schedule.fibers`).

The fibers' graphs of a merged run are levelled by their distance to each
fiber's read (`fibers.heights`), so a step's product lines up whatever each
fiber computed before it; and a graph after which no fiber parked again (a
loss at the end of a data-dependent loop) waits while steps are parked, so
that such graphs run together. Both must leave values and gradients as they
are without parking.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import pytest

import monadl as ml
from monadl.runtime import entry
from monadl.runtime.schedule import batched_run, fibers

EXAMPLES = 12


class Detour:
    """At each step an example whose value is positive first takes a detour
    (a product by ``aside``), then every example takes the same step (a
    product by ``main``); examples walk ``1 + i % 4`` steps, then their loss."""

    def __init__(self, hidden: int = 8) -> None:
        rng = np.random.default_rng(3)
        scale = 1.5 / np.sqrt(hidden)
        self.main = ml.Weight(rng.standard_normal((hidden, hidden)) * scale)
        self.aside = ml.Weight(rng.standard_normal((hidden, hidden)) * scale)
        self.bias = ml.Weight(rng.standard_normal(hidden) * 0.1)
        self.inputs = [rng.standard_normal(hidden) for _ in range(EXAMPLES)]

    def weights(self) -> list[ml.ArrayWeight]:
        return [self.main, self.aside, self.bias]

    def example(self, x: ml.Array, steps: int) -> ml.ScalarLayer:
        def walk(h: ml.ArrayLayer, left: int) -> ml.Do[ml.Tape[Any, Any]]:
            if not left:
                return ml.sum(h * h).forward()

            def go(tape: ml.Tape[ml.Array, ml.Array]) -> ml.Do[ml.Tape[Any, Any]]:
                g = ml.tanh(h @ self.aside) if tape.data[0] > 0 else h
                return walk(ml.tanh(g @ self.main + self.bias), left - 1)

            return h.forward().bind(go)

        return ml.Layer(walk(ml.tanh(x @ self.main + self.bias), steps))

    def loss(self) -> ml.ScalarLayer:
        return ml.sum(ml.stack([self.example(x, 1 + i % 4) for i, x in enumerate(self.inputs)]))


def gradients(batching: bool | None) -> tuple[float, list[ml.Array]]:
    model = Detour()
    with ml.settings(batching=batching):
        value, grads = entry.gradients_sync(model.loss())
    return float(value), [grads[w] for w in model.weights()]


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Generator[list[list[str]], None, None]:
    """Per merged run, the primitive of each graph's last node (what its fiber reads);
    the kinds learned so far forgotten, as in a fresh process."""
    seen: list[list[str]] = []
    merge = fibers.merge

    def recording(ev: Any, orders: list[list[Any]]) -> tuple[list[Any], int]:
        seen.append([order[-1]._op.name for order in orders])
        return merge(ev, orders)

    monkeypatch.setattr(fibers, "merge", recording)
    monkeypatch.setattr(fibers, "_steps", set())
    monkeypatch.setattr(fibers, "_leads", set())
    yield seen


def test_last_graphs_wait_for_the_steps_and_run_together(runs: list[list[str]]) -> None:
    gradients(True)  # the first evaluation learns which kinds of graph are steps (fibers park again)
    # (In it, a loss may still run beside the steps of a kind not yet seen to continue.)
    assert sum(run.count("sum") for run in runs) == EXAMPLES
    off_value, off = gradients(False)  # (its fibers park too, and run merged node by node: before the runs counted)
    runs.clear()
    value, grads = gradients(True)
    assert value == pytest.approx(off_value, rel=1e-12)
    for a, b in zip(grads, off):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # The first run holds every example's first step; the examples that stop after
    # one step then wait while the others walk on (9, 6, 3): all losses run in one last run.
    finals = [run.count("sum") for run in runs]
    assert finals[-1] == EXAMPLES and sum(finals) == EXAMPLES
    assert all(name != "sum" for run in runs[:-1] for name in run)
    assert len(runs) == 5  # four steps at most, then the losses


def test_without_a_known_step_nothing_waits(runs: list[list[str]]) -> None:
    # Before any fiber has parked again, no kind is known to be a step: all run at once.
    parked = fibers.Parked()
    assert not parked
    gradients(True)
    assert runs[0].count("add") + runs[0].count("tanh") == EXAMPLES  # every first step, at once


def test_a_step_lines_up_by_its_distance_to_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Examples that took the detour reach the step's product one product later than
    # the others; by height both meet it at the same level: one group per run.
    products: list[int] = []
    group = batched_run.Run.group

    def counting(self: Any, members: list[Any]) -> None:
        first = members[0]
        if first._op.name == "matmul" and first._inputs[1] is model.main:
            products.append(len(members))
        group(self, members)

    model = Detour()
    monkeypatch.setattr(fibers, "_steps", set())
    monkeypatch.setattr(fibers, "_leads", set())
    monkeypatch.setattr(batched_run.Run, "group", counting)
    with ml.settings(batching=True):
        entry.gradients_sync(model.loss())
        products.clear()  # (the first evaluation learned which graphs are steps)
        entry.gradients_sync(model.loss())
    # Per merged run, the examples still walking (12, 9, 6, 3) all in one group; then
    # the last step of every example, inside its loss's graph (12).
    assert products == [12, 9, 6, 3, 12]


def step(model: Detour, h: ml.ArrayLayer) -> ml.ArrayLayer:
    return ml.tanh(h @ model.main + model.bias)


def middle(model: Detour, h: ml.ArrayLayer) -> ml.ArrayLayer:
    return ml.tanh(h @ model.aside)


def test_a_graph_between_two_loops_is_not_held(runs: list[list[str]]) -> None:
    # Each example reads its value after every move of its plan: a + 1 steps, one move
    # of its own kind (`middle`), then 3 - a steps. That move leads to steps, so it runs
    # when it comes; held like a last graph, an example reaching it early would walk
    # its second loop late and alone. Six runs: the first read, four moves, the losses.
    model = Detour()
    moves = {"S": step, "M": middle}

    def example(x: ml.Array, a: int) -> ml.ScalarLayer:
        plan = "S" * (a + 1) + "M" + "S" * (3 - a)

        def walk(h: ml.ArrayLayer, k: int) -> ml.Do[ml.Tape[Any, Any]]:
            if k == len(plan):
                return ml.sum(h * h).forward()
            return h.forward().bind(lambda tape: walk(moves[plan[k]](model, h), k + 1))

        return ml.Layer(walk(ml.tanh(x @ model.main + model.bias), 0))

    def loss() -> ml.ScalarLayer:
        return ml.sum(ml.stack([example(x, i % 3) for i, x in enumerate(model.inputs)]))

    with ml.settings(batching=True):
        entry.gradients_sync(loss())  # (learns which kinds are steps, and which lead to them)
        runs.clear()
        value, grads = entry.gradients_sync(loss())
    counted = list(runs)
    with ml.settings(batching=False):  # (its fibers park too, and its merged runs go node by node)
        off_value, off = entry.gradients_sync(loss())
    assert runs[len(counted) :] == counted  # the same runs: the examples step in one order, on or off
    runs[:] = counted
    assert float(value) == pytest.approx(float(off_value), rel=1e-12)
    for w in model.weights():
        np.testing.assert_allclose(grads[w], off[w], rtol=1e-10, atol=1e-12)
    assert len(runs) == 6 and runs[-1] == ["sum"] * EXAMPLES


def test_heights_order_is_topological() -> None:
    w = ml.Weight(np.eye(3))
    a = ml.tanh(np.ones((1, 3)) @ w)
    b = a @ w + a
    c = ml.sum(b) + ml.sum(a)
    order = [a._inputs[0], a, b._inputs[0], b, c._inputs[0], c._inputs[1], c]
    levels = fibers.heights(order)
    placed = {node: k for k, level in enumerate(levels) for node in level}
    assert sorted(placed, key=id) == sorted(order, key=id)
    for node in order:
        for x in node._inputs:
            if isinstance(x, ml.Layer) and x in placed:
                assert placed[x] < placed[node]
    assert len(levels[-1]) == 1 and levels[-1][0] is c


def test_marked_cells_send_their_weights_deltas_as_factors(outer_rows: list[int]) -> None:
    # A step marked as one operation: its merged groups run its program batched, whose
    # product by the weight sends the rows and their deltas (an Outer), multiplied once
    # at the weight's release; what on_gradient sees is an array, the unbatched gradient.
    import anyio

    rows = outer_rows

    def run(batching: bool | None) -> tuple[float, list[Any], dict[Any, Any]]:
        model = Detour()
        cell = ml.operation(lambda g: ml.tanh(g @ model.main + model.bias))
        told: dict[Any, Any] = {}

        def example(x: ml.Array, steps: int) -> ml.ScalarLayer:
            def walk(h: ml.ArrayLayer, left: int) -> ml.Do[ml.Tape[Any, Any]]:
                if not left:
                    return ml.sum(h * h).forward()
                return h.forward().bind(lambda tape: walk(cell(h), left - 1))

            return ml.Layer(walk(cell(x[None, :]), steps))

        loss = ml.sum(ml.stack([example(x, 1 + i % 4) for i, x in enumerate(model.inputs)]))

        async def go() -> tuple[Any, dict[Any, Any]]:
            with ml.settings(batching=batching):
                return await entry.gradients(loss, on_gradient=told.__setitem__)

        value, grads = anyio.run(go)
        return float(value), [grads[w] for w in model.weights()[::2]], told

    value, grads, told = run(True)
    assert rows and sum(rows) == sum(1 + i % 4 for i in range(EXAMPLES)) + EXAMPLES  # every product's row, once
    assert all(type(g) is np.ndarray for g in told.values())
    off_value, off, _ = run(False)
    assert value == pytest.approx(off_value, rel=1e-12)
    for a, b in zip(grads, off):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
