"""The Tree-LSTM on the host, as the reference of the device tests (`test_cuda`, `test_stand_in_device`),
and a count of a loom's batched calls."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np


def host_reference(hidden: int) -> tuple[dict[str, Any], list[Any], float, dict[str, Any]]:
    """float64 weights, three 128-leaf random trees, and the loss and gradients
    of NumPy node by node (every op a layer, batching off)."""
    from benchmarks import treelstm
    from examples.tree_lstm import init_weights

    weights = init_weights(hidden, dtype=np.float64)
    trees = treelstm.make_batches(3, 1, balanced=False, seed=2)[0]
    cpu = treelstm.VARIANTS["monadl"](weights)
    assert cpu is not None
    with cpu.context():
        loss, grads = anyio.run(cpu.loss_and_gradients, trees)
    return weights, trees, float(loss), {k: np.asarray(g) for k, g in grads.items()}


def loom_calls(monkeypatch: Any) -> list[int]:
    """The sizes of the groups that looms run as one batched call, from now on (``monkeypatch``: pytest's)."""
    from monadl.fold import _loom_looped, _loom_run

    sizes: list[int] = []
    group_call = _loom_looped.group_call

    def counted(plan: Any, operands: Any, arenas: Any, weights: Any, n: int) -> Any:
        sizes.append(n)
        return group_call(plan, operands, arenas, weights, n)

    monkeypatch.setattr(_loom_run, "group_call", counted)
    return sizes
