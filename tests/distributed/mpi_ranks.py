"""What each rank runs under ``mpiexec -n 2`` for test_mpi.py.

``python mpi_ranks.py train OUT``: 50 data-parallel steps of the digits demo's
gated network and of the columns network (float64, each rank on half of
every batch), then two steps that fail on rank 1 (an exception in its
forward; a NaN); writes ``OUT/rank{r}.npz`` (weights) and
``OUT/rank{r}.json`` (the errors, and whether the failed steps changed
anything).

``python mpi_ranks.py kill OUT``: rank 1 is killed (SIGKILL) in the forward
of its first step; the survivor writes what it raised to ``OUT/rank0.json``.

``python mpi_ranks.py mismatch OUT``: the ranks build weights of different
shapes (3 and 1 numbers) and train them, overlapped, twice; each writes what
it raised and whether its weight changed to ``OUT/rank{r}.json``.

``python mpi_ranks.py uneven OUT``: rank 1 has one batch fewer than rank 0,
and calls ``finish()`` after its last; each writes what every call gave and
its weight to ``OUT/rank{r}.json``.

``python mpi_ranks.py late OUT`` (``late-overlap``: with ``overlap=True``):
rank 1 starts its second step once rank 0 has given up on it (2 s timeout),
100 s later on the clock the protocol reads; each writes what that step raised
and the exchanges it entered to ``OUT/rank{r}.json``.

The models and batches come from `model_batches`, which the test also uses
for its one-process reference.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import monadl as ml
from benchmarks.columns import COARSE, Config, MonadlColumns, init_weights, make_batches
from examples.digits import GatedDigits, load_digits

STEPS = 50
Batch = tuple[Callable[[Any, Any], ml.ScalarLayer], npt.NDArray[Any], npt.NDArray[Any]]


def float64_digits() -> GatedDigits:
    """The digits demo's model with float64 weights (for a 1e-6 comparison after 50 steps)."""
    model = GatedDigits(seed=0)
    for dense in [model.features, model.coarse, *(d for pair in model.fine for d in pair)]:
        dense.weight = ml.Weight(np.asarray(dense.weight.data, np.float64), optimizer=dense.weight.optimizer)
        dense.bias = ml.Weight(np.asarray(dense.bias.data, np.float64), optimizer=dense.bias.optimizer)
    return model


def model_batches() -> tuple[list[object], list[Batch]]:
    """The two models and, per step, a loss function and its full batch: the
    digits demo's one-group batches of 16 and the columns network's."""
    digits = float64_digits()
    x, y, _, _ = load_digits()
    x = x.astype(np.float64)
    steps: list[Batch] = []
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        rows = rng.choice(np.flatnonzero(y // 2 == step % 5), 16, replace=False)
        steps.append((digits.training_loss, x[rows], y[rows]))
    config = Config(columns=2)
    columns = MonadlColumns(config, {k: v.astype(np.float64) for k, v in init_weights(config).items()})
    for x_batch, coarse, fine in make_batches(config, STEPS):

        def loss(xs: Any, fines: Any, coarse: int = coarse) -> ml.ScalarLayer:
            return columns.loss(xs, coarse, fines, skip=True)

        steps.append((loss, x_batch.astype(np.float64), fine))
    assert len(steps) == 2 * STEPS and coarse < COARSE
    return [digits, columns], steps


def flat_weights(models: list[object]) -> dict[str, npt.NDArray[Any]]:
    from monadl.distributed import find_weights

    return {f"{m}.{i}": np.asarray(w.data) for m, model in enumerate(models) for i, w in enumerate(find_weights(model))}


async def train(out: Path) -> None:
    from monadl.distributed import DataParallel, RankFailure, mpi_world, shard

    comm = mpi_world(timeout=60.0)
    rank, size = comm.rank, comm.size
    models, steps = model_batches()
    dp = DataParallel(models, comm, overlap=True)  # the overlapped path, on real MPI
    await dp.broadcast()
    for loss, x, y in steps:
        await dp.train(loss(shard(x, rank, size), shard(y, rank, size)))
    weights = flat_weights(models)
    np.savez(out / f"rank{rank}.npz", allow_pickle=False, **weights)
    report: dict[str, Any] = {}
    loss, x, y = steps[0]
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    for fault, bad_x in [("raise", xs[:, :10]), ("nan", xs * np.nan)]:
        try:
            await dp.train(loss(bad_x if rank == 1 else xs, ys))
        except RankFailure as error:
            report[fault] = str(error)
    after = flat_weights(models)
    report["unchanged"] = all(np.array_equal(weights[k], after[k]) for k in weights)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


async def kill(out: Path) -> None:
    from monadl.distributed import DataParallel, RankFailure, mpi_world, shard

    comm = mpi_world(timeout=5.0)
    rank = comm.rank
    weight = ml.Weight(np.ones(4), optimizer=ml.optim.sgd(0.1))
    dp = DataParallel(weight, comm)
    await dp.broadcast()

    @ml.direct
    async def dies_on_rank_1(x: ml.ArrayLayer) -> ml.ArrayLayer:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return x

    report: dict[str, Any] = {}
    try:
        await dp.train(ml.sum(dies_on_rank_1(weight * shard(np.arange(4.0), rank, 2)[0])))
    except RankFailure as error:
        report["error"] = str(error)
    report["unchanged"] = bool(np.array_equal(weight.data, np.ones(4)))
    (out / f"rank{rank}.json").write_text(json.dumps(report))


async def mismatch(out: Path) -> None:
    from monadl.distributed import DataParallel, RankFailure, mpi_world

    comm = mpi_world(timeout=20.0)
    weight = ml.Weight(np.ones(3 if comm.rank == 0 else 1), optimizer=ml.optim.sgd(1.0))
    dp = DataParallel({"w": weight}, comm, overlap=True)
    report: dict[str, Any] = {"errors": []}
    for _ in range(2):
        try:
            await dp.train(ml.sum(weight * (comm.rank + 1.0)))
        except RankFailure as error:
            report["errors"].append(str(error))
    report["unchanged"] = bool(np.array_equal(weight.data, np.ones_like(weight.data)))
    (out / f"rank{comm.rank}.json").write_text(json.dumps(report))


async def uneven(out: Path) -> None:
    from monadl.distributed import DataParallel, RankFailure, mpi_world

    comm = mpi_world(timeout=60.0)
    weight = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
    dp = DataParallel(weight, comm, overlap=True)
    report: dict[str, Any] = {"seen": []}
    for x in [1.0, 10.0, 100.0][: 3 - comm.rank]:  # rank 1's data ends a batch early
        try:
            await dp.train(ml.mean(weight * (x * (comm.rank + 1))))
            report["seen"].append("stepped")
        except RankFailure as error:
            report["seen"].append(str(error))
    if comm.rank == 1:
        try:
            await dp.finish()
        except RankFailure as error:
            report["seen"].append(str(error))
    report["weight"] = float(weight.data[0])
    (out / f"rank{comm.rank}.json").write_text(json.dumps(report))


async def late(out: Path, overlap: bool = False) -> None:
    import types
    from unittest import mock

    from mpi4py import MPI

    import monadl.distributed._data_parallel
    from monadl.distributed import DataParallel, RankFailure, mpi_world
    from tests.distributed.logged import Logged

    now = [0.0]  # the clock the protocol reads: still, but for rank 1's pause
    mock.patch.object(
        monadl.distributed._data_parallel, "time", types.SimpleNamespace(perf_counter=lambda: now[0])
    ).start()
    side = MPI.COMM_WORLD.Dup()  # (the test's own messages, apart from the protocol's)
    comm = Logged(mpi_world(timeout=60.0))
    weight = ml.Weight(np.zeros(1), optimizer=ml.optim.sgd(0.1))
    dp = DataParallel(weight, comm, overlap=overlap)
    await dp.train(ml.mean(weight * 1.0))
    comm.timeout = 2.0  # (not before: the first step waits for a loaded machine)
    if comm.rank == 1:
        side.recv(source=0)  # it starts its step once rank 0 has given up
        now[0] += 100.0
    del comm.log[:]
    report: dict[str, Any] = {}
    try:
        await dp.train(ml.mean(weight * 1.0))
    except RankFailure as error:
        report["error"] = str(error)
    report["log"] = comm.log
    report["weight"] = float(weight.data[0])
    if comm.rank == 0:
        side.send("gave up", dest=1)
        side.recv(source=1)  # (alive until rank 1 is told, as in a job that goes on)
    else:
        side.send("told", dest=0)
    (out / f"rank{comm.rank}.json").write_text(json.dumps(report))


def main() -> None:
    import anyio

    mode, out = sys.argv[1], Path(sys.argv[2])
    modes = {"train": train, "kill": kill, "mismatch": mismatch, "uneven": uneven, "late": late}
    modes["late-overlap"] = functools.partial(late, overlap=True)
    anyio.run(modes[mode], out)
    if mode == "kill":
        # After a dead peer MPI cannot finalize (its finalize would wait for
        # the dead rank): leave without it, as a real job would after the error.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
