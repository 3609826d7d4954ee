"""Batching across data-dependent control flow: the shift-reduce parser of
`examples/shift_reduce.py`, sentences one by one against a batch as one ``train()``.

Each sentence chooses its parse by its own predictions (a value read with
``bind`` at every decision), so no graph of the batch is known before it runs.
One training step over a batch of generated sentences (2-6 digits, 3-11
tokens), in one run, rounds alternating between the contenders:

* one by one: a ``train()`` per sentence (nothing to batch across);
* fibers off: one ``train()`` over the batch, ``Settings.batching=False``
  (the sentences are fibers that park and merge as with batching on, so that
  they step in the same order; each merged graph runs node by node);
* fibers on: the same with batching automatic: fibers park at their graphs,
  which run merged and batched (`monadl.runtime.schedule.fibers`);
* direct on: the same parser in direct style (``await`` at each decision,
  `Parser.parse_direct`), batching automatic;
* cells 1-by-1, cells on: one by one and fibers on, with the tracker and
  the composition marked as operations (``Parser(cells=True)``: one node
  each per call, a merged group of them one call of its program). The
  ratio "1-by-1/cells on" is to the unmarked one by one;
* hand 1-by-1, hand batched: the limit, the same parser by hand in NumPy
  (`benchmarks._shift_reduce_numpy`: the kernels monadl calls, no graph),
  a step per sentence (written plainly for one sentence) and the batch's
  sentences in lock step. Their ratio is what batching by hand buys with
  these kernels.

Ratios are of times, the slower over the faster as named ("1-by-1/on": one
by one's step time over fibers on's; 4x: batching is four times as fast);
earlier tables in BENCHMARKS.md head the same figures "on/1-by-1".

The weights do not move (learning rate 0), so every round parses the same
way. Before timing, the batch's gradients with fibers on are checked against
those of fibers off, of direct style, and the mean of the sentences' own
gradients.

Times are CPU seconds of this process (``time.process_time``, BLAS limited
to one thread) of one training step, the least of all steps of all rounds
(as in `benchmarks/batching.py`, CPU time: wall time on a shared machine
measures the neighbours). Also prints the merge cost per
merged node and the batching analysis cost per node. Run:
``python -m benchmarks.control_flow`` (``--quick`` for a smoke run;
``--device cuda`` for the weights on a GPU, timed by the wall clock).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Generator
from typing import Any

import anyio
import numpy as np

import monadl as ml
from benchmarks import _shift_reduce_numpy
from examples._device import DEVICES
from examples.shift_reduce import Log, Parser, make_sentences
from monadl.runtime import entry
from monadl.runtime.schedule import batched, fibers

_clock = time.process_time


DTYPE: type[np.floating[Any]] = np.float32

TIMED_SEED = 10
"""The timed batch's sentences (`make_sentences`'s seed)."""


def _parser(hidden: int, dtype: type[np.floating[Any]] = DTYPE, cells: bool = False, device: str = "cpu") -> Parser:
    return Parser(hidden, seed=0, learning_rate=0.0, dtype=dtype, cells=cells, device=device)


def check(hidden: int, batch: int, dtype: type[np.floating[Any]] = np.float64) -> float:
    """The largest relative difference of the batch's loss and gradients:
    fibers on against off, and against the mean of one-by-one gradients."""
    parser = _parser(hidden, dtype)
    sentences = make_sentences(batch, 2, 6, seed=1)
    logs: list[Log] = []

    def batch_gradients(batching: bool | None, direct: bool = False) -> tuple[float, list[Any]]:
        with ml.settings(batching=batching):
            value, grads = anyio.run(entry.gradients, parser.loss(sentences, logs, direct))
        return float(value), [grads.get(w) for w in parser.weights()]

    on, off, direct = batch_gradients(None), batch_gradients(False), batch_gradients(None, True)
    marked = _parser(hidden, dtype, cells=True)  # the same weights, its cells marked as operations
    cell_value, cell_grads = anyio.run(entry.gradients, marked.loss(sentences, logs))
    cells = (float(cell_value), [cell_grads.get(w) for w in marked.weights()])
    singles = [anyio.run(entry.gradients, parser.loss([s], logs)) for s in sentences]
    mean_loss = float(np.mean([float(v) for v, _ in singles]))
    mean_grads = []
    for w in parser.weights():
        parts = [g[w] for _, g in singles if w in g]
        mean_grads.append(sum(_dense(p) for p in parts) / batch if parts else None)
    worst = 0.0
    for loss, grads in (off, direct, cells, (mean_loss, mean_grads)):
        worst = max(worst, abs(on[0] - loss) / abs(loss))
        for a, b in zip(on[1], grads):
            if a is None or b is None:
                assert a is None and b is None
                continue
            worst = max(worst, float(np.max(np.abs(_dense(a) - _dense(b))) / (np.max(np.abs(_dense(b))) + 1e-30)))
    return worst


def _dense(g: Any) -> Any:
    return g.to_dense() if hasattr(g, "to_dense") else g


def timing(hidden: int, batch: int, rounds: int, steps: int, device: str = "cpu") -> dict[str, float]:
    """Best CPU seconds of one training step on one batch, for each
    contender: the least of ``steps`` steps in each of ``rounds`` rounds (the
    least of many single steps resists the neighbours' bursts best). On a GPU
    (``device="cuda"``), wall seconds: a step waits for the device."""
    parser = _parser(hidden, device=device)
    marked = _parser(hidden, cells=True, device=device)
    clock = _clock if device == "cpu" else time.perf_counter
    sentences = make_sentences(batch, 2, 6, seed=TIMED_SEED)
    logs: list[Log] = []

    async def one_by_one() -> None:
        for s in sentences:
            await parser.loss([s], logs).train()

    async def together() -> None:
        await parser.loss(sentences, logs).train()

    async def cells_one_by_one() -> None:
        for s in sentences:
            await marked.loss([s], logs).train()

    async def cells_together() -> None:
        await marked.loss(sentences, logs).train()

    async def together_direct() -> None:
        await parser.loss(sentences, logs, direct=True).train()

    contenders: dict[str, tuple[Callable[[], Any], bool | None]] = {
        "one by one": (one_by_one, None),
        "fibers off": (together, False),
        "fibers on": (together, None),
        "direct on": (together_direct, None),
        "cells 1-by-1": (cells_one_by_one, None),
        "cells on": (cells_together, None),
    }
    if device == "cpu":  # the limit: the same parser by hand in NumPy, one by one and batched
        by_hand = _shift_reduce_numpy.Model(_shift_reduce_numpy.weights_of(parser))

        async def hand_one_by_one() -> None:
            for s in sentences:
                by_hand.train_sentence(s)

        async def hand_together() -> None:
            by_hand.train(sentences)

        contenders |= {"hand 1-by-1": (hand_one_by_one, None), "hand batched": (hand_together, None)}
    return alternating(contenders, rounds, steps, clock)


def alternating(
    contenders: dict[str, tuple[Callable[[], Any], bool | None]],
    rounds: int,
    steps: int,
    clock: Callable[[], float] = _clock,
) -> dict[str, float]:
    """Each contender's least ``clock`` seconds of one ``anyio.run`` of its
    coroutine (under its batching setting), over ``steps`` steps in each of
    ``rounds`` rounds after one that warms up, the rounds in turn forwards
    and backwards so that all see the same machine noise."""
    best = dict.fromkeys(contenders, float("inf"))
    names = list(contenders)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names if r % 2 else names[::-1]:
            run, batching = contenders[name]
            with ml.settings(batching=batching):
                for _ in range(steps):
                    t0 = clock()
                    anyio.run(run)
                    elapsed = clock() - t0
                    if r:
                        best[name] = min(best[name], elapsed)
    return best


def costs(hidden: int, batch: int) -> tuple[float, float, int, int]:
    """Per merged node: the merge (union, alike count) and the batching
    analysis (levels by height, and signatures timed again once the run computed their
    operands), in microseconds; merged runs and nodes per step."""
    parser = _parser(hidden)
    sentences = make_sentences(batch, 2, 6, seed=TIMED_SEED)  # the timed batch's merges
    merge_s = [0.0]
    analysis_s = [0.0]
    nodes = [0]
    runs = [0]
    merge, stepwise = fibers.merge, batched.stepwise

    def timed_merge(ev: Any, orders: list[list[Any]]) -> tuple[list[Any], int]:
        t0 = time.perf_counter()
        merged = merge(ev, orders)
        merge_s[0] += time.perf_counter() - t0
        nodes[0] += len(merged[0])
        runs[0] += 1
        return merged

    def timed_stepwise(
        ev: Any, order: list[Any], groups: Any = None, levels: Any = None
    ) -> Generator[object, None, list[Any]]:
        t0 = time.perf_counter()
        fibers.heights(order)  # (the levels, timed again)
        analysis_s[0] += time.perf_counter() - t0
        left = yield from stepwise(ev, order, groups, levels)
        t0 = time.perf_counter()
        for node in order:
            batched.signature(ev.records, node)
        analysis_s[0] += time.perf_counter() - t0
        return left

    # Instrumented for this measurement only (the timed rounds above run the real functions). The
    # merged runs call `batched.stepwise` (a merge's forward, with turns for the event loop).
    fibers.merge, batched.stepwise = timed_merge, timed_stepwise
    try:
        anyio.run(parser.loss(sentences, []).train)
    finally:
        fibers.merge, batched.stepwise = merge, stepwise
    n = max(nodes[0], 1)
    return merge_s[0] / n * 1e6, analysis_s[0] / n * 1e6, runs[0], nodes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small batches, one round")
    parser.add_argument("--hidden", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="cuda: the weights on the GPU (CuPy), wall time, no checks"
    )
    args = parser.parse_args()
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().limit(limits=1)  # one thread, BLAS included (numpy is loaded by now)
    print(f"monadl batching across control flow (shift-reduce); {os.cpu_count()} cores, 1 thread")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    hiddens, sizes, rounds, steps = (args.hidden, args.batch, args.rounds, args.steps)
    if args.quick:
        hiddens, sizes, rounds, steps = [8], [1, 4], 1, 1
    for hidden in hiddens:
        if args.device == "cpu":
            worst = check(hidden, max(sizes))
            worst32 = check(hidden, max(sizes), np.float32)
            # The limit on the timed batch: its loss and gradients, its paths in the timed dtype too.
            timed = make_sentences(max(sizes), 2, 6, seed=TIMED_SEED)
            hand = _shift_reduce_numpy.check(_parser(hidden, np.float64), timed)
            hand32 = _shift_reduce_numpy.check(_parser(hidden), timed)
            print(
                f"\nhidden {hidden}: largest relative difference of loss and gradients (on vs off, vs direct, vs cells, vs one by one): "
                f"{worst:.1e} in float64, {worst32:.1e} in float32 (timed in {np.dtype(DTYPE).name}); "
                f"by hand vs on: {hand:.1e} in float64, {hand32:.1e} in float32"
            )
            if not (hand <= 1e-9 and hand32 <= 1e-3):  # (a NaN fails too)
                raise AssertionError(f"the parser by hand disagrees with monadl: {hand:.1e}, {hand32:.1e} in float32")
        else:  # (the device's gradients are checked by tests/runtime/test_cuda.py and test_stand_in_device.py)
            print(f"\nhidden {hidden}, on {args.device}: wall time")
        print(
            f"{'batch':>5s} {'one by one':>11s} {'fibers off':>11s} {'fibers on':>11s} {'1-by-1/on':>10s} "
            f"{'off/on':>7s} {'direct on':>11s} {'1-by-1/direct':>14s} {'cells 1-by-1':>13s} {'cells on':>10s} "
            f"{'1-by-1/cells on':>16s}"
        )
        for b in sizes:
            best = timing(hidden, b, rounds, steps, args.device)
            print(
                f"{b:5d} {best['one by one'] * 1e3:9.2f}ms {best['fibers off'] * 1e3:9.2f}ms "
                f"{best['fibers on'] * 1e3:9.2f}ms {best['one by one'] / best['fibers on']:9.2f}x "
                f"{best['fibers off'] / best['fibers on']:6.2f}x {best['direct on'] * 1e3:9.2f}ms "
                f"{best['one by one'] / best['direct on']:13.2f}x {best['cells 1-by-1'] * 1e3:11.2f}ms "
                f"{best['cells on'] * 1e3:8.2f}ms {best['one by one'] / best['cells on']:15.2f}x"
            )
            if "hand batched" in best:
                print(
                    f"{'':5s} by hand (NumPy, the limit): one by one {best['hand 1-by-1'] * 1e3:.2f}ms, "
                    f"batched {best['hand batched'] * 1e3:.2f}ms: {best['hand 1-by-1'] / best['hand batched']:.2f}x; "
                    f"monadl's one by one over the batched by hand: {best['one by one'] / best['hand batched']:.2f}x"
                )
        if args.device != "cpu":
            continue
        merge_us, analysis_us, runs, nodes = costs(hidden, max(sizes))
        analysis = f"{analysis_us:.2f} us" if analysis_us else "none (the cost rule left the merges unbatched)"
        print(
            f"batch {max(sizes)}: {runs} merged runs, {nodes} nodes merged; per node: merge {merge_us:.2f} us, "
            f"analysis (heights + signatures) {analysis}"
        )
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
