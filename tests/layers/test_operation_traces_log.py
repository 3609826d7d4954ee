"""The DEBUG log of an operation's many traces says what to change, by their cause."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

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


def test_static_arguments_are_told_to_become_data(caplog: pytest.LogCaptureFixture) -> None:
    w = ml.Weight(np.ones(3))
    cell = ml.operation(lambda xs, k: ml.sum(ml.stack(xs) * w) * float(k))
    calls = [([w, w], k) for k in range(8)]  # lists of one length; an int that differs
    message = traces_message(caplog, calls, cell)
    assert "has 8 traces" in message and "pass a number that differs per call as a float" in message
    assert "an array whose shape differs as a layer, ml.as_layer(x)" in message
    assert "ml.stack" not in message


def test_the_count_of_traces_is_said_once_each_not_at_every_call_past_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At the limit each new signature replaces a trace, so the count stayed
    256, a power of two: the line was said at every call (1,380 lines for a
    new user's 600 batch sizes)."""
    from monadl.layers._operation import _TRACES_LIMIT

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
