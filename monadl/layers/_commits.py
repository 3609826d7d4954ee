"""What weights' commits share with the evaluations running now, process-wide:
the lock a step, an assignment or a load writes under (`COMMIT_LOCK`), the
evaluations that read weights (`READERS`) and those that send them deltas
(`TRAINING`), and the keeping of a weight's data for those readers before it
is replaced (`pin_for_readers`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from monadl.layers._weight import Weight

__all__ = ["COMMIT_LOCK", "READERS", "TRAINING", "pin_for_readers"]

COMMIT_LOCK: Final = threading.RLock()  # (re-entrant: an optimizer may read a weight's data)
"""Held while weights step (`monadl.optim.apply`) and while their data is
taken to be read: a step may write into an array nobody holds, and it must
not gain a reader on another thread half way."""

READERS: Final[dict[int, dict[Any, Any]]] = {}
"""The evaluations running now (`monadl.runtime.drive`), by id: the data
each keeps of weights written since it began (`pin_for_readers`). Changed
under `COMMIT_LOCK`. Process-wide, as the weights are: a write (a step, an
assignment, a load) on any thread or event loop must reach every evaluation
that may read the weight, and nothing else knows them all."""

TRAINING: Final[dict[int, Mapping[Any, Any]]] = {}
"""The evaluations that send deltas to weights (``train()``, ``gradients()``)
running now, by id: their records, by layer and weight (a weight among them
was read, and its step or gradient is of that value). Changed under
`COMMIT_LOCK`; a checkpoint's load warns of the weights it replaces there."""


def pin_for_readers(weights: Iterable[Weight[Any, Any]]) -> None:
    """Before their data is replaced, under `COMMIT_LOCK`: every evaluation
    running keeps these weights' data as it is, and reads that, not the new.

    So an evaluation reads the model as it was when it began, whatever
    commits while it runs: a prediction beside a ``train()``, whose weights
    an ``@ml.direct`` function reaches after an await, sees one model, not
    the old value of one weight and the new of another. (A kept array is
    held, so a step never writes into it.)
    """
    for pinned in READERS.values():
        for weight in weights:
            if weight not in pinned:
                pinned[weight] = weight._data
