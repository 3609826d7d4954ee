"""Batching across data-dependent control flow: fibers park at their graphs, which run as one.

Each example below chooses its path by its own values (``bind`` or direct
style); the whole batch is one ``train()``. Parking must give the same values,
gradients and errors as batching off (whose fibers park too, and run merged
node by node, so that the examples step in the same order), and must batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.layers._layer import Layer
from monadl.layers._primitives import Primitive
from monadl.runtime import entry
from monadl.runtime.schedule import batched, batched_gather, batched_records, batched_run, fibers

HERE = __file__
STEPS = 4


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


class Walk:
    """Each example takes ``STEPS`` steps; at each, its own value picks one of two weights."""

    def __init__(self, seed: int = 0, hidden: int = 6) -> None:
        rng = np.random.default_rng(seed)
        scale = 1.5 / np.sqrt(hidden)
        self.up = ml.Weight(rng.standard_normal((hidden, hidden)) * scale)
        self.down = ml.Weight(rng.standard_normal((hidden, hidden)) * scale)
        self.bias = ml.Weight(rng.standard_normal(hidden) * 0.1)
        self.inputs = [rng.standard_normal(hidden) for _ in range(16)]

    def weights(self) -> list[ml.ArrayWeight]:
        return [self.up, self.down, self.bias]

    def step(self, h: ml.ArrayLayer | ml.Array, up: bool) -> ml.ArrayLayer:
        return ml.tanh(h @ (self.up if up else self.down) + self.bias)

    def monadic(self, x: ml.Array, steps: int = STEPS) -> ml.ScalarLayer:
        def walk(h: ml.ArrayLayer, left: int) -> ml.Do[ml.Tape[Any, Any]]:
            if not left:
                return ml.sum(h * h).forward()
            return h.forward().bind(lambda tape: walk(self.step(h, tape.data[0] > 0), left - 1))

        return ml.Layer(walk(self.step(x, True), steps))

    @ml.direct
    async def direct(self, x: ml.Array) -> ml.ScalarLayer:
        h = self.step(x, True)
        for _ in range(STEPS):
            value = await h
            h = self.step(h, value[0] > 0)
        return ml.sum(h * h)

    def loss(self, way: str, n: int = 16) -> ml.ScalarLayer:
        example: Callable[[ml.Array], ml.ScalarLayer] = getattr(self, way)
        return ml.sum(ml.stack([example(x) for x in self.inputs[:n]]))


def gradients(way: str, batching: bool | None, n: int = 16, hidden: int = 6) -> tuple[float, list[ml.Array]]:
    model = Walk(hidden=hidden)
    with ml.settings(batching=batching):
        value, grads = entry.gradients_sync(model.loss(way, n)) if way == "monadic" else _async(model, way, n)
    return float(value), [grads[w] for w in model.weights()]


def _async(model: Walk, way: str, n: int) -> tuple[Any, dict[Any, Any]]:
    import anyio

    async def go() -> tuple[Any, dict[Any, Any]]:
        return await entry.gradients(model.loss(way, n))

    return anyio.run(go)


@pytest.fixture
def merges(monkeypatch: pytest.MonkeyPatch) -> Generator[list[int], None, None]:
    """The sizes of the merged graphs that ran (nodes), one entry per merged run."""
    sizes: list[int] = []
    run = fibers.run

    def counting(ev: Any, parked: fibers.Parked) -> Generator[Any, Any, list[Any]]:
        sizes.append(sum(map(len, parked.orders)))
        return (yield from run(ev, parked))

    monkeypatch.setattr(fibers, "run", counting)
    yield sizes


@pytest.mark.parametrize("way", ["monadic", "direct"])
def test_same_values_and_gradients_as_with_batching_off(way: str, merges: list[int]) -> None:
    off_value, off = gradients(way, False)
    # Batching forced off: the fibers park and merge all the same (the examples step in
    # one order, on or off), and each merged run goes node by node.
    assert len(merges) == STEPS + 1 and all(size >= 16 for size in merges)
    merges.clear()
    for batching in (None, True):  # parked, run merged and batched (16 graphs a merge: MIN_MERGED or more)
        value, grads = gradients(way, batching)
        assert value == pytest.approx(off_value, rel=1e-12)
        for a, b in zip(grads, off):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # Per evaluation (two here), a merged run per read (STEPS of them) and one of the
    # last graphs, each for all 16 examples together.
    assert len(merges) == 2 * (STEPS + 1) and all(size >= 16 for size in merges)
    # Fewer graphs than MIN_MERGED: parked and merged, run unbatched; the same values.
    few = fibers.MIN_MERGED - 1
    off_value, off = gradients(way, False, n=few)
    value, grads = gradients(way, None, n=few)
    assert value == pytest.approx(off_value, rel=1e-12)
    for a, b in zip(grads, off):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_the_log_says_which_merges_ran_batched(caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG, `monadl.batching` names each merge that ran batched, not
    only those that did not (a new user could tell batching across control
    flow happened only by timing it off)."""
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        gradients("direct", None)
    said = [r.getMessage() for r in caplog.records if "fibers' graphs" in r.getMessage()]
    assert sum("runs batched" in line for line in said) == STEPS + 1
    assert all(line.startswith("a merge of 16 fibers' graphs (") for line in said if "runs batched" in line)


@pytest.mark.parametrize("way", ["monadic", "direct"])
def test_with_the_worker_pool_examples_park_and_merge_too(way: str, merges: list[int]) -> None:
    """With ``workers=2`` no fiber parked: a batch of a policy's episodes ran
    one graph at a time, 3-4x slower than with one worker."""
    off_value, off = gradients(way, False)
    merges.clear()  # (batching off parks too: `test_same_values_and_gradients_as_with_batching_off`)
    model = Walk()
    with ml.settings(workers=2):  # (async: the synchronous entry never forks)
        value, by_weight = _async(model, way, 16)
    grads = [by_weight[w] for w in model.weights()]
    assert len(merges) == STEPS + 1 and all(size >= 16 for size in merges)
    assert value == pytest.approx(off_value, rel=1e-12)
    for a, b in zip(grads, off):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("way", ["bind", "direct"])
@pytest.mark.parametrize("workers", [1, 2])
def test_examples_step_in_one_order_whether_batching_is_on_or_off(
    way: str, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every example's first step, then every second step: with batching off,
    ``bind`` examples stepped one after another (example 0's every step, then
    example 1's), so a model that samples from one generator drew other
    samples than with batching on. Off, nothing batches."""
    w = ml.Weight(np.eye(2))
    grouped: list[int] = []
    record = batched_records.group_records

    def counted(groups: Any, members: list[Any], *args: Any) -> None:
        grouped.append(len(members))
        record(groups, members, *args)

    monkeypatch.setattr(batched_run, "group_records", counted)

    def steps(batching: bool | None) -> tuple[list[tuple[int, int]], list[int], float]:
        import anyio

        rng, log = np.random.default_rng(0), []

        def bind(e: int) -> ml.ScalarLayer:
            def step(h: ml.ArrayLayer, d: int) -> ml.Do[ml.Tape[Any, Any]]:
                if d == 3:
                    return ml.sum(h).forward()

                def then(_: Any) -> ml.Do[ml.Tape[Any, Any]]:
                    log.append((e, d))
                    return step(ml.tanh(h @ w) * (1.0 + float(rng.integers(2))), d + 1)

                return h.forward().bind(then)

            return ml.Layer(step(ml.as_layer(np.full((1, 2), float(e))) @ w, 0))

        @ml.direct
        async def direct(e: int) -> ml.ScalarLayer:
            h = ml.as_layer(np.full((1, 2), float(e))) @ w
            for d in range(3):
                await h
                log.append((e, d))
                h = ml.tanh(h @ w) * (1.0 + float(rng.integers(2)))
            return ml.sum(h)

        example = bind if way == "bind" else direct
        loss = ml.sum(ml.stack([example(e) for e in range(12)]))

        async def go() -> float:
            with ml.settings(batching=batching, workers=workers):
                return float(await loss.predict())

        grouped.clear()
        value = anyio.run(go)
        return log, list(grouped), value

    written = [(e, d) for d in range(3) for e in range(12)]
    off, on, auto = steps(False), steps(True), steps(None)
    assert off[0] == on[0] == auto[0] == written
    assert off[1] == [] and 12 in on[1]
    assert off[2] == pytest.approx(on[2], rel=1e-12) and off[2] == pytest.approx(auto[2], rel=1e-12)


def test_paths_differ_per_example() -> None:
    """The examples really take different paths (else this would test nothing)."""
    model = Walk()
    firsts = {bool(np.tanh(x @ model.up.data + model.bias.data)[0] > 0) for x in model.inputs}
    assert firsts == {True, False}


def test_merged_graphs_are_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    groups: list[int] = []
    forward = batched.forward

    def counting(
        ev: Any, order: list[Any], strategy: str | None = None, shared: Any = None, levels: Any = None
    ) -> list[Any]:
        groups.append(len(order))
        return forward(ev, order, strategy, shared, levels)

    stepwise = batched.stepwise

    def counting_steps(
        ev: Any, order: list[Any], shared: Any = None, levels: Any = None
    ) -> Generator[object, None, list[Any]]:  # (a graph's own, inline, and a merged run's, with turns)
        groups.append(len(order))
        left: list[Any] = yield from stepwise(ev, order, shared, levels)
        return left

    monkeypatch.setattr(batched, "forward", counting)
    monkeypatch.setattr(batched, "stepwise", counting_steps)
    gradients("monadic", None, n=fibers.MIN_MERGED - 1, hidden=128)  # too few graphs a merge to pay
    assert groups == []
    gradients("monadic", None, n=fibers.MIN_MERGED)  # from MIN_MERGED on: batched
    assert groups == [3 * fibers.MIN_MERGED] * STEPS + [5 * fibers.MIN_MERGED]
    groups.clear()
    gradients("monadic", None)  # 16 graphs a merge: batched, however fine the weights (6 x 6)
    # Every step's merge (16 alike graphs of 3 nodes, far below MIN_NODES) went through the
    # batching scheduler, and the last (a product among 5 nodes each).
    assert groups == [3 * 16] * STEPS + [5 * 16]
    groups.clear()
    gradients("monadic", True)  # forced: however fine (the first graph is the one holding the 16 examples,
    # and the last its stack and sum, after the examples' bind layers)
    assert groups[1:] == [3 * 16] * STEPS + [5 * 16, 2]


def test_later_runs_read_earlier_groups_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each step's product reads the tanh that the previous merged run computed as one
    # group: by index (a gather, whose delta goes back in one scatter), not stacked
    # from the members' records (whose deltas would come back one member at a time).
    puts = [0]
    put = batched_gather.Gather.put

    def counting(self: batched_gather.Gather, i: int, g: Any) -> batched_gather.Gather:
        puts[0] += 1
        return put(self, i, g)

    monkeypatch.setattr(batched_gather.Gather, "put", counting)
    value, grads = gradients("monadic", True, hidden=128)
    off_value, off = gradients("monadic", False, hidden=128)
    assert value == pytest.approx(off_value, rel=1e-12)
    for a, b in zip(grads, off):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # Only the batch's own stack of the 16 losses (one node, run alone) reads members
    # one by one; before the groups were kept across runs, each step's did too (80).
    assert puts[0] == 16


def test_factored_weight_deltas_are_arrays_when_final() -> None:
    # A weight used by several merged runs' products gets its delta as their rows
    # (batched_records.Outer), multiplied once at its release: what on_gradient and
    # the returned gradients see is an array, equal to the unbatched gradient.
    import anyio

    told: dict[Any, Any] = {}
    model = Walk(hidden=128)

    async def go() -> tuple[Any, dict[Any, Any]]:
        with ml.settings(batching=True):
            return await entry.gradients(model.loss("monadic"), on_gradient=told.__setitem__)

    value, grads = anyio.run(go)
    off_value, off = gradients("monadic", False, hidden=128)
    assert float(value) == pytest.approx(off_value, rel=1e-12)
    for w, expected in zip(model.weights(), off):
        assert type(told[w]) is np.ndarray and told[w] is grads[w]
        np.testing.assert_allclose(grads[w], expected, rtol=1e-10, atol=1e-12)


def test_lone_product_by_a_large_weight_joins_the_factors(outer_rows: list[int]) -> None:
    # Hidden 256: a 256 x 256 weight (batched.MIN_FACTORED elements). Where one example
    # alone picks a weight in a step, its product runs as a group of one, its row
    # kept with the other groups' rows; the gradients are those of evaluating unbatched.
    rows = outer_rows
    value, grads = gradients("monadic", True, n=3, hidden=256)  # (three graphs a merge: batched when forced)
    off_value, off = gradients("monadic", False, n=3, hidden=256)
    assert value == pytest.approx(off_value, rel=1e-12)
    for a, b in zip(grads, off):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    assert 1 in rows and sum(rows) == 3 * (STEPS + 1)  # every product's row, once (groups of one too)


def test_outer_sums_its_factors_and_arrays() -> None:
    rng = np.random.default_rng(0)
    a, b, c, d, dense = (
        rng.normal(size=(2, 3)),
        rng.normal(size=(2, 4)),
        rng.normal(size=(5, 3)),
        rng.normal(size=(5, 4)),
        rng.normal(size=(3, 4)),
    )
    total = dense + (batched_records.Outer(a, b) + batched_records.Outer(c, d))  # array + outer: __radd__
    assert total.shape == (3, 4)
    np.testing.assert_allclose(total.dense(), a.T @ b + c.T @ d + dense, rtol=1e-12)


def test_one_example_does_not_park(merges: list[int]) -> None:
    gradients("monadic", None, n=1)
    assert merges == []


def test_training_steps_match() -> None:
    import anyio

    def trained(batching: bool | None) -> list[ml.Array]:
        model = Walk()
        for w in model.weights():
            w.optimizer = ml.optim.sgd(0.1)

        async def go() -> None:
            with ml.settings(batching=batching):
                for _ in range(3):
                    await model.loss("monadic").train()

        anyio.run(go)
        return [w.data for w in model.weights()]

    for a, b in zip(trained(None), trained(False)):
        np.testing.assert_allclose(a, b, rtol=1e-10)


def test_shared_node_computed_once(merges: list[int]) -> None:
    count = [0]

    def rule(a: Any) -> tuple[Any, tuple[Callable[[Any], Any], ...]]:
        count[0] += 1
        return a, (lambda g: g,)

    model = Walk()
    shared = Layer._make(Primitive("count", rule), (model.bias * 1.0,))
    losses = [model.monadic(x + 0.0) * 1.0 for x in model.inputs[:8]]

    def with_shared(loss: ml.ScalarLayer) -> ml.ScalarLayer:
        return ml.Layer(loss.forward().bind(lambda t: (loss + ml.sum(shared)).forward()))

    entry.gradients_sync(ml.sum(ml.stack([with_shared(loss) for loss in losses])))
    assert count[0] == 1 and merges


def test_failure_is_the_original_error_at_the_users_line() -> None:
    model = Walk()
    before = [w.data.copy() for w in model.weights()]

    def bad(x: ml.Array) -> ml.ScalarLayer:
        h = ml.tanh(x @ model.up)
        return ml.Layer(h.forward().bind(lambda t: ml.sum(h + np.ones(4)).forward()))  # FIBER-BAD

    loss = ml.sum(ml.stack([*(model.monadic(x) for x in model.inputs[:6]), bad(model.inputs[6])]))
    import anyio

    async def go() -> None:
        await loss.train()

    for batching in (None, True):
        with ml.settings(batching=batching), pytest.raises(ml.ShapeError) as info:
            anyio.run(go)
        assert f"{HERE}:{line_of('FIBER-BAD')}" in str(info.value)
    for old, w in zip(before, model.weights()):
        assert np.array_equal(old, w.data)


@pytest.mark.anyio
async def test_a_parked_fiber_is_not_waited_for_by_a_coroutine_that_waits_for_it() -> None:
    """One example's coroutine waits (outside monadl) for another example to
    get past its graph: the parked graph must run without that coroutine's step."""
    import anyio

    model = Walk()
    passed = anyio.Event()

    @ml.direct
    async def waits() -> ml.ScalarLayer:
        await passed.wait()  # set by the other example, after its graph
        value = await model.step(model.inputs[0], True)
        return ml.sum(model.step(model.inputs[1], bool(value[0] > 0)))

    @ml.direct
    async def sets() -> ml.ScalarLayer:
        value = await model.step(model.inputs[2], True)
        passed.set()
        return ml.sum(model.step(model.inputs[3], bool(value[0] > 0)))

    with anyio.fail_after(60):  # a guard against a hang, not a timing
        value, grads = await entry.gradients(ml.sum(ml.stack([waits(), sets()])))
    with ml.settings(batching=False):
        passed = anyio.Event()
        expected, off = await entry.gradients(ml.sum(ml.stack([waits(), sets()])))
    assert float(value) == pytest.approx(float(expected), rel=1e-12)
    assert grads.keys() == off.keys()
    for w in grads:
        np.testing.assert_allclose(grads[w], off[w], rtol=1e-12)


def test_coroutine_steps_take_no_task_or_turn_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct-style examples' coroutine steps asked for together run in one
    task; one turn of the event loop finishes those that come back at once,
    and the interpreter takes each completion already back without another
    turn (a turn a step cost about 7 us, a task a step more: 300 of each in
    a step of the shift-reduce parser at batch 32)."""
    import anyio
    import anyio.lowlevel

    from examples import shift_reduce as sr
    from monadl.runtime import drive
    from monadl.runtime.process import advance

    turns: list[int] = []
    checkpoint = anyio.lowlevel.checkpoint

    async def counted() -> None:
        turns.append(1)
        await checkpoint()

    stepped: list[int] = []  # coroutine steps asked for, and tasks started for them
    started: list[int] = []

    def counting(step: Any, arg: Any, pause: bool) -> Any:
        request = advance(step, arg, pause)
        if type(request).__name__ == "Steps":
            stepped.append(len(request.items))
            started.append(1)
        return request

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)
    monkeypatch.setattr(drive, "advance", counting)
    parser = sr.Parser(8, seed=1)
    sentences = sr.make_sentences(12, 2, 6, seed=4)
    with ml.settings(yield_interval_s=60.0):  # (no turns for the time: only those the steps ask for)
        value, grads = anyio.run(entry.gradients, parser.loss(sentences, [], direct=True))
    assert sum(stepped) > 40
    assert len(turns) < sum(stepped) / 4
    assert len(started) < sum(stepped) / 4  # a task for the steps asked for together, not one a step
    with ml.settings(batching=False):
        expected, off = anyio.run(entry.gradients, parser.loss(sentences, [], direct=True))
    assert float(value) == pytest.approx(float(expected), rel=1e-12)
    for w in grads:
        np.testing.assert_allclose(_dense(grads[w]), _dense(off[w]), rtol=1e-10, atol=1e-14)


def _dense(g: Any) -> Any:
    return g.to_dense() if hasattr(g, "to_dense") else g


def test_merged_runs_are_the_same_whichever_task_the_event_loop_runs_first() -> None:
    """Trio runs ready tasks in random order: the examples' coroutine steps
    came back in another order each run, and a merged run went without the
    graphs of steps not yet back, so which graphs ran together, and the sums
    of their groups' deltas, changed from run to run (4-6 distinct gradients
    in 8 runs of this model)."""
    import anyio

    hidden = 16
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(hidden, hidden)) / np.sqrt(hidden))
    v = ml.Weight(rng.normal(size=(hidden, 1)))
    xs = [rng.normal(size=(1, hidden)) for _ in range(24)]

    @ml.direct
    async def example(x: ml.Array) -> ml.ScalarLayer:  # until its own halting value passes 0.6
        h = ml.tanh(x @ w)
        for _ in range(8):
            p = await ml.sigmoid(h @ v)
            if p[0, 0] > 0.6:
                break
            h = ml.tanh(h @ w)
        return ml.sum(h * h) + ml.sum(ml.sigmoid(h @ v))

    def once(backend: str) -> list[bytes]:
        async def go() -> tuple[Any, dict[Any, Any]]:
            return await entry.gradients(ml.sum(ml.stack([example(x) for x in xs])))

        _, grads = anyio.run(go, backend=backend)
        return [grads[w].tobytes(), grads[v].tobytes()]

    reference = once("asyncio")
    for _ in range(6):
        assert once("trio") == reference


def test_gradients_inside_the_examples_steps_are_waited_for_as_their_reads(caplog: pytest.LogCaptureFixture) -> None:
    """First-order MAML as one ``train()``: each example's step takes inner
    steps with ``ml.gradients``, whose evaluation gives the event loop a turn
    every ``yield_interval_s``. Such a turn counted as a foreign await: the
    merged run of the examples' query losses went without the examples whose
    inner loop had taken one, so which of them merged (10 or 11 of 12, by the
    clock) and the last bits of the weights (3-6e-17) changed run to run and
    between asyncio and trio. A turn of a nested evaluation is the step's own
    wait: every example is waited for, all twelve losses merge, every run."""
    rng = np.random.default_rng(0)
    init = [rng.normal(size=(1, 16)), np.zeros(16), rng.normal(size=(16, 1)) / 4.0]
    tasks = [(rng.uniform(-5, 5, size=(6, 1)), rng.uniform(-1, 1, size=(6, 1))) for _ in range(12)]

    def loss(w: Sequence[ml.ArrayLayer | ml.ArrayWeight], x: ml.Array, y: ml.Array) -> ml.ScalarLayer:
        return ml.mean((ml.tanh(x @ w[0] + w[1]) @ w[2] - y) ** 2.0)

    def once(backend: str) -> tuple[list[int], bytes]:
        meta = [ml.Weight(v.copy(), optimizer=ml.optim.sgd(0.01)) for v in init]

        @ml.direct
        async def task(x: ml.Array, y: ml.Array) -> ml.ScalarLayer:
            moved = [np.zeros_like(w.data) for w in meta]
            for _ in range(3):
                fast = [w - 0.02 * g for w, g in zip(meta, moved, strict=True)]
                grads = await ml.gradients(loss(fast, x, y), meta)
                moved = [g + d for g, d in zip(moved, grads, strict=True)]
            return loss([w - 0.02 * g for w, g in zip(meta, moved, strict=True)], -x, y)

        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(yield_interval_s=1e-6):
            anyio.run(ml.mean(ml.stack([task(x, y) for x, y in tasks])).train, backend=backend)
        merges = [int(r.getMessage().split()[3]) for r in caplog.records if r.getMessage().startswith("a merge of")]
        return merges, b"".join(w.data.tobytes() for w in meta)

    reference = once("asyncio")
    assert reference[0] == [12]
    for backend in ("asyncio", "trio", "asyncio", "trio"):
        assert once(backend) == reference


class _Stop(BaseException):
    """Not an Exception, nor a cancellation: as Ctrl-C's KeyboardInterrupt, or SystemExit."""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("way", ["monadic", "direct"])
def test_a_base_exception_in_an_examples_code_surfaces_as_itself(backend: str, way: str) -> None:
    # It came out of the driver's task group as a BaseExceptionGroup (a KeyboardInterrupt on trio).
    import anyio

    model = Walk()
    before = [w.data.copy() for w in model.weights()]

    @ml.direct
    async def stops() -> ml.ScalarLayer:
        await model.step(model.inputs[0], True)
        raise _Stop

    def stops_monadic() -> ml.ScalarLayer:
        def stop(tape: Any) -> Any:
            raise _Stop

        return ml.Layer(model.step(model.inputs[0], True).forward().bind(stop))

    examples = [getattr(model, way)(x) for x in model.inputs[1:4]]
    loss = ml.sum(ml.stack([*examples, stops() if way == "direct" else stops_monadic()]))
    with pytest.raises(_Stop):
        anyio.run(loss.train, backend=backend)
    for old, w in zip(before, model.weights()):
        assert np.array_equal(old, w.data)


def test_what_is_built_on_the_examples_bind_layers_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each example picks its input with `bind`; its RNN is built on that layer, outside
    # the continuation: the graph of the batch holds the bind layers, and what was built
    # on them ran node by node once they were computed (0 of 400 cells batched).
    import anyio

    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(4, 4)) / 2)
    u = ml.Weight(rng.normal(size=(4, 4)) / 2)
    cell = ml.operation(lambda x, h: ml.tanh(x @ w + h @ u))

    def example(i: int) -> ml.ScalarLayer:
        x = ml.as_layer(np.full((1, 4), 0.1 * i))
        picked = ml.Layer(x.forward().bind(lambda t: (x * 2.0 if t.data.sum() > 1 else x * -1.0).forward()))
        h: Any = np.zeros((1, 4))
        for _ in range(6):
            h = cell(picked, h)
        return ml.sum(h * h)

    cells: list[int] = []  # the members of each group of cells that ran batched
    group = batched_run.Run.group

    def counting(self: Any, members: list[Any], numbers_stack: bool = True) -> None:
        before = self.batches
        group(self, members, numbers_stack)
        if self.batches > before and "lambda" in members[0]._op.name:
            cells.append(len(members))

    monkeypatch.setattr(batched_run.Run, "group", counting)
    results = {}
    for batching in (False, None):
        with ml.settings(batching=batching):
            results[batching] = anyio.run(ml.gradients, ml.sum(ml.stack([example(i) for i in range(48)])), [w, u])
    assert cells == [48] * 6  # each step's cells, one group, after the bind layers (MIN_NODES: 256)
    for a, b in zip(results[None], results[False]):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_a_weight_lifted_by_as_layer_batches_as_the_weight_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # A parser's learned start vector, lifted with `ml.as_layer(start)`, was a layer built
    # from a Do: every graph holding it ran alone, one example at a time, never merged (145
    # of a new user's 356 step graphs), and the log blamed MIN_NODES. It is one primitive
    # node of the weight now, which the examples share as they share the weight.
    import anyio

    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(6, 6)) / 2, optimizer=ml.optim.sgd(0.1))
    start = ml.Weight(rng.normal(size=(1, 6)), optimizer=ml.optim.sgd(0.1))
    xs = [rng.normal(size=(1, 6)) for _ in range(16)]

    def example(x: ml.Array, lift: bool) -> ml.ScalarLayer:
        @ml.direct
        async def run() -> ml.ScalarLayer:
            h = ml.tanh(((ml.as_layer(start) if lift else start) + x) @ w)
            for _ in range(STEPS):
                value = await h
                h = ml.tanh(h @ w) if value.sum() > 0 else ml.tanh(-h @ w)
            return ml.sum(h * h)

        return run()

    parked: list[int] = []  # the graphs of each merged run
    run = fibers.run

    def counting(ev: Any, waiting: fibers.Parked) -> Generator[Any, Any, list[Any]]:
        parked.append(len(waiting.orders))
        return (yield from run(ev, waiting))

    products: list[int] = []  # the members of each group of products that ran batched
    group = batched_run.Run.group

    def grouping(self: Any, members: list[Any], numbers_stack: bool = True) -> None:
        before = self.batches
        group(self, members, numbers_stack)
        if self.batches > before and members[0]._op.name == "matmul":
            products.append(len(members))

    monkeypatch.setattr(fibers, "run", counting)
    monkeypatch.setattr(batched_run.Run, "group", grouping)

    def loss(lift: bool) -> ml.ScalarLayer:
        return ml.sum(ml.stack([example(x, lift) for x in xs]))

    value, grads = anyio.run(ml.value_and_gradients, loss(True))
    assert parked == [16] * (STEPS + 1)  # every example's graphs in every merge: the first steps too
    assert sum(products) == 16 * (STEPS + 1)  # (the first product, then one a step: in groups by path)
    lifted = (parked.copy(), products.copy())
    parked.clear()
    products.clear()
    want_value, want = anyio.run(ml.value_and_gradients, loss(False))
    assert (parked, products) == lifted  # batched as the weight itself is
    assert value == pytest.approx(want_value, rel=1e-13)
    for weight in (w, start):
        np.testing.assert_allclose(grads[weight], want[weight], rtol=1e-12)
    before = [w.data, start.data]
    anyio.run(loss(True).train)
    stepped = [w.data, start.data]
    w.data, start.data = before
    anyio.run(loss(False).train)
    for a, b in zip(stepped, [w.data, start.data]):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_a_graph_holding_a_layer_built_from_a_do_merges_after_it(caplog: pytest.LogCaptureFixture) -> None:
    # Each example's graph holding a layer built from a Do (here an object's own forward()
    # lifted) ran alone, node by node, never merged with the other examples' (a DEBUG
    # line said so, one an example). Its Do layers are evaluated first now, and what it
    # builds on them parks and merges: one merged run, batched, the same values.
    import anyio

    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(4, 4)) / 2)
    start = ml.Weight(rng.normal(size=(1, 4)))
    xs = [rng.normal(size=(1, 4)) for _ in range(12)]

    def example(x: ml.Array) -> ml.ScalarLayer:
        @ml.direct
        async def run() -> ml.ScalarLayer:
            h = ml.Layer(start.forward())
            h = ml.tanh((h + x) @ w)  # MERGED-AFTER
            value = await h
            return ml.sum(h if value.sum() > 0 else -h)

        return run()

    results = {}
    for batching in (None, True, False):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=batching):
            value, grads = anyio.run(ml.value_and_gradients, ml.sum(ml.stack([example(x) for x in xs])))
            results[batching] = (value, [grads[w], grads[start]])
        said = [r.getMessage() for r in caplog.records]
        assert not [m for m in said if "not merged" in m or "(alone: it holds" in m]
        if batching is not False:
            merges = [m for m in said if m.startswith("a merge of 12 fibers' graphs")]
            assert merges[0].endswith(f"the last built at {HERE}:{line_of('MERGED-AFTER')}) runs batched")
    for batching in (None, True):
        assert results[batching][0] == pytest.approx(results[False][0], rel=1e-13)
        for a, b in zip(results[batching][1], results[False][1]):
            np.testing.assert_allclose(a, b, rtol=1e-12)
    want = 0.0
    for x in xs:
        h = np.tanh((start.data + x) @ w.data)
        want += float(np.sum(h if h.sum() > 0 else -h))
    assert results[None][0] == pytest.approx(want, rel=1e-13)


def test_a_recursion_of_direct_calls_merges_each_level_across_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tree decoder written as a recursive @ml.direct function (each call reads its node's
    # scores, then returns its loss plus its children's calls) ran each node's loss alone,
    # node by node: a graph holding the children's calls never parked. Each level's losses
    # of all the trees now run in one merged run, with equal values and gradients.
    import anyio

    rng = np.random.default_rng(1)
    w = ml.Weight(rng.normal(size=(3, 3)) / 2)

    @ml.direct
    async def node(h: ml.ArrayLayer, depth: int) -> ml.ScalarLayer:
        scores = ml.tanh(h @ w)
        value = await scores
        loss = ml.sum(scores * scores)
        if depth < 3 and value[0, 0] > -0.9:
            loss = loss + node(scores, depth + 1) + node(-scores, depth + 1)
        return loss

    xs = [rng.normal(size=(1, 3)) for _ in range(10)]
    sizes: list[int] = []
    run = fibers.run

    def counting(ev: Any, waiting: fibers.Parked) -> Generator[Any, Any, list[Any]]:
        sizes.append(len(waiting.orders))
        return (yield from run(ev, waiting))

    monkeypatch.setattr(fibers, "run", counting)
    value, grads = anyio.run(ml.value_and_gradients, ml.sum(ml.stack([node(ml.as_layer(x), 0) for x in xs])))
    # Each level's reads, down (every node has two children here), then each level's losses
    # back up, all ten trees' in one run (before: those ran alone, a graph a node).
    assert sizes == [10, 20, 40, 80, 80, 40, 20, 10]
    want_value, want = 0.0, []
    for x in xs:  # each tree alone
        v, g = anyio.run(ml.value_and_gradients, node(ml.as_layer(x), 0))
        want_value += float(v)
        want.append(g[w])
    assert float(value) == pytest.approx(want_value, rel=1e-12)
    np.testing.assert_allclose(grads[w], sum(want), rtol=1e-10)


def test_fibers_nested_deeper_than_pythons_recursion_limit_park() -> None:
    # Where a fiber sits (its branch's slots from the root, which orders a merge) was
    # found recursively, a frame a level: 1,200 nested direct-style calls raised RecursionError.
    import anyio

    w = ml.Weight(np.array([0.5, -0.25]))
    one = ml.as_layer(np.float64(1.0))

    @ml.direct
    async def leaf(k: int) -> ml.Expr[Any, Any]:
        if k > 2:
            return w  # (no graph: only the deepest fibers park)
        h = w * float(k)
        v = await h
        return ml.sum(h) * (1.0 if v[0] > 0 else -1.0)

    @ml.direct
    async def nested(k: int) -> ml.ScalarLayer:
        if k == 0:
            return ml.sum(w * 3.0)
        a, b = await ml.values(nested(k - 1), leaf(k))
        return one * float(a + float(np.sum(b)))

    for batching in (False, None):
        with ml.settings(batching=batching):
            assert anyio.run(nested(1200).predict) == 301.0


def test_a_merge_of_few_graphs_ending_at_one_line_runs_node_by_node(caplog: pytest.LogCaptureFixture) -> None:
    # 16 examples of lengths 1 to 6 that read their state every 4 steps: the short ones park their whole
    # graphs, which end elsewhere and share few signatures; counted by examples the merge batched (54 of
    # 218 nodes grouped) and ran 8-18% slower than node by node (a new user's early-stopping RNN).
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((8, 8)) / 8)
    seqs = [[rng.standard_normal((1, 8)) for _ in range(1 + i % 6)] for i in range(16)]

    @ml.direct
    async def example(seq: list[Any]) -> ml.ScalarLayer:
        h: Any = ml.as_layer(np.zeros((1, 8)))
        for i, x in enumerate(seq):
            h = ml.tanh(x @ w + h @ w)
            if i % 4 == 3:
                await ml.values(h)
        return ml.sum(h * h)

    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    value = anyio.run(ml.sum(ml.stack([example(s) for s in seqs])).predict)
    with ml.settings(batching=False):
        assert anyio.run(ml.sum(ml.stack([example(s) for s in seqs])).predict) == pytest.approx(value, rel=1e-12)
    said = [r.getMessage() for r in caplog.records if "a merge of 16 fibers' graphs" in r.getMessage()]
    assert said and all("9 of them alike (ending at one line, or a model's steps), fewer than 10" in m for m in said)


def test_examples_reading_a_node_built_on_either_of_two_lines_merge(caplog: pytest.LogCaptureFixture) -> None:
    # 16 examples read one await, the node read built on one of two lines (an if/else): counted by the
    # lines that built their graphs' last nodes, 8 and 8, their merges ran node by node (a review's find);
    # as a model's steps they are alike.
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((8, 8)) / 8)
    xs = [rng.standard_normal((1, 8)) for _ in range(16)]

    @ml.direct
    async def example(x: Any, k: int) -> ml.ScalarLayer:
        h: Any = x
        for _ in range(4):
            h = ml.tanh(h @ w + x) if k % 2 else ml.relu(h @ w + x)
            await h
        return ml.sum(h)

    def loss() -> Any:
        return ml.sum(ml.stack([example(x, k) for k, x in enumerate(xs)]))

    anyio.run(ml.gradients, loss(), [w])  # (the first evaluation learns which graphs are steps)
    caplog.set_level(logging.DEBUG, logger="monadl.batching")
    anyio.run(ml.gradients, loss(), [w])
    said = [r.getMessage() for r in caplog.records if "fibers' graphs" in r.getMessage()]
    assert said and not any("fewer than 10 (MIN_MERGED)" in m for m in said if "a merge of 16" in m), said
    assert any(m.startswith("a merge of 16 fibers' graphs") and "runs batched" in m for m in said), said


def test_graphs_that_wait_for_a_do_layer_another_example_evaluates_merge_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Six examples' graphs hold one shared layer built from a Do, which the first to reach it
    # evaluates (it sleeps): the other five waited for it, then ran their rest alone, inline,
    # unmerged (a reviewer's). All six rests now run as one merged run.
    import anyio
    import anyio.lowlevel

    rng = np.random.default_rng(5)
    w = ml.Weight(rng.normal(size=(3, 3)) / 2)

    @ml.direct
    async def shared_fn() -> ml.ScalarLayer:
        g = ml.tanh(ml.as_layer(np.ones((1, 3))) @ w)
        await anyio.lowlevel.checkpoint()  # (still being evaluated when the other examples' graphs reach it)
        return ml.sum(g)

    shared = shared_fn()

    def example(x: ml.Array) -> ml.ScalarLayer:
        @ml.direct
        async def run() -> ml.ScalarLayer:
            h = ml.tanh(ml.as_layer(x) @ w)
            await h
            return shared * ml.sum(ml.tanh(h @ w) @ w) + ml.sum(h @ w)

        return run()

    sizes: list[list[int]] = []
    run = fibers.run

    def counting(ev: Any, waiting: fibers.Parked) -> Generator[Any, Any, list[Any]]:
        sizes.append([len(order) for order in waiting.orders])
        return (yield from run(ev, waiting))

    monkeypatch.setattr(fibers, "run", counting)
    xs = [rng.normal(size=(1, 3)) for _ in range(6)]
    value = anyio.run(ml.sum(ml.stack([example(x) for x in xs])).predict)
    assert sizes == [[3] * 6, [8] * 6]
    s = float(np.sum(np.tanh(np.ones((1, 3)) @ w.data)))
    want = 0.0
    for x in xs:
        h = np.tanh(x @ w.data)
        want += s * float(np.sum(np.tanh(h @ w.data) @ w.data)) + float(np.sum(h @ w.data))
    assert float(value) == pytest.approx(want, rel=1e-12)
