"""The cost rule's minimum for a group of one marked operation's calls
(`monadl.operation`): from 2 to 4 calls, by the weights a call reads and its
program's steps; the other primitives' minimum is
`monadl.runtime.schedule.batched_rule.MIN_GROUP`."""

from __future__ import annotations

from typing import Any, Final

from monadl.layers._weight import Weight
from monadl.runtime.schedule.batched_weights import MIN_PACKED

__all__ = ["MARKED_SOME", "MARKED_STEPS", "MARKED_WEIGHTS", "marked_minimum"]

MARKED_WEIGHTS: Final = 1 << 15
"""Elements of the weights a marked operation reads from which a group of
two of its calls pays (`marked_minimum`)."""

MARKED_SOME: Final = 1 << 13
"""Elements of its weights from which a group of three pays, as it does of
a program of `MARKED_STEPS` steps or more (`marked_minimum`)."""

MARKED_STEPS: Final = 6


def marked_minimum(node: Any) -> int:
    """The smallest group of a marked operation's calls (``node``'s
    signature) that pays: 2 where the weights it reads hold `MARKED_WEIGHTS`
    elements or more, 3 where `MARKED_SOME` or more or its program has
    `MARKED_STEPS` steps or more, else `MIN_PACKED`. Measured
    (`OPENBLAS_NUM_THREADS=1`, this project's VM; a new user's: 2 sequences
    through a marked ``tanh(h @ W + x)`` of 16, 1.22x the time of batching
    off when groups of 2 paid): sequences of 30 calls of a cell of ``k``
    such steps, W of H x H, default over off, when groups of any size
    paid. Two sequences: 1.15-1.23x at H = 16 to 64 (k of 1 to 6), 1.12x
    at 96 and 1.06-1.09x at 128 (k = 1), 1.03x at 96 (k = 3: 27,648
    elements), 0.95-0.97x at 128 (49,152), 0.84-0.89x at 128 (k = 6).
    Three: 1.01-1.05x for k = 1 at H = 16 and 32, 0.99-1.03x at 64 (4,096
    elements), 0.95-0.96x at 96 (9,216), 0.97x or less from 9 steps at any
    H. Four: 0.94x or less in every case.

    >>> import numpy as np, monadl as ml
    >>> small, large = ml.Weight(np.ones((16, 16))), ml.Weight(np.ones((256, 256)))
    >>> cell = lambda w: ml.operation(lambda h: ml.tanh(h @ w))
    >>> [marked_minimum(cell(w)(np.ones((1, w.shape[0])))) for w in (small, large)]
    [4, 2]
    """
    weights = sum([int(x.size) for x in node._inputs if type(x) is Weight])
    if weights >= MARKED_WEIGHTS:
        return 2
    return 3 if weights >= MARKED_SOME or len(node._op.rule.steps) >= MARKED_STEPS else MIN_PACKED
