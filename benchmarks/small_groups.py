"""The cost rule on small groups: the default rule against batching off.

A graph of 128 examples, each ``sum(tanh(x @ W))`` with one shared weight
``W``, where each row count of ``x`` repeats ``members`` times: every product
has ``members - 1`` others of its signature, and the tanh and sum groups are
as small. This is the shape of per-example models over examples of different
lengths (attention, sequences), where groups are few members each. The cost
rule must not make such a graph slower than node by node (issue 15: "never
lose to unbatched by more than a few percent"). Prints, per number of
members, weight size and rows a member, the best step (forward, backward and
an SGD step) of the default rule (``batching=None``) and of batching off,
and their ratio (above 1: the default is faster), alternating in one run.

Run: ``python -m benchmarks.small_groups`` (``--help``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml

EXAMPLES = 128


def step_time(members: int, size: int, first_rows: int, steps: int, seed: int = 0) -> dict[bool | None, float]:
    """Seconds of the best step, by ``batching`` setting (None: the rule)."""
    rng = np.random.default_rng(seed)
    w = ml.Weight((rng.standard_normal((size, size)) / size**0.5).astype(np.float32), optimizer=ml.optim.sgd(1e-4))
    rows = range(first_rows, first_rows + EXAMPLES // members)
    xs = [rng.standard_normal((r, size)).astype(np.float32) for r in rows for _ in range(members)]

    def loss() -> Any:
        return ml.sum(ml.stack([ml.sum(ml.tanh(x @ w)) for x in xs]))

    async def step(batching: bool | None) -> None:
        with ml.settings(batching=batching):
            await loss().train()

    best: dict[bool | None, float] = {None: float("inf"), False: float("inf")}
    for setting in best:  # (warm: the rule's verdict, the collector's threshold)
        for _ in range(2):
            anyio.run(step, setting)
    for _ in range(steps):
        for setting in best:
            started = time.perf_counter()
            anyio.run(step, setting)
            best[setting] = min(best[setting], time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 256], help="W is size x size")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 20], help="the first row count")
    parser.add_argument("--steps", type=int, default=21)
    args = parser.parse_args()
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "(unset)")
    print(f"# {platform.machine()}, Python {platform.python_version()}, NumPy {np.__version__}")
    print(f"# OPENBLAS_NUM_THREADS={threads}; best of {args.steps} steps, ms")
    print(f"{'members':>7} {'W':>9} {'rows':>5} {'default':>9} {'off':>9} {'off/default':>11}")
    for members in args.members:
        for size in args.sizes:
            for rows in args.rows:
                best = step_time(members, size, rows, args.steps)
                on, off = best[None], best[False]
                print(
                    f"{members:>7} {f'{size}x{size}':>9} {rows:>5} {on * 1e3:>9.2f} {off * 1e3:>9.2f} {off / on:>10.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
