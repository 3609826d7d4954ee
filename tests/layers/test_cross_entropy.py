"""``cross_entropy``'s options (``weight``, ``ignore_index``, ``label_smoothing``):
PyTorch's values and gradients, float32 and float64, one loss or a batched
group of them; the refusals of what PyTorch would not compute or would
compute wrongly; and the plain call left as it was."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.gradcheck import check_grads
from monadl.layers._batching_rules import BATCHING_RULES
from monadl.layers._primitives import PRIMITIVES
from monadl.runtime import entry
from monadl.runtime.evaluation import Evaluation, Record
from monadl.runtime.node import collect
from monadl.runtime.schedule import batched as _batching

WEIGHT = np.array([0.5, 2.0, 1.0, 3.0])
OPTIONS: dict[str, dict[str, Any]] = {
    "weight": {"weight": WEIGHT},
    "ignore": {"ignore_index": 1},
    "ignore_outside_the_classes": {"ignore_index": -100},
    "smoothing": {"label_smoothing": 0.2},
    "weight_smoothing": {"weight": WEIGHT, "label_smoothing": 0.3},
    "weight_ignore_smoothing": {"weight": WEIGHT, "ignore_index": 3, "label_smoothing": 0.1},
    "ignore_smoothing": {"ignore_index": 3, "label_smoothing": 0.1},
    "all_smoothing": {"weight": WEIGHT, "label_smoothing": 1.0},
}
LABELS = np.array([0, 3, 1, 1, 2, 3, -100])


def line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


def reference(
    logits: Any, labels: Any, weight: Any = None, ignore_index: Any = None, label_smoothing: float = 0.0
) -> Any:
    """PyTorch's formula (``cross_entropy_loss_label_smoothing``, reduction
    'mean'), row by row in NumPy: ``(1 - e) sum_i w_i nll_i / W + (e / C)
    sum_i sum_c weight_c (-log p_ic) / W`` over the rows not ignored, ``W =
    sum_i w_i``."""
    classes = logits.shape[1]
    weight = np.ones(classes) if weight is None else weight
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll = smooth = total = 0.0
    for row, label in zip(log_p, labels):
        if label == ignore_index:
            continue
        nll -= weight[label] * row[label]
        smooth -= (weight * row).sum()
        total += weight[label]
    return ((1 - label_smoothing) * nll + label_smoothing / classes * smooth) / total


async def value_and_gradient(logits: Any, labels: Any, **options: Any) -> tuple[Any, Any]:
    w = ml.Weight(logits)
    value, grads = await ml.value_and_gradients(ml.cross_entropy(w, labels, **options))
    return value, grads[w]


def logits_and_labels(options: dict[str, Any], dtype: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Seven rows of four classes; the last row's label, -100, only where it is ignored."""
    logits = np.random.default_rng(0).standard_normal((7, 4)).astype(dtype)
    labels = LABELS if options.get("ignore_index") == -100 else LABELS[:-1]
    options = {k: v.astype(dtype) if k == "weight" else v for k, v in options.items()}
    return logits[: len(labels)], labels, options


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_values_and_gradients_are_pytorchs(name: str, dtype: Any) -> None:
    torch = pytest.importorskip("torch")
    logits, labels, options = logits_and_labels(OPTIONS[name], dtype)
    value, gradient = anyio.run(lambda: value_and_gradient(logits, labels, **options))
    t = torch.tensor(logits, requires_grad=True)
    theirs = {k: torch.tensor(v) if k == "weight" else v for k, v in options.items()}
    theirs.setdefault("ignore_index", -100)
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(labels), **theirs)
    loss.backward()
    assert np.asarray(value).dtype == gradient.dtype == dtype
    rtol = 1e-13 if dtype == np.float64 else 1e-6
    assert float(value) == pytest.approx(loss.item(), rel=rtol)
    assert float(value) == pytest.approx(reference(logits.astype(np.float64), labels, **OPTIONS[name]), rel=rtol)
    np.testing.assert_allclose(gradient, t.grad.numpy(), rtol=rtol * 10, atol=rtol * 0.1)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_values_are_pytorchs_formula_and_gradients_finite_differences(name: str) -> None:
    logits, labels, options = logits_and_labels(OPTIONS[name], np.float64)
    value, _ = anyio.run(lambda: value_and_gradient(logits, labels, **options))
    assert float(value) == pytest.approx(reference(logits, labels, **options), rel=1e-13)
    check_grads(lambda z: ml.cross_entropy(z, labels, **options), logits)


def test_the_weighted_mean_divides_by_the_weights_picked() -> None:
    logits = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    loss = ml.cross_entropy(logits, np.array([0, 0, 1]), weight=np.array([1.0, 3.0]))
    soft = np.log1p(np.exp(-2.0))  # -log softmax of the larger of two logits 2 apart
    want = (soft + (2.0 + soft) + 3.0 * np.log(2.0)) / 5.0  # rows weighted 1, 1 and 3
    assert float(anyio.run(loss.predict)) == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize(
    "options", [{"ignore_index": 2}, {"ignore_index": 2, "weight": WEIGHT, "label_smoothing": 0.1}], ids=["", "all"]
)
def test_a_batch_with_every_row_ignored_is_nan_with_a_zero_gradient_as_in_pytorch(options: dict[str, Any]) -> None:
    logits = np.random.default_rng(1).standard_normal((3, 4))
    value, gradient = anyio.run(lambda: value_and_gradient(logits, np.array([2, 2, 2]), **options))
    assert np.isnan(value)
    np.testing.assert_array_equal(gradient, np.zeros((3, 4)))
    loss = ml.cross_entropy(logits, np.array([2, 2, 2]), **options)  # ALL-IGNORED
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(loss.predict)
    assert str(info.value).startswith("cross_entropy produced a NaN or an infinity from float64[3, 4]")
    assert f"{__file__}:{line_of('ALL-IGNORED')}" in str(info.value)


@pytest.mark.parametrize(
    "name", ["ignore_outside_the_classes", "weight", "ignore_smoothing", "weight_ignore_smoothing"]
)
@pytest.mark.parametrize("padding", [-np.inf, np.nan], ids=["masked", "nan"])
def test_an_ignored_rows_nonfinite_logits_count_for_nothing_as_in_pytorch(
    name: str, padding: float, recwarn: pytest.WarningsRecorder
) -> None:
    """A padding row, labelled ignore_index, its logits masked to -inf (or
    NaN): the loss is the other rows', finite (it was 0 * NaN, NaN), and
    that row's delta 0 (PyTorch's is NaN there; the others' are the same)."""
    options = {**OPTIONS[name], "ignore_index": OPTIONS[name].get("ignore_index", -100)}
    logits, labels, _ = logits_and_labels(options, np.float64)
    padded = np.concatenate([logits, np.full((1, 4), padding)])
    labels = np.append(labels, options["ignore_index"])
    value, gradient = anyio.run(lambda: value_and_gradient(padded, labels, **options))
    want, want_gradient = anyio.run(lambda: value_and_gradient(logits, labels[:-1], **options))
    assert float(value) == pytest.approx(float(want), rel=1e-14)
    assert float(value) == pytest.approx(reference(logits, labels[:-1], **options), rel=1e-13)
    np.testing.assert_allclose(gradient[:-1], want_gradient, rtol=1e-14)
    np.testing.assert_array_equal(gradient[-1], np.zeros(4))
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # (-inf - -inf, unread: no warning)
    torch = pytest.importorskip("torch")
    t = torch.tensor(padded, requires_grad=True)
    theirs = {k: torch.tensor(v) if k == "weight" else v for k, v in options.items()}
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(labels), **theirs)
    loss.backward()
    assert float(value) == pytest.approx(loss.item(), rel=1e-13)
    np.testing.assert_allclose(gradient[:-1], t.grad.numpy()[:-1], rtol=1e-12, atol=1e-16)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
def test_rows_of_classes_weighted_zero_only_are_nan_as_in_pytorch(smoothing: float) -> None:
    """With smoothing too: the smoothed part's sum is not 0 (it was inf, its
    delta +-inf); PyTorch's is the sum of two means, the first 0 / 0."""
    logits = np.random.default_rng(1).standard_normal((3, 4))
    options: dict[str, Any] = {"weight": np.array([1.0, 1.0, 0.0, 1.0]), "label_smoothing": smoothing}
    value, gradient = anyio.run(lambda: value_and_gradient(logits, np.array([2, 2, 2]), **options))
    assert np.isnan(value) and np.isnan(gradient).all()  # (0 / 0: PyTorch's NaN everywhere too)
    torch = pytest.importorskip("torch")
    t = torch.tensor(logits, requires_grad=True)
    theirs = {**options, "weight": torch.tensor(options["weight"])}
    loss = torch.nn.functional.cross_entropy(t, torch.tensor([2, 2, 2]), **theirs)
    loss.backward()
    assert np.isnan(loss.item()) and t.grad.isnan().all()


def test_a_batched_member_whose_weights_picked_are_0_is_nan_alone_with_smoothing() -> None:
    rng = np.random.default_rng(3)
    logits, rows = rng.standard_normal((3, 2, 4)), np.arange(2)
    labels = np.array([[0, 1], [2, 2], [3, 1]])  # (member 1 picks class 2 only, weighted 0)
    args = (logits, rows, labels, np.array([1.0, 2.0, 0.0, 0.5]), None, 0.2)
    batched = BATCHING_RULES["cross_entropy"](args, (True, False, True, False, False, False), 3)
    assert batched is not None
    losses, (vjp,) = batched
    gradient = vjp(np.ones(3))
    assert np.isnan(losses[1]) and np.isnan(gradient[1]).all()
    assert np.isfinite(losses[[0, 2]]).all() and np.isfinite(gradient[[0, 2]]).all()


def test_ignored_labels_are_not_checked_and_the_others_are() -> None:
    logits = np.zeros((3, 4))
    loss = ml.cross_entropy(logits, np.array([0, -100, 3]), ignore_index=-100)
    assert float(anyio.run(loss.predict)) == pytest.approx(np.log(4.0), rel=1e-15)
    wrong = ml.cross_entropy(logits, np.array([0, -100, 7]), ignore_index=-100)  # OUT-OF-RANGE
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(wrong.predict)
    assert str(info.value) == (
        "cross_entropy: label 7 at labels[2] out of range for 4 classes (labels must lie in [0, 4));"
        f" layer built at {__file__}:{line_of('OUT-OF-RANGE')}"
    )


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            {"weight": np.array([1, 2, 3, 4])},
            "weight must be a 1-D float array, one weight per class, got int64[4] (cast it to the logits' dtype:",
        ),
        ({"weight": np.ones((2, 4))}, "weight must be a 1-D float array, one weight per class, got float64[2, 4]"),
        ({"weight": np.array([1.0, -2.0, 3.0, 4.0])}, "weight must hold finite weights >= 0, got -2.0 at weight[1]"),
        ({"weight": np.array([1.0, 1.0, np.nan, 4.0])}, "weight must hold finite weights >= 0, got nan at weight[2]"),
        ({"weight": np.array([1.0, 1.0, 1.0, np.inf])}, "weight must hold finite weights >= 0, got inf at weight[3]"),
        (
            {"weight": ml.Weight(np.ones(4))},
            "weight must be plain data (an array of one weight per class), got a Weight",
        ),
        ({"ignore_index": 1.5}, "ignore_index (a label) must be an integer, got 1.5"),
        ({"ignore_index": True}, "ignore_index (a label) must be an integer, got True"),
        ({"label_smoothing": 1.5}, "label_smoothing must lie in [0.0, 1.0], got 1.5"),
        ({"label_smoothing": -0.1}, "label_smoothing must lie in [0.0, 1.0], got -0.1"),
        ({"label_smoothing": float("nan")}, "label_smoothing must lie in [0.0, 1.0], got nan"),
    ],
)
def test_wrong_options_are_refused_where_the_loss_is_built(options: dict[str, Any], said: str) -> None:
    with pytest.raises(ml.OperandError) as info:
        ml.cross_entropy(np.zeros((2, 4)), np.array([0, 1]), **options)
    assert str(info.value).startswith(f"cross_entropy: {said}")


def test_weights_not_one_per_class_or_of_another_dtype_are_refused_when_the_loss_runs() -> None:
    w = ml.Weight(np.zeros((2, 4), dtype=np.float32))
    short = ml.cross_entropy(w, np.array([0, 1]), weight=np.ones(3, dtype=np.float32))  # SHORT
    with pytest.raises(ml.ShapeError) as shape_info:
        anyio.run(short.predict)
    assert str(shape_info.value).startswith(
        "cross_entropy: cannot take float32[2, 4] (weight holds 3 class weights for logits of 4 classes);"
        f" layer built at {__file__}:{line_of('SHORT')}"
    )
    wide = ml.cross_entropy(w, np.array([0, 1]), weight=np.ones(4))  # FLOAT64
    with pytest.raises(ml.DTypeError) as dtype_info:
        anyio.run(wide.predict)
    assert str(dtype_info.value) == (
        "cross_entropy: weight float64[4] for float32 logits; cast it first (weight.astype(np.float32) in NumPy),"
        f" as PyTorch refuses it too; layer built at {__file__}:{line_of('FLOAT64')}"
    )


def test_host_weights_for_another_librarys_logits_are_copied_over_and_checked_by_dtype_name() -> None:
    """array_api_strict logits (a stand-in for CuPy's) with a NumPy weight of
    their precision: copied over, as labels are (it was refused, comparing
    two libraries' dtypes, with the hint 'np.array_api_strict.float64')."""
    xs = pytest.importorskip("array_api_strict")
    logits, labels, options = logits_and_labels(OPTIONS["weight_ignore_smoothing"], np.float64)
    w = ml.Weight(xs.asarray(logits))
    value, grads = entry.gradients_sync(ml.cross_entropy(w, labels, **options))
    want, want_gradient = anyio.run(lambda: value_and_gradient(logits, labels, **options))
    assert float(value) == float(want)
    np.testing.assert_array_equal(np.asarray(grads[w]), want_gradient)
    for weight, hint in (
        (WEIGHT.astype(np.float32), "weight.astype(np.float64) in NumPy"),
        (xs.asarray(WEIGHT, dtype=xs.float32), "xp.astype(weight, xp.float64), xp = weight.__array_namespace__()"),
    ):
        loss = ml.cross_entropy(w, labels, weight=weight)  # STRICT
        with pytest.raises(ml.DTypeError) as info:
            anyio.run(loss.predict)
        assert str(info.value) == (
            f"cross_entropy: weight float32[4] for float64 logits; cast it first ({hint}), as PyTorch refuses it"
            f" too; layer built at {__file__}:{line_of('STRICT')}"
        )


def test_the_plain_call_builds_the_node_it_built() -> None:
    """Without options (or with their defaults) the node's parameters are
    the rows and labels only: the same rule and batching signature as before."""
    labels = np.array([0, 2])
    for loss in (
        ml.cross_entropy(np.zeros((2, 3)), labels),
        ml.cross_entropy(np.zeros((2, 3)), labels, weight=None, ignore_index=None, label_smoothing=0.0),
    ):
        rows, classes = loss._params
        np.testing.assert_array_equal(rows, [0, 1])
        assert classes is labels
    three = WEIGHT[:3]
    _, _, weight, ignore, smoothing = ml.cross_entropy(np.zeros((2, 3)), labels, weight=three)._params
    assert (weight, ignore, smoothing) == (three, None, 0.0)


# ---- batched -------------------------------------------------------------------------
def per_example_losses(w: ml.ArrayWeight, own_weights: bool, **options: Any) -> ml.ScalarLayer:
    """12 losses, each its own weight array where ``own_weights``; member 5's
    rows all ignored, where a label is (its loss NaN, its gradient zero)."""
    rng = np.random.default_rng(4)
    losses = []
    for i in range(12):
        x, y = rng.standard_normal((3, 5)), rng.integers(0, 4, 3)
        if i == 5 and "ignore_index" in options:
            y = np.full(3, options["ignore_index"])
        weight: dict[str, Any] = {"weight": WEIGHT.copy()} if own_weights else {}
        losses.append(ml.cross_entropy(ml.as_layer(x) @ w, y, **options, **weight))
    return ml.sum(ml.stack(losses))


@pytest.mark.parametrize("own_weights", [False, True], ids=["shared", "own"])
@pytest.mark.parametrize("name", ["weight", "ignore", "weight_ignore_smoothing", "smoothing"])
def test_per_example_losses_batch_as_one_group_with_each_members_value_and_gradient(
    name: str, own_weights: bool
) -> None:
    w = ml.Weight(np.random.default_rng(2).standard_normal((5, 4)))
    options = {k: v for k, v in OPTIONS[name].items() if k != "weight" or not own_weights}
    results = []
    for batching in (False, True):
        with ml.settings(batching=batching):
            results.append(entry.gradients_sync(per_example_losses(w, own_weights, **options)))
    (value, grads), (batched_value, batched_grads) = results
    assert np.isnan(value) == ("ignore_index" in options)
    np.testing.assert_allclose(batched_value, value, rtol=1e-13)
    assert np.isfinite(grads[w]).all()
    np.testing.assert_allclose(batched_grads[w], grads[w], rtol=1e-12, atol=1e-15)
    ev = Evaluation(train=True)
    with ml.settings(batching=True):
        _batching.forward(ev, collect(ev, [per_example_losses(w, own_weights, **options)]))
    groups = [
        np.shape(r.value) for key, r in ev.records.items() if type(key) is Record and r.node._op.name == "cross_entropy"
    ]
    assert (12,) in groups  # the 12 losses as one kernel


@pytest.mark.parametrize("stacked_weights", [False, True])
def test_the_batching_rule_with_options_gives_each_members_rule(stacked_weights: bool) -> None:
    rng = np.random.default_rng(1)
    logits = [rng.standard_normal((3, 4)) for _ in range(5)]
    labels = [rng.integers(0, 4, 3) for _ in range(5)]
    labels[2] = np.array([1, 1, 1])
    weights = [rng.uniform(0.5, 2.0, 4) for _ in range(5)] if stacked_weights else [WEIGHT] * 5
    rows = np.arange(3)
    weight = np.stack(weights) if stacked_weights else WEIGHT
    args = (np.stack(logits), rows, np.stack(labels), weight, 1, 0.2)
    batched = BATCHING_RULES["cross_entropy"](args, (True, False, True, stacked_weights, False, False), 5)
    assert batched is not None
    losses, (vjp,) = batched
    g = rng.standard_normal(5)
    got = vjp(g)
    for i in range(5):
        value, (single,) = PRIMITIVES["cross_entropy"].rule(logits[i], rows, labels[i], weights[i], 1, 0.2)
        np.testing.assert_allclose(losses[i], value, rtol=1e-13)  # (member 2: NaN in both)
        np.testing.assert_allclose(got[i], single(g[i]), rtol=1e-13)


@pytest.mark.parametrize("batching", [False, True, None])
def test_label_smoothing_a_float_argument_of_a_marked_cell(batching: bool | None) -> None:
    """A marked cell's float argument passed as ``label_smoothing`` (a layer
    while the cell is traced) was refused as a branch on its value (a new
    user's); now each call's loss is its own smoothing's, and calls of
    different values batch together."""
    logits, labels, options = logits_and_labels(OPTIONS["weight"], np.float64)
    w = ml.Weight(logits)

    @ml.operation
    def cell(z: ml.ArrayLayer, e: float) -> ml.ScalarLayer:
        return ml.cross_entropy(z, labels, label_smoothing=e, **options)

    es = (0.0, 0.1, 0.25, 1.0)
    expected = sum(reference(logits, labels, label_smoothing=e, **options) for e in es)
    unmarked = ml.sum(ml.stack([ml.cross_entropy(w, labels, label_smoothing=e, **options) for e in es]))
    with ml.settings(batching=batching):
        value, grads = entry.gradients_sync(ml.sum(ml.stack([cell(w * 1.0, e) for e in es])))
        _, unmarked_grads = entry.gradients_sync(unmarked)
    assert float(value) == pytest.approx(expected, rel=1e-13)
    np.testing.assert_allclose(grads[w], unmarked_grads[w], rtol=1e-12, atol=1e-15)
    if batching:
        ev = Evaluation(train=True)
        with ml.settings(batching=True):
            _batching.forward(ev, collect(ev, [ml.sum(ml.stack([cell(w * 1.0, e) for e in es]))]))
        groups = [
            np.shape(r.value)
            for key, r in ev.records.items()
            if type(key) is Record and r.node._op.name.startswith(cell.__name__ + "#")
        ]
        assert (4,) in groups  # the four calls as one kernel


@pytest.mark.parametrize("name", ["smoothing", "weight"])
def test_a_marked_cells_constant_labels_batch(name: str) -> None:
    """Labels the cell closes over (one array for every call, not stacked)
    were declined by the batching rule: the whole group ran call by call."""
    logits, labels, options = logits_and_labels(OPTIONS[name], np.float64)
    w = ml.Weight(logits)

    @ml.operation
    def cell(z: ml.ArrayLayer) -> ml.ScalarLayer:
        return ml.cross_entropy(z, labels, **options)

    def loss() -> ml.ScalarLayer:
        return ml.sum(ml.stack([cell(w * float(k)) for k in range(1, 5)]))

    results = []
    for batching in (False, True):
        with ml.settings(batching=batching):
            results.append(entry.gradients_sync(loss()))
    (value, grads), (batched_value, batched_grads) = results
    assert float(batched_value) == pytest.approx(float(value), rel=1e-13)
    np.testing.assert_allclose(batched_grads[w], grads[w], rtol=1e-12, atol=1e-15)
    ev = Evaluation(train=True)
    with ml.settings(batching=True):
        _batching.forward(ev, collect(ev, [loss()]))
    groups = [
        np.shape(r.value)
        for key, r in ev.records.items()
        if type(key) is Record and r.node._op.name.startswith(cell.__name__ + "#")
    ]
    assert (4,) in groups  # the four calls as one kernel
