"""Data parallelism across real processes: ``mpiexec -n 2`` from the venv's MPICH wheel.

Skipped (with the reason) only when mpiexec cannot start two ranks here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from tests.distributed.mpi_ranks import flat_weights, model_batches

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("mpi_ranks.py")
MPIEXEC = Path(sys.executable).with_name("mpiexec")


def launch(mode: str, out: Path, *extra: str, shell: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # Two ranks share two cores: one BLAS thread each, or their spinning
    # BLAS threads take turns on the cores (20x slower on a loaded box).
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    program = [sys.executable, str(SCRIPT), mode, str(out)]
    if shell:
        # Each rank under a shell that outlives it (rank 1's by a few seconds).
        program = ["sh", "-c", '"$0" "$@"; [ "$PMI_RANK" = 1 ] && sleep 8; true', *program]
    command = [str(MPIEXEC), *extra, "-n", "2", *program]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


@cache
def mpiexec_problem() -> str:
    """Why mpiexec cannot run two ranks here, or "" if it can."""
    if not MPIEXEC.exists():
        return f"no mpiexec beside {sys.executable} (install the mpi extra)"
    probe = "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2"
    try:
        done = subprocess.run(
            [str(MPIEXEC), "-n", "2", sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"mpiexec -n 2 cannot start: {error}"
    return "" if done.returncode == 0 else f"mpiexec -n 2 cannot start: {done.stderr[-500:]}"


@pytest.fixture
def mpi() -> None:
    if problem := mpiexec_problem():
        pytest.skip(problem)


@pytest.mark.slow
@pytest.mark.usefixtures("mpi")
def test_two_processes_train_digits_and_columns_as_one_on_the_full_batch_and_survive_faults(tmp_path: Path) -> None:
    done = launch("train", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    models, steps = model_batches()
    initial = flat_weights(models)

    async def one_process() -> None:
        for loss, x, y in steps:
            await loss(x, y).train()

    with ThreadpoolController().limit(limits=1):  # as the ranks run, and fast on a loaded box
        anyio.run(one_process)
    expected = flat_weights(models)
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    # digits: 2 + 2 + 5 * 2 * 2 weights; columns: 2 * 2 * 2 + 2 + 20 * 3 * 2
    assert sorted(ranks[0].files) == sorted(expected) and len(expected) == 24 + 130
    for name, want in expected.items():
        assert ranks[0][name].dtype == np.float64
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])  # every rank holds the same bits
        np.testing.assert_allclose(ranks[0][name], want, rtol=1e-6, atol=1e-12, err_msg=name)
    # The comparison is of trained weights: all of digits' and the reached ones of columns' moved.
    assert sum(not np.array_equal(initial[k], expected[k]) for k in expected) > 100

    for r in range(2):
        report: dict[str, Any] = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report["unchanged"]  # neither failed step changed a weight on any rank
        assert report["raise"].startswith("no rank stepped: rank 1 failed: ShapeError: dense")
        assert (
            report["nan"]
            == "no rank stepped: rank 1 failed: non-finite gradient of weight '0.features.weight' (shape (64, 64))"
        )


@pytest.mark.slow
@pytest.mark.usefixtures("mpi")
def test_a_rank_killed_mid_step_is_reported_by_the_survivor(tmp_path: Path) -> None:
    # MPICH's launcher ends the whole job when a rank dies of a signal (its
    # own clear error, not a hang); a rank under a shell that outlives it is
    # the case the launcher cannot see (a node cut off, a hung process),
    # which only the survivors' timeout catches.
    launch("kill", tmp_path, "-disable-auto-cleanup", shell=True)
    report: dict[str, Any] = json.loads((tmp_path / "rank0.json").read_text())
    assert report["unchanged"]
    assert report["error"].endswith(
        "rank 0: no answer from the other ranks in all-gather within 5 s (a rank died or hangs, or ended without "
        "this exchange: a rank with fewer batches, which DataParallel.finish() reports at once; or this rank was "
        "the late one, and the others had given up on an earlier exchange before it came)"
    )
    assert not (tmp_path / "rank1.json").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("mpi")
def test_processes_whose_weights_differ_in_shape_stop_before_any_all_reduce(tmp_path: Path) -> None:
    done = launch("mismatch", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = (
        "no rank stepped: the ranks hold different models: weight 0 is 'w' float64[3] on rank 0, "
        "'w' float64[1] on rank 1; every rank must build the same model (the same weights, shapes and dtypes, "
        "in the same containers, with the same optimizers and hyperparameters)"
    )
    for r in range(2):
        report: dict[str, Any] = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report == {"errors": [expected, expected], "unchanged": True}


@pytest.mark.slow
@pytest.mark.usefixtures("mpi")
def test_a_process_with_fewer_batches_that_finishes_is_named_at_once(tmp_path: Path) -> None:
    # Rank 0 waited for the returned rank 1 until its timeout, then blamed "a rank [that] died or hangs".
    done = launch("uneven", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ended = (
        "no rank stepped: rank 1 finished after 2 train() calls, while rank 0 at step 2 still trained: the ranks "
        "had different numbers of batches; give every rank as many (shard each global batch, with drop_last=True "
        "where it does not divide, or stop every rank where the shortest data ends)"
    )
    for r in range(2):
        report: dict[str, Any] = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report == {"seen": ["stepped", "stepped", ended], "weight": pytest.approx(-0.1 * 1.5 * 11)}


@pytest.mark.slow
@pytest.mark.usefixtures("mpi")
@pytest.mark.parametrize("mode", ["late", "late-overlap"])
def test_a_process_that_came_after_the_others_gave_up_says_it_was_late_at_once(tmp_path: Path, mode: str) -> None:
    # Its status all-gather met the one rank 0 had left; it then waited a second timeout in
    # the all-reduce and said "no answer from the other ranks", though it was the late one.
    done = launch(mode, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    waited, late = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert waited["error"].startswith(
        "no rank stepped: rank 0: no answer from the other ranks in all-gather within 2 s"
    )
    assert late["error"].startswith(
        "no rank stepped: rank 1 was the late one: it came to this exchange 100 s after rank 0, past its timeout "
        "of 2 s, so it had given up waiting for it"
    )
    # No second wait: the status all-gather was its last exchange (its bucket, rank 0 had left).
    assert late["log"] == ["start bucket"] * (mode == "late-overlap") + ["all-gather"]
    assert waited["weight"] == late["weight"] == pytest.approx(-0.1)  # (the first step's alone)
