"""The DEBUG log of a batched run says why the nodes that ran one by one did:
those with no partner of their signature, by primitive, with an example of
two signatures that differ and in what (a new user's graph network got only
'173 nodes in 22 groups, 179 one by one')."""

from __future__ import annotations

import logging

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
    assert (
        "the 4 test_calls_of_an_operation_traced_apart_are_said_to_come_from_several_traces.<locals>.cell nodes come"
        " from 4 traces of the operation, one per signature of its calls, and nodes of different traces never run"
        " as one (its DEBUG line 'has N traces' says which arguments differ)"
    ) in line


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
    three = [ml.sum(ml.tanh(np.ones((4, 3)) @ w)) for _ in range(3)]  # (under DEFAULT_MIN_GROUP, 8; matmul's 4)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        anyio.run(ml.sum(ml.stack(many + three)).predict)
    (line,) = [r.getMessage() for r in caplog.records if "ran batched" in r.getMessage()]
    assert line.endswith(
        "ran batched: 900 nodes in 3 groups, 11 one by one: 2 had no partner of their signature among the nodes"
        " ready with them (stack 1, sum 1); nodes run as one kernel only with nodes of one primitive (one trace of"
        " a marked operation) whose operands have equal shapes and dtypes and whose parameters are equal"
        "; 9 in groups smaller than their rule's minimum (MIN_GROUP)"
    ), line


def test_nothing_is_kept_unless_the_log_is_on_for_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="monadl.batching"):
        assert watching() is None
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"):
        alone = watching()
    assert alone is not None and alone.single == [] and alone.small == alone.coarse == alone.unsigned == 0
