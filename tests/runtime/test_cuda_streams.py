"""How a graph's branches spread over CUDA streams (pure Python: runs everywhere)."""

from __future__ import annotations

from typing import Any

import numpy as np

import monadl as ml
from monadl.runtime.evaluation import Evaluation
from monadl.runtime.node import collect as _collect
from monadl.runtime.schedule import cuda as _cuda


def _order(root: ml.Layer[Any, Any]) -> list[Any]:
    return _collect(Evaluation(train=False), [root])


def test_a_chain_stays_on_one_stream() -> None:
    w = ml.Weight(np.ones(3))
    h = w * 2.0
    for _ in range(5):
        h = ml.tanh(h) + 1.0
    assert set(_cuda.assign(_order(ml.sum(h)), 4)) == {0}


def test_each_column_of_a_sum_of_columns_gets_its_own_stream() -> None:
    ws = [ml.Weight(np.ones((4, 4))) for _ in range(3)]
    x = np.ones((2, 4))
    columns = [ml.relu(ml.relu(x @ w) @ w) for w in ws]
    root = ml.sum(columns[0] + columns[1] + columns[2])
    order = _order(root)
    colour = _cuda.assign(order, 4)
    by_node = dict(zip(order, colour))
    assert len({by_node[c] for c in columns}) == 3
    # The chain of each column shares its column's stream.
    for c in columns:
        producer = c._inputs[0]
        assert by_node[producer] == by_node[c]


def test_more_branches_than_streams_reuse_them_round_robin() -> None:
    ws = [ml.Weight(np.ones(2)) for _ in range(6)]
    root = ml.sum(ml.stack([ml.tanh(w) for w in ws]))
    assert set(_cuda.assign(_order(root), 2)) == {0, 1}
    assert set(_cuda.assign(_order(root), 1)) == {0}


def test_without_cupy_imported_no_graph_is_on_a_device() -> None:
    import sys

    assert ("cupy" in sys.modules) == _cuda.loaded()
