"""`ml.segment_sum`: rows summed by segment, against NumPy's ``add.at`` and
PyTorch's ``index_add``, its errors, and its batching rule (a GNN's per-graph
sums of messages grouped into one scatter)."""

from __future__ import annotations

import sys
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.gradcheck import check_grads_over_shapes
from monadl.layers._batching_rules import BATCHING_RULES
from monadl.layers._primitives import PRIMITIVES

# (data's shape, ids, num_segments): repeated ids, segments no row goes to, 1-D and N-D rows.
CASES = [
    ((5,), [2, 0, 2, 3, 0], 4),
    ((5, 3), [2, 0, 2, 3, 0], 6),
    ((4, 2, 3), [1, 1, 1, 1], 3),
    ((3, 2), [0, 1, 2], 3),
    ((300, 4), list(np.random.default_rng(5).integers(0, 290, 300)), 290),  # (more segments than the one-hot path's)
]


def _numpy(data: np.ndarray, ids: np.ndarray, segments: int) -> np.ndarray:
    out = np.zeros((segments, *data.shape[1:]), data.dtype)
    np.add.at(out, ids, data)
    return out


def _value_and_gradient(data: np.ndarray, ids: np.ndarray, segments: int, projection: np.ndarray) -> tuple[Any, Any]:
    w = ml.Weight(data)
    loss = ml.segment_sum(w, ids, segments)
    value = anyio.run(loss.predict)
    [grad] = anyio.run(ml.gradients, ml.sum(loss * projection), [w])
    return value, grad


@pytest.mark.parametrize(("shape", "ids", "segments"), CASES, ids=str)
def test_values_and_gradients_are_numpys_add_at_and_its_gather(
    shape: tuple[int, ...], ids: list[int], segments: int
) -> None:
    rng = np.random.default_rng(0)
    data, index = rng.normal(size=shape), np.array(ids)
    projection = rng.normal(size=(segments, *shape[1:]))
    value, grad = _value_and_gradient(data, index, segments, projection)
    np.testing.assert_allclose(value, _numpy(data, index, segments), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(grad, projection[index])  # (a gather: exact)
    for empty in set(range(segments)) - set(ids):
        assert not value[empty].any()


@pytest.mark.parametrize(("shape", "ids", "segments"), CASES, ids=str)
def test_values_and_gradients_are_pytorchs_index_add(shape: tuple[int, ...], ids: list[int], segments: int) -> None:
    torch = pytest.importorskip("torch")  # (not in CI)
    rng = np.random.default_rng(1)
    data, index = rng.normal(size=shape), np.array(ids)
    projection = rng.normal(size=(segments, *shape[1:]))
    value, grad = _value_and_gradient(data, index, segments, projection)
    t = torch.tensor(data, requires_grad=True)
    out = torch.zeros((segments, *shape[1:]), dtype=torch.float64).index_add(0, torch.tensor(index), t)
    (out * torch.tensor(projection)).sum().backward()
    np.testing.assert_allclose(value, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_gradients_match_finite_differences_over_shapes() -> None:
    ids = np.array([1, 0, 1, 3])
    checked = check_grads_over_shapes(lambda x: ml.segment_sum(x, ids, 4), [[(4,)], [(4, 3)], [(4, 2, 2)]])
    assert checked == 3

    def squares(x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.segment_sum(ml.tanh(x), ids, 5) ** 2.0

    ml.check_grads(squares, np.linspace(-1.0, 1.0, 8).reshape(4, 2))


def test_float32_stays_float32_and_integer_ids_of_any_width_are_taken() -> None:
    data = np.arange(6, dtype=np.float32).reshape(3, 2)
    value, grad = _value_and_gradient(data, np.array([1, 1, 0], np.int8), 2, np.ones((2, 2), np.float32))
    assert value.dtype == grad.dtype == np.float32
    np.testing.assert_array_equal(value, [[4.0, 5.0], [2.0, 4.0]])


def test_no_rows_and_no_segments() -> None:
    value, grad = _value_and_gradient(np.zeros((0, 3)), np.zeros(0, np.int64), 2, np.ones((2, 3)))
    np.testing.assert_array_equal(value, np.zeros((2, 3)))
    assert grad.shape == (0, 3)
    none = anyio.run(ml.segment_sum(np.zeros((0, 3)), np.zeros(0, np.int64), 0).predict)
    assert none.shape == (0, 3)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: ml.segment_sum(np.ones((3, 2)), np.array([0.0, 1.0, 1.0]), 2), ml.OperandError, "must be integers"),
        (lambda: ml.segment_sum(np.ones((3, 2)), np.zeros((3, 1), int), 2), ml.OperandError, "1-D integer array"),
        (lambda: ml.segment_sum(np.ones((3, 2)), np.array([0, 1, 1]), -1), ml.OperandError, ">= 0, got -1"),
        (lambda: ml.segment_sum(np.ones((3, 2)), np.array([0, 1, 1]), 2.0), ml.OperandError, "be an integer"),  # type: ignore[arg-type]
        (lambda: ml.segment_sum(np.ones((3, 2)), np.array([0, 1, 1]), True), ml.OperandError, "be an integer"),  # type: ignore[arg-type]
        (lambda: ml.segment_sum(np.ones((4, 2)), np.array([0, 1, 1]), 2), ml.ShapeError, "got 3 ids for data of shape"),
        (lambda: ml.segment_sum(ml.Weight(np.ones(2)), np.array([0]), 2), ml.ShapeError, r"shape \(2,\)"),
    ],
)
def test_what_is_known_when_the_layer_is_built_is_checked_there(build: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize(
    ("ids", "rows", "match"),
    [
        (
            np.array([0, 4, 1]),
            3,
            r"segment_sum: segment id 4 at segment_ids\[1\] out of range for 4 segments"
            r" \(segment_ids must lie in \[0, 4\)\)",
        ),
        (
            np.array([0, -1, 1]),
            3,
            r"segment_sum: segment id -1 at segment_ids\[1\] out of range for 4 segments"
            r" \(segment_ids must lie in \[0, 4\); negative segment_ids are refused, not counted from the end\)",
        ),
        (np.array([0, 1]), 3, "got 2 ids for data of shape"),
    ],
)
def test_what_is_known_when_the_layer_runs_is_a_shape_error_naming_the_line(
    ids: np.ndarray, rows: int, match: str, batching: bool
) -> None:
    # Sixteen graphs, one of them wrong: with batching on the group is checked as one, and runs node by node
    # when it fails, so that the error is the wrong member's (an id past its segments would land in the next's).
    w = ml.Weight(np.ones((2, 2)))
    members = [ml.segment_sum(np.ones((3, 2)) @ w, np.array([0, 1, 3]), 4) for _ in range(15)]
    line = sys._getframe().f_lineno + 1
    wrong = ml.segment_sum(np.ones((rows, 2)) @ w, ids, 4)
    loss = ml.sum(ml.stack([*members, wrong]))
    with ml.settings(batching=batching), pytest.raises(ml.ShapeError, match=match) as caught:
        anyio.run(loss.predict)
    assert f"test_segment_sum.py:{line}" in str(caught.value)


def _graphs(rng: np.random.Generator, count: int, dtype: type = np.float64) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-example graphs of 6 edges into 5 nodes: each edge's features and its target node."""
    return [(rng.normal(size=(6, 3)).astype(dtype), rng.integers(0, 5, 6)) for _ in range(count)]


@pytest.mark.parametrize("marked", [False, True])
def test_batching_on_and_off_agree_and_the_rule_groups_the_graphs(
    marked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    w = ml.Weight(rng.normal(size=(3, 4)))
    graphs = _graphs(rng, 16)

    def node_states(edges: ml.ArrayOperand, targets: np.ndarray) -> ml.ArrayLayer:
        return ml.tanh(ml.segment_sum(ml.tanh(edges @ w), targets, 5))

    step = ml.operation(node_states) if marked else node_states
    calls: list[bool] = []
    rule = BATCHING_RULES["segment_sum"]

    def counting(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> Any:
        result = rule(args, batched, n)
        calls.append(result is not None)
        return result

    monkeypatch.setitem(BATCHING_RULES, "segment_sum", counting)
    results = []
    for batching in (False, True):
        loss = ml.sum(ml.stack([ml.sum(step(x, ids) ** 2.0) for x, ids in graphs]))
        with ml.settings(batching=batching):
            results.append((anyio.run(loss.predict), anyio.run(ml.gradients, loss, [w])[0]))
    assert calls and all(calls)  # batched, by the rule (each graph's own ids: a marked cell's data argument)
    (value, grad), (batched_value, batched_grad) = results
    assert batched_value == pytest.approx(value, rel=1e-12)
    np.testing.assert_allclose(batched_grad, grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("shared", ["ids", "data"])
def test_the_rule_with_a_shared_operand_is_the_members_rules(shared: str) -> None:
    rng = np.random.default_rng(4)
    n, segments = 4, 3
    datas = [rng.normal(size=(5, 2)) for _ in range(n)]
    idss = [rng.integers(0, segments, 5) for _ in range(n)]
    if shared == "ids":
        idss = [idss[0]] * n
    else:
        datas = [datas[0]] * n
    args = (datas[0] if shared == "data" else np.stack(datas), idss[0] if shared == "ids" else np.stack(idss), segments)
    result = BATCHING_RULES["segment_sum"](args, (shared != "data", shared != "ids", False), n)
    assert result is not None
    out, (vjp,) = result
    g = rng.normal(size=out.shape)
    deltas = vjp(g)
    singles = [PRIMITIVES["segment_sum"].rule(d, i, segments) for d, i in zip(datas, idss)]
    for k, (value, (single,)) in enumerate(singles):
        np.testing.assert_allclose(out[k], value, rtol=1e-12)
        if shared != "data":
            np.testing.assert_allclose(deltas[k], single(g[k]), rtol=1e-12)
    if shared == "data":  # (the batch axis left in: the runtime sums it away)
        np.testing.assert_allclose(deltas.sum(axis=0), sum(s[1][0](g[k]) for k, s in enumerate(singles)), rtol=1e-12)


def test_float32_graphs_batched_stay_float32() -> None:
    rng = np.random.default_rng(6)
    w = ml.Weight(rng.normal(size=(3, 4)).astype(np.float32))
    loss = ml.sum(ml.stack([ml.sum(ml.segment_sum(x @ w, ids, 5)) for x, ids in _graphs(rng, 16, np.float32)]))
    with ml.settings(batching=True):
        value = anyio.run(loss.predict)
        [grad] = anyio.run(ml.gradients, loss, [w])
    assert np.asarray(value).dtype == grad.dtype == np.float32
