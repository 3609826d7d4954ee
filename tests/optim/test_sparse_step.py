"""A table's sparse step (its looked-up rows, `SparseRows`) costs its rows: it
writes them into the table and its optimizer state's arrays where nothing else
holds those, with the values the copying step gives, and keeps every guarantee
of a step: no array someone holds changes, a refused commit changes nothing,
threads lose no update."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.deltas import SparseRows
from monadl.optim import apply
from monadl.runtime import entry
from tests._threads import train_in_threads

pytestmark = pytest.mark.anyio

V, D = 50, 4
OPTIMIZERS: dict[str, Callable[[], ml.optim.GradientTransformation]] = {
    "sgd": lambda: ml.optim.sgd(0.1),
    "momentum": lambda: ml.optim.momentum(0.1),
    "trace": lambda: ml.optim.trace(0.9),  # (a state that is the array itself, in no tuple)
    "adam": lambda: ml.optim.adam(0.01),
    "adagrad": lambda: ml.optim.adagrad(0.1),
}
LOOKUPS = [np.array([3, 7, 3, 3, 41]), np.array([0, 49, 7]), np.array([7, 7])]  # rows repeated in a lookup


def table(optimizer: str) -> ml.ArrayWeight:
    return ml.Weight(np.random.default_rng(0).standard_normal((V, D)), optimizer=OPTIMIZERS[optimizer]())


def loss(w: ml.ArrayWeight, rows: Any) -> ml.ScalarLayer:
    return ml.sum(ml.tanh(ml.embedding(w, rows)) * np.arange(1.0, D + 1))


def arrays(state: Any) -> list[Any]:
    if isinstance(state, np.ndarray):
        return [state]
    return [a for part in state for a in arrays(part)] if isinstance(state, tuple) else []


def snapshot(w: ml.ArrayWeight) -> tuple[Any, list[Any], Any]:
    return w.data.copy(), [a.copy() for a in arrays(w.state)], w.state


def assert_same(a: ml.ArrayWeight, b: ml.ArrayWeight) -> None:
    np.testing.assert_array_equal(a.data, b.data)
    for x, y in zip(arrays(a.state), arrays(b.state), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sparse step into copies of the table and its state, as before."""
    monkeypatch.setattr(apply, "private", lambda *args: False)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
async def test_a_step_writes_the_rows_into_the_table_and_state_nobody_holds(
    optimizer: str, request: pytest.FixtureRequest
) -> None:
    w = table(optimizer)
    await loss(w, LOOKUPS[0]).train()  # (Adam's count, momentum's velocity: from the first step on)
    data, state = id(w.data), [id(a) for a in arrays(w.state)]
    for rows in LOOKUPS:
        await loss(w, rows).train()
    assert id(w.data) == data and [id(a) for a in arrays(w.state)] == state
    request.getfixturevalue("copying")
    copied = table(optimizer)
    for rows in [LOOKUPS[0], *LOOKUPS]:
        await loss(copied, rows).train()
    assert id(copied.data) != data
    assert_same(w, copied)  # bit for bit
    untouched = [r for r in range(V) if r not in {0, 3, 7, 41, 49}]
    np.testing.assert_array_equal(w.data[untouched], table(optimizer).data[untouched])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
async def test_a_step_allocates_for_its_rows_not_for_the_table(optimizer: str) -> None:
    w = ml.Weight(np.zeros((20_000, 16)), optimizer=OPTIMIZERS[optimizer]())
    rows = np.arange(0, 20_000, 625)  # 32 rows
    await ml.sum(ml.tanh(ml.embedding(w, rows))).train()
    tracemalloc.start()
    try:
        await ml.sum(ml.tanh(ml.embedding(w, rows))).train()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < w.data.nbytes // 8  # (a copy of the table, or of a moment, is its whole size)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
async def test_a_table_or_state_a_user_holds_is_never_written(optimizer: str) -> None:
    reference, w = table(optimizer), table(optimizer)
    for rows in LOOKUPS:
        await loss(reference, rows).train()
        held = w.data
        data, moments, state = snapshot(w)
        await loss(w, rows).train()
        np.testing.assert_array_equal(held, data)
        assert w.data is not held
        for x, y in zip(arrays(state), moments, strict=True):  # (the state the user holds: none of it written)
            np.testing.assert_array_equal(x, y)
    assert_same(w, reference)


async def test_a_moment_a_user_holds_is_never_written() -> None:
    w = table("adam")
    await loss(w, LOOKUPS[0]).train()
    mu, nu = w.state[0].mu, id(w.state[0].nu)
    before = mu.copy()
    await loss(w, LOOKUPS[1]).train()
    np.testing.assert_array_equal(mu, before)
    assert w.state[0].mu is not mu and id(w.state[0].nu) == nu  # (the moment nobody else holds: in place)


async def test_a_running_evaluations_table_is_never_written() -> None:
    # An @ml.direct model reads the table, and again after another task's step:
    # both times the table it began with (its pin holds the array: no step writes it).
    w = table("adam")
    rows = np.array([3, 7])
    before = w.data.copy()
    read, stepped = anyio.Event(), anyio.Event()

    @ml.direct
    async def model() -> ml.ArrayLayer:
        await ml.values(ml.embedding(w, rows))
        read.set()
        await stepped.wait()
        return ml.embedding(w, rows)

    async def step() -> None:
        await read.wait()
        await loss(w, rows).train()
        stepped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        seen = await model().predict()
    np.testing.assert_array_equal(seen, before[rows])
    assert not np.array_equal(w.data[rows], before[rows])


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("where", ["its rows", "another weight"])
async def test_a_refused_sparse_step_changes_nothing(optimizer: str, where: str) -> None:
    w = table(optimizer)
    await loss(w, LOOKUPS[0]).train()
    data, moments, state = snapshot(w)
    ids = id(w.data), [id(a) for a in arrays(w.state)]
    other = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.1))
    bad = ml.sum(ml.embedding(w, np.array([3, 9])) * np.inf) if where == "its rows" else ml.sum(other * np.nan)
    with np.errstate(invalid="ignore"), pytest.raises(ml.NonFiniteError, match=r"shape \[(50, 4|2)\]"):
        await (loss(w, LOOKUPS[1]) + bad).train()
    np.testing.assert_array_equal(w.data, data)
    assert w.state is state and (id(w.data), [id(a) for a in arrays(w.state)]) == ids
    for x, y in zip(arrays(w.state), moments, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(other.data, [1.0, 1.0])


async def test_a_nan_in_a_row_not_looked_up_is_not_the_steps_to_refuse() -> None:
    # The check reads the rows a step writes; a NaN assigned into another row stays
    # where it was, and refuses the first step that looks that row up.
    w = table("sgd")
    data = w.data.copy()
    data[20] = np.nan
    w.data = data
    await loss(w, np.array([3])).train()
    assert np.isnan(w.data[20]).all() and not np.array_equal(w.data[3], data[3])
    stepped = w.data.copy()
    with pytest.raises(ml.NonFiniteError):
        await loss(w, np.array([3, 20])).train()
    np.testing.assert_array_equal(w.data, stepped)


def test_apply_gradients_steps_a_sparse_gradient_in_place_and_only_reads_it() -> None:
    w = table("adam")
    grad = SparseRows(np.array([4, 1, 4]), np.ones((3, D)), (V, D))
    kept = grad.rows.copy()
    ml.optim.apply_gradients({w: grad})
    data = id(w.data)
    ml.optim.apply_gradients({w: grad})
    assert id(w.data) == data and w.state[0].step == 2
    np.testing.assert_array_equal(grad.rows, kept)
    dense = table("adam")
    # A row looked up at every step steps as the dense step does; the same rounding.
    for _ in range(2):
        ml.optim.apply_gradients({dense: grad.to_dense()})
    np.testing.assert_array_equal(w.data[[1, 4]], dense.data[[1, 4]])


async def test_a_long_commits_sparse_step_is_taken_in_the_commit_in_place() -> None:
    # An Adam table past `PREPARE_ELEMENTS`: the commit computes steps ahead, but not
    # a sparse one, whose entry would hold the table and could not see a write since.
    rows = int(entry.PREPARE_ELEMENTS) // D
    w = ml.Weight(np.zeros((rows, D)), optimizer=ml.optim.adam(0.01))
    sparse = SparseRows(np.array([1]), np.ones((1, D)), (rows, D))
    assert apply.prepare(w, sparse) is apply.IN_COMMIT and apply.current(w, apply.IN_COMMIT)
    await loss(w, np.array([1, 2])).train()
    data = id(w.data)
    await loss(w, np.array([2, 5])).train()
    assert id(w.data) == data and w.state[0].step == 2


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_steps_across_threads_lose_no_update(optimizer: str) -> None:
    w = ml.Weight(np.zeros((V, D)), optimizer=ml.optim.sgd(0.5) if optimizer == "sgd" else ml.optim.adam(0.5))
    train_in_threads(lambda: ml.sum(ml.embedding(w, np.array([1, 2, 1]))), 100)
    if optimizer == "sgd":
        np.testing.assert_array_equal(w.data[[1, 2]], [[-200.0] * D, [-100.0] * D])  # (exact: halves)
    else:
        assert w.state[0].step == 200
    np.testing.assert_array_equal(w.data[0], np.zeros(D))


def test_a_state_read_on_another_thread_during_a_commit_waits_for_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sparse step writes rows into moment arrays nobody holds: a thread that took
    # w.state between the commit's check and its writes saw the count of one step
    # beside the moments of the next.
    w = ml.Weight(np.zeros((10, 2)), optimizer=ml.optim.adam(0.1))
    anyio.run(ml.sum(ml.embedding(w, np.array([1]))).train)
    seen: list[Any] = []
    readers: list[threading.Thread] = []
    written: Callable[..., Any] = vars(apply)["rows_written"]  # (the name the commit calls)

    def read_meanwhile(*args: Any) -> Any:
        out = written(*args)
        reader = threading.Thread(target=lambda: seen.append(w.state))
        reader.start()
        reader.join(timeout=0.2)  # (it waits for the lock this commit holds)
        readers.append(reader)
        return out

    monkeypatch.setattr(apply, "rows_written", read_meanwhile)
    anyio.run(ml.sum(ml.embedding(w, np.array([1]))).train)
    readers[0].join()
    adam = seen[0][0]
    assert adam.step == 2 and adam is w.state[0]  # (the state the commit wrote, read after it)


def sparse_adam(
    table: Any, lookups: list[Any], grads: list[Any], lr: float, eps: Callable[[int], float]
) -> tuple[Any, list[Any]]:
    """``torch.optim.SparseAdam``'s steps (``torch/optim/_functional.py``, ``sparse_adam``) in NumPy:
    ``eps`` added to ``sqrt(nu)``, then ``lr * sqrt(1 - b2**t) / (1 - b1**t)``; ``eps(t)`` the eps of step t."""
    b1, b2 = 0.9, 0.999
    w, mu, nu, moved = table.copy(), np.zeros_like(table), np.zeros_like(table), []
    for t, (rows, g) in enumerate(zip(lookups, grads, strict=True), 1):
        before = w.copy()
        mu[rows] = b1 * mu[rows] + (1 - b1) * g
        nu[rows] = b2 * nu[rows] + (1 - b2) * g * g
        w[rows] -= lr * np.sqrt(1 - b2**t) / (1 - b1**t) * mu[rows] / (np.sqrt(nu[rows]) + eps(t))
        moved.append(w - before)
    return w, moved


def test_an_embeddings_adam_is_sparse_adam_with_eps_scaled_by_the_steps_correction() -> None:
    # A recommender's user (gradients 1e-7 to 1e-5: a mean over a large batch) read that the two were
    # 1e-6 apart at the default eps; their first steps differed by 70% of a step. monadl adds eps after
    # the bias correction, as torch.optim.Adam: SparseAdam's step with eps * sqrt(1 - b2**t) for eps.
    lookups = [np.array([0, 1, 2]), np.array([1, 3]), np.array([0, 3, 4]), np.array([2])]
    scale = np.array([[1e-7, 3e-7, 1e-6], [2e-7, 1e-5, -5e-7], [-1e-7, 4e-7, 2e-6], [3e-7, -1e-7, 1e-7]])
    start = np.random.default_rng(1).standard_normal((5, 3))
    w = ml.Weight(start.copy(), optimizer=ml.optim.adam(0.01))
    grads = []
    for rows, c in zip(lookups, scale, strict=True):
        grads.append(np.broadcast_to(c, (len(rows), 3)))
        anyio.run(ml.sum(ml.embedding(w, rows) * c).train)
    scaled, _ = sparse_adam(start, lookups, grads, 0.01, lambda t: 1e-8 * np.sqrt(1 - 0.999**t))
    np.testing.assert_allclose(w.data, scaled, rtol=0, atol=1e-15)
    fixed, moved = sparse_adam(start, lookups, grads, 0.01, lambda t: 1e-8)
    first = ml.Weight(start.copy(), optimizer=ml.optim.adam(0.01))
    anyio.run(ml.sum(ml.embedding(first, lookups[0]) * scale[0]).train)
    apart = np.abs((first.data - start) - moved[0])[lookups[0]]
    g = scale[0]  # (a first step is lr * g / (|g| + eps) in monadl, eps / sqrt(1 - b2) = 3.2e-7 in SparseAdam)
    np.testing.assert_allclose(apart, np.broadcast_to(0.01 * (g / (g + 1e-8) - g / (g + 1e-8 / np.sqrt(1e-3))), (3, 3)))
    assert apart.max() > 0.65 * 0.01  # (g = 1e-7: 0.67 of a full step, lr)
    assert np.abs(w.data - fixed).max() > 1e-3


async def test_accumulated_gradients_step_a_table_as_train_does_only_kept_as_rows() -> None:
    """What the tour's accumulation recipe says: `value_and_gradients`' rows,
    summed over micro-batches, take ``train()``'s lazy Adam step of the mean
    loss; `ml.gradients`' dense arrays take a dense Adam step, which moves the
    rows no micro-batch looked up (a user's trial: 0.161 apart after 4 steps)."""
    trained, by_rows, dense = table("adam"), table("adam"), table("adam")
    batches = [(np.array([3, 7]), np.array([7, 41])), (np.array([0, 3]), np.array([49, 49]))]
    for first, second in batches:
        await ml.mean(ml.stack([ml.sum(ml.embedding(trained, ids) ** 2) for ids in (first, second)])).train()
        rows = [
            (await ml.value_and_gradients(ml.sum(ml.embedding(by_rows, ids) ** 2)))[1][by_rows]
            for ids in (first, second)
        ]
        ml.optim.apply_gradients({by_rows: (rows[0] + rows[1]) / 2})
        arrays = [(await ml.gradients(ml.sum(ml.embedding(dense, ids) ** 2), [dense]))[0] for ids in (first, second)]
        ml.optim.apply_gradients({dense: (arrays[0] + arrays[1]) / 2})
    assert type(rows[0]) is SparseRows
    np.testing.assert_array_equal(by_rows.data, trained.data)
    moved = np.abs(dense.data - trained.data).max(axis=1)
    assert moved[41] > 1e-3  # (looked up in the first step only: dense Adam moved it on its momentum in the second)
    assert moved[1] == 0.0  # (never looked up: no momentum to move it)
