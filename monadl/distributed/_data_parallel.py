"""Data-parallel training: every rank runs the model on its shard; all step alike.

One `DataParallel.train` is a transaction across ranks, in three exchanges
(and, with ``overlap=True``, a fourth during the backward, from the second step on):

0. **Overlap.** The planned buckets (`monadl.distributed._overlap`): every
   weight that had a dense gradient on some rank so far, in a fixed order,
   all-reduced bucket by bucket while the backward runs, each as soon as
   its gradients are final; a failing rank contributes what it has (zeros
   for the rest), so every rank takes part in every bucket (which totals a
   weight steps by: `monadl.distributed._reduce`). The buckets are awaited
   after the agreement round, which runs while they are in flight: a rank
   that came after the others had given up on it learns so from their
   statuses at once, not after a timeout in buckets they left.
1. **Agree.** Each rank runs its forward and backward
   (`monadl.distributed._rank_gradients`: gradients, no step) and
   all-gathers a small status (`monadl.distributed._rank_status`): whether it
   failed, and per weight of the model whether its gradient is absent, dense or a
   sparse `SparseRows` (and how many rows), and its step: the number of
   its batch (``train``'s ``step``, by default its count of ``train`` calls)
   and whether it has finished (`DataParallel.finish`). If any rank failed
   (an exception, a non-finite gradient), the ranks all-gather the reasons and
   every rank raises the same `RankFailure`; no rank steps. So they do where
   the ranks' steps differ, or some have finished: each rank's call meets the
   others' in order, so a rank that skipped a batch (an uneven data loader)
   would otherwise average its next batch with the others' current one.
2. **Reduce** (`monadl.distributed._reduce`). Dense gradients not in the
   plan (all of them at the first step) are all-reduced in buckets of up to
   ``bucket_bytes``, all at once; sparse gradients are all-gathered as rows,
   never as dense tables. A weight that no rank reached is not stepped, as on
   one process.
3. **Commit.** Every rank computes every step from the same reduced
   gradients and then writes them (`_commit`): identical weights everywhere.

Before the first step, one more exchange checks that every rank holds the
same model (`monadl.distributed._same_model`), its values included (a
checksum per weight: ranks built from different seeds without a
`DataParallel.broadcast` are refused). Once passed, it is not repeated:
the weights are found once, when `DataParallel` is built, and a
weight's shape and dtype never change (`Weight`'s setter, a step and a
checkpoint keep them), so every later buffer has the same size and dtype on
every rank.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Final, TypeVar, final, overload

from monadl._named import ModelWrapper, named_weights
from monadl.distributed._broadcast import broadcast_weights
from monadl.distributed._comm import Communicator, RankFailure, agree, mpi_world
from monadl.distributed._in_step import in_step
from monadl.distributed._overlap import Overlap, Plan, next_plan
from monadl.distributed._rank_gradients import rank_gradients
from monadl.distributed._rank_status import _DENSE, _came, _late, _parted, _rank_status, _status
from monadl.distributed._reduce import pack_rest, reduce_overlapped, reduce_rest
from monadl.distributed._same_model import checksums, describe, label, same_model
from monadl.errors import NoGradientError
from monadl.layers import Weight
from monadl.layers._arrays import Array
from monadl.layers._layer import Expr
from monadl.optim import apply_gradients
from monadl.runtime import entry
from monadl.runtime.node import where
from monadl.runtime.settings import current_settings

__all__ = ["DataParallel"]

D = TypeVar("D")

BUCKET_BYTES: Final = 25 << 20  # PyTorch DDP's default bucket size
_NOT_BROADCAST: Final = "no rank took the root's weights"


@final
class DataParallel(ModelWrapper):
    """Train one model on every rank, each on its own shard, as one model.

    ``await dp.train(loss)`` computes this rank's gradients, averages them
    over the ranks (as PyTorch's DDP and Horovod do, so with equal shards the
    step is the full batch's) and steps every weight identically on every
    rank; if any rank failed, no rank steps and each raises `RankFailure`.
    With unequal shards each rank's mean loss still counts as one rank's
    share: `shard`'s ``drop_last`` makes them equal, or, to keep every
    example, ``average=False`` with each rank's mean loss times
    ``len(its_shard) / len(batch)`` gives the full batch's step exactly (its
    gradients sum to the full batch's mean's); a rank whose shard is
    empty (a batch of fewer examples than ranks) has a NaN mean loss and a
    zero gradient that the average would count, so `train` refuses that
    step, on every rank, rather than take a smaller one. Each rank's
    ``train`` calls meet the others' in order: call `finish` on every rank
    when its data ends, and pass each batch's number as ``step`` to have the
    ranks checked to be on the same batch at every step.

    ``ml.save(path, dp)`` and ``ml.load(path, dp)`` save and load its
    `model`, under the model's own names (no ``module.`` prefix, as PyTorch's
    DDP adds): a checkpoint moves between the plain model and the wrapped
    one as it is. A load changes only this rank's weights: load on every
    rank, or on one and then `broadcast`.

    Args:
        model: the weights to keep in sync: a `Weight`, or any object,
            list, tuple or dict holding them (found by `find_weights`, in the
            same order on every rank).
        comm: how ranks talk; by default ``MPI.COMM_WORLD`` (`mpi_world`).
        bucket_bytes: the largest dense bucket reduced as one buffer (the
            first bucket of the overlap at most `FIRST_BUCKET_BYTES`).
        average: divide the summed gradients by the number of ranks.
        overlap: all-reduce buckets while the backward still runs (from the
            second step on, once a step has shown which gradients are dense
            and in what order they become final), as DDP does. Off by default:
            MPI moves the data inside the rank's own tests, on its one thread,
            and on the 2-core development machine the overlapped step measured
            4-28% slower (BENCHMARKS.md, "Distributed"); turn it on where each
            rank has its own cores and the network is the bottleneck.

    >>> import numpy as np, monadl as ml
    >>> from monadl.distributed import DataParallel, run_local, shard
    >>> x = np.arange(8.0)
    >>> async def main(comm):
    ...     w = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
    ...     dp = DataParallel(w, comm)
    ...     await dp.broadcast()
    ...     await dp.train(ml.mean(w * shard(x, comm.rank, comm.size)))
    ...     return w.data
    >>> run_local(2, main)  # each rank saw half of x; both stepped by the mean of all of x
    [array([-0.35]), array([-0.35])]
    """

    __slots__ = (
        "_agreed",
        "_calls",
        "_comm",
        "_dense",
        "_described",
        "_finished",
        "_index",
        "_labels",
        "_met",
        "_model",
        "_order",
        "_plan",
        "_times",
        "_weights",
        "average",
        "bucket_bytes",
        "overlap",
    )

    def __init__(
        self,
        model: object,
        comm: Communicator | None = None,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        average: bool = True,
        overlap: bool = False,
    ) -> None:
        self._comm = mpi_world() if comm is None else comm
        self._model = model
        named = named_weights(model)  # (`find_weights`, with the names that errors show)
        self._weights = tuple(named.values())
        self._labels = tuple(label(name, i) for i, name in enumerate(named))
        self._described = [describe(name, w._data, w._state, w.optimizer) for name, w in named.items()]
        self._agreed = False  # every rank was shown to hold this model (`same_model`)
        self._calls = 0  # train() calls so far: the step of the next, unless the caller numbers them
        self._finished = False  # finish() was called: no train() nor finish() after it
        self._met: float | None = None  # when the ranks' last exchange here ended (`_came`)
        self._index = {w: i for i, w in enumerate(self._weights)}
        self.bucket_bytes = bucket_bytes
        self.average = average
        self.overlap = overlap
        self._plan: Plan = ()
        self._dense: set[int] = set()  # weights (by index) that had a dense gradient on some rank
        self._order: dict[int, int] = {}  # weight index -> its gradient's earliest position, last seen
        self._times: dict[str, float] = {}

    @property
    def model(self) -> object:
        """The model it trains, as given: what `monadl.save` and `monadl.load` see in its place."""
        return self._model

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._comm.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._comm.size

    @property
    def weights(self) -> tuple[Weight[Any, Any], ...]:
        """The model's weights, in the order every rank exchanges them."""
        return self._weights

    async def broadcast(self, root: int = 0) -> None:
        """Give every rank ``root``'s weights and optimizer state (at start, or after loading a checkpoint).

        Raises `RankFailure` on every rank, and no weight changes, if the
        ranks' models differ (as `train` checks them: names, shapes, dtypes,
        optimizers) or a collective fails.
        """
        try:
            with in_step(self._comm):
                await broadcast_weights(self._comm, self._weights, self._described, self._labels, root)
                self._met = time.perf_counter()
        except RankFailure as failure:  # (told as what did not happen: no rank tried to step)
            told = RankFailure(failure.failures, failure.reason, failure.in_step, outcome=_NOT_BROADCAST)
            raise told.with_traceback(failure.__traceback__) from failure.__cause__

    @property
    def buckets(self) -> tuple[tuple[Weight[Any, Any], ...], ...]:
        """The dense buckets that `train` all-reduces while the backward runs, in
        launch order (the same on every rank; empty until a step has run)."""
        return self._plan

    @property
    def last_step_seconds(self) -> dict[str, float]:
        """Where the last `train` spent its time: ``backward`` (this rank's
        forward and backward), ``allreduce`` (dense buckets in flight,
        overlapped or not), ``exposed`` (waiting for gradient exchanges after
        the backward, and with overlap after the status round, during which
        the buckets move: the communication not hidden behind them) and ``agree``
        (the status round, and at the first step the check that every rank
        holds the same model: where the ranks first meet, so a late rank's
        wait shows there)."""
        return dict(self._times)

    # Typed as ``loss.train()``: a float or an array, spelt, not inferred alone (``Expr[D, Any] -> D``):
    # an ``async def`` returns a coroutine, no bare type variable, so mypy took D from around the call,
    # and ``float(await dp.train(loss))`` wanted an ``Expr[str | Buffer | SupportsFloat | ..., Any]``.
    @overload
    async def train(self, loss: Expr[float, Any], *, step: int | None = None) -> float: ...
    @overload
    async def train(self, loss: Expr[Array, Any], *, step: int | None = None) -> Array: ...
    @overload
    async def train(self, loss: Expr[D, Any], *, step: int | None = None) -> D: ...
    async def train(self, loss: Expr[Any, Any], *, step: int | None = None) -> Any:
        """One data-parallel step: local forward and backward, then all ranks step alike.

        With ``overlap=True``, from the second step on, dense gradient
        buckets are all-reduced while the backward still runs (see
        `monadl.distributed._overlap`); by default they are reduced after it.
        Returns this rank's loss value. Raises `RankFailure` (on every rank)
        if any rank failed, or if the ranks' models differ (in their number
        of weights, or a weight's name, shape, dtype, optimizer, or, at the
        first step, its values or optimizer state: call `broadcast` first);
        then no weight changed on any rank. After one whose ``in_step`` is False (a
        collective timed out or failed, or the ranks parted), every later call raises at once.

        The ranks also compare their steps and refuse one where they differ,
        naming each rank's step, or where some rank has called `finish` (it
        had fewer batches). ``step`` is this batch's number in your loop (the
        same on every rank for the same global batch); by default, how many
        times ``train`` was called before, which catches a call that one rank
        alone made or had refused, but not a batch your loop skipped on one
        rank: number the batches for that.

        A rank whose loss reaches no weight (a sum over an empty shard; a
        mean over one is NaN, which every rank refuses as a `RankFailure`)
        steps by the others' gradients; where no rank's does, every rank raises
        `NoGradientError`, as ``train()`` does, with no weight changed and
        the ranks in step (its ``.value`` is this rank's loss).
        """
        if self._finished:  # (every rank that does so raises here alike, with no exchange to wait for)
            raise RuntimeError(
                "DataParallel.train() after finish(): this rank said its training was over; call finish() once, "
                "after the last batch (a new DataParallel over the same weights trains again)"
            )
        if not isinstance(loss, Expr):  # (a number reached the runtime: "'float' object has no attribute '_inputs'")
            raise TypeError(
                f"DataParallel.train() takes the loss as a layer (what loss.train() would train), got "
                f"{type(loss).__name__}: pass the layer, not its value"
            )
        at = self._calls if step is None else step
        self._calls += 1  # (a call refused here alone still took a batch of this rank's loop)
        entry.refuse_inside_evaluation("DataParallel.train()")  # (on every rank alike, before any exchange)
        with in_step(self._comm):
            try:
                value, reduced = await self._exchange(loss, at)
            finally:  # (after its last exchange, failed or not: on every rank at about the same moment)
                self._met = time.perf_counter()
            # (after `_met`: the update's time differs between ranks, a large model's on a
            # loaded node by seconds, and would count as lateness at the next exchange)
            if reduced:  # (the same on every rank: the agreed statuses decide it)
                _commit(reduced)
                return value
        raise NoGradientError(  # (out of `in_step`: the ranks are in step, a later train() exchanges as ever)
            f"DataParallel.train() of the loss built at {where(loss)}: no rank's loss sends a gradient to any "
            f"weight (this rank's is {value}), so no rank stepped: were every rank's batches empty, or without "
            "targets? See ml.NoGradientError; its .value is this rank's loss",
            value,
        )

    async def finish(self) -> None:
        """This rank's training is over: say so, on every rank, after its last `train`.

        Returns once every rank has finished after as many `train` calls.
        Where some rank is still in `train` (its data had more batches), that
        `train` and every rank's `finish` raise the same `RankFailure`, which
        names each rank's step; no rank steps. A `train` or a `finish` after
        it raises `RuntimeError`. (Without it, that rank waits
        for the finished one's answer until its timeout: under MPI, it cannot
        tell a rank that returned from one that died.)
        """
        if self._finished:
            raise RuntimeError("DataParallel.finish() called twice: call it once, after the last batch")
        self._finished = True
        with in_step(self._comm):
            await self._finish()

    async def _finish(self) -> None:
        # The collectives a step makes, in its order, the same on every rank:
        # the model check before the first step, the overlap's buckets (zeros
        # from this rank, as from a rank that reached no weight) started before
        # the status round and awaited after it.
        comm = self._comm
        await self._same_model()
        overlap = Overlap(comm, self._plan) if self.overlap and self._plan and comm.size > 1 else None
        if overlap is not None:
            overlap.finish({})
        status = _status(len(self._weights), self._calls, finished=True)
        _came(status, self._met, time.perf_counter(), getattr(comm, "timeout", None))
        late = functools.partial(_late, rank=comm.rank)
        await agree(comm, "", None, status, _parted, late, None if overlap is None else overlap.wait)
        if overlap is not None:
            await overlap.wait()

    async def _same_model(self) -> float:
        """Before the first step (once): check that every rank holds this model,
        values included; the seconds it took (0 once passed)."""
        if self._agreed:
            return 0.0
        start = time.perf_counter()
        await same_model(self._comm, self._described, checksums(self._weights), self._labels)
        self._agreed = True
        self._met = time.perf_counter()
        return self._met - start

    async def _exchange(self, loss: Expr[Any, Any], step: int) -> tuple[Any, dict[Weight[Any, Any], Any]]:
        """This rank's loss value and the reduced gradients every rank steps by."""
        comm, weights, index, n = self._comm, self._weights, self._index, len(self._weights)
        checked = await self._same_model()  # where the ranks first meet, and wait for a late one
        # One rank has nothing to overlap: its "all-reduce" is a copy.
        overlap = Overlap(comm, self._plan) if self.overlap and self._plan and comm.size > 1 else None
        started = time.perf_counter()
        mine = await rank_gradients(loss, overlap)
        value, grads = mine.value, mine.grads
        backward_end = time.perf_counter()
        status, problem = _rank_status(n, step, mine.order, grads, index, self._labels, overlap, value, mine.problem)
        agree_start = time.perf_counter()
        _came(status, self._met, agree_start, getattr(comm, "timeout", None))  # (a Communicator need not have one)
        # The status round runs while the buckets are still in flight, and they are
        # awaited after it: a rank that came after the others had given up on it is
        # told so by their statuses at once, not held first in buckets they had left.
        late, wait = functools.partial(_late, rank=comm.rank), None if overlap is None else overlap.wait
        statuses = await agree(comm, problem, mine.cause, status, _parted, late, wait)
        agree_end = time.perf_counter()
        if overlap is not None:
            await overlap.wait()  # a rank that died or hangs: RankFailure after the timeout
        reduced_end = time.perf_counter()
        exposed = agree_start - backward_end + reduced_end - agree_end
        kinds, rows = statuses[:, 1 : 1 + n], statuses[:, 1 + n : 1 + 2 * n]
        scale = 1.0 / comm.size if self.average else 1.0
        # Dense where any rank's gradient is dense (the other ranks' rows or
        # absences made dense); rows where the ranks that have one have rows.
        any_dense = (kinds == _DENSE).any(axis=0)
        reduced = {} if overlap is None else reduce_overlapped(overlap, any_dense, index, scale)
        planned = overlap.bucket_of if overlap is not None else {}
        packed = pack_rest(weights, grads, kinds, any_dense, planned, self.bucket_bytes)
        post_start = time.perf_counter()
        reduced.update(await reduce_rest(comm, weights, grads, packed, rows, scale))
        post = time.perf_counter() - post_start
        positions = statuses[:, 1 + 2 * n : 1 + 3 * n]
        self._plan = next_plan(self._plan, weights, self._dense, self._order, any_dense, positions, self.bucket_bytes)
        self._times = {
            "backward": backward_end - started,
            "allreduce": (reduced_end - overlap.started_at if overlap is not None else 0.0) + post,
            "exposed": exposed + post,
            "agree": agree_end - agree_start + checked,
        }
        return value, reduced


def _commit(grads: dict[Weight[Any, Any], Any]) -> None:
    """Step every weight by its gradient, as ``train()`` commits: every step
    computed before any is written, atomically, never NaN into a weight."""
    apply_gradients(grads, finite=current_settings().finite_steps)
