"""Forking: coarse independent branches run on the worker pool, fine ones never
do, a coarse graph runs the faster of the two ways, results match one thread,
and a branch's exception surfaces as itself."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.layers._layer import Layer
from monadl.layers._primitives import Primitive
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.schedule import pool as _parallel

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def unmeasured() -> Iterator[None]:
    """Each test starts with no graph measured (the measurements are kept by
    the site that built a graph, and these tests reuse their sites)."""
    _parallel._costs.clear()
    yield
    _parallel._costs.clear()


class Probe:
    """An identity primitive that notes the thread it ran on, and can fail."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.error: BaseException | None = None
        self.primitive = Primitive("probe", self._rule)

    def _rule(self, a: Any) -> tuple[Any, tuple[Any, ...]]:
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        return a, (lambda g: g,)

    def __call__(self, x: ml.ArrayLayer) -> ml.ArrayLayer:
        return Layer._make(self.primitive, (x,))


def columns(x: ml.Array, ws: list[ml.ArrayWeight], probe: Probe) -> ml.ScalarLayer:
    outs = [probe(ml.relu(ml.tanh(x @ w) @ w.T)) for w in ws]
    total = outs[0]
    for out in outs[1:]:
        total = total + out
    return ml.mean(total * total)


def make(seed: int = 0) -> tuple[ml.Array, list[ml.ArrayWeight]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((128, 512))
    return x, [ml.Weight(rng.standard_normal((512, 512)) * 0.05, optimizer=ml.optim.sgd(0.1)) for _ in range(4)]


async def gradients(workers: int, probe: Probe) -> tuple[float, list[Any]]:
    x, ws = make()
    with ml.settings(workers=workers, fork_threshold_s=1e-4):
        for _ in range(3):  # the first two evaluations measure (only with workers > 1), the next may fork
            value = await columns(x, ws, probe).predict()
            grads = await ml.gradients(columns(x, ws, probe), ws)
    return float(value), grads


async def test_coarse_branches_fork_and_match_one_thread() -> None:
    one, two = Probe(), Probe()
    value1, grads1 = await gradients(1, one)
    value2, grads2 = await gradients(2, two)
    assert set(one.threads) == {"MainThread"}
    assert any(name.startswith("monadl-worker") for name in two.threads)
    assert value2 == pytest.approx(value1, rel=1e-12)
    for g1, g2 in zip(grads1, grads2):
        np.testing.assert_allclose(g2, g1, rtol=1e-10, atol=1e-14)


async def test_training_on_the_pool_steps_like_one_thread() -> None:
    results = []
    for workers in (1, 2):
        x, ws = make(1)
        with ml.settings(workers=workers, fork_threshold_s=1e-4):
            for _ in range(3):
                await columns(x, ws, Probe()).train()
        results.append([w.data for w in ws])
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-14)


async def test_fine_graphs_never_fork() -> None:
    probe = Probe()
    w = ml.Weight(np.ones((4, 4)))
    with ml.settings(workers=4):
        for _ in range(3):
            await ml.sum(probe(w * 2.0) + probe(w * 3.0)).train()
    assert set(probe.threads) == {"MainThread"}


async def test_branches_get_their_share_of_blas_even_where_the_main_thread_set_a_limit() -> None:
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    if not [info for info in controller.info() if info["user_api"] == "blas"]:
        pytest.skip("no BLAS library that threadpoolctl can see")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    seen: list[tuple[str, list[int]]] = []

    def rule(a: Any) -> tuple[Any, tuple[Any, ...]]:
        blas = [info["num_threads"] for info in controller.info() if info["user_api"] == "blas"]
        seen.append((threading.current_thread().name, blas))
        return a, (lambda g: g,)

    blas_probe = Primitive("blas_probe", rule)
    x, ws = make(3)
    # As a benchmark does: the main thread sets a limit first, and so (from
    # threadpoolctl 3.8) becomes the one thread whose limits OpenBLAS obeys.
    with controller.limit(limits=cores, user_api="blas"):
        with ml.settings(workers=2, fork_threshold_s=1e-4):
            for _ in range(4):  # two evaluations measure inline, the next two fork
                outs = [Layer._make(blas_probe, (ml.tanh(x @ w),)) for w in ws]
                await ml.sum(outs[0] + outs[1] + outs[2] + outs[3]).predict()
        after = [info["num_threads"] for info in controller.info() if info["user_api"] == "blas"]
    on_pool = [blas for name, blas in seen if name != "MainThread"]
    assert on_pool, "the graph never forked"
    assert all(n == max(1, cores // 2) for blas in on_pool for n in blas)
    assert after == [cores] * len(after)  # restored once the pool is done


class Boom(Exception):
    pass


async def test_exception_in_a_branch_surfaces_as_itself_and_changes_nothing() -> None:
    probe = Probe()
    x, ws = make(2)
    before = [w.data.copy() for w in ws]
    with ml.settings(workers=2, fork_threshold_s=1e-4):
        await columns(x, ws, probe).predict()  # measure: the next evaluation forks
        ws_after_predict = [w.data.copy() for w in ws]
        probe.error = Boom("in a branch")
        with pytest.raises(Boom) as info:
            await columns(x, ws, probe).train()
    assert info.value is probe.error
    assert not isinstance(info.value, BaseExceptionGroup)
    for b, a, w in zip(before, ws_after_predict, ws):
        assert w.data.tobytes() == b.tobytes() == a.tobytes()


def test_the_helpers_run_in_the_callers_context() -> None:
    """A helper thread sees the evaluation running (`READING`) and the
    settings, as the calling thread does: a backward of one's own run there
    that called train() was not refused (the refusal reads `READING`)."""
    from monadl.runtime.evaluation import READING

    ev = Evaluation(train=True)
    seen: list[tuple[str, Any, bool]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(3)

    def worker() -> None:
        barrier.wait(timeout=30)  # (each thread runs one: the helpers are in use at once)
        with lock:
            seen.append((threading.current_thread().name, READING.get(), ml.current_settings().check_finite))

    token = READING.set(ev)
    try:
        with ml.settings(check_finite=True):
            _parallel._run(3, worker)
    finally:
        READING.reset(token)
    assert len({name for name, _, _ in seen}) == 3
    assert all(reading is ev and finite for _, reading, finite in seen)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="workers"), ml.settings(workers=0):
        pass


# ---- the faster way ------------------------------------------------------------------------------
def test_a_coarse_graph_runs_the_faster_way_and_probes_the_other() -> None:
    w = ml.Weight(np.ones((2, 2)))
    order = [w * 2.0]  # one node stands for a graph here
    ev = Evaluation(train=False)  # fork threshold 1 ms: coarse from 2 ms of work

    def took(seconds: float, forked: bool = False) -> None:
        _parallel.measured(ev, order, seconds, forked)
        _parallel.settle(ev, 0.0)

    assert not _parallel.worth_forking(ev, order)  # never measured
    took(0.010)
    assert not _parallel.worth_forking(ev, order)  # one measurement may be first-touch costs
    took(0.008)
    assert _parallel.worth_forking(ev, order)  # coarse: try the pool
    assert not _parallel.worth_forking(Evaluation(train=True), order)  # training is timed apart
    took(0.012, forked=True)
    assert _parallel.worth_forking(ev, order)  # and again: a first fork starts threads
    took(0.009, forked=True)
    # 9 ms on the pool against 8 inline: inline, except every REPROBE-th time
    choices = [_parallel.worth_forking(ev, order) for _ in range(2 * _parallel.REPROBE)]
    assert choices.count(True) == 2
    assert choices[_parallel.REPROBE - 1] and choices[2 * _parallel.REPROBE - 1]
    took(0.003, forked=True)  # a probe finds the pool faster now, 2.7 times: inline once in 2 * REPROBE
    choices = [_parallel.worth_forking(ev, order) for _ in range(4 * _parallel.REPROBE)]
    assert choices.count(False) == 2
    took(0.060, forked=True)
    took(0.060, forked=True)  # six times slower on the pool (a batched graph, unbatched there)
    choices = [_parallel.worth_forking(ev, order) for _ in range(12 * _parallel.REPROBE)]
    assert choices.count(True) == 2  # once in 6 * REPROBE: a probe costs about 1/REPROBE of the time
    took(0.001)
    took(0.001)  # the graph became fine: inline, probes or not
    assert not any(_parallel.worth_forking(ev, order) for _ in range(2 * _parallel.REPROBE))


def test_a_trained_graph_is_judged_with_its_backward() -> None:
    w = ml.Weight(np.ones((2, 2)))
    order = [w * 2.0]
    ev = Evaluation(train=True)
    for forked, forward, backward in (
        (False, 0.004, 0.006),
        (False, 0.004, 0.006),
        (True, 0.003, 0.009),
        (True, 0.003, 0.009),
    ):
        _parallel.measured(ev, order, forward, forked)
        _parallel.settle(ev, backward)
    # the pool's forward is faster (3 ms against 4), the whole step slower (12 against 10)
    assert not _parallel.worth_forking(ev, order)


class Sleeper:
    """An identity primitive that sleeps (releasing the GIL, as a black-box
    call would) for ``seconds_on(thread name)``, and notes where it ran."""

    def __init__(self, seconds_on: Callable[[str], float]) -> None:
        self.seconds_on = seconds_on
        self.threads: list[str] = []
        self.primitive = Primitive("sleeper", self._rule)

    def _rule(self, a: Any) -> tuple[Any, tuple[Any, ...]]:
        name = threading.current_thread().name
        self.threads.append(name)
        time.sleep(self.seconds_on(name))
        return a, (lambda g: g,)

    def __call__(self, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return Layer._make(self.primitive, (x,))


async def run_branches(sleeper: Sleeper, evaluations: int) -> list[bool]:
    """Evaluate four sleeping branches; for each evaluation, whether it forked."""
    w = ml.Weight(np.ones(3))
    forked = []
    with ml.settings(workers=2):
        for _ in range(evaluations):
            sleeper.threads.clear()
            total = sleeper(w * 1.0) + sleeper(w * 2.0) + sleeper(w * 3.0) + sleeper(w * 4.0)
            assert float(await ml.sum(total).predict()) == 30.0
            forked.append(set(sleeper.threads) != {"MainThread"})
    return forked


async def test_branches_that_wait_keep_forking() -> None:
    forked = await run_branches(Sleeper(lambda name: 0.01), 12)  # 40 ms inline, about 20 on two workers
    assert forked[:2] == [False, False]  # measuring inline
    assert all(forked[2:])  # then on the pool, where it is faster


async def test_a_graph_slower_on_the_pool_goes_back_inline() -> None:
    # Coarse inline (4 x 2.5 ms), slower on the pool (4 x 20 ms over two workers).
    forked = await run_branches(Sleeper(lambda name: 0.0025 if name == "MainThread" else 0.02), 8)
    assert forked[:4] == [False, False, True, True]  # inline twice, then the pool twice
    assert not any(forked[4:])  # then inline


# ---- a fork()ed child --------------------------------------------------------------------------
def _forked_child(conn: Any) -> None:
    probe = Probe()
    value, _ = anyio.run(gradients, 2, probe)
    conn.send((value, any(name.startswith("monadl-worker") for name in probe.threads)))
    conn.close()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork() here")
def test_a_forked_child_runs_on_its_own_pool() -> None:
    """A child that fork() made from a parent that used the pool inherited it
    without its threads, and waited forever for the work it gave it."""
    value, _ = anyio.run(gradients, 2, Probe())
    assert _parallel._pool.pool is not None  # (the parent's pool, with its threads)
    parent, child = multiprocessing.get_context("fork").Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(target=_forked_child, args=(child,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (Python 3.12: fork() with threads running)
        process.start()
    try:
        assert parent.poll(120), "the forked child did not finish in 120 s: it waits for the parent's threads"
        child_value, child_forked = parent.recv()
    finally:
        process.kill()
        process.join()
    assert child_forked  # the child ran on a pool of its own
    assert child_value == pytest.approx(value, rel=1e-12)
