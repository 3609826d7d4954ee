"""The Tree-LSTM on the host, as the reference of the device tests (`test_cuda`, `test_stand_in_device`)."""

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
