"""Batched groups' members, whose records are made only when read (`Records`):
read by later graphs, by ``Do`` layers, as roots, in direct style, with CuPy
imported (its device check looks at operands without holding them), and
gathered from groups with and without a gradient. Each compares the
gradients with batching on to those with it off. A stand-in ``cupy`` module
(every value on the host) stands for CuPy imported."""

from __future__ import annotations

import sys
import types
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml


def _gradients(build: Any, weights: list[Any], batching: bool) -> list[Any]:
    with ml.settings(batching=batching):
        return list(anyio.run(ml.gradients, build(), weights))


def _assert_batching_changes_nothing(build: Any, weights: list[Any]) -> None:
    want = _gradients(build, weights, False)
    got = _gradients(build, weights, True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def _two_graphs(rng: np.random.Generator, w: Any, v: Any, size: int = 6) -> Any:
    """Graph 1 batches ``a`` (read by index only); graph 2, in a bind, reads ``a`` again."""
    xs = [rng.standard_normal((1, 3)) for _ in range(size)]

    def build() -> Any:
        a = [ml.tanh(x @ w) for x in xs]
        s1 = ml.sum(ml.concatenate([ml.tanh(ai) for ai in a], axis=0))

        def then(tape: ml.Tape[Any, Any]) -> ml.Do[Any]:
            b = [ml.sigmoid(ai @ v) for ai in a]
            return ml.sum(ml.concatenate(b, axis=0) * float(tape.data)).forward()

        return ml.Layer(s1.forward().bind(then)) + s1

    return build


def test_a_later_graph_reads_earlier_members_with_the_unbatched_gradients() -> None:
    rng = np.random.default_rng(0)
    w, v = ml.Weight(rng.standard_normal((3, 3))), ml.Weight(rng.standard_normal((3, 3)))
    _assert_batching_changes_nothing(_two_graphs(rng, w, v), [w, v])


def test_cupy_imported_keeps_the_gradients_of_members_read_in_a_later_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CuPy imported, `cuda.on_device` looks at a later graph's operands; a batched member
    looked at there must not get a record that holds its group with nobody to release it."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=type("ndarray", (), {})))
    rng = np.random.default_rng(0)
    w, v = ml.Weight(rng.standard_normal((3, 3))), ml.Weight(rng.standard_normal((3, 3)))
    _assert_batching_changes_nothing(_two_graphs(rng, w, v), [w, v])


def test_cupy_imported_keeps_the_gradients_of_fibers_reading_earlier_members(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=type("ndarray", (), {})))
    rng = np.random.default_rng(0)
    up, down = ml.Weight(rng.standard_normal((4, 4)) * 0.5), ml.Weight(rng.standard_normal((4, 4)) * 0.5)
    xs = [rng.standard_normal(4) for _ in range(8)]

    def walk(h: Any, left: int) -> ml.Do[Any]:  # each step reads the last one's member by index only
        if not left:
            return ml.sum(h * h).forward()
        return ml.sum(h).forward().bind(lambda t: walk(ml.tanh(h @ (up if t.data > 0 else down)), left - 1))

    def build() -> Any:
        return ml.sum(ml.stack([ml.Layer(walk(ml.tanh(x @ up), 3)) for x in xs]))

    _assert_batching_changes_nothing(build, [up, down])


def test_a_later_graph_gathers_from_a_group_with_a_gradient_and_one_without() -> None:
    """Places are the evaluation's: a later graph's group may gather from two earlier groups,
    one of which reads no weight (it has no delta sink)."""
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((3, 3)))
    xs = [rng.standard_normal((1, 3)) for _ in range(4)]

    def build() -> Any:
        a = [ml.tanh(x @ w) for x in xs]
        b = [ml.exp(ml.as_layer(x) * 2.0) for x in xs]
        s1 = ml.sum(ml.concatenate(a + b, axis=0))

        def then(_: Any) -> ml.Do[Any]:
            mixed = [ml.sigmoid(a[0]), ml.sigmoid(b[0]), ml.sigmoid(a[1]), ml.sigmoid(b[1])]
            return ml.sum(ml.concatenate(mixed, axis=0)).forward()

        return ml.Layer(s1.forward().bind(then)) + s1

    _assert_batching_changes_nothing(build, [w])


def test_one_graph_gathers_from_a_group_with_a_gradient_and_one_without() -> None:
    """The same within one graph."""
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.standard_normal((3, 3)))
    xs = [rng.standard_normal((1, 3)) for _ in range(4)]

    def build() -> Any:
        a = [ml.tanh(ml.tanh(x @ w)) for x in xs]  # depth 2, as b's exp (after a constant node and a product)
        b = [ml.exp(ml.as_layer(x) * 2.0) for x in xs]
        mixed = [ml.sigmoid(a[0]), ml.sigmoid(b[0]), ml.sigmoid(a[1]), ml.sigmoid(b[1])]
        return ml.sum(ml.concatenate(mixed, axis=0))

    _assert_batching_changes_nothing(build, [w])


def test_members_as_roots_and_read_by_do_layers_and_alone_consumers() -> None:
    rng = np.random.default_rng(1)
    w, v = ml.Weight(rng.standard_normal((3, 3))), ml.Weight(rng.standard_normal((3, 3)))
    xs = [rng.standard_normal((1, 3)) for _ in range(6)]

    def build() -> Any:
        a = [ml.tanh(x @ w) for x in xs]
        c = [ml.sigmoid(ai @ v) for ai in a]  # gathers a
        s = ml.sum(ml.concatenate(c, axis=0)) + ml.sum(a[2] * a[3])  # a[2], a[3] also read alone
        roots = ml.Do.zip(c[0].forward(), c[3].forward(), a[4].forward())  # members as roots of one graph
        through = ml.Layer(c[5].forward().map(lambda t: t))  # a Do layer reading a member
        return ml.Layer(roots.bind(lambda _: (s + ml.sum(c[0] * c[3] * a[4]) + ml.sum(through)).forward()))

    _assert_batching_changes_nothing(build, [w, v])


def test_direct_style_reads_members_over_several_graphs() -> None:
    rng = np.random.default_rng(2)
    w, v = ml.Weight(rng.standard_normal((3, 3))), ml.Weight(rng.standard_normal((3, 3)))
    xs = [rng.standard_normal((1, 3)) for _ in range(6)]

    @ml.direct
    async def model() -> Any:
        a = [ml.tanh(x @ w) for x in xs]
        c = [ml.sigmoid(ai @ v) for ai in a]
        v0, _ = await ml.values(c[0], c[1])
        h = await a[4]
        d = [ml.tanh(ci * float(v0[0, 0])) for ci in c]
        return ml.sum(ml.concatenate(d, axis=0)) + ml.sum(a[5]) * float(h[0, 0])

    _assert_batching_changes_nothing(model, [w, v])
