"""Examples evaluated together in direct style, where batching cannot help:
what stepping them together costs against one example alone.

A greedy decoder's loop (``@ml.direct``: one read of the logits a step) over
a small GRU-like cell marked as one operation, ``--length`` steps, in three
ways, each timed as the best of ``--rounds`` predicts, alternating:

* **alone**: one example;
* **straggler**: two examples, one stopping after 2 steps: the other runs
  on alone (until the sixteenth session each of its steps went through a
  task, as while others run: 1.6x a step);
* **two**: two examples of ``--length`` steps, stepped together in one task
  (a task started every round until the sixteenth session), against twice
  "alone".

Two examples are too few to batch (a merge pays from 10 alike), so this is
the price of evaluating them together, not batching's.

Run: ``python -m benchmarks.direct_steps`` (``--help``); ``OPENBLAS_NUM_THREADS=1``
for the figures in BENCHMARKS.md.
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


def decoder(hidden: int = 32, vocabulary: int = 4) -> Any:
    rng = np.random.default_rng(0)
    table = ml.Weight(rng.standard_normal((vocabulary, hidden)))
    wx, wh = (ml.Weight(rng.standard_normal((hidden, 2 * hidden)) / hidden**0.5) for _ in range(2))
    wo = ml.Weight(rng.standard_normal((hidden, vocabulary)) / hidden**0.5)

    @ml.operation
    def cell(x: Any, h: Any) -> Any:
        gates = x @ wx + h @ wh
        z = ml.sigmoid(gates[:, :hidden])
        return (1.0 - z) * h + z * ml.tanh(gates[:, hidden:])

    @ml.direct
    async def greedy(length: int) -> Any:
        h: Any = ml.as_layer(np.zeros((1, hidden)))
        token = 0
        for _ in range(length):
            logits = h @ wo
            (values,) = await ml.values(logits)
            token = int(values[0].argmax())
            h = cell(ml.embedding(table, np.array([token])), h)
        return ml.sum(h)

    return greedy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    greedy = decoder()
    cases = {"alone": [args.length], "straggler": [2, args.length], "two": [args.length, args.length]}
    best = dict.fromkeys(cases, float("inf"))

    async def run() -> None:
        for lengths in cases.values():  # (traces and plans first)
            await ml.stack([greedy(n) for n in lengths]).predict()
        for turn in range(args.rounds):
            for name in list(cases) if turn % 2 else list(cases)[::-1]:
                started = time.perf_counter()
                await ml.stack([greedy(n) for n in cases[name]]).predict()
                best[name] = min(best[name], time.perf_counter() - started)

    anyio.run(run)
    print(f"# {platform.machine()}, Python {platform.python_version()}, NumPy {np.__version__}")
    print(f"# OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; best of {args.rounds}, ms")
    alone = best["alone"]
    print(f"{'case':<12} {'ms':>9} {'/ alone':>9}")
    for name, seconds in best.items():
        print(f"{name:<12} {seconds * 1e3:>9.1f} {seconds / alone:>8.2f}x")
    print(f"{'two / (2 x alone)':<22} {best['two'] / (2 * alone):.2f}x")


if __name__ == "__main__":
    main()
