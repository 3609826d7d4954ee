"""Every optimizer reduces a quadratic and Rosenbrock's function from the standard start."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl import optim
from monadl.optim._spec import spec

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(1e-3),
    "sgd, decaying rate": lambda: optim.sgd(optim.exponential_decay(1e-3, 0.999)),
    "sgd, cosine rate": lambda: optim.sgd(optim.cosine_decay_schedule(1e-3, 3000)),
    "momentum": lambda: optim.momentum(2e-4, 0.9),
    "nesterov": lambda: optim.nesterov(2e-4, 0.9),
    "adagrad": lambda: optim.adagrad(0.05),
    "rmsprop": lambda: optim.rmsprop(1e-2),
    "adam": lambda: optim.adam(1e-2),
    "adam + l2": lambda: optim.chain(optim.add_decayed_weights(1e-4), optim.adam(1e-2)),
    "sgd + l1": lambda: optim.chain(optim.add_l1_decay(1e-4), optim.sgd(1e-3)),
}


def rosenbrock(p: ml.ArrayWeight) -> ml.ScalarLayer:
    x, y = p[0], p[1]
    return (1.0 - x) ** 2.0 + 100.0 * (y - x * x) ** 2.0


def quadratic(p: ml.ArrayWeight) -> ml.ScalarLayer:
    return ml.sum(np.array([1.0, 10.0]) * (p - np.array([3.0, -2.0])) ** 2.0)


async def minimise(loss_fn: object, make: object, steps: int) -> tuple[float, float]:
    assert callable(loss_fn) and callable(make)
    p = ml.Weight(np.array([-1.2, 1.0]), optimizer=make())
    first = float(await loss_fn(p).predict())
    for _ in range(steps):
        await loss_fn(p).train()
    return first, float(await loss_fn(p).predict())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_reduces_quadratic_and_rosenbrock(name: str) -> None:
    first, last = anyio.run(minimise, quadratic, OPTIMIZERS[name], 3000)
    assert last < 0.01 * first, (first, last)
    first, last = anyio.run(minimise, rosenbrock, OPTIMIZERS[name], 3000)
    assert last < 0.25 * first, (first, last)


def test_adam_first_step_is_learning_rate_in_size() -> None:
    opt = optim.adam(0.1)
    update, _ = opt.update(np.array([5.0, -0.01]), opt.init(np.zeros(2)), np.zeros(2))
    np.testing.assert_allclose(update, [-0.1, 0.1], rtol=1e-5)


def test_schedules() -> None:
    assert optim.exponential_decay(1.0, 0.5)(3) == 0.125
    cosine = optim.cosine_decay_schedule(2.0, 10, alpha=0.1)
    assert cosine(0) == pytest.approx(2.0)
    assert cosine(10) == pytest.approx(0.2)
    assert cosine(99) == pytest.approx(0.2)


def test_default_optimizer_is_documented_sgd_and_overridable() -> None:
    w = ml.Weight(np.zeros(1))
    update, _ = w.optimizer.update(np.ones(1), w.optimizer.init(w.data), w.data)
    np.testing.assert_allclose(update, [-optim.DEFAULT_LEARNING_RATE])
    with optim.using_default(optim.sgd(0.5)):
        v = ml.Weight(np.zeros(1))
    update, _ = v.optimizer.update(np.ones(1), v.optimizer.init(v.data), v.data)
    np.testing.assert_allclose(update, [-0.5])


def test_weight_keeps_its_dtype() -> None:
    w = ml.Weight(np.ones(3, np.float32), optimizer=optim.adam(0.1))
    anyio.run((ml.sum(w * np.ones(3, np.float32))).train)
    assert w.data.dtype == np.float32
    s = ml.Weight(1.0, optimizer=optim.momentum(0.1))
    anyio.run((s * s).train)
    assert isinstance(s.data, float) and s.data == pytest.approx(0.8)


def test_bad_optimizer_arguments() -> None:
    with pytest.raises(ValueError, match="learning_rate"):
        optim.sgd(-1.0)
    with pytest.raises(ml.OperandError, match="GradientTransformation"):
        ml.Weight(np.zeros(2), optimizer="adam")  # type: ignore[call-overload]  # the mistake under test


def test_an_optimizers_repr_shows_its_hyperparameters() -> None:
    assert repr(optim.adam(0.1)) == (
        "GradientTransformation(chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), scale(-0.1)))"
    )
    assert repr(optim.adagrad(0.1)) == (
        "GradientTransformation(chain(scale_by_adagrad(eps=1e-07) with init(initial_accumulator=0.1), scale(-0.1)))"
    )


def test_a_schedules_repr_shows_every_number_it_holds() -> None:
    """join_schedules held its schedules and boundaries in lists, shown as
    ``list``: every warmup read alike, in the repr and across ranks."""
    warmup = optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000)
    assert repr(optim.adam(warmup)) == (
        "GradientTransformation(chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), scale_by_learning_rate("
        "schedule=warmup_cosine_decay_schedule(decay_steps=1000, end_value=0.0, init_value=0.0, peak_value=0.001, "
        "warmup_steps=10))))"
    )
    joined = optim.join_schedules([optim.linear_schedule(0.0, 0.1, 5), optim.cosine_decay_schedule(0.1, 20)], [5])
    assert spec(optim.sgd(joined)) == (
        "scale_by_learning_rate(schedule=join_schedules(boundaries=[5], schedules=[linear_schedule(end_value=0.1, "
        "init_value=0.0, transition_steps=5), cosine_decay_schedule(alpha=0.0, decay_steps=20, init_value=0.1)]))"
    )


def test_optimizers_built_alike_read_alike_and_others_do_not() -> None:
    """What data parallelism compares across ranks: two builds of one optimizer
    give one text; a rate, a decay or a schedule's parameter of another value, another."""
    built: list[Callable[[], optim.GradientTransformation]] = [
        lambda: optim.adam(0.1),
        lambda: optim.adam(0.01),
        lambda: optim.momentum(0.1, 0.8),
        lambda: optim.sgd(optim.exponential_decay(0.1, 0.5)),
        lambda: optim.sgd(optim.exponential_decay(0.1, 0.6)),
        lambda: optim.chain(optim.scale(2.0), optim.sgd(0.1)),
        lambda: optim.adam(optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000)),
        lambda: optim.adam(optim.warmup_cosine_decay_schedule(0.0, 0.5, 500, 600)),
        lambda: optim.adam(optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000, end_value=1e-5)),
        lambda: optim.sgd(optim.join_schedules([optim.constant_schedule(0.1), optim.constant_schedule(0.001)], [5])),
        lambda: optim.sgd(optim.join_schedules([optim.constant_schedule(9.0), optim.constant_schedule(7.0)], [1000])),
        lambda: optim.sgd(optim.join_schedules([optim.constant_schedule(9.0), optim.constant_schedule(7.0)], [5])),
        lambda: optim.sgd(optim.cosine_decay_schedule(0.1, 100, alpha=0.1)),
        lambda: optim.sgd(optim.linear_schedule(0.0, 0.1, 100)),
    ]
    texts = [spec(make()) for make in built]
    assert texts == [spec(make()) for make in built]
    assert len(set(texts)) == len(texts)


def test_what_the_user_wrote_is_named_not_opened() -> None:
    """A function or object of the user's may hold what rightly differs
    between processes (the rank it logs on, a set ordered by the hash seed, an
    object-dtype array's pointers), or something large, or no module at all:
    its name alone, read at once."""
    rank, kinds, table = 3, {"linear", "cosine"}, np.arange(1e6)

    def schedule(step: int) -> float:
        return float(table[step]) if rank and "cosine" in kinds else 0.0

    anonymous = eval("lambda step: 0.1", {})  # (its __module__ is None)

    class Rates:
        def __init__(self) -> None:
            self.objects = np.array([object()], dtype=object)

        def __call__(self, step: int) -> float:
            return 0.1

    texts = [spec(optim.sgd(f)) for f in (schedule, anonymous, Rates(), Rates().__call__)]
    prefix = "scale_by_learning_rate(schedule="
    local = "test_what_the_user_wrote_is_named_not_opened.<locals>"
    names = [f"{local}.schedule", "<lambda>", f"{local}.Rates", f"{local}.Rates.__call__"]
    assert texts == [f"{prefix}{name})" for name in names]
    own = optim.GradientTransformation(lambda p: table, lambda g, s, p: (g, s))
    assert spec(own) == f"{local}.<lambda>"


@pytest.mark.parametrize(("dtype", "gradient"), [(np.float16, 300.0), (np.float32, 1e20), (np.float64, 1e155)])
def test_adams_first_step_is_the_rate_however_large_the_gradient(dtype: Any, gradient: float) -> None:
    """The first bias-corrected step is lr * g / |g| (to eps). nu / (1 - b2)
    overflowed the dtype where nu did not: the denominator was infinite and
    the weight did not move, silently (PyTorch divides the root instead)."""
    weight = ml.Weight(np.ones(2, dtype), optimizer=optim.adam(0.1))
    optim.apply_gradients({weight: np.array([gradient, -gradient], dtype)})
    np.testing.assert_allclose(weight.data, np.array([0.9, 1.1], dtype), rtol=1e-3)
    assert weight.data.dtype == dtype


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # optax's habit: clipping is a transformation there; here it is a step of one's own.
        ((optim.clip_by_global_norm, optim.sgd(0.1)), r"argument 1 is clip_by_global_norm.*ml\.value_and_gradients"),
        (
            (optim.sgd, optim.adam(0.1)),
            r"argument 1 is the function sgd, not called: call it, as in sgd\(learning_rate\)",
        ),
        ((optim.sgd(0.1), 3), r"argument 2 is int 3, not a GradientTransformation"),
        ((optim.sgd(0.1), lambda g: g), r"argument 2 is the function <lambda>, not a GradientTransformation"),
    ],
)
def test_chain_refuses_what_is_no_transformation_naming_it(arguments: tuple[Any, ...], message: str) -> None:
    # They were accepted, and ml.Weight(..., optimizer=...) failed: 'function' object has no attribute 'init'.
    with pytest.raises(TypeError, match=rf"^chain: {message}"):
        optim.chain(*arguments)


def test_chain_of_nothing_is_refused() -> None:
    # Its update was the gradient itself, which a step adds: a weight went up the gradient, 0 -> 2.
    with pytest.raises(TypeError, match=r"chain\(\) of no transformations would add the gradient"):
        optim.chain()


def test_chain_takes_any_init_update_pair() -> None:
    pair = optim.GradientTransformation(lambda p: (), lambda g, s, p: (2.0 * g, s))
    opt = optim.chain(pair, optim.sgd(0.5))
    assert opt.update(1.0, opt.init(0.0), 0.0)[0] == -1.0


def test_a_weight_given_an_uncalled_optimizer_or_clipping_says_what_to_write() -> None:
    bad: Any = optim.sgd
    with pytest.raises(ml.OperandError, match=r"optimizer is the function sgd, not called: call it"):
        ml.Weight(np.zeros(2), optimizer=bad)
    bad = optim.clip_by_global_norm
    with pytest.raises(
        ml.OperandError, match=r"ml\.optim\.clip_by_global_norm\(gradients, max_norm\), then ml\.optim\.apply_gradients"
    ):
        ml.Weight(np.zeros(2), optimizer=bad)
    w, bad = ml.Weight(np.zeros(2)), optim.adam
    with pytest.raises(ml.OperandError, match=r"the function adam, not called: call it, as in adam\(learning_rate\)"):
        w.optimizer = bad


def test_none_or_false_as_an_optimizer_points_to_stop_gradient_for_freezing() -> None:
    # A user freezing a teacher with optimizer=None got the default optimizer, and a teacher that trained;
    # the setter's refusal of None said nothing of ml.stop_gradient, the documented way to freeze.
    freeze = (
        "does not freeze a weight: to freeze it, read it through ml.stop_gradient(w) where the model uses it (it "
        "then takes no step and its optimizer state stays as it is); for the default optimizer, "
        "ml.optim.default_optimizer()"
    )
    not_one = (
        "not a GradientTransformation: an optimizer such as ml.optim.sgd(0.1), or GradientTransformation(init, update)"
    )
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=optim.adam(1e-2))
    state = w.state
    bad: Any = None
    with pytest.raises(ml.OperandError) as raised:
        w.optimizer = bad
    assert str(raised.value) == f"Weight.optimizer: the optimizer is NoneType None, {not_one}; None {freeze}"
    assert w.state is state
    bad = False
    with pytest.raises(ml.OperandError) as raised:
        ml.Weight(np.zeros(2), optimizer=bad)
    assert str(raised.value) == f"Weight(...): optimizer is bool False, {not_one}; False {freeze}"
    bad = 3
    with pytest.raises(ml.OperandError) as raised:
        w.optimizer = bad
    assert "freeze" not in str(raised.value)  # (no hint where it is no attempt to freeze)
    # None is the default optimizer, as documented: the weight trains; ml.stop_gradient freezes it.
    default = ml.Weight(np.array([1.0, 2.0]), optimizer=None)
    anyio.run(ml.sum(default * default).train)
    np.testing.assert_allclose(default.data, [1.0 - 0.0005 * 2.0, 2.0 - 0.0005 * 4.0], rtol=1e-12)
    frozen = ml.Weight(np.array([1.0, 2.0]), optimizer=None)
    anyio.run(ml.sum(ml.stop_gradient(frozen) * ml.Weight(np.ones(2))).train)
    np.testing.assert_array_equal(frozen.data, [1.0, 2.0])


def _adam_by_formula(g: Any, state: Any, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, Any]:
    """Adam's update as its docstring writes it, one expression a line (new arrays throughout)."""
    count = state.step + 1
    mu = b1 * state.mu + (1 - b1) * g
    nu = b2 * state.nu + (1 - b2) * g * g
    update = (mu / (1 - b1**count)) / (np.sqrt(nu) / math.sqrt(1 - b2**count) + eps)
    return update, optim.AdamState(count, mu, nu)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7,), (5, 3)])
def test_adams_update_in_place_is_the_formula_bit_for_bit(dtype: Any, shape: tuple[int, ...]) -> None:
    # NumPy arrays of one dtype and shape are updated in place into fresh arrays (6 a step, not 12):
    # the same numbers, overflowing moments (float16) included, and the step's state is new arrays.
    rng = np.random.default_rng(3)
    transform = optim.scale_by_adam()
    p = np.zeros(shape, dtype)
    state = expected = transform.init(p)
    for scale in (1.0, 1e-3, 300.0, 9000.0, 0.0):
        g = (rng.normal(size=shape) * scale).astype(dtype)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            before = state
            update, state = transform.update(g, state, p)
            want, expected = _adam_by_formula(g, expected)
        assert update.dtype == dtype and state.mu.dtype == dtype and state.nu.dtype == dtype
        np.testing.assert_array_equal(update, want)
        np.testing.assert_array_equal(state.mu, expected.mu)
        np.testing.assert_array_equal(state.nu, expected.nu)
        assert state.mu is not before.mu and state.nu is not before.nu and update is not g
    assert np.isinf(state.nu).any() == (dtype == np.float16)  # (float16's moments overflowed, as by the formula)


def test_adam_promotes_a_gradient_of_another_dtype_as_its_formula_does() -> None:
    # (no in-place cast: a float64 gradient of float32 moments makes float64 moments, as before)
    transform = optim.scale_by_adam()
    state = transform.init(np.zeros(3, np.float32))
    g = np.array([1.0, 2.0, 1e-30])
    update, new = transform.update(g, state, None)
    want, expected = _adam_by_formula(g, state)
    assert new.mu.dtype == np.float64 and update.dtype == np.float64
    np.testing.assert_array_equal(update, want)
    np.testing.assert_array_equal(new.nu, expected.nu)
