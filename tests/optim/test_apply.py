"""Committing a step: every weight or none, never NaN or infinity, rates that
make sense, and the value types a user gave."""

from __future__ import annotations

import re
import signal
import sys
import threading
import warnings
from typing import Any

import numpy as np
import pytest

import monadl as ml
import monadl._blas
from monadl.deltas import Outer
from monadl.optim import apply, apply_gradients
from monadl.optim.apply import consume_gradients
from tests._threads import train_in_threads

pytestmark = pytest.mark.anyio


def line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


async def test_a_step_that_would_write_nan_is_refused_and_names_the_weight() -> None:
    good = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.1))
    bad = ml.Weight(np.array([1.0, 0.0]), optimizer=ml.optim.sgd(0.1))  # WEIGHT-SITE
    data = np.array([np.nan, 1.0])  # a NaN in the data
    loss = ml.sum(good * 2.0) + ml.sum(bad * data)
    with pytest.raises(ml.NonFiniteError, match=rf"weight built at .*:{line_of('WEIGHT-SITE')}"):
        await loss.train()
    np.testing.assert_array_equal(good.data, [1.0, 1.0])  # all or none
    np.testing.assert_array_equal(bad.data, [1.0, 0.0])
    with ml.settings(finite_steps=False):  # the user may opt out
        await loss.train()
    assert np.isnan(bad.data[0])


async def test_an_overflowing_step_is_refused() -> None:
    w = ml.Weight(np.array([1.0]), optimizer=ml.optim.sgd(1e10))
    with np.errstate(over="ignore"), pytest.raises(ml.NonFiniteError):
        await ml.sum(w * -1e300).train()  # a finite gradient, an update past the largest float
    np.testing.assert_array_equal(w.data, [1.0])


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -0.1])
def test_a_rate_must_be_finite_and_not_negative(rate: float, anyio_backend: str) -> None:
    with pytest.raises(ValueError, match="learning_rate must be a finite number >= 0"):
        ml.optim.sgd(rate)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: ml.optim.adam(0.1, b1=1.5), "b1"),
        (lambda: ml.optim.adam(0.1, b2=-1.0), "b2"),
        (lambda: ml.optim.adam(0.1, b1=1.0), "b1"),
        (lambda: ml.optim.adam(0.1, eps=-1.0), "eps"),
        (lambda: ml.optim.momentum(0.1, decay=2.0), "decay"),
        (lambda: ml.optim.nesterov(0.1, decay=float("nan")), "decay"),
        (lambda: ml.optim.rmsprop(0.1, decay=1.5), "decay"),
        (lambda: ml.optim.adagrad(0.1, initial_accumulator=-1.0), "initial_accumulator"),
        (lambda: ml.optim.add_decayed_weights(-0.1), "weight_decay"),
        (lambda: ml.optim.exponential_decay(0.1, -0.5), "decay_rate"),  # (negative or complex rates, later)
        (lambda: ml.optim.sgd(True), "learning_rate"),  # (a bool is no rate)
    ],
)
def test_hyperparameters_out_of_range_are_refused_where_the_optimizer_is_made(make: Any, name: str) -> None:
    # (as PyTorch's optimizers refuse them; a beta of 1.5 trained silently, away from the minimum)
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0"):
        make()


@pytest.mark.parametrize(
    ("arguments", "refused"),
    [
        (
            (0.1, 1000, 0.5),
            r"decay_rate must be at most 1 \(above 1, the learning rate would grow at every step\), got 1000",
        ),
        ((0.1, 0.5, 0.5), "transition_steps must be a whole number > 0"),
    ],
    ids=["optax's order", "fractional steps"],
)
def test_exponential_decay_in_optaxs_order_is_refused(arguments: tuple[Any, ...], refused: str) -> None:
    # (optax takes (init_value, transition_steps, decay_rate): ported as written, the rate grew 1000x a step)
    with pytest.raises(ValueError, match=rf"{refused}.*optax's order is \(init_value, transition_steps, decay_rate\)"):
        ml.optim.exponential_decay(*arguments)
    assert ml.optim.exponential_decay(1.0, 0.5, 2.0)(4) == 0.25  # (a whole number of steps read from a config)


def _arrays(state: Any) -> Any:
    if isinstance(state, np.ndarray):
        yield state
    elif isinstance(state, tuple):
        for part in state:
            yield from _arrays(part)


async def test_numpy_hyperparameters_keep_a_float32_weights_state_float32(tmp_path: Any) -> None:
    f64 = np.float64
    for optimizer in (
        ml.optim.momentum(f64(0.1), f64(0.9)),
        ml.optim.adam(f64(0.1), b1=f64(0.9), b2=f64(0.99)),
        ml.optim.rmsprop(0.1, decay=f64(0.9)),
        ml.optim.chain(ml.optim.add_decayed_weights(f64(0.01)), ml.optim.adam(0.1)),
        ml.optim.sgd(lambda step: np.asarray(0.1)),  # type: ignore[arg-type,return-value]  # a 0-d array: refused before
    ):
        w = ml.Weight(np.ones(3, np.float32), optimizer=optimizer)
        await ml.sum(w * w).train()
        leaves = list(_arrays(w.state))
        assert w.data.dtype == np.float32 and all(x.dtype == np.float32 for x in leaves), optimizer
        path = tmp_path / "w.safetensors"
        ml.save(path, {"w": w})  # (a float64 state did not load back into the model built again)
        ml.load(path, {"w": ml.Weight(np.ones(3, np.float32), optimizer=optimizer)})
    with pytest.raises(ValueError, match="the factor must be a finite number, got nan"):
        ml.optim.scale(float("nan"))


async def test_a_rate_of_zero_freezes_a_weight() -> None:
    w = ml.Weight(np.ones(2), optimizer=ml.optim.adam(0.0))
    await ml.sum(w * w).train()
    np.testing.assert_array_equal(w.data, [1.0, 1.0])


async def test_a_schedule_that_goes_negative_fails_that_step() -> None:
    w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(lambda step: 0.1 - 0.1 * step))
    loss = ml.sum(w)
    await loss.train()  # rate 0.1
    await loss.train()  # rate 0.0
    with pytest.raises(ValueError, match=re.escape("gave -0.1") + ".*at step 2"):
        await loss.train()
    np.testing.assert_allclose(w.data, [0.9, 0.9])


async def test_a_zero_d_weight_stays_a_zero_d_array() -> None:
    w = ml.Weight(np.array(1.5), optimizer=ml.optim.sgd(0.1))
    await (w * w).train()
    assert type(w.data) is np.ndarray and w.data.shape == ()
    assert w.data == pytest.approx(1.5 - 0.1 * 3.0)


async def test_train_refuses_a_loss_that_is_not_a_scalar() -> None:
    w = ml.Weight(np.ones(3))
    with pytest.raises(ml.ShapeError, match=r"scalar loss.*shape \[3\].*ml\.sum"):
        await (w * 2.0).train()
    np.testing.assert_array_equal(w.data, [1.0, 1.0, 1.0])
    [grad] = await ml.gradients(w * 2.0, [w])  # gradients() documents the sum
    np.testing.assert_array_equal(grad, [2.0, 2.0, 2.0])


async def test_train_of_an_array_weight_says_it_is_a_weight() -> None:
    line = sys._getframe().f_lineno + 1
    w = ml.Weight(np.ones(2))
    with pytest.raises(ml.ShapeError, match=rf"shape \[2\] from the weight made at .*test_apply.py:{line};"):
        await w.train()


async def test_a_zero_d_loss_of_a_library_whose_size_is_a_method_trains() -> None:
    # PyTorch's tensors (through the array API's compat layer) have ``size()``, not ``size``.
    torch = pytest.importorskip("torch")
    w = ml.Weight(torch.ones(3, dtype=torch.float64), optimizer=ml.optim.sgd(0.1))
    assert float(await ml.sum(w * 2.0).train()) == 6.0
    np.testing.assert_allclose(np.asarray(w.data), [0.8, 0.8, 0.8])


async def test_a_tape_of_a_past_evaluation_is_refused() -> None:
    w = ml.Weight(2.0)
    captured: list[ml.Tape[float, float]] = []

    async def keep() -> ml.Tape[float, float]:
        return captured[0]

    def capture(tape: ml.Tape[float, float]) -> ml.Tape[float, float]:
        captured.append(tape)
        return tape

    grab: ml.ScalarLayer = ml.Layer(w.forward().map(capture))
    await (grab * 1.0).train()
    stale: ml.ScalarLayer = ml.Layer(ml.Do.from_async(keep))
    with pytest.raises(RuntimeError, match="another evaluation"):
        await (stale * 3.0).train()


def test_apply_gradients_is_all_or_nothing() -> None:
    a = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(1.0))
    b = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(1.0))
    with pytest.raises(ValueError):
        apply_gradients({a: np.ones(2), b: np.ones(4)})  # b's gradient does not fit
    np.testing.assert_array_equal(a.data, [1.0, 1.0])
    apply_gradients({a: np.ones(2), b: np.ones(3)})
    np.testing.assert_array_equal(a.data, [0.0, 0.0])


@pytest.mark.parametrize("optimizer", [ml.optim.sgd(1.0), ml.optim.adam(1.0)])
def test_a_given_gradient_of_an_infinity_is_named_as_the_cause(optimizer: ml.optim.GradientTransformation) -> None:
    """It was refused as an optimizer step that would write an infinity,
    with advice to find the operation of a model that made it (none did),
    after NumPy's warnings of the step's arithmetic."""
    w = ml.Weight(np.ones(2), optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no RuntimeWarning first)
        with pytest.raises(ml.NonFiniteError, match=r"the gradient given for the weight built at .* holds a NaN or an"):
            apply_gradients({w: np.array([np.inf, 0.0])})
    huge = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(1e308))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ml.NonFiniteError, match=r"would write a NaN or an infinity into .*, its gradient finite"):
            apply_gradients({huge: np.array([1e308, 0.0])})
    assert w.data.tolist() == [1.0, 1.0] and huge.data.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("optimizer", [ml.optim.sgd(1.0), ml.optim.momentum(1.0), ml.optim.adam(1.0)])
def test_a_gradient_of_another_shape_is_refused_not_broadcast(optimizer: ml.optim.GradientTransformation) -> None:
    # (broadcasting would change the weight's shape, which its data setter refuses)
    w = ml.Weight(np.array([1.0]), optimizer=optimizer)
    m = ml.Weight(np.zeros(3), optimizer=ml.optim.sgd(1.0))
    for g, shapes in ((np.array([1.0, 2.0]), r"\(2,\) for a weight of shape \(1,\)"), (np.ones((2, 1)), r"\(2, 1\)")):
        with pytest.raises(ml.ShapeError, match=shapes):
            apply_gradients({m: np.ones(3), w: g})
    assert w.data.tolist() == [1.0] and m.data.tolist() == [0.0, 0.0, 0.0]  # no weight changed


def test_a_gradient_of_no_real_numbers_is_refused() -> None:
    w = ml.Weight(np.ones(2), optimizer=ml.optim.sgd(0.5))
    for g, what in (
        (np.array([1 + 1j, 2]), "dtype complex128"),
        (np.array([True, False]), "dtype bool"),
        ([1.0, 2.0], "list"),
    ):
        with pytest.raises(TypeError, match=rf"a gradient is an array or a number of real values, got {what}"):
            apply_gradients({w: g})  # (a complex one stepped with its imaginary part dropped; a list, 'shape ()')
    assert w.data.tolist() == [1.0, 1.0]
    apply_gradients({w: np.array([2, 0])})  # (integers are real numbers)
    assert w.data.tolist() == [0.0, 1.0]


def unchanged(*weights: ml.Weight[Any, Any]) -> None:
    """Each of ``weights`` holds ones and its optimizer's first state (Adam's step count 0): no step taken."""
    for w in weights:
        assert (w.data == 1.0).all() and repr(w.state) == repr(w.optimizer.init(w.data))


@pytest.mark.parametrize("optimizer", [ml.optim.sgd(0.1), ml.optim.adam(0.1)])
def test_a_gradient_of_another_array_library_is_refused_naming_the_weight(
    optimizer: ml.optim.GradientTransformation,
) -> None:
    """A PyTorch tensor (or any array of another library) for a NumPy weight
    passed the checks of dtype and shape and raised NumPy's "Concatenation
    operation is not implemented for NumPy arrays" from inside the optimizer."""
    import array_api_strict as xs

    good = ml.Weight(np.ones(3), optimizer=optimizer)
    w = ml.Weight(np.ones((4, 2)), optimizer=optimizer)  # FOREIGN-SITE
    site = rf"the weight built at .*test_apply.py:{line_of('FOREIGN-SITE')}, whose data is a numpy array"
    with pytest.raises(ml.DeviceError, match=rf"got array_api_strict\.Array for {site}; .* convert it to numpy; no"):
        apply_gradients({good: np.ones(3), w: xs.ones((4, 2), dtype=xs.float64)})
    unchanged(good, w)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=rf"got torch.Tensor for {site}; .*\(a PyTorch tensor t: t.detach\(\).cpu"):
        apply_gradients({good: np.ones(3), w: torch.ones(4, 2, dtype=torch.float64)})
    unchanged(good, w)
    held = ml.Weight(torch.ones(2, dtype=torch.float64), optimizer=ml.optim.sgd(0.5))
    with pytest.raises(ml.DeviceError, match=r"got numpy.ndarray for .*, whose data is a torch array"):
        apply_gradients({held: np.ones(2)})  # (as the forward refuses torch's with NumPy's: 'operands mix')
    apply_gradients({held: torch.ones(2, dtype=torch.float64)})  # (its own library's steps it)
    assert held.data.tolist() == [0.5, 0.5]


def test_a_gradient_that_is_no_array_is_refused_saying_what_is_taken() -> None:
    class Lookalike:  # (a shape and a float dtype, as a pandas object's: it passed the checks)
        shape = (2,)
        dtype = np.dtype(np.float64)

    w = ml.Weight(np.ones(2), optimizer=ml.optim.adam(0.1))
    for g, what in ((Lookalike(), "Lookalike"), (None, "NoneType")):
        with pytest.raises(
            TypeError, match=rf"got {what} for the weight built at .*: give a numpy array \(its weight's library\)"
        ):
            apply_gradients({w: g})
    unchanged(w)


def test_a_layer_as_a_key_is_refused_saying_only_weights_take_steps() -> None:
    """A hypernetwork's generated matrix given a step raised an AttributeError
    about lazy shapes and ``ml.operation`` (``ml.gradients`` refused it)."""
    e = ml.Weight(np.ones((1, 3)), optimizer=ml.optim.adam(0.1))
    h = ml.Weight(np.ones((3, 8)), optimizer=ml.optim.adam(0.1))
    generated = ml.reshape(e @ h, (4, 2))  # LAYER-SITE
    by_layer: dict[Any, Any] = {e: np.ones((1, 3)), generated: np.ones((4, 2))}  # (mypy refuses both typed)
    by_name: dict[Any, Any] = {"e": np.ones((1, 3))}
    with pytest.raises(
        TypeError,
        match=rf"apply_gradients takes the gradients by weight, got a Layer as a key \(built at .*test_apply.py:"
        rf"{line_of('LAYER-SITE')}\): only a weight takes a step\. A layer computed from weights takes none; give the "
        "gradients of the weights it is computed from",
    ):
        apply_gradients(by_layer)
    unchanged(e)
    with pytest.raises(TypeError, match=r"clip_by_global_norm takes the gradients by weight, got a str as a key; key"):
        ml.optim.clip_by_global_norm(by_name, 1.0)


def test_steps_are_atomic_across_event_loops_in_threads() -> None:
    w = ml.Weight(np.zeros(2), optimizer=ml.optim.adam(0.5))
    train_in_threads(lambda: ml.sum(w), 200)
    assert w.state[0].step == 400  # Adam's step count: every step counted once


async def test_large_finite_weights_are_not_mistaken_for_overflow() -> None:
    w = ml.Weight(np.array([1e200, -1e200]), optimizer=ml.optim.sgd(1.0))
    await ml.sum(w * 1.0).train()
    np.testing.assert_array_equal(w.data, [1e200 - 1.0, -1e200 - 1.0])


# ---- the runtime's commit writes a plain SGD step into a gradient nobody else holds ----------------
def test_a_private_gradient_becomes_the_new_weight() -> None:
    w = ml.Weight(np.full(3, 2.0, np.float32), optimizer=ml.optim.sgd(0.5))
    old = w.data
    gradients = {w: np.array([1.0, -2.0, 4.0], np.float32)}
    buffer = id(gradients[w])
    consume_gradients(gradients)
    np.testing.assert_array_equal(w.data, [1.5, 3.0, 0.0])
    assert id(w.data) == buffer  # no fresh array
    np.testing.assert_array_equal(old, [2.0, 2.0, 2.0])  # the old data is not written


def test_a_gradient_held_elsewhere_is_only_read() -> None:
    kept = np.array([1.0, -2.0], np.float32)
    a = ml.Weight(np.zeros(2, np.float32), optimizer=ml.optim.sgd(1.0))
    b = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.sgd(1.0))
    c = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.sgd(1.0))
    shared = np.array([0.5, 0.5], np.float32)
    gradients = {a: kept, b: shared, c: shared}  # one array for two weights: neither may write it
    del shared
    consume_gradients(gradients)
    np.testing.assert_array_equal(kept, [1.0, -2.0])
    np.testing.assert_array_equal(gradients[b], [0.5, 0.5])
    np.testing.assert_array_equal(a.data, [-1.0, 2.0])
    np.testing.assert_array_equal(b.data, [0.5, 0.5])
    np.testing.assert_array_equal(c.data, [0.5, 0.5])
    view = np.array([[3.0, 3.0]], np.float32)  # a view's base is held by the view
    consume_gradients({a: view[0]})
    np.testing.assert_array_equal(view, [[3.0, 3.0]])


def test_the_in_place_step_keeps_the_weights_type_and_refuses_non_finite() -> None:
    w = ml.Weight(np.zeros(2, np.float32), optimizer=ml.optim.sgd(1.0))
    consume_gradients({w: np.array([1.0, 2.0])})  # float64 gradient: the generic step, float32 data
    assert w.data.dtype == np.float32
    np.testing.assert_array_equal(w.data, [-1.0, -2.0])
    good = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.sgd(1.0))
    before = good.data
    with pytest.raises(ml.NonFiniteError):
        consume_gradients({good: np.ones(2, np.float32), w: np.array([np.inf, 0.0], np.float32)})
    assert good.data is before  # all or none: the written gradient is thrown away
    np.testing.assert_array_equal(good.data, [1.0, 1.0])
    np.testing.assert_array_equal(w.data, [-1.0, -2.0])


async def test_training_with_sgd_steps_as_by_hand() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 300)).astype(np.float32)
    w0 = rng.standard_normal((300, 64)).astype(np.float32)
    w = ml.Weight(w0.copy(), optimizer=ml.optim.sgd(0.1))
    for _ in range(3):
        expected = w.data - np.float32(0.1) * (x.T @ np.ones((8, 64), np.float32))
        await ml.sum(ml.matmul(x, w)).train()
        np.testing.assert_allclose(w.data, expected, rtol=1e-6, atol=1e-6)


async def test_training_weights_that_share_one_delta_array() -> None:
    # add's rule hands the same delta to both operands: neither step may write into it.
    a = ml.Weight(np.zeros((300, 64), np.float32), optimizer=ml.optim.sgd(0.5))
    b = ml.Weight(np.ones((300, 64), np.float32), optimizer=ml.optim.sgd(0.5))
    x = np.full((300, 64), 2.0, np.float32)
    await ml.sum((a + b) * x).train()
    np.testing.assert_array_equal(a.data, np.full((300, 64), -1.0, np.float32))
    np.testing.assert_array_equal(b.data, np.zeros((300, 64), np.float32))
    np.testing.assert_array_equal(x, np.full((300, 64), 2.0, np.float32))


def test_small_weights_pooled_step_as_each_would_alone() -> None:
    rng = np.random.default_rng(3)
    shapes = [(3, 2), (2,), (), (4, 4)]
    datas = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    rates = [0.1, 0.1, 0.1, 0.5]  # three in one pool; the last alone
    pooled = [ml.Weight(d, optimizer=ml.optim.sgd(r)) for d, r in zip(datas, rates)]
    alone = [ml.Weight(d, optimizer=ml.optim.sgd(r)) for d, r in zip(datas, rates)]
    consume_gradients({w: g.copy() for w, g in zip(pooled, grads)})
    for w, g in zip(alone, grads):
        apply_gradients({w: g})
    for p, a in zip(pooled, alone):
        assert type(p.data) is np.ndarray and p.data.shape == a.data.shape and p.data.dtype == a.data.dtype
        np.testing.assert_array_equal(p.data, a.data)


def test_a_non_finite_gradient_in_a_pool_names_its_weight_and_changes_nothing() -> None:
    ws = [ml.Weight(np.ones(3, np.float32), optimizer=ml.optim.sgd(0.1)) for _ in range(3)]
    bad = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.sgd(0.1))  # POOLED-SITE
    grads = {w: np.ones(3, np.float32) for w in ws}
    grads[bad] = np.array([1.0, np.inf], np.float32)
    with pytest.raises(ml.NonFiniteError, match=rf"weight built at .*:{line_of('POOLED-SITE')} \(shape \[2\]\)"):
        consume_gradients(grads)
    for w in [*ws, bad]:
        np.testing.assert_array_equal(w.data, np.ones_like(w.data))


async def test_a_float32_weights_gradient_and_optimizer_state_stay_float32_beside_float64_numbers(
    tmp_path: Any,
) -> None:
    """A float32 loss divided by a NumPy float64 (or by a scalar weight,
    float64) back-propagated float64 deltas: the gradients were float64,
    Adam's moments became float64, and the model's own checkpoint was
    refused by the same model ("expected dtype float32, got float64")."""
    w = ml.Weight(np.ones((3, 2), np.float32), optimizer=ml.optim.adam(0.01))
    table = ml.Weight(np.ones((4, 2), np.float32), optimizer=ml.optim.adam(0.01))
    temperature = ml.Weight(2.0, optimizer=ml.optim.adam(0.01))
    x = np.ones((5, 3), np.float32)
    rows = ml.embedding(table, np.array([0, 1, 1]))
    loss = ml.cross_entropy(x @ w, np.zeros(5, int)) / np.float64(2.0) + ml.sum(rows) / temperature
    _, grads = await ml.value_and_gradients(loss)
    assert grads[w].dtype == np.float32 and grads[table].dtype == np.float32 and grads[temperature].dtype == np.float64
    await loss.train()
    moments = arrays_of(w.state)
    assert moments and all(a.dtype == np.float32 for a in moments)
    ml.save(tmp_path / "model.npz", {"w": w, "table": table, "temperature": temperature})
    ml.load(tmp_path / "model.npz", {"w": w, "table": table, "temperature": temperature})
    given = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.adam(0.1))
    apply_gradients({given: np.array([1.0, -1.0])})  # float64, given by hand
    assert given.data.dtype == np.float32 and all(a.dtype == np.float32 for a in arrays_of(given.state))


def arrays_of(state: Any) -> list[Any]:
    """The arrays of an optimizer state (nested tuples, named tuples)."""
    if isinstance(state, np.ndarray):
        return [state]
    if isinstance(state, tuple):
        return [a for part in state for a in arrays_of(part)]
    return []


@pytest.mark.parametrize("asyncio_runner", [False, True])
def test_a_ctrl_c_while_a_commit_writes_acts_after_its_last_write(
    monkeypatch: pytest.MonkeyPatch, asyncio_runner: bool
) -> None:
    """Python raises KeyboardInterrupt between any two bytecodes: one while
    plain SGD added its products into three weights in place left the first
    stepped and the others not (a user's notebook, 3 in 25 interrupted
    loops). It is held until every weight is written, then raised. Under
    asyncio's runner (its own handler: a cancellation at an await) nothing
    is held, and the handler runs where the signal came."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread")
    rng = np.random.default_rng(0)
    weights = [ml.Weight(rng.normal(size=(16, 16)), optimizer=ml.optim.sgd(0.1)) for _ in range(3)]
    factors = [(rng.normal(size=(4, 16)), rng.normal(size=(4, 16))) for _ in weights]
    consume_gradients({w: Outer(*f) for w, f in zip(weights, factors)})  # (the next step's products go in place)
    expected = [w.data - 0.1 * left.T @ right for w, (left, right) in zip(weights, factors)]
    add_product = monadl._blas.add_product
    interrupted: list[bool] = []

    def interrupting(*args: Any) -> None:
        if not interrupted:
            interrupted.append(True)
            signal.raise_signal(signal.SIGINT)
        add_product(*args)

    monkeypatch.setattr(apply, "add_product", interrupting)
    noted: list[int] = []
    handler = (lambda signum, frame: noted.append(signum)) if asyncio_runner else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, handler)
    try:
        if asyncio_runner:
            consume_gradients({w: Outer(*f) for w, f in zip(weights, factors)})
            assert noted == [signal.SIGINT]
        else:
            with pytest.raises(KeyboardInterrupt):
                consume_gradients({w: Outer(*f) for w, f in zip(weights, factors)})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted
    for w, want in zip(weights, expected):
        np.testing.assert_allclose(w.data, want, rtol=1e-12)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGALRM", "SIGUSR1"])
def test_a_users_signal_handler_that_raises_while_a_commit_writes_acts_after_its_last_write(
    monkeypatch: pytest.MonkeyPatch, signame: str
) -> None:
    """A batch scheduler's SIGTERM handled by ``sys.exit``, or a SIGALRM
    watchdog that raises, came among plain SGD's in-place writes: a new
    user's model had its large weight stepped and the others not (4 in 12
    interrupted runs), and a checkpoint saved on the way out would have held
    it. The handler is held as Ctrl-C's is, then called once, after the last
    write; it is in place again after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, signame):
        pytest.skip("signal handlers run in the main thread, on POSIX")
    signum = getattr(signal, signame)
    rng = np.random.default_rng(1)
    weights = [ml.Weight(rng.normal(size=(16, 16)), optimizer=ml.optim.sgd(0.1)) for _ in range(3)]
    factors = [(rng.normal(size=(4, 16)), rng.normal(size=(4, 16))) for _ in weights]
    consume_gradients({w: Outer(*f) for w, f in zip(weights, factors)})  # (the next step's products go in place)
    expected = [w.data - 0.1 * left.T @ right for w, (left, right) in zip(weights, factors)]
    add_product = monadl._blas.add_product
    calls: list[int] = []

    def interrupting(*args: Any) -> None:
        if not calls:
            signal.raise_signal(signum)
            signal.raise_signal(signum)  # (twice: its handler still runs once)
        calls.append(1)
        add_product(*args)

    def handler(got: int, frame: Any) -> None:
        handled.append(len(calls))
        raise SystemExit(f"{signame}: leaving")

    handled: list[int] = []
    monkeypatch.setattr(apply, "add_product", interrupting)
    previous = signal.signal(signum, handler)
    try:
        with pytest.raises(SystemExit, match="leaving"):
            consume_gradients({w: Outer(*f) for w, f in zip(weights, factors)})
        assert signal.getsignal(signum) is handler
    finally:
        signal.signal(signum, previous)
    assert handled == [3]  # after the third weight's product, once
    for w, want in zip(weights, expected):
        np.testing.assert_allclose(w.data, want, rtol=1e-12)


def test_held_signals_run_after_the_commit_lets_go_of_its_lock_and_none_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handlers ran inside the commit's lock: a SIGTERM handler saving a
    checkpoint from a thread (which takes the lock) waited for ever (a
    reviewer's find); and a second signal held with the first was lost when
    the first's handler raised. Each now runs after the lock, as Python runs
    signals that come together."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        pytest.skip("signal handlers run in the main thread, on POSIX")
    from monadl.layers._commits import COMMIT_LOCK

    w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
    consume = apply._commit
    raised: list[int] = []

    def signalling(*args: Any, **kwargs: Any) -> None:
        from monadl.runtime.process import hold

        def held() -> Any:
            found = hold()
            if not raised:
                raised.append(1)
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGUSR1)
            return found

        monkeypatch.setattr(apply, "hold", held)
        consume(*args, **kwargs)

    monkeypatch.setattr(apply, "_commit", signalling)
    free: list[bool] = []

    def terminate(signum: int, frame: Any) -> None:
        def take() -> None:
            if COMMIT_LOCK.acquire(timeout=5):
                COMMIT_LOCK.release()
                free.append(True)
            else:
                free.append(False)

        taker = threading.Thread(target=take)
        taker.start()
        taker.join()
        raise SystemExit("terminated")

    usr1: list[int] = []
    previous = signal.signal(signal.SIGTERM, terminate), signal.signal(signal.SIGUSR1, lambda *a: usr1.append(1))
    try:
        with pytest.raises(SystemExit, match="terminated"):
            consume_gradients({w: np.ones(3)})
        for _ in range(100):  # (the second runs at the next line Python runs)
            if usr1:
                break
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGUSR1, previous[1])
    assert free == [True] and usr1 == [1]
    np.testing.assert_allclose(w.data, 0.9 * np.ones(3))


async def test_an_event_loops_signal_handler_is_not_swapped_on_every_step() -> None:
    """asyncio's loop.add_signal_handler leaves a handler that does nothing
    (the loop is woken through a file): held, it cost a swap on every step
    (6 us) and left its system flags changed."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR2"):
        pytest.skip("signal handlers run in the main thread, on POSIX")
    import asyncio

    from monadl.runtime import process

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        pytest.skip("asyncio's loop only")
    calls: list[int] = []
    loop.add_signal_handler(signal.SIGUSR2, lambda: calls.append(1))
    try:
        held = process.hold()
        process.release(held)
        w = ml.Weight(np.ones(3), optimizer=ml.optim.sgd(0.1))
        await ml.sum(w * w).train()
        signal.raise_signal(signal.SIGUSR2)
        await asyncio.sleep(0.01)
    finally:
        loop.remove_signal_handler(signal.SIGUSR2)
    assert held is None or all(signum != signal.SIGUSR2 for signum, _ in held[0])
    assert calls == [1]


async def test_a_step_refused_for_a_weight_that_already_holds_an_infinity_says_so() -> None:
    """A LOG_REAL rule mask of -inf (the semiring's zero) could not step, and
    the message sent the user to check_finite, under check_finite too."""
    mask = ml.Weight(np.array([0.0, -np.inf]), optimizer=ml.optim.sgd(0.1))
    loss = ml.sum(ml.exp(mask))
    with (
        ml.settings(check_finite=True),
        pytest.raises(ml.NonFiniteError, match=r"which already holds one .*finite_steps=False"),
    ):
        await loss.train()
    with ml.settings(finite_steps=False):
        await loss.train()
    assert mask.data[1] == -np.inf and mask.data[0] < 0.0
    growing = ml.Weight(np.array([-1e308]), optimizer=ml.optim.sgd(1e308))  # (a step past the largest float)
    with np.errstate(over="ignore"), ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as refused:
        await ml.sum(growing * 1.0).train()
    assert "its gradient finite" in str(refused.value) and "check_finite=True) finds" not in str(refused.value)


async def test_under_warnings_as_errors_a_refused_step_is_a_non_finite_error() -> None:
    """Under python -W error an Adam step over an infinite gradient raised
    NumPy's RuntimeWarning from the optimizer's division, not NonFiniteError."""
    w = ml.Weight(np.ones(3), optimizer=ml.optim.adam(0.1))
    loss = ml.sum(w * np.array([np.inf, 1.0, 1.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ml.NonFiniteError, match=r"no weight was changed"):
            await loss.train()
    assert w.data.tolist() == [1.0, 1.0, 1.0]


async def test_a_step_that_train_refuses_prints_no_numpy_warning_first() -> None:
    """train() printed NumPy's 'invalid value encountered in divide', pointing
    into transforms.py, before refusing the step; apply_gradients' refusal of
    the same step was quiet."""
    w = ml.Weight(np.ones(2), optimizer=ml.optim.adam(0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ml.NonFiniteError) as refused:
            await ml.sum(w * np.array([np.inf, 1.0])).train()
    assert [str(warning.message) for warning in caught] == []
    assert str(refused.value).startswith("the optimizer step would write a NaN or an infinity into the weight built at")
    assert w.data.tolist() == [1.0, 1.0] and w.state[0].step == 0


async def test_a_step_that_an_eps_of_0_in_float16_refuses_names_the_eps_not_an_operation() -> None:
    """float16 with Adam's default eps (1e-8, 0 in float16): a gradient entry
    of 0 made 0/0, and the refusal sent the user to check_finite to find the
    operation that made a NaN, though the gradient was finite."""
    w = ml.Weight(np.array([1.0, 2.0], np.float16), optimizer=ml.optim.adam(1e-3))
    loss = ml.sum(w * np.array([3.0, 0.0], np.float16))  # (a dead unit's entry: 0)
    for settings in (ml.settings(), ml.settings(check_finite=True)):
        with settings, np.errstate(invalid="ignore"), pytest.raises(ml.NonFiniteError) as refused:
            await loss.train()
        message = str(refused.value)
        assert "its gradient finite: the optimizer's state or its settings made it" in message
        assert "The optimizer's eps=1e-08 (of scale_by_adam) is 0 in float16, whose smallest normal number" in message
        assert message.endswith("Give it an eps that float16 holds: eps=1e-04, as in ml.optim.adam(1e-3, eps=1e-04)")
        assert "check_finite=True) finds" not in message
        assert w.data.tolist() == [1.0, 2.0] and w.state[0].step == 0
    fixed = ml.Weight(np.array([1.0, 2.0], np.float16), optimizer=ml.optim.adam(1e-3, eps=1e-4))
    await ml.sum(fixed * np.array([3.0, 0.0], np.float16)).train()
    assert fixed.data.tolist() == [np.float16(1.0 - 1e-3), 2.0]
    rms = ml.Weight(np.zeros(2, np.float16), optimizer=ml.optim.rmsprop(1e-3))
    with pytest.raises(ml.NonFiniteError, match=r"eps=1e-08 \(of scale_by_rms\) .*ml.optim.rmsprop\(1e-3, eps=1e-04\)"):
        apply_gradients({rms: np.zeros(2, np.float16)})


async def test_a_step_made_non_finite_by_the_optimizers_state_blames_the_state_not_an_operation() -> None:
    w = ml.Weight(np.ones(2, np.float32), optimizer=ml.optim.adam(1e-3))
    state = w.state
    w.state = (state[0]._replace(nu=np.array([-1.0, 1.0], np.float32)), state[1])  # (a root of -1)
    with np.errstate(invalid="ignore"), pytest.raises(ml.NonFiniteError) as refused:
        await ml.sum(w * np.ones(2, np.float32)).train()
    message = str(refused.value)
    assert message.endswith(
        "its gradient finite: the optimizer's state or its settings made it (a learning rate, a schedule, an eps); "
        "no weight was changed"
    )
    assert w.data.tolist() == [1.0, 1.0]
