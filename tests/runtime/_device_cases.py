"""Cases run on the host, on the stand-in device (`test_stand_in_device`,
for CI) and on a real GPU (`test_cuda`) alike: ``asarray`` puts data where
the case runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import monadl as ml


def joint_reading_two_output_cells(asarray: Callable[[Any], Any]) -> tuple[ml.Weight[Any, Any], ml.ScalarLayer]:
    """A weight and a loss: a two-output cell's group reads its operands from
    two producer cells' groups (on a device, a joint gather); its even
    members read only ``h``, which does not depend on the producers' ``r``,
    whose ``sqrt`` is at 0 there. Batched, the joint's output ``r`` must get
    only the odd members' rows: a zero row times ``sqrt``'s infinite
    derivative at 0 is a NaN in the weight's gradient."""
    w = ml.Weight(asarray(np.array([[0.9, -0.4], [0.3, 1.1]])))
    one = ml.operation(lambda h, r: (ml.tanh(h @ w), ml.sqrt(ml.tanh(h @ w) * 0.0 + r)))
    other = ml.operation(lambda h, r: (ml.sigmoid(h @ w), ml.sqrt(ml.sigmoid(h @ w) * 0.0 + r)))
    two = ml.operation(lambda h, r: (ml.tanh(h @ w), r + ml.tanh(h @ w) * 0.0))
    terms = []
    for i in range(8):
        x = ml.as_layer(asarray(np.array([[0.1 * i + 0.05, -0.1 * i]])))
        produce = one if i % 3 else other
        h, r = two(*produce(x, ml.as_layer(asarray(np.full((1, 2), float(i % 2))))))
        terms.append(ml.sum(h) if i % 2 == 0 else ml.sum(r))
    return w, ml.sum(ml.stack(terms))


def cells_reading_one_shared_cell(
    asarray: Callable[[Any], Any], either: bool
) -> tuple[list[ml.Weight[Any, Any]], ml.ScalarLayer]:
    """Two weights and a loss: an encoder cell called once, its two outputs
    read by 40 calls of a decoder cell, each with its own row; the loss
    reads the decoder's first output (``either``: the second in odd calls).
    Batched, the decoder's calls are one group, the encoder's node shared by
    all of them as a weight is."""
    rng = np.random.default_rng(5)
    w = ml.Weight(asarray(rng.normal(size=(2, 2))))
    v = ml.Weight(asarray(rng.normal(size=(2, 2))))
    encode = ml.operation(lambda x: (ml.tanh(x @ w), ml.sigmoid(x @ w)))
    decode = ml.operation(lambda h, c, x: (ml.tanh(h @ v + x) * c, c + ml.tanh(x @ v)))
    h, c = encode(ml.as_layer(asarray(np.array([[0.5, -0.5]]))))
    terms = []
    for i, x in enumerate(rng.normal(size=(40, 1, 2))):
        out, state = decode(h, c, ml.as_layer(asarray(x)))
        terms.append(ml.sum(state) if either and i % 2 else ml.sum(out))
    return [w, v], ml.sum(ml.stack(terms))
