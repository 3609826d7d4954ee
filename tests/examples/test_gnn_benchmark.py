"""The graph network benchmark: its monadl variants (and PyTorch's, where present) agree before they are timed."""

from __future__ import annotations

import importlib.util

from benchmarks import gnn


def test_segment_sums_and_one_hot_products_give_the_same_loss_and_gradients() -> None:
    names = ["segment_sum", "one-hot"] + (["torch"] if importlib.util.find_spec("torch") else [])
    assert gnn.check(8, names) < 1e-10
