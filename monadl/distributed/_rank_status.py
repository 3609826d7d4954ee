"""What each rank tells the others at every step of `DataParallel.train`, and how
their answers are read: the status a rank all-gathers in the agreement round
(`monadl.distributed._comm.agree`), made after its backward (`_rank_status`):
per weight of the model whether its gradient is absent, dense or a sparse
`SparseRows` (and how many rows) and its position in the backward's order,
then when the rank came to the exchange and its timeout (`_came`), its step
and whether it has finished (`DataParallel.finish`);
with the first problem the rank met (a weight outside the model, a
non-finite gradient, an empty shard's NaN loss). `_parted` reads the
gathered steps: where they differ, or some rank has finished while another
still trains, every rank raises the same `RankFailure` and no rank steps.
`_late` reads the times: whether this rank came after the others had given
up waiting for it.
Kept apart from `monadl.distributed._data_parallel`, which runs the step's
exchanges, so that the status's layout is read in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from monadl._namespace import all_finite, namespace
from monadl.deltas import SparseRows
from monadl.distributed._comm import seconds
from monadl.distributed._overlap import Overlap
from monadl.distributed._same_model import shape_of
from monadl.layers import Weight

__all__ = [
    "_DENSE",
    "_EMPTY_SHARD",
    "_SPARSE",
    "_came",
    "_finite",
    "_is_nan",
    "_late",
    "_parted",
    "_rank_status",
    "_status",
]

_ABSENT, _DENSE, _SPARSE = 0, 1, 2


def _rank_status(
    n: int,
    step: int,
    order: Sequence[Weight[Any, Any]],
    grads: Mapping[Weight[Any, Any], Any],
    index: Mapping[Weight[Any, Any], int],
    labels: Sequence[str],
    overlap: Overlap | None,
    value: Any,
    problem: str,
) -> tuple[npt.NDArray[np.int64], str]:
    """This rank's status after its backward (``order``: the weights in the order
    their gradients became final; ``value``: its loss), and its problem: ``problem``
    (its backward's exception), else the first one its gradients or loss show."""
    status = _status(n, step, finished=False)
    for position, weight in enumerate(order):
        i = index.get(weight)
        if i is not None and status[1 + 2 * n + i] < 0:
            status[1 + 2 * n + i] = position
    # In the model's order, so that a failure names the same weight whatever the graph's order.
    for weight, grad in sorted(grads.items(), key=lambda item: index.get(item[0], n)):
        i = index.get(weight)
        if i is None:
            problem = problem or f"the loss reached a weight outside the model: {weight!r:.60}"
        elif not _finite(grad):
            problem = problem or f"non-finite gradient of weight {labels[i]} (shape {shape_of(weight._data)})"
        elif overlap is not None and weight in overlap.bucket_of and overlap.reported(weight) is not grad:
            problem = problem or f"the runtime reported weight {labels[i]}'s gradient final before it was"
        elif type(grad) is SparseRows:
            status[1 + i], status[1 + n + i] = _SPARSE, grad.indices.shape[0]
        else:
            status[1 + i] = _DENSE
    if not problem and _is_nan(value):
        problem = _EMPTY_SHARD
    return status, problem


_CAME, _PATIENCE = -4, -3  # (microseconds: `_came`)


def _status(n: int, step: int, finished: bool) -> npt.NDArray[np.int64]:
    """A rank's status for ``n`` weights: its failure's length (filled by `agree`);
    per weight its gradient's kind, rows and position in the backward's order
    (-1: none); when it came and its timeout (-1: unknown; filled by `_came`);
    its step; whether it has finished."""
    status = np.zeros(5 + 3 * n, np.int64)
    status[1 + 2 * n : 1 + 3 * n] = -1
    status[_CAME] = status[_PATIENCE] = -1
    status[-2] = step
    status[-1] = finished
    return status


def _came(status: npt.NDArray[np.int64], since: float | None, now: float, patience: float | None) -> None:
    """Note in ``status`` when this rank came to the exchange: ``now`` - ``since``,
    the end of the ranks' last exchange here (a collective ends on every rank
    at about the same moment, so the ranks' times compare without a shared
    clock), and how long it waits for the others (``patience``, its
    communicator's timeout), both in microseconds; None: unknown."""
    if since is not None:
        status[_CAME] = round((now - since) * 1e6)
    if patience is not None and math.isfinite(patience):
        status[_PATIENCE] = round(patience * 1e6)


LATE_MARGIN: Final = 1.0
"""Seconds by which a rank must come later than another's timeout to be told
that it was the late one: the slack of the ranks' common reference (when each
saw the last exchange end; a rank polls every millisecond, and a loaded machine
may pause it longer). Within it, its wait runs on to its own timeout."""


def _late(statuses: npt.NDArray[np.int64], rank: int) -> str:
    """Why ``rank`` came too late to this exchange, or ``""``: it came more than
    their timeout (and `LATE_MARGIN`) after some other ranks, which had given up
    on it before it came; the statuses it gathered are what they sent before
    they gave up, and no rank waits for its next exchange."""
    came, patience = statuses[:, _CAME], statuses[:, _PATIENCE]
    mine = int(came[rank])
    if mine < 0:
        return ""
    gone = [
        q
        for q in range(len(statuses))
        if q != rank and came[q] >= 0 and patience[q] >= 0 and mine - came[q] > patience[q] + LATE_MARGIN * 1e6
    ]
    if not gone:
        return ""
    after = (mine - int(max(came[q] for q in gone))) / 1e6
    timeouts = ", ".join(seconds(t / 1e6) for t in sorted({int(patience[q]) for q in gone}))
    one = len(gone) == 1
    return (
        f"rank {rank} was the late one: it came to this exchange {seconds(after)} s after {_ranks(gone)}, past "
        f"{'its' if one else 'their'} timeout of {timeouts} s, so {'it' if one else 'they'} had given up waiting "
        f"for it (this rank spent that long since the ranks' last exchange: in its loader, forward and backward, "
        "or paused); where a rank may be that slow, give the communicator a longer timeout"
    )


def _parted(statuses: npt.NDArray[np.int64]) -> str:
    """How the ranks' calls fail to pair (the same words on every rank), or ``""``."""
    tail = statuses[:, -2:]
    if (tail == tail[0]).all():
        return ""
    steps, finished = tail.T
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, key in enumerate(zip(finished.tolist(), steps.tolist())):
        groups.setdefault(key, []).append(rank)
    at = [f"{_ranks(ranks)} at step {step}" for (done, step), ranks in groups.items() if not done]
    ended = [
        f"{_ranks(ranks)} finished after {step} train() call{'s' * (step != 1)}"
        for (done, step), ranks in groups.items()
        if done
    ]
    if ended and at:
        return (
            f"{'; '.join(ended)}, while {'; '.join(at)} still trained: the ranks had different numbers of "
            "batches; give every rank as many (shard each global batch, with drop_last=True where it does not "
            "divide, or stop every rank where the shortest data ends)"
        )
    return (
        f"the ranks are at different steps: {'; '.join(ended or at)}; each rank's train() meets the others' "
        "in call order, so a rank that skipped or repeated a batch, or made a call the others did not, pairs "
        "its batches with the others' next ones"
    )


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, or ``ranks 0-2, 5``: a group of ranks, in runs."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and runs[-1][-1] == rank - 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


_EMPTY_SHARD: Final = (
    "the loss is NaN and its gradients finite, as a mean over an empty shard makes them (a batch of fewer "
    "examples than ranks), and any NaN loss is refused here: an empty shard's zero gradient would still count "
    "in the average, and shrink the step; give every rank at least one example (batches of at least as many "
    "examples as ranks; shard's drop_last=True also makes the shards equal), or keep NaN out of the loss "
    "(a metric added with a factor of 0 still makes it NaN)"
)


def _is_nan(value: Any) -> bool:
    """Whether a loss value is NaN (where the ranks' gradients are finite, an empty shard's mean)."""
    if value is None:
        return False
    xp = namespace(value)
    return bool(xp.any(xp.isnan(xp.asarray(value))))


def _finite(grad: Any) -> bool:
    return all_finite(grad.rows if type(grad) is SparseRows else grad)
