"""Which ops batch inside a marked cell: a chained `ml.operation`, batching off and on.

64 chains of 20 steps each, ``h = cell(h)`` with ``cell`` marked as one
operation: ``z = h @ W`` (W: 32 x 64, float32) and then one body per row of
the table, each the same arithmetic written with another op (slices,
``ml.split``, ``** 2.0``, ``ml.stack``, ``ml.reshape``, ``ml.transpose``,
``ml.stop_gradient``), one whose cell takes a Python float per call (a
per-step scale), dot-product attention (a matrix times a vector, both the
call's own), and a product by a shared vector. One ``train()`` (SGD) per round; the time is CPU seconds of
this process, best of the rounds, BLAS limited to one thread. A cell whose
program has a step that does not batch runs call by call with batching on:
its "on" time is then about its "off" time.

Only monadl is imported from the project, so that another checkout's
package can be timed with the same file:
``PYTHONPATH=/path/to/other python benchmarks/cell_ops.py``.
Run: ``python -m benchmarks.cell_ops`` (``--rounds``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import anyio
import numpy as np

import monadl as ml

CHAINS, STEPS, WIDTH = 64, 20, 32


def _halves(z: ml.ArrayLayer) -> ml.ArrayLayer:
    a, b = ml.split(z, 2, axis=-1)
    return ml.tanh(a) * ml.sigmoid(b)


def _attend(z: ml.ArrayLayer) -> ml.ArrayLayer:
    """Dot-product attention of a query over two states, all of the call's own."""
    states = ml.reshape(z, (2, WIDTH))
    scores = states @ ml.reshape(z[:, :WIDTH], (WIDTH,))  # (a matrix times a vector, both per call)
    return ml.tanh(ml.reshape(ml.softmax(scores) @ states, (1, WIDTH)))


_VECTOR = np.linspace(-0.5, 0.5, WIDTH, dtype=np.float32)


BODIES: dict[str, Callable[[ml.ArrayLayer, float], ml.ArrayLayer]] = {
    "slices": lambda z, t: ml.tanh(z[:, :WIDTH]) * ml.sigmoid(z[:, WIDTH:]),
    "ml.split": lambda z, t: _halves(z),
    "** 2.0": lambda z, t: ml.tanh(z[:, :WIDTH]) ** 2.0,
    "ml.stack": lambda z, t: ml.tanh(ml.sum(ml.stack([z[:, :WIDTH], z[:, WIDTH:]]), axis=0)),
    "ml.reshape": lambda z, t: ml.tanh(ml.reshape(z, (2, WIDTH)))[0:1],
    "ml.transpose": lambda z, t: ml.transpose(ml.transpose(ml.tanh(z[:, :WIDTH]))),
    "ml.stop_gradient": lambda z, t: ml.tanh(z[:, :WIDTH] + ml.stop_gradient(z[:, WIDTH:])),
    "a float per call": lambda z, t: ml.tanh(z[:, :WIDTH]) * t,
    "attention": lambda z, t: _attend(z),
    "@ a shared vector": lambda z, t: ml.tanh(z[:, :WIDTH] * ml.reshape(z[:, WIDTH:] @ _VECTOR, (1, 1))),
}


def timing(rounds: int) -> dict[str, tuple[float, float]]:
    rng = np.random.default_rng(0)
    w = ml.Weight((rng.normal(size=(WIDTH, 2 * WIDTH)) / 6).astype(np.float32), optimizer=ml.optim.sgd(0.0))
    xs = [rng.normal(size=(1, WIDTH)).astype(np.float32) for _ in range(CHAINS)]
    results: dict[str, tuple[float, float]] = {}

    async def run() -> None:
        for name, body in BODIES.items():

            def step(h: ml.ArrayOperand, t: float, body: Callable[..., ml.ArrayLayer] = body) -> ml.ArrayLayer:
                return body(ml.matmul(h, w), t)

            cell = ml.operation(step)

            def loss(cell: Callable[..., ml.ArrayLayer] = cell) -> ml.ScalarLayer:
                hs: list[ml.ArrayOperand] = list(xs)
                for k in range(STEPS):
                    hs = [cell(h, 1.0 - 0.01 * (k + i % 7)) for i, h in enumerate(hs)]
                return ml.sum(ml.concatenate(hs, axis=0))

            best = {False: float("inf"), True: float("inf")}
            for _ in range(rounds):
                for batching in (False, True):  # (alternating)
                    with ml.settings(batching=batching):
                        built = loss()
                        start = time.process_time()
                        await built.train()
                        best[batching] = min(best[batching], time.process_time() - start)
            results[name] = (best[False], best[True])

    anyio.run(run)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().limit(limits=1)  # one thread, BLAS included
    print(f"monadl {ml.__file__}; {CHAINS} chains x {STEPS} steps, width {WIDTH}, float32; CPU ms of train()")
    print(f"{'cell body':18s} {'off':>8s} {'on':>8s} {'off/on':>7s}")
    for name, (off, on) in timing(args.rounds).items():
        print(f"{name:18s} {off * 1e3:8.1f} {on * 1e3:8.1f} {off / on:6.1f}x")


if __name__ == "__main__":
    main()
