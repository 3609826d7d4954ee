"""How long the event loop waits for a turn while a large graph trains.

`train()` gives the event loop a turn every ``yield_interval_s`` of work
(README, "A good event-loop citizen"). A task beside it that does nothing but
take turns measures the gaps between them. The graph is a chain of ``depth``
steps ``tanh(h @ W) + 0.5 * h`` over 32x64 arrays (three nodes a step) and
four weights under Adam; a new user's trial found gaps of 35-42 ms at the
start of such a step (the walk that finds the graph, the batching
scheduler's depths) and of 34 ms at its end (the graph's arrays freed at
once), at 90,000 nodes.

Prints per depth: the build (not timed by the loop: the user's own code),
the step, how many turns it gave and its longest gap, with Python's cyclic
collector off (so the gaps are the runtime's own; a collection that comes
in a step is the collector's, "Process-wide effects").
Run: ``python -m benchmarks.loop_gaps`` (``--depths``, ``--interval``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from itertools import pairwise
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml


def chain(weights: list[ml.ArrayWeight], x: ml.Array, depth: int) -> ml.ScalarLayer:
    h: ml.ArrayLayer = ml.as_layer(x)
    for i in range(depth):
        h = ml.tanh(h @ weights[i % len(weights)]) + h * 0.5
    return ml.mean(h * h)


async def gaps(loss: ml.ScalarLayer, interval: float) -> tuple[float, int, float]:
    """The step's seconds, the turns the loop got during it, the longest gap between them."""
    seen: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            seen.append(time.perf_counter())
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        with ml.settings(yield_interval_s=interval):
            started = time.perf_counter()
            await loss.train()
            ended = time.perf_counter()
        done.set()
    inside = [started, *(t for t in seen if started < t < ended), ended]
    return ended - started, len(inside) - 2, max(b - a for a, b in pairwise(inside))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8000, 30000])
    parser.add_argument("--interval", type=float, default=0.001, help="yield_interval_s")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = [ml.Weight(rng.normal(size=(64, 64)) / 8, optimizer=ml.optim.adam(1e-3)) for _ in range(4)]
    x = rng.normal(size=(32, 64))
    anyio.run(chain(weights, x, 50).train)  # (the process tuned, the primitives warm)
    gc.disable()
    print(f"yield_interval_s {args.interval * 1e3:g} ms, the collector off")
    print(f"{'depth':>7} {'nodes':>7} {'build ms':>9} {'step ms':>9} {'turns':>6} {'longest gap ms':>15}")
    for depth in args.depths:
        t0 = time.perf_counter()
        loss = chain(weights, x, depth)
        built = time.perf_counter() - t0
        step, turns, longest = anyio.run(gaps, loss, args.interval)
        print(f"{depth:7d} {3 * depth + 3:7d} {built * 1e3:9.1f} {step * 1e3:9.1f} {turns:6d} {longest * 1e3:15.1f}")
    gc.enable()


if __name__ == "__main__":
    main()
