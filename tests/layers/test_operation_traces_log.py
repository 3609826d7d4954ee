"""The DEBUG log of an operation's many traces says what to change, by their cause."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml


def traces_message(
    caplog: pytest.LogCaptureFixture, calls: Sequence[tuple[object, ...]], cell: Callable[..., Any]
) -> str:
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        for args in calls:
            cell(*args)
    (message,) = [r.getMessage() for r in caplog.records if "traces" in r.getMessage()]
    return message


def test_lists_of_varying_length_are_told_to_become_one_layer(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda xs: ml.sum(ml.stack(xs) * w))
    calls = [([w * float(i) for i in range(n)],) for n in range(1, 9)]  # one list per call, 1 to 8 long
    message = traces_message(caplog, calls, cell)
    assert "has 8 traces" in message
    assert "a list or tuple argument whose length differs per call" in message
    assert "ml.concatenate or ml.stack" in message
    assert "as a float" not in message


def test_lists_of_per_call_lengths_are_told_to_pad_with_a_mask(caplog: pytest.LogCaptureFixture) -> None:
    """Attention over each example's own states, a list of its length: the
    advice was to concatenate them into one layer, which still differs in
    shape per length and never groups (a new user's decoder), and, inside
    ``ml.loom()``, made every call drop out of the loom. Padded to one
    length, with a mask passed as data, the calls batch as one group."""
    w = ml.Weight(np.ones((3, 3)))

    def attend(s: ml.ArrayLayer, states: list[ml.ArrayLayer]) -> ml.ScalarLayer:
        h = ml.concatenate(states, axis=0)
        return ml.sum(ml.softmax(h @ ml.transpose(s @ w), axis=0) * h)

    cell = ml.operation(attend)
    x = ml.as_layer(np.ones((1, 3)))
    calls = [(x, [x * float(i) for i in range(n)]) for n in range(1, 9)]
    message = traces_message(caplog, calls, cell)
    assert message.endswith(
        "has 8 traces, one per signature: a list or tuple argument whose length differs per call traces each"
        " length apart (here states), and calls of different lengths never batch together; its items concatenated"
        " or stacked into one layer (ml.concatenate or ml.stack) make one trace for all lengths, but still no"
        " group: calls batch only where their operands' shapes match, so calls of per-example lengths batch once"
        " padded to one length (the items of states and rows of zeros up to the longest, or to one of a few sizes),"
        " with a mask of the real rows passed as data, a bool array (np.arange(longest)[:, None] < len(states) for"
        " a column of scores) that the cell applies, ml.where(mask, scores, -np.inf); inside ml.loom(), build the"
        " padded layer in a marked cell of the block, or pass data arrays (a layer built outside the block's calls"
        " makes each call that reads it a node, not recorded)"
    ), message

    @ml.operation
    def masked(s: ml.ArrayLayer, h: ml.ArrayLayer, mask: ml.Array) -> ml.ScalarLayer:
        scores = ml.where(mask, h @ ml.transpose(s @ w), -np.inf)
        return ml.sum(ml.softmax(scores, axis=0) * h)

    def padded(states: list[ml.ArrayLayer]) -> ml.ArrayLayer:
        return ml.concatenate([*states, ml.as_layer(np.zeros((8 - len(states), 3)))], axis=0)

    want = [anyio.run(attend(*args).predict) for args in calls]
    outs = [masked(x, padded(states), (np.arange(8) < len(states))[:, None]) for _, states in calls]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=True):
        got = anyio.run(ml.stack(outs).predict)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert len(masked._traces) == 1
    (ran,) = [r.getMessage() for r in caplog.records if "ran batched" in r.getMessage()]
    assert "masked" not in ran.split(" one by one")[1], ran  # (the 8 calls: one group, none alone)


def test_static_arguments_are_told_to_become_data(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda xs, k: ml.sum(ml.stack(xs) * w) * float(k))
    calls = [([w, w], k) for k in range(8)]  # lists of one length; an int that differs
    message = traces_message(caplog, calls, cell)
    assert "has 8 traces" in message and "pass a number that differs per call as a float, float(k)" in message
    assert "they differ in k's value (0, 1, 2, ... 8 in all)" in message
    assert "ml.as_layer" not in message  # (no array differs: advice about arrays would be noise)
    assert "ml.stack" not in message


def test_arrays_of_values_whose_shape_differs_are_told_to_become_layers(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda x: ml.sum(x * w))
    message = traces_message(caplog, [(np.ones((n, 3)),) for n in range(1, 9)], cell)
    assert "they differ in x's shape (float64[1, 3], float64[2, 3], float64[3, 3], ... 8 in all)" in message
    assert "pass an array whose shape differs as a layer, ml.as_layer(x)" in message
    assert "as a float" not in message and "unmarked" not in message
    # A layer makes one trace, not one group: it promised batching that shapes still split.
    assert message.endswith(
        "ml.as_layer(x), whose shape is no part of the signature where the cell reads none (one trace for all its"
        " shapes; calls batch only where their operands' shapes match, so calls of per-example lengths batch once"
        " padded to one length, with a mask of the real rows passed as data)"
    ), message


def test_indices_and_counts_of_varying_shape_are_told_no_cell_takes_them(caplog: pytest.LogCaptureFixture) -> None:
    """A new user's graph network: the advice was to pass the edges' index
    arrays as layers and the node count as a float, both of which the cell
    then refused (an index must be plain data; num_segments an int)."""
    w = ml.Weight(np.ones((3, 3)))

    @ml.operation
    def cell(h: ml.ArrayOperand, src: np.ndarray, dst: np.ndarray, n: int, scale: np.ndarray) -> ml.ArrayLayer:
        return ml.segment_sum(ml.tanh(h[src] @ w) * scale, dst, n)

    calls = [
        (ml.as_layer(np.ones((n, 3))), np.arange(n + 1) % n, np.arange(n + 1) % n, n, np.ones((n + 1, 1)))
        for n in range(1, 9)
    ]
    message = traces_message(caplog, calls, cell)
    line = cell.__wrapped__.__code__.co_firstlineno + 2
    assert (
        "here they differ in src's shape (int64[2], int64[3], int64[4], ... 8 in all), dst's shape (int64[2], int64[3], int64[4], "
        "... 8 in all), n's value (1, 2, 3, ... 8 in all), scale's shape (float64[2, 1], float64[3, 1], "
        "float64[4, 1], ... 8 in all): "
    ) in message
    assert "pass an array whose shape differs as a layer, ml.as_layer(scale)" in message
    assert "ml.as_layer(src)" not in message and "ml.as_layer(dst)" not in message and "float(n)" not in message
    assert f"src is getitem's index at {__file__}:{line}, " in message
    assert f"dst is segment_sum's segment_ids at {__file__}:{line}, " in message
    assert f"n is segment_sum's num_segments at {__file__}:{line}: " in message
    assert "no way of passing them inside a cell changes that: leave the operation unmarked" in message
    assert "batch the examples by hand" in message and "ml.segment_sum by the offset ids" in message


def test_an_int_index_is_told_to_become_an_integer_array_which_then_shares_one_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = ml.Weight(np.arange(40.0).reshape(20, 2))
    cell = ml.operation(lambda token: ml.sum(table[token]))
    message = traces_message(caplog, [(t,) for t in range(8)], cell)
    assert "here they differ in token's value (0, 1, 2, ... 8 in all): pass token as an integer array" in message
    assert "float(token)" not in message
    before = len(cell._traces)
    values = [anyio.run(cell(np.asarray(t)).predict) for t in range(8)]
    assert len(cell._traces) == before + 1 and values == [4.0 * t + 1.0 for t in range(8)]


def test_ints_that_python_reads_are_told_to_stay_ints_not_to_become_floats(caplog: pytest.LogCaptureFixture) -> None:
    """An int from which the cell computes an index or a count (``h[i +
    1]``, ``n + 1`` segments), or a loop count, was told "pass float(i)",
    which the cell then refused: only an int that no step took as it was
    counted as one."""
    w = ml.Weight(np.ones((3, 3)))
    shifted = ml.operation(lambda h, i: ml.sum(h[i + 1]))
    summed = ml.operation(lambda h, ids, n: ml.segment_sum(h @ w, ids, n + 1))

    @ml.operation
    def deep(h: ml.ArrayLayer, depth: int) -> ml.ArrayLayer:
        for _ in range(depth):
            h = ml.tanh(h @ w)
        return h

    rows = ml.as_layer(np.ones((12, 3)))
    cases: list[tuple[Callable[..., Any], Sequence[tuple[object, ...]], str]] = [
        (shifted, [(rows, i) for i in range(8)], "i"),
        (summed, [(ml.as_layer(np.ones((n, 3))), np.arange(n), n) for n in range(1, 9)], "n"),
        (deep, [(ml.as_layer(np.ones((2, 3))), d) for d in range(1, 9)], "depth"),
    ]
    for cell, calls, name in cases:
        caplog.clear()
        message = traces_message(caplog, calls, cell)
        assert "as a float" not in message
        assert (
            f"; {name} is read by Python, not computed with (no step takes it as it is and no constant of the trace "
            "equals it: a loop count, a flag, or an index, a slice or a count computed from it), so it must stay an "
            f"int (float({name}) is refused where Python reads it), each value its own trace: give it a few values "
            "(round it up to one of a few sizes, padding the data to match), or "
        ) in message
    assert message.endswith(
        "or leave the operation unmarked (its operations still batch with those of other calls "
        "of equal shapes), or batch the examples by hand: stack their rows into one array, offset each example's "
        "indices by the rows before it, and run the cell once on the stack (ml.segment_sum by the offset ids sums "
        "each example's rows apart, as torch's index_add does)"
    )
    # What the advice says of a float there holds: each refuses it.
    floats: list[tuple[Callable[..., Any], tuple[object, ...], str]] = [
        (shifted, (rows, 3.0), "getitem: an index must be plain data"),
        (summed, (ml.as_layer(np.ones((3, 3))), np.arange(3), 3.0), "segment_sum: num_segments must be an integer"),
        (deep, (ml.as_layer(np.ones((2, 3))), 3.0), "a layer has no value while the graph is built"),
    ]
    for cell, args, refused in floats:
        with pytest.raises(ml.OperandError, match=refused):
            anyio.run(cell(*args).predict)


def test_an_int_the_cell_computes_with_is_still_told_to_become_a_float(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda h, n: ml.sum(h * w) * n)  # (the trace keeps n as a constant)
    message = traces_message(caplog, [(ml.as_layer(np.ones(3)), n) for n in range(8)], cell)
    assert "pass a number that differs per call as a float, float(n), as the cell computes with it" in message
    assert "read by Python" not in message
    assert [anyio.run(cell(ml.as_layer(np.ones(3)), float(n)).predict) for n in range(3)] == [0.0, 3.0, 6.0]


def test_a_string_that_differs_is_told_to_stay_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda h, mode: ml.sum(h * w) if mode.startswith("s") else ml.mean(h * w))
    message = traces_message(caplog, [(ml.as_layer(np.ones(3)), f"s{k}") for k in range(8)], cell)
    assert "here they differ in mode's value ('s0', 's1', 's2', ... 8 in all); mode is read by Python" in message
    assert "so it must stay as it is, each value its own trace" in message and "float(" not in message


def test_arrays_whose_dtype_alone_differs_are_told_to_take_one_dtype(caplog: pytest.LogCaptureFixture) -> None:
    """The advice said they differed in shape, and to pass them as layers."""
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda x: ml.sum(x * w[0]))
    dtypes = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8]
    message = traces_message(caplog, [(np.ones(3, dtype),) for dtype in dtypes], cell)
    assert "here they differ in x's dtype (float64[3], float32[3], float16[3], ... 8 in all): " in message
    assert message.endswith("convert x to one dtype before the call (x.astype(np.float64))")
    assert "ml.as_layer" not in message


def test_arguments_of_a_star_parameter_are_named_by_it(caplog: pytest.LogCaptureFixture) -> None:
    """They were "argument 2" and "argument 3"."""

    @ml.operation
    def gathered(h: ml.ArrayOperand, *idx: np.ndarray) -> ml.ScalarLayer:
        return ml.sum(h[idx[0]]) + ml.sum(h[idx[1]])

    calls = [(ml.as_layer(np.ones((12, 3))), np.arange(n), np.arange(n + 1)) for n in range(1, 9)]
    message = traces_message(caplog, calls, gathered)
    assert "here they differ in idx[0]'s shape (int64[1], int64[2], int64[3], ... 8 in all), idx[1]'s shape" in message
    assert "; idx[0] and idx[1] are getitem's index at " in message


def test_the_count_of_traces_is_said_once_each_not_at_every_call_past_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At the limit each new signature replaces a trace, so the count stayed
    256, a power of two: the line was said at every call (1,380 lines for a
    new user's 600 batch sizes)."""
    from monadl.layers._operation_traces import _TRACES_LIMIT

    @ml.operation
    def scaled(x: ml.ArrayWeight, n: int) -> ml.ArrayLayer:
        return x * float(n)

    w = ml.Weight(np.ones(2))
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        for n in range(_TRACES_LIMIT + 100):
            scaled(w, n)
    said = [r.getMessage() for r in caplog.records if " has " in r.getMessage()]
    assert [int(line.split(" has ")[1].split()[0]) for line in said] == [8, 16, 32, 64, 128, 256]
    # At the limit a WARNING, once: each new signature is then traced again (a new user's counter, an
    # int that changed every call, built at 40-80x a call's cost with only DEBUG lines to say so).
    (warned,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"scaled keeps {_TRACES_LIMIT} traces, its limit" in warned.getMessage()
    assert "pass a number that differs per call as a float" in warned.getMessage()


def test_an_operation_marked_anew_each_step_is_said_once_at_its_32nd_mark(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ml.operation(step)`` inside the code that builds each step's graph
    traces every step (a new user's capsule network: 1.7x its step); each
    operation alone has one trace, so only the count by the function's code
    can tell. A partial of one function counts as it."""
    import functools

    from monadl.layers import _operation_traces

    monkeypatch.setattr(_operation_traces, "_MARKS", {})
    w = ml.Weight(np.eye(2))
    x = ml.as_layer(np.ones((1, 2)))

    def step(h: ml.ArrayOperand, scale: float) -> ml.ArrayLayer:
        return ml.tanh(h @ w) * scale

    with caplog.at_level(logging.WARNING, logger="monadl.batching"):
        for _ in range(31):
            ml.operation(functools.partial(step, scale=1.0))(x)
        assert not [r for r in caplog.records if "marked" in r.getMessage()]
        for _ in range(10):
            ml.operation(functools.partial(step, scale=1.0))(x)
    (said,) = [r.getMessage() for r in caplog.records if "marked" in r.getMessage()]
    line = step.__code__.co_firstlineno
    assert f"(the function at {__file__}:{line}) was marked 32 times over the same weights, and each mark" in said
    assert "mark it once" in said


def test_operations_over_the_weights_of_models_built_anew_are_not_counted_together(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep or a benchmark builds 40 models, each marking its cell over
    its own weights (each model gone before the next: an id may come
    again): no mark is made again (the benchmark of the Tree-LSTM said so
    of its 32 models, before the weights were counted apart)."""
    from monadl.layers import _operation_traces

    monkeypatch.setattr(_operation_traces, "_MARKS", {})
    x = ml.as_layer(np.ones((1, 2)))
    with caplog.at_level(logging.WARNING, logger="monadl.batching"):
        for _ in range(40):
            w = ml.Weight(np.eye(2))
            ml.operation(lambda h, w=w: ml.tanh(h @ w))(x)
            ml.operation(lambda h, v: ml.tanh(h @ v))(x, w)  # (its weight an argument: none held)
            ml.operation(lambda h: ml.tanh(h))(x)  # (none at all)
            del w
    assert not [r for r in caplog.records if "marked" in r.getMessage()]


def test_cells_marked_once_each_over_one_weight_are_not_said_to_be_marked_anew(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 layers sharing one weight, each a partial of one function by its
    index, marked once (an ALBERT-style stack, a reviewer's): each holds
    another argument, so none is a mark made again."""
    import functools

    from monadl.layers import _operation_traces

    monkeypatch.setattr(_operation_traces, "_MARKS", {})
    w = ml.Weight(np.eye(2) / 2)

    def block(h: ml.ArrayOperand, i: float) -> ml.ArrayLayer:
        return ml.tanh(h @ w) * (1.0 + 0.01 * i)

    layers = [ml.operation(functools.partial(block, i=float(i))) for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="monadl.batching"):
        h: Any = ml.as_layer(np.ones((1, 2)))
        for layer in layers:
            h = layer(h)
    assert not [r for r in caplog.records if "marked" in r.getMessage()]


def test_a_callable_whose_func_is_itself_is_marked_and_called() -> None:
    """The count reads only partials and bound methods: an object whose
    ``func`` attribute leads back to itself (a mock) hung its first call."""
    w = ml.Weight(np.eye(2))

    class Cell:
        __qualname__ = "Cell"

        @property
        def func(self) -> Any:
            return self

        def __call__(self, h: ml.ArrayOperand) -> ml.ArrayLayer:
            return ml.tanh(h @ w)

    out = ml.operation(Cell())(ml.as_layer(np.ones((1, 2))))
    np.testing.assert_allclose(anyio.run(out.predict), np.tanh(np.ones((1, 2))))
