"""``softplus``, ``log_sigmoid`` and ``binary_cross_entropy_with_logits``
against PyTorch: values and gradients in float32 and float64, scores up to
1e4 in size, batched and not. A GAN's non-saturating loss written as
``-log(sigmoid(d))`` was infinite for a confident critic (a step refused
with `NonFiniteError`); these are finite for any score."""

from __future__ import annotations

import sys
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.gradcheck import check_grads
from tests._batched_groups import groups_run

torch = pytest.importorskip("torch")
F = torch.nn.functional

SCORES = np.array([-1e4, -800.0, -104.0, -50.0, -20.5, -1.0, -1e-3, 0.0, 1e-3, 1.0, 20.5, 37.5, 50.0, 800.0, 1e4])
DTYPES = [np.float64, np.float32]
TOLERANCE = {np.float64: 1e-15, np.float32: 1e-6}


def _torch(x: np.ndarray[Any, Any]) -> Any:
    return torch.tensor(x, requires_grad=True)


def _value_and_gradient(layer: Any, weights: list[ml.Weight[Any, Any]]) -> tuple[Any, list[Any]]:
    value = anyio.run(layer.predict)
    return value, list(anyio.run(ml.gradients, layer, weights))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("softplus", lambda t: -F.logsigmoid(-t)),  # (F.softplus returns x itself above 20: within 1e-9 relative)
        ("log_sigmoid", F.logsigmoid),
    ],
)
def test_softplus_and_log_sigmoid_match_pytorch_at_any_score(name: str, reference: Any, dtype: Any) -> None:
    x = SCORES.astype(dtype)
    w = ml.Weight(x.copy())
    scale = np.linspace(0.5, 2.0, x.size).astype(dtype)  # (each entry's delta its own)
    value, [grad] = _value_and_gradient(ml.sum(getattr(ml, name)(w) * scale), [w])
    values = anyio.run(getattr(ml, name)(w).predict)
    t = _torch(x)
    want = reference(t)
    (want * torch.tensor(scale)).sum().backward()
    assert values.dtype == grad.dtype == dtype
    assert np.isfinite(values).all() and np.isfinite(grad).all()
    np.testing.assert_allclose(values, want.detach().numpy(), rtol=TOLERANCE[dtype], atol=0)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=TOLERANCE[dtype], atol=1e-300)
    np.testing.assert_allclose(value, float(want.detach().numpy() @ scale), rtol=10 * TOLERANCE[dtype])


def test_softplus_is_within_1e9_of_pytorchs_where_pytorch_returns_x() -> None:
    x = SCORES
    got = anyio.run(ml.softplus(x).predict)
    np.testing.assert_allclose(got, F.softplus(torch.tensor(x)).numpy(), rtol=1e-9)
    assert got[SCORES == 20.5][0] == 20.5 + np.log1p(np.exp(-20.5)) != 20.5  # (PyTorch's: 20.5)


def test_log_sigmoids_delta_keeps_the_tail_that_one_minus_sigmoid_rounds_to_0() -> None:
    w = ml.Weight(np.array([40.0, 700.0]))
    [grad] = anyio.run(ml.gradients, ml.sum(ml.log_sigmoid(w)), [w])
    np.testing.assert_allclose(grad, np.exp(-np.array([40.0, 700.0])), rtol=1e-15)
    assert 1 - 1 / (1 + np.exp(-40.0)) == 0.0


def test_the_non_saturating_gan_loss_is_finite_where_log_of_sigmoid_is_not() -> None:
    d = ml.Weight(np.array([-800.0, 0.0, 800.0]))
    loss = ml.mean(ml.softplus(-d))  # -log(sigmoid(d))
    value, [grad] = _value_and_gradient(loss, [d])
    assert value == pytest.approx((800.0 + np.log(2.0)) / 3, rel=1e-15)
    np.testing.assert_allclose(grad, [-1 / 3, -1 / 6, 0.0], rtol=1e-15)
    with np.errstate(over="ignore", divide="ignore"):
        assert anyio.run((-ml.mean(ml.log(ml.sigmoid(d)))).predict) == np.inf


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "pos_weight"])
def test_binary_cross_entropy_matches_pytorch_for_logits_targets_and_weights(dtype: Any, weighted: bool) -> None:
    rng = np.random.default_rng(0)
    x = np.stack([SCORES, rng.permutation(SCORES), rng.normal(size=SCORES.size) * 3]).astype(dtype)
    y = np.stack([np.arange(x.shape[1]) % 2, rng.uniform(size=x.shape[1]), rng.uniform(size=x.shape[1]) > 0.5])
    y = y.astype(dtype)
    p = np.linspace(0.5, 3.0, x.shape[1]).astype(dtype)
    logits, targets, weight = ml.Weight(x.copy()), ml.Weight(y.copy()), ml.Weight(p.copy())
    loss = ml.binary_cross_entropy_with_logits(logits, targets, weight if weighted else None)
    value, grads = _value_and_gradient(loss, [logits, targets, weight])
    tx, ty, tp = _torch(x), _torch(y), torch.tensor(p)  # (PyTorch's has no delta for pos_weight)
    want = F.binary_cross_entropy_with_logits(tx, ty, pos_weight=tp if weighted else None)
    want.backward()
    assert type(value) is dtype and all(g.dtype == dtype for g in grads)
    assert value == pytest.approx(want.item(), rel=TOLERANCE[dtype])
    # (PyTorch's logits' delta, sigmoid(x) - t, rounds a tail of e**-|x| to 0 where t is 1 and x past 37
    # (float64); ours keeps it, so they agree to rounding of the largest entry.)
    largest = np.abs(grads[0]).max()
    np.testing.assert_allclose(grads[0], tx.grad.numpy(), rtol=10 * TOLERANCE[dtype], atol=largest * TOLERANCE[dtype])
    tail = (y == 1) & (x > 37) & (x < 700)
    assert tail.any()
    pos = p * np.ones_like(x) if weighted else np.ones_like(x)
    want_tail = -pos[tail] * np.exp(-x[tail].astype(np.float64)) / x.size
    np.testing.assert_allclose(grads[0][tail], want_tail, rtol=10 * TOLERANCE[dtype])
    # (PyTorch's targets' delta is log(1 - sigmoid(x)) - w log(sigmoid(x)): for scores past 37 in float64
    # (16 in float32) it rounds log(1 - sigmoid(x)) to -inf, or to within a few ulps of -x; ours is exact.)
    finite = np.abs(x) < (30.0 if dtype is np.float64 else 12.0)
    np.testing.assert_allclose(grads[1][finite], ty.grad.numpy()[finite], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grads[1], -x / x.size if not weighted else grads[1], rtol=TOLERANCE[dtype])
    if weighted:  # (its delta: the mean of targets * softplus(-x), per class)
        want_p = (y * -F.logsigmoid(torch.tensor(x)).numpy()).sum(axis=0) / x.size
        np.testing.assert_allclose(grads[2], want_p, rtol=10 * TOLERANCE[dtype])
    else:
        assert not grads[2].any()


def test_binary_cross_entropy_matches_finite_differences() -> None:
    rng = np.random.default_rng(1)
    x, y, p = rng.normal(size=(3, 4)), rng.uniform(size=(3, 4)), rng.uniform(0.5, 2.0, size=4)
    check_grads(ml.binary_cross_entropy_with_logits, x, y)
    check_grads(ml.binary_cross_entropy_with_logits, x, y, p)


def test_targets_shaped_otherwise_than_the_logits_are_refused_with_both_shapes() -> None:
    scores = ml.Weight(np.zeros((4, 1)))
    with pytest.raises(ml.ShapeError) as caught:
        anyio.run(ml.binary_cross_entropy_with_logits(scores, np.ones(4)).train)
    message = str(caught.value)
    assert message.startswith("binary_cross_entropy_with_logits: ")
    assert "targets must be shaped as the logits, got [4] for [4, 1]; reshape one" in message
    assert f"test_binary_losses.py:{caught.traceback[-1].lineno}" not in message  # (the user's line, below)
    assert "layer built at" in message and "test_binary_losses.py" in message
    assert not scores.data.any()


POS_WEIGHT_MISFIT = (
    "pos_weight must broadcast to the logits' shape {logits} without enlarging it, got {weight} (as PyTorch"
    " requires: a loss broadcast larger would be divided by the logits' count alone); one weight per class"
    " is shaped as the logits' last axis"
)


@pytest.mark.parametrize(("logits", "weight"), [((2, 3), (4, 2, 3)), ((4,), (4, 1)), ((2, 3), (2,))])
def test_a_pos_weight_that_enlarges_the_loss_is_refused_where_the_loss_is_built(
    logits: tuple[int, ...], weight: tuple[int, ...]
) -> None:
    """A (4, 2, 3) pos_weight for (2, 3) logits gave a loss 4 times too
    large, value and gradient; (N, 1) for (N,) logits N times (PyTorch
    refuses both). Shapes known where it is built (data, a weight): there."""
    x, t = np.zeros(logits), np.ones(logits)
    said = POS_WEIGHT_MISFIT.format(logits=list(logits), weight=list(weight))
    for scores in (x, ml.Weight(x)):
        with pytest.raises(ml.ShapeError) as caught:
            ml.binary_cross_entropy_with_logits(scores, t, np.ones(weight))
        assert str(caught.value) == f"binary_cross_entropy_with_logits: {said}"
    with pytest.raises(ml.ShapeError) as caught:
        ml.binary_cross_entropy_with_logits(x, t, ml.Weight(np.ones(weight)))
    assert str(caught.value) == f"binary_cross_entropy_with_logits: {said}"


def test_a_pos_weight_that_enlarges_the_loss_of_a_layer_is_refused_when_it_runs() -> None:
    scores = ml.Weight(np.zeros((2, 3)))
    line = sys._getframe().f_lineno + 1
    loss = ml.binary_cross_entropy_with_logits(scores * 1.0, np.ones((2, 3)), np.ones((4, 2, 3)))
    with pytest.raises(ml.ShapeError) as caught:
        anyio.run(loss.train)
    message = str(caught.value)
    assert message.startswith(
        "binary_cross_entropy_with_logits: operands float64[2, 3], float64[2, 3], float64[4, 2, 3] do not fit together ("
    )
    assert POS_WEIGHT_MISFIT.format(logits=[2, 3], weight=[4, 2, 3]) + f"); layer built at {__file__}:{line}" in message
    assert not scores.data.any()


def test_a_batched_members_pos_weight_that_enlarges_its_loss_is_refused_as_the_members() -> None:
    w, shared = ml.Weight(np.zeros((2, 3))), np.ones((4, 2, 3))  # (shared: the batching rule's case)
    losses = [ml.binary_cross_entropy_with_logits(w * float(i), np.ones((2, 3)), shared) for i in range(4)]
    with ml.settings(batching=True), pytest.raises(ml.ShapeError) as caught:
        anyio.run(ml.sum(ml.stack(losses)).predict)
    assert POS_WEIGHT_MISFIT.format(logits=[2, 3], weight=[4, 2, 3]) in str(caught.value)


def test_boolean_targets_are_cast_and_a_mixed_precision_is_refused() -> None:
    scores = ml.Weight(np.array([0.0, 2.0], np.float32))
    value = anyio.run(ml.binary_cross_entropy_with_logits(scores, np.array([True, False])).predict)
    assert np.asarray(value).dtype == np.float32  # (NumPy's scalar, typed as a float)
    assert value == pytest.approx((np.log(2.0) + 2.0 + np.log1p(np.exp(-2.0))) / 2, rel=1e-6)
    with pytest.raises(ml.DTypeError, match=r"^binary_cross_entropy_with_logits: operands .* mix float32 and float64"):
        anyio.run(ml.binary_cross_entropy_with_logits(scores, np.array([1.0, 0.0])).predict)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("targets", ["per example", "shared"])
def test_per_example_losses_batch_with_the_gradients_of_the_unbatched(
    dtype: Any, targets: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    n = 8
    xs = [rng.normal(size=(3, 2)).astype(dtype) for _ in range(n)]
    ys = [rng.uniform(size=(3, 2)).astype(dtype) for _ in range(n)] if targets == "per example" else [xs[0] * 0 + 1] * n
    w = ml.Weight(rng.normal(size=(2, 2)).astype(dtype) * 300)  # (scores in the hundreds: the stable branches)
    p = rng.uniform(0.5, 2.0, size=2).astype(dtype)

    def build() -> Any:
        losses = [
            ml.binary_cross_entropy_with_logits(x @ w, y, p) + ml.mean(ml.softplus(x @ w) + ml.log_sigmoid(x @ w))
            for x, y in zip(xs, ys)
        ]
        return ml.stack(losses) * np.arange(1.0, n + 1).astype(dtype)

    runs = []
    for batching in (False, True):
        ran = groups_run(monkeypatch)
        with ml.settings(batching=batching):
            runs.append((anyio.run(build().predict), anyio.run(ml.gradients, ml.sum(build()), [w])[0], ran))
    (off, off_grad, _), (on, on_grad, ran) = runs
    assert {"binary_cross_entropy_with_logits", "softplus", "log_sigmoid"} <= {name for name, size in ran if size == n}
    np.testing.assert_allclose(on, off, rtol=TOLERANCE[dtype])
    np.testing.assert_allclose(on_grad, off_grad, rtol=10 * TOLERANCE[dtype])
    losses = [
        F.binary_cross_entropy_with_logits(
            torch.tensor(x) @ torch.tensor(w.data), torch.tensor(y), pos_weight=torch.tensor(p)
        )
        + (
            F.softplus(torch.tensor(x) @ torch.tensor(w.data)) + F.logsigmoid(torch.tensor(x) @ torch.tensor(w.data))
        ).mean()
        for x, y in zip(xs, ys)
    ]
    # (a loss is a sum of terms as large as the scores, hundreds, times its weight up to n: where they
    # cancel, as to 4.5 in the last, two libraries' roundings differ by the terms' eps, not the sum's)
    scale = n * max(float(np.abs(x @ w.data).max()) for x in xs)
    want = [float(v) * (i + 1) for i, v in enumerate(losses)]
    np.testing.assert_allclose(on, want, rtol=10 * TOLERANCE[dtype], atol=10 * TOLERANCE[dtype] * scale)
