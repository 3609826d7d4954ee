"""Training semantics: the paper's listing, diamonds, stack safety, one step
per train(), and nothing changed by a failed step."""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import monadl as ml


def test_guess_next_number_listing_converges() -> None:
    np.random.seed(0)
    sys.modules.pop("examples.guess_next_number", None)
    example = importlib.import_module("examples.guess_next_number")
    guess = anyio.run(example.main)
    assert abs(guess - 45.0) < 0.5


def probe(layer: ml.ScalarLayer, calls: list[int]) -> ml.ScalarLayer:
    """The same value as ``layer``; counts how often its backward runs."""

    def wrap(tape: ml.Tape[float, float]) -> ml.Tape[float, float]:
        inner = tape.backward
        assert inner is not None

        def backward(delta: float) -> None:
            calls.append(1)
            inner(delta)

        return ml.Tape(tape.data, backward)

    return ml.Layer(layer.forward().map(wrap))


@pytest.mark.anyio
async def test_paper_diamond_runs_each_backward_once() -> None:
    x, w0 = 0.7, 1.3
    w = ml.Weight(w0, optimizer=ml.optim.sgd(1e-3))
    calls0: list[int] = []
    calls1: list[int] = []
    calls2: list[int] = []
    y0 = probe(x * w, calls0)
    y1 = probe(y0 * y0, calls1)
    y2 = probe(y1 * y1, calls2)
    [grad] = await ml.gradients(y2, [w])
    assert (len(calls0), len(calls1), len(calls2)) == (1, 1, 1)
    assert grad == pytest.approx(4 * x**4 * w0**3, rel=1e-12)
    await y2.train()
    assert (len(calls0), len(calls1), len(calls2)) == (2, 2, 2)
    assert w.data == pytest.approx(w0 - 1e-3 * 4 * x**4 * w0**3, rel=1e-12)


def nested_diamond(w: ml.ScalarWeight, depth: int, calls: list[int]) -> ml.ScalarLayer:
    y: ml.ScalarLayer = probe(w * 1.0, calls)
    for _ in range(depth):
        y = probe(y * y, calls)
    return y


@pytest.mark.anyio
async def test_nested_diamonds_cost_linear_work() -> None:
    seconds = {}
    for depth in (10, 20, 40):
        w = ml.Weight(1.0)
        calls: list[int] = []
        [grad] = await ml.gradients(nested_diamond(w, depth, calls), [w])
        assert grad == 2.0**depth  # d/dw w**(2**depth) at w = 1
        assert len(calls) == depth + 1  # one backward per node
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            await ml.gradients(nested_diamond(w, depth, []), [w])
            best = min(best, time.perf_counter() - t0)
        seconds[depth] = best
    # Linear: 4x the depth costs about 4x (exponential would be 2**30 x).
    assert seconds[40] < 12 * seconds[10]


def random_dag(ws: list[ml.ArrayWeight], rng: np.random.Generator, size: int) -> list[ml.ArrayLayer]:
    """Layers that each use two earlier ones, picked at random: shared nodes
    whose consumers sit at many depths."""
    nodes: list[ml.ArrayLayer] = [w * 1.0 for w in ws]
    for i in range(size):
        a, b = (nodes[j] for j in rng.integers(0, len(nodes), 2))
        nodes.append(ml.tanh(a * b) if i % 3 == 0 else a + 0.5 * b if i % 3 == 1 else ml.sigmoid(a - b))
    return nodes


@pytest.mark.anyio
async def test_pure_graph_backward_equals_the_reference_counted_release() -> None:
    # A graph of primitives only is back-propagated in one reverse pass over
    # its records; a layer built from a Do anywhere in it makes the runtime
    # release by reference counts instead. Both must give the same gradients.
    rng = np.random.default_rng(3)
    ws = [ml.Weight(rng.standard_normal(3)) for _ in range(3)]
    nodes = random_dag(ws, rng, 60)
    pure = ml.sum(nodes[-1] + nodes[-7] * nodes[len(ws)])
    counted = ml.sum(nodes[-1] + nodes[-7] * ml.Layer(nodes[len(ws)].forward().map(lambda t: t)))
    grads_pure = await ml.gradients(pure, ws)
    grads_counted = await ml.gradients(counted, ws)
    for a, b in zip(grads_pure, grads_counted):
        np.testing.assert_allclose(a, b, rtol=1e-13)  # the deltas may be summed in another order
    eps = 1e-6  # and the pure pass against central differences, one coordinate
    original = ws[0].data.copy()
    values = []
    for sign in (1, -1):
        ws[0]._data = original + sign * eps * np.array([1.0, 0.0, 0.0])
        values.append(await pure.predict())
    ws[0]._data = original
    assert grads_pure[0][0] == pytest.approx((values[0] - values[1]) / (2 * eps), rel=1e-6)


@pytest.mark.anyio
async def test_a_layer_whose_value_is_a_python_number_gets_a_summed_delta_from_an_array() -> None:
    # Beside a plain number an array's delta needs no unbroadcasting; beside
    # a layer whose value happens to be a Python float, the float's does.
    w = ml.Weight(2.0)
    as_float = ml.Layer(w.forward().map(lambda t: ml.Tape(float(t.data), t.backward)))
    [grad] = await ml.gradients(ml.sum(as_float * np.array([1.0, 3.0]) + 1.5 * as_float), [w])
    assert np.shape(grad) == () and grad == 7.0  # 1 + 3, and 1.5 for each of the 2 elements


@pytest.mark.anyio
@pytest.mark.parametrize("optimizer", [ml.optim.sgd(0.1), ml.optim.momentum(0.1, 0.9), ml.optim.adam(0.1)])
async def test_a_step_leaves_the_old_weight_array_as_it_was(optimizer: ml.optim.GradientTransformation) -> None:
    # A step may add the optimizer's fresh update in place (to save an array),
    # never into the weight's old array, its gradient or the optimizer's state.
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((128, 128)), optimizer=optimizer)  # 128 kB: large enough to be stepped in place
    x = rng.standard_normal((128, 128))
    before = w.data
    copies = [before.copy()]
    for _ in range(3):
        await ml.sum(w * x).train()
        np.testing.assert_array_equal(before, copies[0])
        copies.append(w.data.copy())
    # and the steps are the optimizer's: compare with its update applied by hand
    state = optimizer.init(copies[0])
    expected = copies[0]
    for step in range(3):
        update, state = optimizer.update(x.copy(), state, expected)
        expected = expected + update
        np.testing.assert_allclose(copies[step + 1], expected, rtol=1e-12)


@pytest.mark.anyio
async def test_gc_is_paused_while_the_runtime_computes_and_restored_after() -> None:
    import gc

    seen: list[bool] = []
    w = ml.Weight(2.0, optimizer=ml.optim.sgd(0.1))

    def look(tape: ml.Tape[float, float]) -> ml.Tape[float, float]:
        seen.append(gc.isenabled())
        return tape

    model = ml.Layer((w * w).forward().map(look)) * 3.0
    assert gc.isenabled()
    await model.train()
    assert seen == [False] and gc.isenabled()
    with ml.settings(pause_gc=False):
        await model.train()
    assert seen == [False, True] and gc.isenabled()
    gc.disable()  # a caller's own choice stands
    try:
        await model.train()
        assert seen == [False, True, False] and not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.anyio
async def test_chain_of_100000_operations_trains() -> None:
    w = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.1))
    y: ml.ArrayLayer = w * 1.0
    for _ in range(100_000):
        y = y * 1.0
    loss = await ml.sum(y).train()
    assert loss == 4.0
    np.testing.assert_allclose(w.data, 0.9)


@pytest.mark.anyio
async def test_chain_of_layers_from_do_and_binds_is_stack_safe() -> None:
    w = ml.Weight(2.0, optimizer=ml.optim.sgd(0.5))
    y: ml.ScalarLayer = w * 1.0
    for _ in range(20_000):
        y = ml.Layer(y.forward().map(lambda t: t))
    assert await y.train() == 2.0
    assert w.data == 1.5
    d: ml.Do[int] = ml.Do.pure(0)
    for _ in range(100_000):
        d = d.bind(lambda v: ml.Do.pure(v + 1))
    assert await d.run() == 100_000


@pytest.mark.anyio
async def test_weight_used_five_times_takes_one_step() -> None:
    lr = 0.01
    w = ml.Weight(np.array([1.0, -2.0]), optimizer=ml.optim.sgd(lr))
    xs = [np.array([float(i), 1.0 + i]) for i in range(5)]
    loss = ml.sum(w * xs[0])
    for x in xs[1:]:
        loss = loss + ml.sum(w * x)
    await loss.train()
    np.testing.assert_allclose(w.data, np.array([1.0, -2.0]) - lr * sum(xs), rtol=1e-15)


@pytest.mark.anyio
async def test_subgraph_without_weights_computes_no_delta() -> None:
    calls: list[int] = []
    w = ml.Weight(2.0)

    def counting(tape: ml.Tape[float, float]) -> ml.Tape[float, float]:
        assert tape.backward is None  # nothing upstream to train
        return tape

    constant_branch = ml.Layer((ml.exp(ml.Layer(ml.Do.pure(ml.Tape(1.0)))) * 3.0).forward().map(counting))
    [grad] = await ml.gradients(probe(w * constant_branch, calls), [w])
    assert grad == pytest.approx(3.0 * np.e)


# ---- failures --------------------------------------------------------------------------
class Boom(Exception):
    pass


def own_threads() -> set[str]:
    """Live threads, less trio's idle thread cache (a worker that trio keeps
    for reuse; a standalone run of these steps shows none)."""
    return {t.name for t in threading.enumerate() if not t.name.startswith("Trio thread")}


def weights_and_snapshot() -> tuple[list[ml.ArrayWeight], list[Any]]:
    rng = np.random.default_rng(0)
    ws = [ml.Weight(rng.standard_normal(3), optimizer=ml.optim.adam(0.1)) for _ in range(3)]
    return ws, [(w.data.copy(), w._state) for w in ws]


def assert_unchanged(ws: list[ml.ArrayWeight], snapshot: list[Any]) -> None:
    for w, (data, state) in zip(ws, snapshot):
        assert w.data.tobytes() == data.tobytes()
        assert w._state is state


def tracked_resource(log: list[str], name: str) -> ml.Do[float]:
    async def acquire() -> float:
        log.append(f"open {name}")
        return 1.0

    async def release(value: float) -> None:
        log.append(f"close {name}")

    return ml.Do.resource(acquire, release)


def scalar_layer(do: ml.Do[float]) -> ml.ScalarLayer:
    return ml.Layer(do.map(lambda v: ml.Tape(v)))


@pytest.mark.anyio
async def test_exception_in_forward_changes_nothing_and_surfaces() -> None:
    ws, snap = weights_and_snapshot()
    log: list[str] = []
    error = Boom("forward")

    def fail(_: object) -> ml.Tape[float, float]:
        raise error

    good = ml.sum(ws[0] * ws[1]) * scalar_layer(tracked_resource(log, "a"))
    bad = ml.Layer(ml.Do.pure(0).map(fail))
    threads = own_threads()
    with pytest.raises(Boom) as info:
        await (good + ml.sum(ws[2]) * bad).train()
    assert info.value is error
    assert log == ["open a", "close a"]
    assert_unchanged(ws, snap)
    assert own_threads() == threads


@pytest.mark.anyio
async def test_exception_in_backward_changes_nothing_and_surfaces() -> None:
    ws, snap = weights_and_snapshot()
    log: list[str] = []
    error = Boom("backward")

    def poison(tape: ml.Tape[Any, Any]) -> ml.Tape[Any, Any]:
        def backward(delta: Any) -> None:
            raise error

        return ml.Tape(tape.data, backward)

    poisoned = ml.Layer(ml.sum(ws[2] * 2.0).forward().map(poison))
    loss = ml.sum(ws[0] * ws[1]) * scalar_layer(tracked_resource(log, "a")) + poisoned
    with pytest.raises(Boom) as info:
        await loss.train()
    assert info.value is error
    assert log == ["open a", "close a"]
    assert_unchanged(ws, snap)
    # The same weights still train normally afterwards.
    await (ml.sum(ws[0] * ws[1]) + ml.sum(ws[2])).train()
    assert not np.array_equal(ws[2].data, snap[2][0])


@pytest.mark.anyio
async def test_cancellation_mid_train_changes_nothing() -> None:
    ws, snap = weights_and_snapshot()
    log: list[str] = []

    async def slow() -> float:
        log.append("slow started")
        await anyio.sleep(10)
        return 1.0

    loss = ml.sum(ws[0] * ws[1]) * scalar_layer(tracked_resource(log, "a")) * scalar_layer(ml.Do.from_async(slow))
    threads = own_threads()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await loss.train()
    # the two effects run concurrently, so either may start first; the resource is closed after
    assert sorted(log[:2]) == ["open a", "slow started"] and log[2:] == ["close a"]
    assert_unchanged(ws, snap)
    assert own_threads() == threads


@pytest.mark.anyio
async def test_failing_optimizer_update_changes_no_weight() -> None:
    def update(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        raise Boom("update")

    bad = ml.optim.GradientTransformation(lambda p: None, update)
    ws, snap = weights_and_snapshot()
    broken = ml.Weight(np.ones(3), optimizer=bad)
    with pytest.raises(Boom):
        await (ml.sum(ws[0] * ws[1]) + ml.sum(ws[2] * broken)).train()
    assert_unchanged(ws, snap)


@pytest.mark.anyio
async def test_predict_changes_nothing() -> None:
    ws, snap = weights_and_snapshot()
    value = await ml.sum(ws[0] * ws[1]).predict()
    assert value == pytest.approx(float(np.dot(snap[0][0], snap[1][0])))
    assert_unchanged(ws, snap)


@pytest.mark.anyio
async def test_train_returns_the_loss_and_steps_every_weight() -> None:
    a = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    b = ml.Weight(3.0, optimizer=ml.optim.sgd(0.1))
    loss = await (ml.sum(a * a) * b).train()
    assert loss == 15.0
    np.testing.assert_allclose(a.data, [1.0 - 0.1 * 6.0, 2.0 - 0.1 * 12.0])
    assert b.data == pytest.approx(3.0 - 0.1 * 5.0)


@pytest.mark.anyio
async def test_an_infinite_loss_still_seeds_a_finite_delta() -> None:
    w = ml.Weight(np.array([1.0, 2.0]))
    with np.errstate(divide="ignore"):
        loss = ml.sum(w * 0.0 - ml.log(np.array([0.0, 1.0])))  # +inf, from a constant
        [grad] = await ml.gradients(loss, [w])
    np.testing.assert_array_equal(grad, [0.0, 0.0])


def test_sync_entry_refuses_an_effect() -> None:
    async def value() -> float:
        return 1.0

    from monadl.runtime import entry

    layer = scalar_layer(ml.Do.from_async(value))
    with pytest.raises(RuntimeError, match="inside an event loop"):
        entry.predict_sync(layer)


Step = Callable[[], Any]


def test_process_tuning_waits_for_the_first_use_and_respects_the_setting() -> None:
    import subprocess
    import sys

    from monadl.runtime.process import GC_THRESHOLD

    program = """
import gc, anyio, numpy as np, monadl as ml
from monadl.runtime import process
before = gc.get_threshold()[0]
w = ml.Weight(np.ones(2))
assert not process.malloc_tuned and gc.get_threshold()[0] == before, "import changed the process"
with ml.settings(tune_process=TUNE):
    anyio.run((ml.sum(w * w)).predict)
print(gc.get_threshold()[0], process._malloc_tried)
"""
    outputs = [
        subprocess.run(
            [sys.executable, "-c", program.replace("TUNE", flag)], capture_output=True, text=True, check=True
        ).stdout.split()
        for flag in ("True", "False")
    ]
    assert outputs[0] == [str(GC_THRESHOLD), "True"]  # tuned on the first predict()
    assert outputs[1] == ["700", "False"]  # CPython's default, untouched


def test_a_loop_of_gradients_alone_tunes_the_process_as_train_does() -> None:
    # The clipping recipe (value_and_gradients, clip, apply_gradients) calls neither train() nor
    # predict(): the collector stayed at 700 and a new user's LSTM step ran 1.7-4x slower.
    import subprocess
    import sys

    from monadl.runtime.process import GC_THRESHOLD

    program = """
import gc, anyio, numpy as np, monadl as ml
from monadl.runtime import process
w = ml.Weight(np.ones(2))
value, grads = anyio.run(ml.value_and_gradients, ml.sum(w * w))
grads = ml.optim.clip_by_global_norm(grads, 1.0)
ml.optim.apply_gradients(grads)
print(gc.get_threshold()[0], process._malloc_tried)
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(GC_THRESHOLD), "True"]


def test_the_collector_threshold_follows_the_largest_graph_so_that_a_loop_over_it_collects_nothing() -> None:
    import subprocess
    import sys

    from monadl.runtime.process import GC_PER_NODE

    program = """
import gc, anyio, numpy as np, monadl as ml
w = ml.Weight(np.ones(2))
def chain():
    x = ml.as_layer(w)
    for _ in range(20_000):
        x = x * 1.0
    return ml.sum(x)
with ml.settings(tune_process=TUNE):
    anyio.run(chain().train)
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(phase) if phase == "start" else None)
    anyio.run(chain().train)  # the same graph again, as a training loop builds and trains it
    print(gc.get_threshold()[0], len(collections))
"""
    outputs = [
        subprocess.run(
            [sys.executable, "-c", program.replace("TUNE", flag)], capture_output=True, text=True, check=True
        ).stdout.split()
        for flag in ("True", "False")
    ]
    assert int(outputs[0][0]) >= 20_000 * GC_PER_NODE and outputs[0][1] == "0"
    assert outputs[1][0] == "700" and int(outputs[1][1]) > 20  # untouched: CPython's collections, while it builds


def test_an_example_failed_or_cancelled_in_a_foreign_await_frees_its_evaluation_without_a_collection() -> None:
    """A failure or a cancellation thrown into a direct-style coroutine at its
    own await (a sleep, a service call) and raised again was held by the
    interpreter's frame and the step's, which its traceback holds: each such
    evaluation's records waited for a full collection (a reviewer's count:
    20 more every 10 cancelled predicts)."""
    import gc

    from monadl.runtime.evaluation import Record

    def records() -> int:
        return sum(type(o) is Record for o in gc.get_objects())

    w = ml.Weight(np.ones(3))

    async def service() -> None:
        await anyio.lowlevel.checkpoint()
        raise ConnectionError("the service is down")

    @ml.direct
    async def example(fail: bool) -> ml.ScalarLayer:
        x = ml.sum(w * 2.0)
        await ml.values(x)
        if fail:
            await service()
        await anyio.sleep(10)
        return x

    async def steps() -> list[int]:
        counts = [records()]
        for _ in range(3):
            for _ in range(5):
                with anyio.move_on_after(0.01):
                    await example(False).predict()
                with pytest.raises(ConnectionError):
                    await example(True).predict()
            counts.append(records())
        return counts

    gc.collect()
    gc.disable()
    try:
        counts = anyio.run(steps)
    finally:
        gc.enable()
    assert counts == [counts[0]] * 4


def test_a_failed_or_cancelled_step_frees_its_evaluation_without_a_collection() -> None:
    """The failure was held by the driver's frame, which its traceback holds:
    a cycle that kept the evaluation's records and arrays until a full
    collection (the tuned collector runs one rarely: a new user's 60 failed
    steps held 4 GiB, 60 cancelled ones 8 GiB)."""
    import contextlib
    import gc

    from monadl.runtime.evaluation import Record

    def records() -> int:
        return sum(type(o) is Record for o in gc.get_objects())

    w = ml.Weight(np.ones((3, 5)), optimizer=ml.optim.sgd(0.1))
    x = np.ones((4, 3))

    @ml.direct
    async def refused(x: ml.Array) -> ml.ScalarLayer:
        h = ml.tanh(ml.dense(x, w))
        await ml.values(h)
        raise ValueError("a data check refused this batch")

    @ml.direct
    async def ok(x: ml.Array) -> ml.ScalarLayer:
        h = ml.tanh(ml.dense(x, w))
        await ml.values(h)
        return ml.sum(h)

    async def steps() -> list[int]:  # (a loop of steps in one event loop: a failed run of one holds its own cycle)
        counts = [records()]
        for _ in range(3):
            with contextlib.suppress(ml.ShapeError):
                await ml.sum(ml.tanh(x @ w) @ w).train()  # (the second product does not fit)
            with contextlib.suppress(ValueError):
                await refused(x).train()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await ml.sum(ml.tanh(x @ w)).train()
            with contextlib.suppress(ValueError):  # (examples evaluated together, one failing)
                await ml.sum(ml.stack([refused(x), ok(x)])).train()
            await ml.sum(ml.stack([ok(x), ok(x)])).train()  # (and succeeding: their contexts hold the evaluation)
            counts.append(records())
        return counts

    gc.collect()
    gc.disable()
    try:
        counts = anyio.run(steps)
    finally:
        gc.enable()
    assert counts == [counts[0]] * 4
