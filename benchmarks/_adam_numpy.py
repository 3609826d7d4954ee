"""Adam by hand in NumPy, as ``torch.optim.Adam`` takes it (betas 0.9,
0.999; eps 1e-8): the optimizer step of the benchmarks' hand-written limits
(`benchmarks._treelstm_numpy`, `benchmarks._shift_reduce_numpy`,
`benchmarks._gated_routing_numpy`)."""

from __future__ import annotations

from typing import Any

import numpy as np

B1, B2, EPS = 0.9, 0.999, 1e-8


def adam(weight: Any, m: Any, v: Any, g: Any, rate: float, t: int) -> None:
    """Step ``t`` (from 1) of Adam on ``weight`` with gradient ``g``, its
    moments ``m`` and ``v`` updated in place.

    >>> w, m, v = np.ones(2), np.zeros(2), np.zeros(2)
    >>> adam(w, m, v, np.array([1.0, -1.0]), 0.1, 1)
    >>> w.round(6).tolist()
    [0.9, 1.1]
    """
    m *= B1
    m += (1 - B1) * g
    v *= B2
    v += (1 - B2) * g * g
    weight -= (rate / (1 - B1**t)) * m / (np.sqrt(v / (1 - B2**t)) + EPS)
