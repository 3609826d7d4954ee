"""Reducing gradient buckets while the backward pass still runs (as PyTorch's DDP does).

A `Plan` is the same list of dense buckets on every rank: the weights whose
gradient was dense on some rank at the previous step, in the order their
gradients became final there (the earliest rank's), packed up to a size
(the first bucket smaller, so that communication starts early). `Overlap`
carries one step: the runtime tells it each weight's gradient the moment
it is final (`monadl.runtime.entry.gradients`' ``on_gradient``); once every
weight of the next bucket in plan order is final, a communication thread
packs that bucket and all-reduces it (`Communicator.allreduce_blocking`),
while the event loop's thread goes on back-propagating. NumPy, BLAS and
MPI release the GIL, so the two run at once. Buckets start in plan order on
every rank (collectives must), whatever order a rank's dynamic graph made
its gradients final in; at the end of the backward (or on its failure) every
bucket not started yet starts, a weight this rank never reached contributing
zeros. A failed rank thus still takes part in every collective, and the
agreement round after it makes every rank raise, as without overlap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from monadl._namespace import is_array, namespace
from monadl.deltas import SparseRows
from monadl.distributed._comm import Communicator
from monadl.layers import Weight

__all__ = ["FIRST_BUCKET_BYTES", "Overlap", "Plan", "dense", "flatten", "nbytes", "plan_buckets"]

FIRST_BUCKET_BYTES: Final = 1 << 20  # DDP's first bucket: small, so the reduction starts early

Plan = tuple[tuple[Weight[Any, Any], ...], ...]


def plan_buckets(weights: Sequence[Weight[Any, Any]], limit: int, first: int = FIRST_BUCKET_BYTES) -> Plan:
    """Consecutive runs of same-dtype weights, each at most ``limit`` bytes (the first ``first``).

    >>> import numpy as np, monadl as ml
    >>> ws = [ml.Weight(np.zeros(n)) for n in (100, 100, 300)]
    >>> [len(b) for b in plan_buckets(ws, 4000, first=1600)]
    [2, 1]
    """
    buckets: list[list[Weight[Any, Any]]] = []
    size = 0
    for weight in weights:
        n = nbytes(weight._data)
        cap = first if len(buckets) == 1 else limit
        if buckets and size + n <= cap and _dtype(buckets[-1][0]._data) == _dtype(weight._data):
            buckets[-1].append(weight)
            size += n
        else:
            buckets.append([weight])
            size = n
    return tuple(tuple(b) for b in buckets)


@final
class Overlap:
    """One step's buckets: filled as gradients become final, reduced by a thread in plan order.

    Use: `start`, pass `final` to the backward as its listener, then `finish`
    with every gradient (or none, on failure), then `wait` (from the event
    loop, in a worker thread) and read `results` or `error`.
    """

    __slots__ = (
        "_comm",
        "_cv",
        "_grads",
        "_launched",
        "_pending",
        "_thread",
        "bucket_of",
        "error",
        "plan",
        "reduce_s",
        "results",
    )

    def __init__(self, comm: Communicator, plan: Plan) -> None:
        self._comm = comm
        self.plan = plan
        self.bucket_of = {w: k for k, bucket in enumerate(plan) for w in bucket}
        self._pending = [len(b) for b in plan]
        self._grads: dict[Weight[Any, Any], Any] = {}
        self._launched = 0  # buckets 0.._launched-1 may be reduced
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=f"monadl all-reduce (rank {comm.rank})", daemon=True)
        self.results: list[npt.NDArray[Any] | None] = [None] * len(plan)
        self.error: BaseException | None = None
        self.reduce_s = 0.0  # seconds the thread spent in collectives

    def start(self) -> None:
        self._thread.start()

    def final(self, weight: Weight[Any, Any], grad: Any) -> None:
        """The runtime's listener: ``weight``'s gradient is final."""
        k = self.bucket_of.get(weight)
        if k is None:  # not in a bucket (sparse, or not dense last step): reduced after the agreement
            return
        with self._cv:
            if weight in self._grads:
                return
            self._grads[weight] = grad
            self._pending[k] -= 1
            launched = self._launched
            while launched < len(self.plan) and not self._pending[launched]:
                launched += 1
            if launched != self._launched:
                self._launched = launched
                self._cv.notify()

    def finish(self, grads: Mapping[Weight[Any, Any], Any]) -> None:
        """The backward is over: the buckets not started yet start, with what ``grads`` has."""
        with self._cv:
            for weight, grad in grads.items():
                if weight in self.bucket_of:
                    self._grads.setdefault(weight, grad)
            self._launched = len(self.plan)
            self._cv.notify()

    def wait(self) -> None:
        """Block until every bucket is reduced or the thread failed."""
        self._thread.join()

    def reported(self, weight: Weight[Any, Any]) -> Any:
        """The gradient ``weight``'s bucket was packed with (None: zeros)."""
        return self._grads.get(weight)

    def _work(self) -> None:
        try:
            for k, bucket in enumerate(self.plan):
                with self._cv:
                    while self._launched <= k:
                        self._cv.wait()
                flat = flatten([dense(self._grads.get(w), w._data) for w in bucket])
                started = time.perf_counter()
                self.results[k] = self._comm.allreduce_blocking(flat)
                self.reduce_s += time.perf_counter() - started
        except BaseException as error:  # handed to the event loop's thread by `wait`
            self.error = error


def dense(grad: Any, data: Any) -> Any:
    """A rank's gradient as a dense array like the weight (zeros where it has none)."""
    if grad is None:
        return np.zeros(_shape(data), _dtype(data)) if not is_array(data) else namespace(data).zeros_like(data)
    if type(grad) is SparseRows:
        return grad.to_dense()
    if not is_array(grad):
        return np.asarray(grad, _dtype(data))
    return grad


def flatten(arrays: Sequence[Any]) -> Any:
    """The arrays, raveled and concatenated: one bucket's buffer."""
    xp = namespace(arrays[0])
    return xp.concat([xp.reshape(xp.asarray(a), (-1,)) for a in arrays])


def nbytes(data: Any) -> int:
    """The bytes of a weight's data (a number counts as a float64)."""
    return int(data.nbytes) if is_array(data) else int(np.asarray(data).nbytes)


def _shape(data: Any) -> tuple[int, ...]:
    return tuple(data.shape) if hasattr(data, "shape") else ()


def _dtype(data: Any) -> Any:
    return data.dtype if hasattr(data, "dtype") else np.dtype(np.float64)
