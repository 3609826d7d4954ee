"""Small models' inference: one ``predict()`` a request, against PyTorch's
``no_grad`` forward and the same forward by hand in NumPy.

A 3-layer MLP (32 -> 64 -> 64 -> 10, tanh, float32) at batch 1 and 64, its
weights as a checkpoint's load leaves them (no step has run: a served model),
each request's layers built anew as a user's code does. Rounds alternate
between the three implementations; each figure is the best round's mean.
Run: ``OPENBLAS_NUM_THREADS=1 python -m benchmarks.inference``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time
from collections.abc import Callable

import anyio
import numpy as np

import monadl as ml

SIZES = (32, 64, 64, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    arrays = [
        (rng.standard_normal((i, o)).astype(np.float32) / i**0.5, np.zeros(o, np.float32))
        for i, o in itertools.pairwise(SIZES)
    ]
    weights = [(ml.Weight(w), ml.Weight(b)) for w, b in arrays]
    tensors = [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in arrays]

    def monadl_forward(x: np.ndarray) -> ml.ArrayLayer:
        h: ml.ArrayLayer = ml.as_layer(x)
        for i, (w, b) in enumerate(weights):
            h = ml.dense(h, w, b)
            h = ml.tanh(h) if i < len(weights) - 1 else h
        return h

    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, (w, b) in enumerate(tensors):
            h = h @ w + b
            h = torch.tanh(h) if i < len(tensors) - 1 else h
        return h

    def numpy_forward(x: np.ndarray) -> np.ndarray:
        h = x
        for i, (w, b) in enumerate(arrays):
            h = h @ w + b
            h = np.tanh(h) if i < len(arrays) - 1 else h
        return h

    print(
        f"# {platform.machine()}, Python {platform.python_version()}, NumPy {np.__version__}, torch {torch.__version__}"
    )
    print(
        f"# OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; best of {args.rounds}, us a request"
    )
    print(f"{'batch':>5} {'monadl':>9} {'torch':>9} {'numpy':>9} {'/torch':>8} {'/numpy':>8}")
    for batch in args.batch:
        x = rng.standard_normal((batch, SIZES[0])).astype(np.float32)
        tx = torch.from_numpy(x)
        expected = numpy_forward(x)

        async def monadl_requests(x: np.ndarray = x) -> None:
            for _ in range(args.requests):
                await monadl_forward(x).predict()

        def torch_requests(tx: torch.Tensor = tx) -> None:
            with torch.no_grad():
                for _ in range(args.requests):
                    torch_forward(tx)

        def numpy_requests(x: np.ndarray = x) -> None:
            for _ in range(args.requests):
                numpy_forward(x)

        got = anyio.run(monadl_forward(x).predict)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            np.testing.assert_allclose(torch_forward(tx).numpy(), expected, rtol=1e-5, atol=1e-6)
        runs: dict[str, Callable[[], object]] = {
            "monadl": lambda: anyio.run(monadl_requests),
            "torch": torch_requests,
            "numpy": numpy_requests,
        }
        best = dict.fromkeys(runs, float("inf"))
        for turn in range(args.rounds):
            for name in list(runs) if turn % 2 else list(runs)[::-1]:
                started = time.perf_counter()
                runs[name]()
                best[name] = min(best[name], (time.perf_counter() - started) / args.requests)
        m, t, n = (best[k] * 1e6 for k in runs)
        print(f"{batch:>5} {m:>9.1f} {t:>9.1f} {n:>9.1f} {m / t:>7.2f}x {m / n:>7.2f}x")


if __name__ == "__main__":
    main()
