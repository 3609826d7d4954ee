"""Cutting a gate vector: five slices against one ``ml.split``.

A binary Tree-LSTM cell cuts its (1, 5 * 256) gate pre-activations into
input, two forget, output and update gates. Each slice's backward builds a
zero array the size of the whole vector and the five are summed; ``split``
concatenates the five parts' deltas once. Two workloads, forward + backward
(``ml.gradients``, no step), float64:

* cut: only the cut (each part times a constant, summed): the cut's own cost;
* cell: the cut and the cell on top (sigmoids, tanhs, products).

Prints microseconds per iteration. Run: ``python -m benchmarks.split_gates``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np

import monadl as ml

WIDTH = 256
ROUNDS = 5


def slices(gates: ml.ArrayLayer | ml.ArrayWeight) -> Sequence[ml.ArrayLayer]:
    return [gates[:, k * WIDTH : (k + 1) * WIDTH] for k in range(5)]


def split(gates: ml.ArrayLayer | ml.ArrayWeight) -> Sequence[ml.ArrayLayer]:
    return ml.split(gates, 5)


Cut = Callable[[ml.ArrayLayer | ml.ArrayWeight], Sequence[ml.ArrayLayer]]


def cut_only(gates: ml.ArrayWeight, cut: Cut, scales: np.ndarray) -> ml.ScalarLayer:
    parts = cut(gates)
    total = ml.sum(parts[0] * scales[0])
    for k in range(1, 5):
        total = total + ml.sum(parts[k] * scales[k])
    return total


def cell(gates: ml.ArrayWeight, cut: Cut, children: np.ndarray) -> ml.ScalarLayer:
    i, f_left, f_right, o, u = cut(gates)
    c = ml.sigmoid(i) * ml.tanh(u) + ml.sigmoid(f_left) * children[0] + ml.sigmoid(f_right) * children[1]
    return ml.sum(ml.sigmoid(o) * ml.tanh(c))


async def time_it(build: Callable[[], ml.ScalarLayer], weight: ml.ArrayWeight, repeats: int) -> float:
    for _ in range(50):  # warm up
        await ml.gradients(build(), [weight])
    started = time.perf_counter()
    for _ in range(repeats):
        await ml.gradients(build(), [weight])
    return (time.perf_counter() - started) / repeats * 1e6


async def _both(workload: Callable[[Cut], ml.ScalarLayer], gates: ml.ArrayWeight, repeats: int) -> tuple[float, float]:
    """Microseconds per iteration with slices, then with split."""
    return (
        await time_it(lambda: workload(slices), gates, repeats),
        await time_it(lambda: workload(split), gates, repeats),
    )


async def main(repeats: int, rows: int) -> None:
    rng = np.random.default_rng(0)
    gates = ml.Weight(rng.standard_normal((rows, 5 * WIDTH)))
    scales = rng.standard_normal((5, 1, WIDTH))
    children = rng.standard_normal((2, rows, WIDTH))
    workloads: list[tuple[str, Callable[[Cut], ml.ScalarLayer]]] = [
        ("cut", lambda cut: cut_only(gates, cut, scales)),
        ("cell", lambda cut: cell(gates, cut, children)),
    ]
    for _, workload in workloads:  # the two cuts give the same gradient
        [a] = await ml.gradients(workload(slices), [gates])
        [b] = await ml.gradients(workload(split), [gates])
        np.testing.assert_allclose(a, b, rtol=1e-14)
    print(f"{repeats} iterations of forward + backward, ({rows}, {5 * WIDTH}) float64 gates cut in five")
    print(f"{'workload':<10}{'5 slices (us)':>15}{'split (us)':>12}{'ratio':>8}")
    for name, workload in workloads:
        # Interleaved rounds, the best of each: a busy machine slows some rounds, never speeds one up.
        rounds = [await _both(workload, gates, repeats // ROUNDS) for _ in range(ROUNDS)]
        by_slices, by_split = min(r[0] for r in rounds), min(r[1] for r in rounds)
        print(f"{name:<10}{by_slices:>15.1f}{by_split:>12.1f}{by_slices / by_split:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=1, help="rows of the gate matrix (a batch of cells)")
    args = parser.parse_args()
    anyio.run(main, args.repeats, args.rows)
