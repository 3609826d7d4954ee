"""Data-parallel training on MPI: measured here, and projected to many GPUs.

Measured: the columns network (benchmarks/columns.py, dynamic "skip" mode)
trained with the same global batch by one process (``loss.train()``, BLAS
on every core) and by ``mpiexec -n 2`` ranks (`DataParallel`, each rank on
half the batch with one BLAS thread): trained samples per second, and per
step (`DataParallel.last_step_seconds`) the forward and backward, the
gradient all-reduce, the part of it the step waited for after its backward
("exposed"), and the agreement (the status all-gather that makes a step
transactional); rounds of steps alternate the all-reduce after the backward
and overlapped with it, on the same model. On a shared 2-core machine the
collectives' time includes waiting for the slower rank.

Projected: a ring all-reduce of B bytes over p ranks takes
``2(p-1)/p * B / bandwidth + 2(p-1) * latency`` (Patarasuk and Yuan 2009;
Horovod's and NCCL's ring), per bucket. For the columns network and a binary
Tree-LSTM (Tai et al. 2015, eqs. 9-14, N = 2; hidden 256, GloVe inputs of
300) the table gives the all-reduce time per step on 8, 64 and 512 GPUs on a
stated interconnect, and what share of a step it would be if a rank's
forward and backward took what one process takes here for its part of the
batch (weak scaling: the per-rank batch stays the same), without overlap and
with the best overlap (`overlapped_ms`).

Run: ``python -m benchmarks.distributed`` from the repository root (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from threadpoolctl import ThreadpoolController

from benchmarks.columns import Config, MonadlColumns, init_weights, make_batches
from monadl.distributed import DataParallel, mpi_world, shard

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Interconnect:
    """A per-GPU link: bandwidth in bytes per second and latency per message hop."""

    name: str
    bandwidth: float
    latency: float


# One 200 Gb/s InfiniBand HDR port per GPU (25 GB/s, about 5 us a hop, MPI or
# NCCL over RDMA) for ranks on different nodes: the link a ring crosses.
HDR = Interconnect("InfiniBand HDR, 200 Gb/s (25 GB/s) per GPU, 5 us per hop", 25e9, 5e-6)


def ring_allreduce_seconds(nbytes: float, ranks: int, link: Interconnect, buckets: int = 1) -> float:
    """The ring all-reduce cost model: reduce-scatter then all-gather, p-1 steps each.

    >>> round(ring_allreduce_seconds(25e6, 8, HDR) * 1e3, 3)  # 25 MB over 8 ranks
    1.82
    """
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / link.bandwidth + 2 * (ranks - 1) * link.latency * buckets


def tree_lstm_parameters(hidden: int = 256, inputs: int = 300, classes: int = 5) -> int:
    """Dense parameters of a binary Tree-LSTM (Tai et al. 2015, eqs. 9-14, N = 2).

    W (input to i, o, u and the shared f): 4 x inputs x hidden; U: for i, o
    and u one matrix per child (3 x 2), for f one per pair of children (2 x
    2): 10 x hidden x hidden; biases 4 x hidden; a softmax classifier of the
    hidden state. The word embeddings are sparse rows, exchanged as rows.

    >>> tree_lstm_parameters()
    964869
    """
    return 4 * inputs * hidden + 10 * hidden * hidden + 4 * hidden + hidden * classes + classes


def columns_parameters(config: Config, reached_only: bool) -> int:
    """Parameters of the columns network; in skip mode one step reaches one fine classifier of 20."""
    weights = init_weights(config)
    fine = [k for k in weights if k.startswith("fine")]
    total = sum(v.size for v in weights.values())
    if reached_only:
        total -= sum(weights[k].size for k in fine) * 19 // 20
    return int(total)


def model_and_batches(args: argparse.Namespace) -> tuple[MonadlColumns, list[tuple[Any, int, Any]]]:
    config = Config(columns=args.columns, batch=args.batch)
    return MonadlColumns(config, init_weights(config)), make_batches(config, args.warmup + args.steps)


async def one_process(args: argparse.Namespace) -> dict[str, float]:
    model, batches = model_and_batches(args)
    for x, coarse, fine in batches[: args.warmup]:
        await model.loss(x, coarse, fine, skip=True).train()
    started = time.perf_counter()
    for x, coarse, fine in batches[args.warmup :]:
        await model.loss(x, coarse, fine, skip=True).train()
    seconds = time.perf_counter() - started
    return {"step_ms": 1e3 * seconds / args.steps, "samples_per_s": args.steps * args.batch / seconds}


MODES = ("after", "overlap")  # the gradient all-reduce after the backward; overlapped with it
PARTS = ("backward", "allreduce", "exposed", "agree")  # DataParallel.last_step_seconds
HEADERS = {"backward": "fwd+bwd ms", "allreduce": "allreduce ms", "exposed": "exposed ms", "agree": "agree ms"}


async def rank_main(args: argparse.Namespace) -> None:
    """Rounds of ``args.round`` steps alternate the two modes (the same model, weights and
    buckets), so that both see the same machine noise; per mode: the step time and the
    means of `DataParallel.last_step_seconds`."""
    comm = mpi_world(timeout=120.0)
    rank, size = comm.rank, comm.size
    model, batches = model_and_batches(args)
    dp = DataParallel(model.w, comm, bucket_bytes=int(args.bucket_mb * (1 << 20)))
    await dp.broadcast()

    async def step(x: Any, coarse: int, fine: Any) -> None:
        await dp.train(model.loss(shard(x, rank, size), coarse, shard(fine, rank, size), skip=True))

    for batch in batches[: args.warmup]:
        await step(*batch)
    seconds = dict.fromkeys(MODES, 0.0)
    parts = {mode: dict.fromkeys(PARTS, 0.0) for mode in MODES}
    steps = dict.fromkeys(MODES, 0)
    timed = batches[args.warmup :]
    for r, start in enumerate(range(0, len(timed), args.round)):
        mode = MODES[r % 2]
        dp.overlap = mode == "overlap"
        for batch in timed[start : start + args.round]:
            started = time.perf_counter()
            await step(*batch)
            seconds[mode] += time.perf_counter() - started
            steps[mode] += 1
            for part, s in dp.last_step_seconds.items():
                parts[mode][part] += s
    if rank == 0:
        for mode in MODES:
            n = steps[mode]
            result = {"ranks": size, "mode": mode, "step_ms": 1e3 * seconds[mode] / n}
            result["samples_per_s"] = n * args.batch / seconds[mode]
            result.update({f"{part}_ms": 1e3 * parts[mode][part] / n for part in PARTS})
            result["buckets"] = len(dp.buckets)
            print("RESULT " + json.dumps(result), flush=True)


def launch_ranks(args: argparse.Namespace, ranks: int) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    command = [
        str(Path(sys.executable).with_name("mpiexec")),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "benchmarks.distributed",
        "--rank",
    ]
    command += ["--columns", str(args.columns), "--batch", str(args.batch)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--round", str(args.round), "--bucket-mb", str(args.bucket_mb)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return [json.loads(line.removeprefix("RESULT ")) for line in lines]


def overlapped_ms(allreduce_ms: float, last_bucket_ms: float, backward_ms: float) -> float:
    """The all-reduce time a step still waits for when buckets reduce during the backward.

    At best the reduction hides behind the backward, except for what is
    final only when the backward ends (the last bucket):
    ``max(allreduce - backward, last)``.

    >>> overlapped_ms(5.0, 1.0, 3.0), overlapped_ms(5.0, 1.0, 10.0)
    (2.0, 1.0)
    """
    return max(allreduce_ms - backward_ms, last_bucket_ms)


def projection(args: argparse.Namespace, rank_step_ms: float) -> list[str]:
    config = Config(columns=args.columns, batch=args.batch)
    # Per model: gradient bytes, and the bytes whose gradients are final only when the
    # backward ends (no overlap can hide their reduction): the first column's first layer
    # (3072 x 64, used first; the other columns' are final as the sweep leaves them); all
    # of the Tree-LSTM's (every node uses every weight, the first leaf first).
    first_layers = 4 * sum(v.size for k, v in init_weights(config).items() if k.startswith("col0.0."))
    models = {
        f"columns x{args.columns} (skip: reached weights)": (columns_parameters(config, True) * 4, first_layers),
        f"columns x{args.columns} (all weights)": (columns_parameters(config, False) * 4, first_layers),
        "Tree-LSTM h=256, x=300": (tree_lstm_parameters() * 4, tree_lstm_parameters() * 4),
    }
    backward_ms = rank_step_ms * 2 / 3  # a backward costs about twice its forward
    lines = [f"interconnect: {HDR.name}; float32 gradients; after the backward one 25 MiB bucket,"]
    lines += ["overlapped 1 MiB buckets (DataParallel(bucket_bytes=1 << 20))", ""]
    head = " ".join(f"{f'{p} GPUs ms':>12} {'share':>6} {'ovl':>5}" for p in (8, 64, 512))
    lines.append(f"{'model':42} {'MB':>6} {head}")
    for name, (nbytes, final_last) in models.items():
        cells = []
        buckets = math.ceil(nbytes / (1 << 20))
        for p in (8, 64, 512):
            ms = 1e3 * ring_allreduce_seconds(nbytes, p, HDR, buckets=math.ceil(nbytes / (25 << 20)))
            planned = 1e3 * ring_allreduce_seconds(nbytes, p, HDR, buckets=buckets)
            last = 1e3 * ring_allreduce_seconds(final_last, p, HDR)
            hidden = overlapped_ms(planned, last, backward_ms)
            cells.append(f"{ms:12.3f} {ms / (ms + rank_step_ms):6.0%} {hidden / (hidden + rank_step_ms):5.0%}")
        lines.append(f"{name:42} {nbytes / 1e6:6.2f} " + " ".join(cells))
    lines.append(
        f"(share: of a step whose forward and backward take {rank_step_ms:.2f} ms, as one rank's half here; "
        f"ovl: the same with the buckets reduced during a backward of 2/3 of that, see overlapped_ms)"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--columns", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="the global batch (split over the ranks)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--round", type=int, default=10, help="steps per round; rounds alternate the modes")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DataParallel's bucket_bytes, in MiB")
    parser.add_argument("--rank", action="store_true", help="run as one rank under mpiexec")
    args = parser.parse_args()
    if args.rank:
        anyio.run(rank_main, args)
        return
    print(f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}")
    print(f"columns network x{args.columns}, skip mode, global batch {args.batch}, {args.steps} timed steps, float32")
    single = anyio.run(one_process, args)
    with ThreadpoolController().limit(limits=1):
        single_1 = anyio.run(one_process, args)
        half = anyio.run(one_process, argparse.Namespace(**{**vars(args), "batch": args.batch // 2}))
    ranks = [*launch_ranks(args, 1), *launch_ranks(args, 2)]
    header = f"{'run':34} {'ms/step':>8} {'samples/s':>10}"
    print(header + " " + " ".join(f"{HEADERS[p]:>12}" for p in PARTS))
    for name, r in [("1 process, BLAS threads", single), ("1 process, 1 BLAS thread", single_1)]:
        print(f"{name:34} {r['step_ms']:8.2f} {r['samples_per_s']:10.0f} " + " ".join(f"{'-':>12}" for _ in PARTS))
    for run in ranks:
        name = f"mpiexec -n {run['ranks']}, {'overlapped' if run['mode'] == 'overlap' else 'reduce after'}"
        cells = " ".join(f"{run[p + '_ms']:12.2f}" for p in PARTS)
        print(f"{name:34} {run['step_ms']:8.2f} {run['samples_per_s']:10.0f} {cells}")
    print(f"buckets (bucket_bytes {args.bucket_mb:g} MiB, the first at most 1 MiB): {ranks[-1]['buckets']}")
    reached = 4 * columns_parameters(Config(columns=args.columns), reached_only=True)
    print(f"gradient bytes all-reduced per step (the reached weights): {reached / 1e6:.2f} MB")
    print()
    print("\n".join(projection(args, half["step_ms"])))


if __name__ == "__main__":
    main()
