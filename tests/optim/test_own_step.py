"""A step of one's own: `ml.value_and_gradients`, then `ml.optim.apply_gradients`
(clipped by `ml.optim.clip_by_global_norm` or not), is the step `train()` takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.deltas import SparseRows


def model() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "w": ml.Weight(rng.standard_normal((3, 2)), optimizer=ml.optim.adam(0.1)),
        "frozen": ml.Weight(rng.standard_normal(2), optimizer=ml.optim.adam(0.1)),
        "table": ml.Weight(rng.standard_normal((5, 3)), optimizer=ml.optim.adam(0.1)),
    }


def loss(m: dict[str, Any], rows: list[int]) -> ml.ScalarLayer:
    h = ml.tanh(ml.embedding(m["table"], np.array(rows)) @ m["w"])
    return ml.sum(h * ml.stop_gradient(m["frozen"]))


def test_an_unclipped_step_of_ones_own_is_the_step_train_takes() -> None:
    # It gave a weight the loss reaches only through stop_gradient a zero gradient,
    # which Adam stepped on its momentum, and an embedding table a dense one, whose
    # rows not looked up moved on theirs (a user's clipping steps beside train()'s).
    by_train, by_hand = model(), model()
    for rows in ([0, 1], [2, 2], [1, 4]):
        trained = anyio.run(loss(by_train, rows).train)
        value, grads = anyio.run(ml.value_and_gradients, loss(by_hand, rows))
        assert value == trained
        assert by_hand["frozen"] not in grads and type(grads[by_hand["table"]]) is SparseRows
        ml.optim.apply_gradients(ml.optim.clip_by_global_norm(grads, 1e9))
    ml.optim.apply_gradients({by_train["frozen"]: np.ones(2)})  # (give both the same momentum ...)
    ml.optim.apply_gradients({by_hand["frozen"]: np.ones(2)})
    anyio.run(loss(by_train, [3]).train)  # (... which a step of zeros would spend)
    _, grads = anyio.run(ml.value_and_gradients, loss(by_hand, [3]))
    ml.optim.apply_gradients(grads)
    for name in by_train:
        np.testing.assert_array_equal(by_train[name].data, by_hand[name].data, err_msg=name)


def test_clip_by_global_norm_counts_a_row_looked_up_twice_as_its_dense_gradient_does() -> None:
    table, w = ml.Weight(np.zeros((4, 2))), ml.Weight(np.zeros(1))
    twice = SparseRows(np.array([1, 1]), np.array([[3.0, 0.0], [0.0, 4.0]]), (4, 2))  # (row 1: [3, 4])
    clipped = ml.optim.clip_by_global_norm({table: twice, w: np.array([0.0])}, 1.0)
    got = clipped[table]
    assert type(got) is SparseRows
    np.testing.assert_allclose(got.to_dense()[1], [0.6, 0.8], rtol=1e-6)
    unclipped = ml.optim.clip_by_global_norm({table: twice}, 10.0)
    assert unclipped[table] is twice
    with pytest.raises(ValueError, match="max_norm must be positive"):
        ml.optim.clip_by_global_norm({w: np.ones(1)}, 0.0)


@pytest.mark.parametrize(
    ("dtype", "big"),
    [(np.float16, 300.0), (np.float32, 3e20), (np.float64, 3e200)],
)
def test_a_norm_whose_squares_overflow_clips_as_its_value_says(dtype: Any, big: float) -> None:
    # Squared in their dtype, float16 entries of 256 on (float32 of about 1e19) made the norm inf, and
    # clipping multiplied every gradient by 0 (a new user's trial; PyTorch's clip_grad_norm_ does too).
    w, v = ml.Weight(np.zeros(3, dtype)), ml.Weight(np.zeros(2, dtype))
    grads = {w: np.array([big, big * 4 / 3, 0.0], dtype), v: np.array([0.0, 0.0], dtype)}
    assert ml.optim.global_norm(grads) == pytest.approx(big * 5 / 3, rel=1e-3)
    clipped = ml.optim.clip_by_global_norm(grads, 1.0)
    np.testing.assert_allclose(clipped[w].astype(np.float64), [0.6, 0.8, 0.0], rtol=1e-3)
    assert clipped[w].dtype == dtype
    assert np.isnan(ml.optim.global_norm({w: np.array([np.nan, 1.0, 0.0], dtype)}))  # (not finite: as it is)


def test_a_float16_norm_of_small_entries_is_not_zero() -> None:
    # Squared in float16, entries below about 2.4e-4 gave 0: no clipping at all (PyTorch squares in float32).
    w = ml.Weight(np.zeros(2, np.float16))
    grads = {w: np.array([1e-4, 1e-4], np.float16)}
    assert ml.optim.global_norm(grads) == pytest.approx(1e-4 * 2**0.5, rel=1e-3)
    np.testing.assert_allclose(ml.optim.clip_by_global_norm(grads, 1e-5)[w].astype(float), [7.07e-6] * 2, rtol=1e-2)


def test_gradients_not_given_by_weight_are_refused_with_what_to_pass() -> None:
    # A new user's clip_by_global_norm(list(grads.values()), 1.0) raised AttributeError:
    # 'list' object has no attribute 'values'.
    w = ml.Weight(np.array([3.0, 4.0]), optimizer=ml.optim.sgd(1.0))
    advice = (
        "takes the gradients by weight, a {weight: gradient} dict as ml.value_and_gradients gives them, got a "
        "{kind}; for gradients in the order of their weights, as ml.gradients(loss, weights) gives them, pass "
        "dict(zip(weights, gradients))"
    )
    given: Any  # (the mistake under test, which mypy rejects)
    calls: list[tuple[str, Callable[[Any], object]]] = [
        ("clip_by_global_norm", lambda g: ml.optim.clip_by_global_norm(g, 1.0)),
        ("global_norm", ml.optim.global_norm),
        ("apply_gradients", ml.optim.apply_gradients),
    ]
    for given, kind in [([np.array([3.0, 4.0])], "list"), ((np.array([3.0, 4.0]),), "tuple")]:
        for name, call in calls:
            with pytest.raises(TypeError) as raised:
                call(given)
            assert str(raised.value) == f"{name} {advice.replace('{kind}', kind)}"
    np.testing.assert_array_equal(w.data, [3.0, 4.0])
    weights, grads = [w], [np.array([3.0, 4.0])]
    clipped = ml.optim.clip_by_global_norm(dict(zip(weights, grads)), 1.0)  # (what the message says)
    np.testing.assert_allclose(clipped[w], [0.6, 0.8], rtol=1e-6)
    assert ml.optim.global_norm(dict(zip(weights, grads))) == 5.0


def test_clipping_refuses_a_non_finite_gradient_naming_its_weights_not_a_finite_ones() -> None:
    # One NaN in a regression target made the norm NaN; scaled by it every gradient was NaN, and
    # apply_gradients named the first weight it read: a head whose own gradient was finite (a user's trial).
    trunk = ml.Weight(np.ones((3, 3)), optimizer=ml.optim.adam(1e-2))  # TRUNK-SITE
    head_a = ml.Weight(np.ones((3, 2)), optimizer=ml.optim.adam(1e-2))
    head_b = ml.Weight(np.ones((3, 1)), optimizer=ml.optim.adam(1e-2))  # HEAD-B-SITE
    x, target = np.ones((4, 3)), np.ones((4, 1))
    target[0, 0] = np.nan
    h = ml.relu(x @ trunk)
    loss = ml.mean((h @ head_a) ** 2.0) + ml.mean((h @ head_b - target) ** 2.0)
    _, grads = anyio.run(ml.value_and_gradients, loss)
    assert np.isfinite(grads[head_a]).all()
    with pytest.raises(ml.NonFiniteError) as raised:
        ml.optim.clip_by_global_norm(grads, 1.0)
    here = __file__
    assert str(raised.value) == (
        f"clip_by_global_norm: the gradients' norm is nan: the gradients given for the weight built at "
        f"{here}:{_line_of('HEAD-B-SITE')} (shape [3, 1]) and the weight built at {here}:{_line_of('TRUNK-SITE')} "
        "(shape [3, 3]) (2 of 3 weights) hold a NaN or an infinity, and scaled by it every gradient would be NaN; "
        "skip this batch, or find where it came from: for gradients of ml.value_and_gradients, "
        "ml.settings(check_finite=True) finds the operation that made it (finite=False clips them all the same, as "
        "PyTorch's clip_grad_norm_ does by default)"
    )
    clipped = ml.optim.clip_by_global_norm(grads, 1.0, finite=False)  # (PyTorch's default: every one NaN)
    assert all(np.isnan(g).all() for g in clipped.values())
    assert np.isfinite(grads[head_a]).all()  # (only read)


def test_clipping_names_an_infinite_gradient_a_sparse_one_and_counts_those_not_shown() -> None:
    table = ml.Weight(np.zeros((5, 2)))  # TABLE-SITE
    fine = ml.Weight(np.zeros(2))
    rows = SparseRows(np.array([1, 3]), np.array([[1.0, np.inf], [0.0, 2.0]]), (5, 2))
    with pytest.raises(ml.NonFiniteError) as raised:
        ml.optim.clip_by_global_norm({fine: np.array([3.0, 4.0]), table: rows}, 1.0)
    assert str(raised.value).startswith(
        f"clip_by_global_norm: the gradients' norm is inf: the gradient given for the weight built at {__file__}:"
        f"{_line_of('TABLE-SITE')} (shape [5, 2]) (1 of 2 weights) holds a NaN or an infinity, and scaled by it "
        "the other entries would be 0, the infinities NaN; skip this batch"
    )
    many = [ml.Weight(np.zeros(1)) for _ in range(5)]
    with pytest.raises(ml.NonFiniteError, match=r"\(shape \[1\]\) and 2 more \(5 of 6 weights\) hold a NaN"):
        ml.optim.clip_by_global_norm({fine: np.ones(2), **{w: np.array([np.nan]) for w in many}}, 1.0)
    # Finite entries whose norm passes the largest float64 name no culprit: scaled by 0, as PyTorch's.
    huge = {fine: np.array([1.5e308, 1.5e308])}
    np.testing.assert_array_equal(ml.optim.clip_by_global_norm(huge, 1.0)[fine], [0.0, 0.0])


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if line.rstrip().endswith(f"# {marker}"))
