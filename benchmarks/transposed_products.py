"""A layer's delta to its input, ``g @ w.T``, two ways, and what it does to training.

OpenBLAS's single-precision kernel for a transposed right operand is slow
when the left one has few rows: every dense layer's backward computes such a
product (its delta times the transposed weight). `monadl`'s `product`
computes it as ``(w @ g.T).T`` made C-contiguous for float32 deltas of 2 to
48 rows and large weights (`monadl.layers._products`).
This prints, in one run:

* the two forms' times over rows x weight shapes (one thread; ratio > 1: the
  form monadl takes is faster),
* for two to eight rows times weights of 256K to 4M elements, one product
  against one gemv a row, which monadl takes (`_products._rows_pay`) for
  float32 2-5 rows of weights from 512K elements (2-3 times a transposed
  one, 3-6 times a transposed one of 256K), and float64 2-3 rows of plain
  weights from 512K, 2-6 rows of transposed ones from 512K, 3-6 from 256K, and
* one training step of a float32 MLP (784 -> H -> H -> H -> 10, ReLU,
  cross-entropy, SGD) with the fast form on and off, rounds alternating.

Run: ``python benchmarks/transposed_products.py``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import numpy as np
from threadpoolctl import ThreadpoolController

import monadl as ml
import monadl.layers._products as products

ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)
WEIGHTS = ((64, 64), (128, 640), (256, 1280), (512, 2048), (3072, 64), (64, 3072))


def _best(f: Callable[[], Any], seconds: float = 0.05) -> float:
    f()
    reps, best = 1, float("inf")
    while True:  # enough repetitions for about `seconds`, then the best of 5
        started = time.perf_counter()
        for _ in range(reps):
            f()
        if time.perf_counter() - started > seconds / 5:
            break
        reps *= 2
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - started) / reps)
    return best


def _plain(g: ml.Array, w: ml.Array) -> ml.Array:
    return g @ w.T


def _fast(g: ml.Array, w: ml.Array) -> ml.Array:
    return np.ascontiguousarray((w @ g.T).T)


def product_table() -> None:
    rng = np.random.default_rng(0)
    print("g @ w.T time / (w @ g.T).T time (float32, one thread); rows across, weight (in, out) down")
    print(f"{'weight':>12} " + " ".join(f"{r:>6}" for r in ROWS))
    for k, m in WEIGHTS:
        w = rng.standard_normal((k, m)).astype(np.float32)
        ratios = []
        for rows in ROWS:
            g = rng.standard_normal((rows, m)).astype(np.float32)
            plain = _best(partial(_plain, g, w))
            fast = _best(partial(_fast, g, w))
            ratios.append(plain / fast)
        print(f"{f'{k}x{m}':>12} " + " ".join(f"{r:6.2f}" for r in ratios))


BY_ROWS = (2, 3, 4, 5, 6, 8)
BIG_WEIGHTS = ((512, 512), (1024, 512), (1024, 1024), (2048, 1024), (3072, 1024), (1024, 4096))


def rows_table() -> None:
    """Few rows times a large weight: one product against a gemv a row (`monadl.layers._products.by_rows`)."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        print(
            f"\nby rows, {np.dtype(dtype).name}: x @ w time / gemv-a-row time (w.T: the transposed weight against "
            f"{'(w @ g.T).T' if dtype == np.float32 else 'g @ w.T'}); rows across"
        )
        print(f"{'weight':>16} " + " ".join(f"{r:>6}" for r in BY_ROWS))
        for k, m in BIG_WEIGHTS:
            w = rng.standard_normal((k, m)).astype(dtype)
            for name, y in ((f"{k}x{m}", w), (f"{k}x{m} w.T", w.mT)):
                ratios = []
                for rows in BY_ROWS:
                    x = rng.standard_normal((rows, y.shape[0])).astype(dtype)
                    one = _fast if y is not w and dtype == np.float32 else (lambda a, b: a @ b)
                    other = partial(one, x, w) if one is _fast else partial(one, x, y)
                    ratios.append(_best(other) / _best(partial(products.by_rows, x, y)))
                print(f"{name:>16} " + " ".join(f"{r:6.2f}" for r in ratios))


def mlp_table(batches: tuple[int, ...], hiddens: tuple[int, ...], rounds: int) -> None:
    rng = np.random.default_rng(0)
    print("\nMLP training step, float32, one thread: the fast form on and off (best of rounds, ms)")
    print(f"{'batch':>5} {'hidden':>6} {'on':>8} {'off':>8} {'off/on':>7}")
    for batch in batches:
        for hidden in hiddens:
            sizes = [784, hidden, hidden, hidden, 10]
            layers = [
                (
                    ml.Weight(
                        (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), optimizer=ml.optim.sgd(0.0)
                    ),
                    ml.Weight(np.zeros(b, np.float32), optimizer=ml.optim.sgd(0.0)),
                )
                for a, b in itertools.pairwise(sizes)
            ]
            x = rng.standard_normal((batch, 784)).astype(np.float32)
            y = rng.integers(0, 10, batch)

            def loss(layers: list[tuple[ml.ArrayWeight, ml.ArrayWeight]] = layers, x: Any = x, y: Any = y) -> Any:
                h: ml.ArrayOperand = x
                for i, (w, b) in enumerate(layers):
                    h = ml.dense(h, w, b)
                    if i < len(layers) - 1:
                        h = ml.relu(h)
                return ml.cross_entropy(h, y)

            async def steps(n: int = 10, loss: Callable[[], Any] = loss) -> None:
                for _ in range(n):
                    await loss().train()

            saved = products._FEW_ROWS
            best = {"on": float("inf"), "off": float("inf")}
            grads = {}
            for mode in ("on", "off"):  # a warm-up each (the first steps build caches), and the same numbers
                products._FEW_ROWS = saved if mode == "on" else 0  # type: ignore[misc]  # (a private switch, for this table only)
                anyio.run(steps, 2)
                grads[mode] = anyio.run(ml.gradients, loss(), [w for pair in layers for w in pair])
            if not all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads["on"], grads["off"])):
                raise AssertionError(f"batch {batch}, hidden {hidden}: the fast form's gradients differ")
            for r in range(rounds):
                for mode in ("on", "off") if r % 2 else ("off", "on"):
                    products._FEW_ROWS = saved if mode == "on" else 0  # type: ignore[misc]  # (a private switch, for this table only)
                    started = time.process_time()
                    anyio.run(steps)
                    best[mode] = min(best[mode], (time.process_time() - started) / 10)
            products._FEW_ROWS = saved  # type: ignore[misc]
            print(
                f"{batch:5d} {hidden:6d} {best['on'] * 1e3:8.2f} {best['off'] * 1e3:8.2f} {best['off'] / best['on']:6.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}, numpy {np.__version__}")
    with ThreadpoolController().limit(limits=1, user_api="blas"):
        product_table()
        rows_table()
        mlp_table(tuple(args.batch), tuple(args.hidden), args.rounds)


if __name__ == "__main__":
    main()
