"""The cost rule where new users found it wrong, default against off and forced.

Three per-example models whose graphs the rule (``ml.settings(batching=None)``)
once judged badly, each timed under the default rule, with batching off and
with it forced, alternating in one process, best of ``--steps`` steps:

* **early stop**: 16 examples of a direct-style RNN (lengths 1 to 6) that read
  their state every 4 steps: the short ones park whole graphs that end at
  another line. Counted by examples, the merge batched and ran 8-18% slower
  than node by node; now a merge pays from 10 graphs that end at one line.
* **after ragged**: 128 examples of one length through a 2-layer MLP, timed
  after one batch of 128 different lengths (which groups nothing): the
  verdict on the ragged batch (by line and node count) left the next 31
  batches unbatched, 2.1x slower; now it is analysed again at the next.
* **small, large weights**: 10 sequences through a marked RNN cell of
  512 x 512 weights given as arguments (a graph of under 256 nodes) and 16
  examples of a 2-layer MLP at 512 (66 nodes): below 256 nodes the rule left them alone, where batching ran 1.5-2.2x
  faster; now 8 nodes reading a large weight make a graph worth analysing.
  The same cell closing over its weights, for comparison: given as
  arguments, their deltas were a weight-sized product per call until the
  sixteenth session (now factors, as closed-over weights' are).
* **scaled**: a 256 x 256 layer read by 300 scalings, each summed: the
  scalings grouped into one 300 x 256 x 256 array (the sums node by node)
  until the sixteenth session; an elementwise op whose shared operand is
  over `MAX_MEMBER_SIZE` elements is coarse now.
* **shared encoder**: one call of a marked two-output encoder cell at 256,
  read by 200 calls of a marked decoder cell (each with its own row): the
  decoder's calls ran one by one until the twenty-ninth session (the
  encoder's node, shared by all, was taken for another library's array).
* **few examples, large weight**: 4 and 6 examples, each 10 steps of
  ``tanh(h @ W)`` through one weight of 256 x 256 or 512 x 512: groups of 4 to
  6 products by a large weight paid until the thirty-second session, and
  ran 1.11-1.35x the time of batching off; now a group of any primitive pays
  from 8 (`MIN_GROUP`; products that pack a large weight from 4, `packs`).
* **small marked cell**: 2 or 3 sequences of 50 calls of a marked
  ``tanh(h @ W + x)`` (W of 16 x 16 or 128 x 128, Adam): groups of 2 calls
  of any marked operation paid until the thirty-third session, 1.22x the
  time of batching off at 16 (a new user's); now from 2 to 4 by the weights
  a call reads and its program's steps (`marked_minimum`).
* **RNN inputs**: 1,000 steps (300 at 512) of ``h = tanh(h @ U + b + xs[t] @ V)``: the
  input products (one node in five) are ready together, the rest a chain.
  They ran in one group, and the graph 1.03-1.20x the time of batching off
  at H = 16 to 128 with 1 to 16 rows (a new user's, 3,000 steps at 128),
  until the thirty-fourth session: now a graph whose groups hold under a
  third of its nodes runs node by node (`BATCHED_SHARE`), unless a group
  saves more than its dispatch (one-row products by a weight of 16K
  elements or more, products that pack a weight of 512 x 512: kept, 0.8x).

Run: ``python -m benchmarks.cost_rule`` (``--help``); ``OPENBLAS_NUM_THREADS=1``
for the figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio
import numpy as np

import monadl as ml

Loss = Callable[[], Any]


def early_stop(hidden: int = 32) -> Loss:
    rng = np.random.default_rng(0)
    wx, wh = (ml.Weight((rng.standard_normal((hidden, hidden)) / hidden**0.5).astype(np.float32)) for _ in range(2))
    seqs = [[rng.standard_normal((1, hidden)).astype(np.float32) for _ in range(1 + i % 6)] for i in range(16)]
    h0 = np.zeros((1, hidden), np.float32)

    @ml.direct
    async def example(seq: list[Any]) -> Any:
        h: Any = ml.as_layer(h0)
        for i, x in enumerate(seq):
            h = ml.tanh(x @ wx + h @ wh)
            if i % 4 == 3:  # (a read every four steps, as a data-dependent stop would)
                await ml.values(h)
        return ml.sum(h * h)

    return lambda: ml.sum(ml.stack([example(s) for s in seqs]))


def mlp(examples: int, size: int, lengths: Callable[[int], int]) -> Loss:
    rng = np.random.default_rng(0)
    w1, w2 = (ml.Weight((rng.standard_normal((size, size)) / size).astype(np.float32)) for _ in range(2))
    xs = [rng.standard_normal((lengths(i), size)).astype(np.float32) for i in range(examples)]
    return lambda: ml.sum(ml.stack([ml.sum(ml.tanh(x @ w1) @ w2) for x in xs]))


def marked_rnn(sequences: int = 10, size: int = 512, closed: bool = False) -> Loss:
    rng = np.random.default_rng(0)
    wx, wh = (ml.Weight((rng.standard_normal((size, size)) / size**0.5).astype(np.float32)) for _ in range(2))
    if closed:  # (the same cell closing over its weights)
        inner = ml.operation(lambda x, h: ml.tanh(x @ wx + h @ wh))
        cell: Any = lambda x, h, wx, wh: inner(x, h)  # noqa: E731
    else:
        cell = ml.operation(lambda x, h, wx, wh: ml.tanh(x @ wx + h @ wh))
    seqs = [[rng.standard_normal((1, size)).astype(np.float32) for _ in range(1 + i)] for i in range(sequences)]
    h0 = np.zeros((1, size), np.float32)

    def loss() -> Any:
        finals = []
        for seq in seqs:
            h: Any = ml.as_layer(h0)
            for x in seq:
                h = cell(x, h, wx, wh)
            finals.append(ml.sum(h * h))
        return ml.sum(ml.stack(finals))

    return loss


def scaled(uses: int = 300, size: int = 256) -> Loss:
    rng = np.random.default_rng(0)
    w = ml.Weight((rng.standard_normal((size, size)) / 16).astype(np.float32))
    x = (rng.standard_normal((size, size)) / 16).astype(np.float32)

    def loss() -> Any:
        s = ml.tanh(x @ w)
        return ml.sum(ml.stack([ml.sum(s * float(k + 1)) for k in range(uses)]))

    return loss


def shared_encoder(calls: int = 200, size: int = 256) -> Loss:
    rng = np.random.default_rng(0)
    w = ml.Weight((rng.standard_normal((size, size)) / size**0.5).astype(np.float32))
    v = ml.Weight((rng.standard_normal((size, size)) / size**0.5).astype(np.float32))
    encode = ml.operation(lambda x: (ml.tanh(x @ w), ml.sigmoid(x @ w)))
    decode = ml.operation(lambda h, c, x: (ml.tanh(h @ v + x) * c, c + ml.tanh(x @ v)))
    xs = rng.standard_normal((calls, 1, size)).astype(np.float32)
    x0 = rng.standard_normal((1, size)).astype(np.float32)

    def loss() -> Any:
        h, c = encode(ml.as_layer(x0))
        return ml.sum(ml.stack([ml.sum(decode(h, c, ml.as_layer(x))[0]) for x in xs]))

    return loss


def few_examples(examples: int, size: int, dtype: type[np.floating[Any]] = np.float32, depth: int = 10) -> Loss:
    rng = np.random.default_rng(2)
    w = ml.Weight((rng.standard_normal((size, size)) / size**0.5).astype(dtype), optimizer=ml.optim.sgd(1e-4))
    xs = [rng.standard_normal((1, size)).astype(dtype) for _ in range(examples)]

    def loss() -> Any:
        outs = []
        for x in xs:
            h: Any = ml.as_layer(x)
            for _ in range(depth):
                h = ml.tanh(h @ w)
            outs.append(ml.sum(h))
        return ml.sum(ml.stack(outs))

    return loss


def small_cell(sequences: int, size: int = 16, length: int = 50) -> Loss:
    rng = np.random.default_rng(2)
    table, w, out = (
        ml.Weight(rng.standard_normal(shape) / size, optimizer=ml.optim.adam(1e-3))
        for shape in ((30, size), (size, size), (size, 30))
    )
    cell = ml.operation(lambda h, x: ml.tanh(h @ w + x))
    seqs = [rng.integers(30, size=length) for _ in range(sequences)]

    def loss() -> Any:
        terms = []
        for s in seqs:
            h: Any = ml.as_layer(np.zeros((1, size)))
            for a, b in itertools.pairwise(s):
                h = cell(h, ml.embedding(table, np.array([a])))
                terms.append(ml.cross_entropy(h @ out, np.array([b])))
        return ml.mean(ml.stack(terms))

    return loss


def rnn_inputs(size: int, rows: int, steps: int = 1000) -> Loss:
    rng = np.random.default_rng(2)
    u, v = (ml.Weight(rng.standard_normal((size, size)) / size**0.5, optimizer=ml.optim.sgd(1e-4)) for _ in range(2))
    b = ml.Weight(np.zeros(size), optimizer=ml.optim.sgd(1e-4))
    xs = rng.standard_normal((steps, rows, size))

    def loss() -> Any:
        h: Any = ml.as_layer(np.zeros((rows, size)))
        for x in xs:
            h = ml.tanh(h @ u + b + x @ v)
        return ml.mean(h * h)

    return loss


def best(loss: Loss, steps: int, before: Loss | None = None) -> dict[bool | None, float]:
    """Seconds of the best training step, by ``batching`` setting; ``before``:
    a loss trained once before each timed step (under the same setting)."""

    async def step(batching: bool | None, make: Loss) -> None:
        with ml.settings(batching=batching):
            await make().train()

    times: dict[bool | None, float] = {None: float("inf"), False: float("inf"), True: float("inf")}
    for setting in times:
        anyio.run(step, setting, loss)
    for turn in range(steps):
        for setting in list(times) if turn % 2 else list(times)[::-1]:  # (the order alternates)
            if before is not None:
                anyio.run(step, setting, before)
            started = time.perf_counter()
            anyio.run(step, setting, loss)
            times[setting] = min(times[setting], time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    cases: list[tuple[str, Loss, Loss | None]] = [
        ("early stop (16 examples, hidden 32)", early_stop(), None),
        ("after ragged (128 examples, 2-layer MLP at 32)", mlp(128, 32, lambda i: 4), mlp(128, 32, lambda i: 1 + i)),
        ("small, large weights: marked RNN at 512", marked_rnn(), None),
        ("the same RNN, weights closed over", marked_rnn(closed=True), None),
        ("small, large weights: 16 examples, MLP at 512", mlp(16, 512, lambda i: 10), None),
        ("a 256 x 256 layer scaled 300 times, each summed", scaled(), None),
        ("a marked encoder's outputs read by 200 decoder calls", shared_encoder(), None),
        ("2 sequences x 50 calls of a marked cell at 16", small_cell(2), None),
        ("3 sequences x 50 calls of a marked cell at 16", small_cell(3), None),
        ("2 sequences x 50 calls of a marked cell at 128", small_cell(2, 128), None),
    ]
    cases += [
        (
            f"{n} examples x 10 steps through one {size}x{size}, {np.dtype(dtype).name}",
            few_examples(n, size, dtype),
            None,
        )
        for dtype in (np.float32, np.float64)
        for size in (256, 512)
        for n in (4, 6)
    ]
    cases += [
        (
            f"RNN inputs: {300 if size == 512 else 1000} steps at {size}, {rows} row(s)",
            rnn_inputs(size, rows, 300 if size == 512 else 1000),
            None,
        )
        for size, rows in ((16, 1), (64, 16), (128, 4), (128, 1), (512, 4))
    ]
    print(f"# {platform.machine()}, Python {platform.python_version()}, NumPy {np.__version__}")
    print(f"# OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; best of {args.steps} steps, ms")
    print(f"{'case':<52} {'default':>9} {'off':>9} {'forced':>9} {'default/off':>12} {'forced/off':>11}")
    for name, loss, before in cases:
        t = best(loss, args.steps, before)
        print(
            f"{name:<52} {t[None] * 1e3:>9.2f} {t[False] * 1e3:>9.2f} {t[True] * 1e3:>9.2f} "
            f"{t[None] / t[False]:>11.2f}x {t[True] / t[False]:>10.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
