"""A group's members that got no delta make no NaN in the others' gradients.

A group's delta has a zero row for each member that got none (its output
unread, or read under ``stop_gradient``), and, for cells with several
outputs, for each output a member left unread while others read it. Those
zeros are no delta: alone, such a member sends nothing. But a zero times an
infinite derivative (``sqrt``'s at 0) is a NaN, and in a delta the group
shares (a weight's, summed over its members) it spoiled every member's. Each
test compares the gradients with batching on (the case batches: `grouped`)
and off, and with PyTorch where it is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

Loss = Callable[[ml.Weight[Any, Any]], ml.ScalarLayer]


def _gradient(loss: Loss, batching: bool | None) -> Any:
    w = ml.Weight(np.eye(2))

    async def go() -> Any:
        with ml.settings(batching=batching), np.errstate(divide="ignore", invalid="ignore"):
            _, grads = await ml.value_and_gradients(loss(w))
        return grads[w]

    return anyio.run(go)


def _assert_as_alone(loss: Loss, batching: bool | None = True) -> Any:
    on, off = _gradient(loss, batching), _gradient(loss, False)
    assert np.isfinite(off).all()
    np.testing.assert_allclose(on, off, rtol=1e-12, atol=1e-14)
    return on


def test_an_unread_member_of_a_one_output_cell(grouped: list[tuple[str, int]]) -> None:
    """Two calls of ``sqrt(h @ w)``: the first at 0, read under
    ``stop_gradient`` only (before: NaN in the weight's first column)."""

    def loss(w: ml.Weight[Any, Any]) -> ml.ScalarLayer:
        cell = ml.operation(lambda h: ml.sqrt(h @ w))
        unread = cell(ml.as_layer(np.array([[0.0, 1.0]])))
        used = cell(ml.as_layer(np.array([[1.0, 1.0]])))
        return ml.sum(used) + 0.0 * ml.sum(ml.stop_gradient(unread))

    np.testing.assert_array_equal(_assert_as_alone(loss), np.full((2, 2), 0.5))
    assert [n for name, n in grouped if "lambda" in name] == [2]


def _two(w: ml.Weight[Any, Any]) -> Callable[[Any], tuple[ml.ArrayLayer, ml.ArrayLayer]]:
    return ml.operation(lambda h: (ml.tanh(h @ w), ml.sqrt(h @ w)))


def test_members_of_a_two_output_cell_that_read_different_outputs(grouped: list[tuple[str, int]]) -> None:
    """The first call reads its ``tanh`` output alone, the second both; the
    first's ``sqrt`` is at 0 (before: NaN in the weight's first row)."""

    def loss(w: ml.Weight[Any, Any]) -> ml.ScalarLayer:
        two = _two(w)
        t1, _ = two(ml.as_layer(np.array([[0.0, 1.0]])))
        t2, s2 = two(ml.as_layer(np.array([[1.0, 1.0]])))
        return ml.sum(t1) + ml.sum(t2 * s2)

    _assert_as_alone(loss)
    assert [n for name, n in grouped if "lambda" in name] == [2]


def _many(w: ml.Weight[Any, Any]) -> ml.ArrayLayer:
    """300 calls of a two-output cell; the ``sqrt`` output (0 at one entry in
    the even calls) read in the odd calls only."""
    xs = np.abs(np.random.default_rng(0).normal(size=(300, 1, 2))) + 0.1
    xs[::2, 0, 0] = 0.0
    two = _two(w)
    terms = []
    for k, x in enumerate(xs):
        t, s = two(ml.as_layer(x))
        terms.append(ml.sum(t) if k % 2 == 0 else ml.sum(t * s))
    return ml.stack(terms)


def test_with_the_default_settings_against_pytorch(grouped: list[tuple[str, int]]) -> None:
    torch = pytest.importorskip("torch")
    got = _assert_as_alone(lambda w: ml.sum(_many(w)), batching=None)
    assert 300 in [n for name, n in grouped if "lambda" in name]
    xs = np.abs(np.random.default_rng(0).normal(size=(300, 1, 2))) + 0.1
    xs[::2, 0, 0] = 0.0
    tw = torch.eye(2, dtype=torch.float64, requires_grad=True)
    total: Any = 0
    for k, x in enumerate(torch.tensor(xs)):
        t, s = torch.tanh(x @ tw), torch.sqrt(x @ tw)
        total = total + (t.sum() if k % 2 == 0 else (t * s).sum())
    total.backward()
    np.testing.assert_allclose(got, tw.grad.numpy(), rtol=1e-12)


def test_members_whose_operands_are_earlier_groups_rows(grouped: list[tuple[str, int]]) -> None:
    """Cells fed by cells (their operands gathered from the first group's
    rows): the second level's members read different outputs, and the
    deltas they send back reach the first level's members they read."""

    def loss(w: ml.Weight[Any, Any]) -> ml.ScalarLayer:
        two = _two(w)
        xs = np.abs(np.random.default_rng(3).normal(size=(8, 1, 2))) + 0.1
        xs[::3] = 0.0  # (their cells' outputs: zeros, and the second level's sqrt at 0)
        firsts = [two(ml.as_layer(x))[0] for x in xs]
        terms = []
        for k, h in enumerate(firsts):
            t, s = two(h)
            terms.append(ml.sum(t) if k % 3 == 0 else ml.sum(t * s))
        return ml.sum(ml.stack(terms))

    _assert_as_alone(loss)
    assert [n for name, n in grouped if "lambda" in name] == [8, 8]


def test_a_reached_member_s_own_infinity_stays(grouped: list[tuple[str, int]]) -> None:
    """Where a member that got a delta makes an infinity itself, batching
    gives the infinity it gives alone (run again, it is not hidden)."""

    def loss(w: ml.Weight[Any, Any]) -> ml.ScalarLayer:
        cell = ml.operation(lambda h: ml.sqrt(h @ w))
        zero = cell(ml.as_layer(np.array([[0.0, 1.0]])))
        unread = cell(ml.as_layer(np.array([[0.0, 2.0]])))
        return ml.sum(zero) + 0.0 * ml.sum(ml.stop_gradient(unread))

    on, off = _gradient(loss, True), _gradient(loss, False)
    np.testing.assert_array_equal(on, off)
    assert np.isinf(on).any()
    assert [n for name, n in grouped if "lambda" in name] == [2]


def test_a_finite_group_s_weight_factors_are_checked_not_multiplied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences of different lengths through a marked two-output cell: at a
    depth where some end (reading ``h`` alone) and others go on (``h`` and
    ``c``), the group's members read different outputs, and the weight's
    delta (factors: `Outer`) is checked for a NaN. Its factors are read;
    the product is made once, when the weight is released (before: once
    more per such group, 1.2x a step at H = 256)."""
    from monadl.deltas import Outer

    made: list[tuple[int, ...]] = []
    dense = Outer.dense

    def counted(self: Outer) -> Any:
        made.append(self.shape)
        return dense(self)

    monkeypatch.setattr(Outer, "dense", counted)
    hidden = 128  # (a weight of 256 x 256: its delta is kept as factors)
    rng = np.random.default_rng(0)
    w = ml.Weight(rng.normal(size=(2 * hidden, 2 * hidden)) / 16)

    def step(x: ml.ArrayOperand, h: ml.ArrayOperand, c: ml.ArrayOperand) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        z = ml.concatenate([x, h], axis=1) @ w
        c2 = ml.tanh(z[:, :hidden]) + c
        return ml.sigmoid(z[:, hidden:]) * ml.tanh(c2), c2

    cell = ml.operation(step)
    finals = []
    for length in (2, 3, 3, 4, 5, 5):
        h = c = ml.as_layer(np.zeros((1, hidden)))
        for x in rng.normal(size=(length, 1, hidden)):
            h, c = cell(ml.as_layer(x), h, c)
        finals.append(ml.sum(h))
    loss = ml.sum(ml.stack(finals))

    async def go() -> Any:
        with ml.settings(batching=True):
            _, grads = await ml.value_and_gradients(loss)
        return grads[w]

    got = anyio.run(go)
    assert made == [w.shape] * len(made) and len(made) <= 1
    with ml.settings(batching=False):
        want = anyio.run(ml.value_and_gradients, loss)[1][w]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)


def _producer_and_reader(w: ml.Weight[Any, Any]) -> ml.ScalarLayer:
    """``sqrt`` at 0 in the first call of a producer, whose output feeds a
    two-output cell; the first call reads only the output that does not
    depend on it (a reviewer's)."""
    rng = np.random.default_rng(0)
    v = rng.normal(size=(2, 2))
    produce = ml.operation(lambda x: ml.sqrt((x @ w) * (x @ w)))
    read = ml.operation(lambda h, u: (ml.tanh(h @ v), ml.tanh(u @ v)))
    xs = [np.zeros((1, 2)), rng.normal(size=(1, 2)), rng.normal(size=(1, 2))]
    terms = []
    for k, x in enumerate(xs):
        a, b = read(produce(ml.as_layer(x)), ml.as_layer(rng.normal(size=(1, 2))))
        terms.append(ml.sum(b) if k == 0 else ml.sum(a) + ml.sum(b))
    return ml.sum(ml.stack(terms))


def test_a_member_whose_outputs_read_do_not_reach_an_operand_sends_it_none(grouped: list[tuple[str, int]]) -> None:
    """The reader's first member reads only ``b``: its row of ``h``'s delta is
    zeros, no delta, and the producer's first member, at ``sqrt``'s 0, is
    not reached (before: reached, and its 0 times infinity a NaN in ``w``'s
    gradient). `Program.feeds` says which outputs reach each operand."""
    _assert_as_alone(_producer_and_reader)
    assert [n for name, n in grouped if "lambda" in name] == [3, 3]


@pytest.mark.parametrize("loom", [False, True])
def test_a_member_that_reads_only_a_stop_gradient_output_sends_its_operand_none(loom: bool) -> None:
    """A cell's first call reads only its output under ``stop_gradient``:
    no delta goes back through it to the call that made its operand, whose
    ``tanh(log(z * z))`` at z = 0 has a NaN derivative (0 times infinity);
    batched, its zero row made NaN in the weight's gradient (a fuzzer's;
    `Program.feeds` now stops at ``stop_gradient``)."""
    w = ml.Weight(np.array([[1.0, 2.0], [3.0, 4.0]]))
    v = ml.Weight(np.array([[0.5, -1.0], [2.0, 1.0]]))
    first = ml.operation(lambda a, b: (b @ v, ml.tanh(ml.log((a @ w) * (a @ w)))))
    after = ml.operation(lambda a: (a @ v, ml.stop_gradient(a @ v)))

    def loss() -> ml.ScalarLayer:
        with ml.loom() if loom else contextlib.nullcontext():
            p = first(ml.as_layer(np.zeros((1, 2))), ml.as_layer(np.full((1, 2), 0.5)))
            q = first(ml.as_layer(np.full((1, 2), 0.5)), ml.as_layer(np.full((1, 2), 0.5)))
            r, s = after(q[1]), after(p[1])
        return ml.sum(r[0]) + ml.sum(s[1])

    def grads(batching: bool) -> Any:
        with ml.settings(batching=batching), np.errstate(all="ignore"):
            return anyio.run(ml.value_and_gradients, loss())[1]

    on, off = grads(True), grads(False)
    assert set(on) == set(off) == {w, v}
    for weight in (w, v):
        assert np.isfinite(on[weight]).all()
        np.testing.assert_allclose(on[weight], off[weight], rtol=1e-12)


def _chained_cells(w: ml.Weight[Any, Any], alone: bool) -> ml.ScalarLayer:
    """Two two-output cells in a chain, the second passing the first's
    ``sqrt`` output on (``r + h * 0``, no infinite derivative of its own);
    even calls read only the second's ``h`` (a new user's). ``alone``: each
    first call its own trace (a static argument), so that they run as
    nodes and the second group stacks their records."""

    def first(h: ml.ArrayLayer, r: ml.ArrayLayer, tag: str) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        h = ml.tanh(h @ w)
        return h, ml.sqrt(h * 0.0 + r)

    def second(h: ml.ArrayLayer, r: ml.ArrayLayer) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        h = ml.tanh(h @ w)
        return h, r + h * 0.0

    one, two = ml.operation(first), ml.operation(second)
    terms = []
    for i in range(6):
        x = ml.as_layer(np.array([[0.1 * i, -0.1 * i]]))
        h, r = two(*one(x, ml.as_layer(np.full((1, 2), float(i % 2))), f"call {i}" if alone else ""))
        terms.append(ml.sum(h) if i % 2 == 0 else ml.sum(r))
    return ml.sum(ml.stack(terms))


@pytest.mark.parametrize("alone", [False, True])
def test_a_member_sends_an_output_of_its_operand_none_where_its_outputs_read_do_not_reach_it(
    grouped: list[tuple[str, int]], alone: bool
) -> None:
    """The second cell's even members read only ``h``, which ``r`` does not
    reach: they send the first cell's ``r`` output no delta, its ``h`` one
    (before: a zero row for ``r`` too, whole operand by whole operand, and
    at the first cell's ``sqrt`` of 0 a NaN in the weight's gradient, with
    batching on and by default). `Program.part_feeds` says which outputs
    reach each output of an operand."""
    _assert_as_alone(lambda w: _chained_cells(w, alone))
    _assert_as_alone(lambda w: _chained_cells(w, alone), batching=None)
    batched = [(name.split(".")[-1].split("#")[0], n) for name, n in grouped if "_chained_cells" in name]
    assert batched == ([("second", 6)] if alone else [("first", 6), ("second", 6)])


def test_an_output_of_a_cell_called_inside_a_cell_depends_on_what_its_own_feeds_say(
    grouped: list[tuple[str, int]],
) -> None:
    """A marked cell called inside another stays one node of the outer
    program, read by ``output`` views: its output 0 does not depend on its
    operand ``b``, so a member reading only that output sends ``b`` (the
    first cell's ``sqrt`` output, at 0) no delta (before: every output of
    the inner node was taken to depend on all its operands, and the zero row
    sent on was a NaN in the weight's gradient; a reviewer's)."""

    def loss(w: ml.Weight[Any, Any]) -> ml.ScalarLayer:
        v = np.array([[1.0, 0.5], [-0.3, 2.0]])
        inner = ml.operation(lambda a, b: (ml.tanh(a @ v), b * 1.0))
        first = ml.operation(lambda h, r: (ml.tanh(h @ w), ml.sqrt(ml.tanh(h @ w) * 0.0 + r)))
        second = ml.operation(lambda a, b: inner(a, b))
        terms = []
        for i in range(6):
            x = ml.as_layer(np.array([[0.1 * i + 0.05, -0.1 * i]]))
            o = second(*first(x, ml.as_layer(np.full((1, 2), float(i % 2)))))
            terms.append(ml.sum(o[0]) if i % 2 == 0 else ml.sum(o[1]))
        return ml.sum(ml.stack(terms))

    _assert_as_alone(loss)
    assert sorted(n for name, n in grouped if "lambda" in name) == [6, 6]
