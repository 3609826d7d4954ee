"""`DataParallel.broadcast`'s exchange: every rank takes the root's weights
and optimizer state, or none does.

The ranks first check that they hold the same model (`same_model`: names,
shapes, dtypes, optimizers; not the values, which are what is sent); the root
then sends its weights' data and states as one pickled buffer, and every other
rank checks the states against its own optimizers (`fitting_states`) before it
writes them, atomically, under the commit lock. The ranks agree on the
outcome at the end: a rank whose states did not fit makes every rank raise
the same `RankFailure`.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from monadl.distributed._comm import Communicator, agree
from monadl.distributed._same_model import fitting_states, same_model
from monadl.layers import Weight
from monadl.layers._commits import COMMIT_LOCK, pin_for_readers
from monadl.runtime.process import Held, hold, release

__all__ = ["broadcast_weights"]


async def broadcast_weights(
    comm: Communicator,
    weights: Sequence[Weight[Any, Any]],
    described: Sequence[str],
    labels: Sequence[str],
    root: int,
) -> None:
    """Give every rank ``root``'s ``weights`` (their data and optimizer state).

    ``described`` is this rank's model as `same_model` compares it, ``labels``
    its weights' names as errors show them.
    """
    await same_model(comm, described)  # (the weights' values are what differs, and what is sent)
    blob = b""
    if comm.rank == root:
        blob = pickle.dumps([(w._data, w._state) for w in weights], protocol=pickle.HIGHEST_PROTOCOL)
    length = await comm.broadcast(np.array([len(blob)], np.int64), root)
    data = await comm.broadcast(np.frombuffer(blob, np.uint8) if blob else np.empty(int(length[0]), np.uint8), root)
    problem = ""
    if comm.rank != root:
        loaded = pickle.loads(data.tobytes())
        states, problem = fitting_states(weights, labels, [state for _, state in loaded])
        if not problem:
            held: Held = None
            try:
                with COMMIT_LOCK:
                    pin_for_readers(weights)
                    held = hold()  # (a Ctrl-C waits for the last write)
                    for weight, (d, _), state in zip(weights, loaded, states):
                        weight._data, weight._state = d, state
            finally:
                release(held)  # (after the lock: a handler may save a checkpoint, which takes it)
    await agree(comm, problem, None)
