"""The DEBUG log of a batched run says why the nodes that ran one by one did:
those with no partner of their signature, by primitive, with an example of
two signatures that differ and in what (a new user's graph network got only
'173 nodes in 22 groups, 179 one by one')."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.runtime.schedule.batched_log import watching

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


def ran_line(caplog: pytest.LogCaptureFixture, loss: ml.ScalarLayer) -> str:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=True):
        anyio.run(loss.predict)
    (line,) = [r.getMessage() for r in caplog.records if "one by one" in r.getMessage()]
    return line


def test_nodes_of_different_shapes_are_said_to_have_no_partner_and_in_what_they_differ(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = ml.Weight(np.ones((3, 3)))
    sums = [ml.sum(ml.tanh(np.ones((n, 3)) @ w)) for n in range(1, 9)]  # EXAMPLES
    line = ran_line(caplog, ml.sum(ml.stack(sums)))
    assert line.endswith(
        "all ran one by one: 26 had no partner of their signature among the nodes ready with them (sum 9, matmul 8,"
        " tanh 8, ...); nodes run as one kernel only with nodes of one primitive (one trace of a marked operation)"
        " whose operands have equal shapes and dtypes and whose parameters are equal; e.g. two sum nodes built at"
        f" {HERE}:{line_of('EXAMPLES')} and {HERE}:{line_of('EXAMPLES')} differ in operand 0's shape:"
        " float64[1, 3] against float64[2, 3]"
    ), line


def test_calls_of_an_operation_traced_apart_are_said_to_come_from_several_traces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = ml.Weight(np.ones((2, 2)))

    @ml.operation
    def cell(h: ml.ArrayOperand, n: int) -> ml.ArrayLayer:
        return ml.tanh(h @ w) * float(n)

    same = [cell(np.ones((1, 2)), 1) for _ in range(4)]
    apart = [cell(np.ones((1, 2)), n) for n in range(2, 6)]  # (an int: a trace per value)
    line = ran_line(caplog, ml.sum(ml.stack([ml.sum(x) for x in same + apart])))
    assert "ran batched: 12 nodes in 2 groups, 6 one by one: 6 had no partner of their signature" in line, line
    assert "(test_calls_of_an_operation_traced_apart_are_said_to_come_from_several_traces.<locals>.cell 4, " in line
    # Which arguments differ, in this line: it sent the user to the operation's line of its traces,
    # written only at 8, 16, 32, ... traces (at 4, never).
    assert line.endswith(
        "; the 4 test_calls_of_an_operation_traced_apart_are_said_to_come_from_several_traces.<locals>.cell nodes"
        " come from 4 traces of the operation, and nodes of different traces never run as one; the traces are one"
        " per signature: calls whose ints, strings or other static arguments, or data arrays' shapes or dtypes,"
        " differ never batch together; here they differ in n's value (2, 3, 4, ... 4 in all): pass a number that"
        " differs per call as a float, float(n), as the cell computes with it"
    ), line
    assert "has N traces" not in line


def test_calls_traced_apart_by_whose_outputs_they_pass_are_said_to_be(caplog: pytest.LogCaptureFixture) -> None:
    """Equal shapes, three traces: which arguments are outputs of which
    call is part of a signature (a trace reads them from that call's node),
    and the log named no cause (a new user's module network: a module that
    passes its state's part through gave every next module 4 traces)."""

    @ml.operation
    def two(x: ml.ArrayLayer) -> tuple[ml.ArrayLayer, ml.ArrayLayer]:
        return ml.tanh(x), ml.sigmoid(x)

    @ml.operation
    def red(h: ml.ArrayLayer, m: ml.ArrayLayer) -> ml.ScalarLayer:
        return ml.sum(h * m)

    x = ml.as_layer(np.ones(3))
    a, b = two(x)
    _, d = two(x * 2.0)
    calls = [red(a, b), red(a, d), red(a, ml.sigmoid(x))]  # one call's outputs; two calls'; a call's and a layer
    assert len(red._traces) == 3
    line = ran_line(caplog, ml.sum(ml.stack(calls)))
    name = "test_calls_traced_apart_by_whose_outputs_they_pass_are_said_to_be.<locals>.red"
    assert (
        f"; the 3 {name} nodes come from 3 traces of the operation, and nodes of different traces never run as one;"
        " the traces are one per signature: calls that pass outputs of other operations' calls in different ways"
        " never batch; here they differ in m's source (the second output of h's call, a layer that is none of a"
        " call's several outputs, the second output of a call other than h's); a trace reads an argument that is"
        " one of another operation's call's several outputs from that call's node, so which arguments are outputs"
        " of one call, which of another, and which are none (a marked call's only output, a layer built outside"
        " marked cells, or one a cell returned as it was given it) is part of its signature: to batch such calls,"
        " pass their arguments alike (a cell that returns an argument unchanged, return h, m, can return its own"
        " output, m * 1.0, so that the next cell gets all of them from one call)"
    ) in line, line


def test_a_marked_cells_only_output_is_not_said_to_be_no_operations(caplog: pytest.LogCaptureFixture) -> None:
    """A chain whose first call gets a cell of one output's result and whose
    next calls get the first of the chain's own two outputs (a new user's
    decoder, started from the encoder's last state): the log called the
    encoder's output 'no operation's output'."""

    @ml.operation
    def encode(h: ml.ArrayLayer) -> ml.ArrayLayer:
        return ml.tanh(h)

    @ml.operation
    def decode(s: ml.ArrayLayer) -> tuple[ml.ArrayLayer, ml.ScalarLayer]:
        return ml.tanh(s), ml.sum(s)

    outs = []
    for k in range(3):  # (inputs of 1, 2, 3 steps: a first call of decode at the depth of another's second)
        s: Any = ml.as_layer(np.full((1, 2), float(k)))
        for _ in range(k + 1):
            s = encode(s)
        for _ in range(2):
            s, out = decode(s)
            outs.append(out)
    line = ran_line(caplog, ml.sum(ml.stack(outs)))
    name = "test_a_marked_cells_only_output_is_not_said_to_be_no_operations.<locals>.decode"
    assert (
        f"the 6 {name} nodes come from 2 traces of the operation, and nodes of different traces never run as one;"
        " the traces are one per signature: calls that pass outputs of other operations' calls in different ways"
        " never batch; here they differ in s's source (a layer that is none of a call's several outputs, the"
        " first output of a call); "
    ) in line, line
    assert "no operation's output" not in line


def test_parameters_are_said_as_written(caplog: pytest.LogCaptureFixture) -> None:
    """A getitem's index of ints, a reduction's axis: the log showed its key,
    ``(<class 'tuple'>, (<class 'int'>, 0), (<class 'int'>, 1))``."""
    w = ml.Weight(np.arange(6.0).reshape(2, 3))
    lp = ml.log_softmax(w, axis=1)
    line = ran_line(caplog, ml.sum(ml.stack([lp[0, 1], lp[0, 2]])))  # INDEXED
    at = f"{HERE}:{line_of('INDEXED')}"
    assert f"e.g. two getitem nodes built at {at} and {at} differ in their index: [0, 1] against [0, 2]" in line, line
    line = ran_line(caplog, ml.sum(ml.stack([ml.sum(w[:, 1:], axis=0), ml.sum(w[:, 1:], axis=1)])))  # AXES
    at = f"{HERE}:{line_of('AXES')}"
    assert f"e.g. two sum nodes built at {at} and {at} differ in their axis: 0 against 1" in line, line
    cut = [w[0, 0:2], w[0, 1:3]]  # SLICES
    line = ran_line(caplog, ml.sum(ml.stack([ml.sum(x) for x in cut])))
    at = f"{HERE}:{line_of('SLICES')}"
    assert f"e.g. two getitem nodes built at {at} and {at} differ in their index: [0, 0:2] against [0, 1:3]" in line


def test_nodes_of_another_operand_count_are_said_to_differ_in_it(caplog: pytest.LogCaptureFixture) -> None:
    """Stacks of 1 and 3 layers: their signatures zipped paired the first's
    parameter with the second's operand (a new user's log: 'parameter 0's
    value: 0 against (<class 'numpy.float32'>, (), dtype('float32'))')."""
    w = ml.Weight(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    lp = ml.log_softmax(w, axis=1)
    parts = [ml.stack([lp[0, 1]] * n) for n in (1, 3, 4, 5)]  # STACKS
    line = ran_line(caplog, ml.sum(ml.stack([ml.mean(p) for p in parts])))
    at = f"{HERE}:{line_of('STACKS')}"
    assert f"e.g. two stack nodes built at {at} and {at} differ in their number of operands: 1 against 3" in line
    assert "class" not in line and "dtype(" not in line, line


def test_a_graph_that_batched_nothing_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """Branches of different shapes, analysed and found to batch nothing:
    the line said 'no group of one signature ready together that pays' and
    that forcing batching would do it, which groups nothing more."""
    from monadl.runtime.schedule import batched_rule

    batched_rule._verdicts.clear()  # (an earlier test's verdict on a graph of this line and size)
    batched_rule._unpaid.clear()
    ws = [ml.Weight(np.ones(k + 1)) for k in range(150)]
    loss = ml.sum(ml.stack([ml.sum(w * 2.0) for w in ws]))  # BRANCHES
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        anyio.run(loss.predict)
    (line,) = [r.getMessage() for r in caplog.records if "runs unbatched" in r.getMessage()]
    at = f"{HERE}:{line_of('BRANCHES')}"
    assert line.startswith(
        f"a graph of 302 nodes (its last built at {at}) runs unbatched: its analysis batched nothing (no group of"
        " one signature ready together that pays): 302 had no partner of their signature among the nodes ready"
        " with them (sum 151, multiply 150, stack 1); nodes run as one kernel only with nodes of one primitive"
        " (one trace of a marked operation) whose operands have equal shapes and dtypes and whose parameters are"
        f" equal; e.g. two sum nodes built at {at} and {at} differ in operand 0's shape: float64[1] against"
        " float64[2]; analysed again "
    ), line
    assert line.endswith(
        "; ml.settings(batching=True) would not batch them either: it groups nodes under their group's minimum,"
        " and these had none of their signature"
    ), line


def helper_made(w: ml.Weight[Any, Any], scale: float) -> Any:
    return ml.operation(lambda h: ml.sum(ml.tanh(h @ w) * scale))  # ONE-LINE


def test_functions_of_one_name_are_told_apart(caplog: pytest.LogCaptureFixture) -> None:
    """Three cells that one helper made share a name (a Fold model's
    reducers, ``Function(lambda hm: f(...))``): the log counted their nodes
    as one operation's, '7 nodes come from 5 traces of the operation', of
    three operations that never batch together."""
    w = ml.Weight(np.ones((2, 2)))
    first, second, third = (helper_made(w, s) for s in (1.0, 2.0, 3.0))
    nodes = [first(np.ones((n, 2))) for n in (1, 2, 3)]  # (arrays of three shapes: three traces)
    nodes += [second(np.ones((1, 2))), third(np.ones((1, 2)))]
    line = ran_line(caplog, ml.sum(ml.stack(nodes)))
    name = "helper_made.<locals>.<lambda>"
    assert (
        f"7 had no partner of their signature among the nodes ready with them ({name} [1] 3, {name} [2] 1,"
        f" {name} [3] 1, ...; {name} [1], [2], ...: 3 different functions of that name, all defined at"
        f" {HERE}:{line_of('ONE-LINE')}); "
    ) in line, line
    assert (
        f"; the 3 {name} [1] nodes come from 3 traces of the operation, and nodes of different traces never run as"
        " one; the traces are one per signature: calls whose ints, strings or other static arguments, or data"
        " arrays' shapes or dtypes, differ never batch together; here they differ in h's shape (float64[1, 2],"
        " float64[2, 2], float64[3, 2]): pass an array whose shape differs as a layer, ml.as_layer(h)"
    ) in line, line


def test_functions_of_one_name_defined_at_two_lines_are_named_by_their_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = ml.Weight(np.ones((2, 2)))
    cells = [
        ml.operation(lambda h: ml.sum(ml.tanh(h @ w))),  # FIRST-LAMBDA
        ml.operation(lambda h: ml.sum(ml.sigmoid(h @ w))),  # SECOND-LAMBDA
    ]
    line = ran_line(caplog, ml.sum(ml.stack([cell(np.ones((1, 2))) for cell in cells])))
    name = f"{test_functions_of_one_name_defined_at_two_lines_are_named_by_their_line.__qualname__}.<locals>.<lambda>"
    assert f"{name} (defined at {HERE}:{line_of('FIRST-LAMBDA')}) 1" in line, line
    assert f"{name} (defined at {HERE}:{line_of('SECOND-LAMBDA')}) 1" in line, line


def test_nodes_of_one_signature_at_different_depths_are_said_to_be_so(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones((2, 2)))
    h = ml.tanh(np.ones((1, 2)) @ w)
    for _ in range(3):
        h = ml.tanh(h)  # CHAIN
    line = ran_line(caplog, ml.sum(h))
    assert (
        f"; 4 tanh nodes of one signature (built at {HERE}:{line_of('h = ml.tanh(np.ones')}) ran apart, at different"
        " depths of the graph (a group's members are ready together: one that feeds another never joins it)"
    ) in line, line


def test_groups_under_their_minimum_are_counted_apart(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones((3, 3)))
    many = [ml.sum(ml.tanh(np.ones((2, 3)) @ w)) for _ in range(300)]
    three = [ml.sum(ml.tanh(np.ones((4, 3)) @ w)) for _ in range(3)]  # (under MIN_GROUP, 8)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        anyio.run(ml.sum(ml.stack(many + three)).predict)
    (line,) = [r.getMessage() for r in caplog.records if "ran batched" in r.getMessage()]
    assert line.endswith(
        "ran batched: 900 nodes in 3 groups, 11 one by one: 2 had no partner of their signature among the nodes"
        " ready with them (stack 1, sum 1); nodes run as one kernel only with nodes of one primitive (one trace of"
        " a marked operation) whose operands have equal shapes and dtypes and whose parameters are equal"
        "; 9 in groups too small to pay (MIN_GROUP; a marked operation's group from 2 to 4: marked_minimum)"
    ), line


def test_nothing_is_kept_unless_the_log_is_on_for_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="monadl.batching"):
        assert watching() is None
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        alone = watching()
    assert alone is not None and alone.single == [] and alone.small == alone.coarse == alone.unsigned == 0
