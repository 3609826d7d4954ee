"""Image-Addition (Estimate and Replace, section 4.2) on scikit-learn's 8x8 digits.

A sequence of k digit images is labelled only with the sum of its digits; no
image carries its digit label. EstiNet learns an argument extractor (a
classifier: image -> one of 10 digits) through a black-box estimator (a small
recurrent network that learned, from the black box's own outputs, to add
sequences of one-hot digits), and at inference replaces the estimator with the
black box itself: Python's ``sum``. The end-to-end network of the same size
(the same extractor and recurrent network) learns from the sums directly.

Both train on k = 10 and are tested on k = 10 and k = 100. The end-to-end
network has never seen a sum beyond ~90, and its recurrent state saturates;
EstiNet's sum is exact whatever k, so its error is only the extractor's.

Run: ``python examples/image_addition.py`` (``--help`` for the options;
``--sampling all`` compares offline, online and hybrid estimator training).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np

import monadl as ml
from monadl.estimate import Sampling, entropy_penalty, estimator_loss, frozen, gumbel_softmax, harden

DIGITS = 10
SCALE = 45.0  # sums are regressed as sum / SCALE (the mean sum of 10 digits)


def load(seed: int) -> tuple[ml.Array, ml.Array, ml.Array, ml.Array]:
    """The digits (pixels scaled to [0, 1]) split 75/25 into train and test."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = len(y) * 3 // 4
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def sequences(y: ml.Array, count: int, k: int, rng: np.random.Generator) -> tuple[ml.Array, ml.Array]:
    """``count`` sequences of ``k`` image indices, uniformly drawn, and their digit sums."""
    index = rng.integers(0, len(y), size=(count, k))
    return index, y[index].sum(axis=1).astype(np.float64)


def _dense(rng: np.random.Generator, n_in: int, n_out: int, lr: float) -> tuple[ml.ArrayWeight, ml.ArrayWeight]:
    w = ml.Weight(rng.normal(size=(n_in, n_out)) * np.sqrt(2.0 / n_in), optimizer=ml.optim.adam(lr))
    return w, ml.Weight(np.zeros(n_out), optimizer=ml.optim.adam(lr))


class Extractor:
    """Image -> scores of the 10 digits (64 -> 32 -> 10)."""

    def __init__(self, rng: np.random.Generator, lr: float) -> None:
        self.w1, self.b1 = _dense(rng, 64, 32, lr)
        self.w2, self.b2 = _dense(rng, 32, DIGITS, lr)

    def logits(self, images: ml.Array) -> ml.ArrayLayer:
        return ml.dense(ml.relu(ml.dense(images, self.w1, self.b1)), self.w2, self.b2)


class Adder:
    """A recurrent network over a (batch, k, 10) sequence -> (batch,) sum / SCALE."""

    def __init__(self, rng: np.random.Generator, lr: float, hidden: int = 32) -> None:
        self.u = ml.Weight(rng.normal(size=(DIGITS, hidden)) * 0.3, optimizer=ml.optim.adam(lr))
        self.w = ml.Weight(rng.normal(size=(hidden, hidden)) * 0.1, optimizer=ml.optim.adam(lr))
        self.b = ml.Weight(np.zeros(hidden), optimizer=ml.optim.adam(lr))
        self.v = ml.Weight(rng.normal(size=(hidden,)) * 0.1, optimizer=ml.optim.adam(lr))
        self.c = ml.Weight(0.0, optimizer=ml.optim.adam(lr))

    def weights(self) -> list[ml.Weight[ml.Array, ml.Array]]:
        return [self.u, self.w, self.b, self.v]

    def __call__(self, steps: ml.ArrayOperand, k: int, frozen_weights: bool = False) -> ml.ArrayLayer:
        u, w, b, v = frozen(self.weights()) if frozen_weights else self.weights()
        c = ml.stop_gradient(self.c) if frozen_weights else self.c
        h: ml.ArrayOperand | None = None
        for t in range(k):
            pre = steps[:, t, :] @ u + b
            h = ml.tanh(pre if h is None else pre + h @ w)
        assert h is not None
        return h @ v + c


@dataclass
class Result:
    name: str
    mae: dict[int, float]
    digit_accuracy: float | None
    seconds: float
    curve: list[float] = field(default_factory=list)


def _one_hot_sequences(rng: np.random.Generator, batch: int, k: int) -> ml.Array:
    return np.eye(DIGITS)[rng.integers(0, DIGITS, size=(batch, k))]


def _black_box(one_hots: ml.Array) -> ml.Array:
    """The black box: the sum of the digits, scaled like the regression target."""
    sums: ml.Array = np.argmax(one_hots, axis=-1).sum(axis=-1) / SCALE
    return sums


async def pretrain(adder: Adder, rng: np.random.Generator, k: int, steps: int, batch: int) -> float:
    """Offline sampling: fit the estimator on uniformly random digit sequences."""
    loss = 0.0
    for _ in range(steps):
        lengths = int(rng.integers(1, k + 1))  # every prefix length, so partial sums are learned too
        sample = _one_hot_sequences(rng, batch, lengths)
        loss = float(await estimator_loss(_black_box, lambda s: adder(s, lengths), [sample]).train())
    return loss


async def train_estinet(
    data: tuple[ml.Array, ml.Array, ml.Array, ml.Array], sampling: Sampling, args: argparse.Namespace, show: bool
) -> Result:
    x_train, y_train, x_test, y_test = data
    rng = np.random.default_rng(args.seed)
    extractor, adder = Extractor(rng, args.lr), Adder(rng, 3e-3)
    started = time.perf_counter()
    if sampling.pretrain:
        await pretrain(adder, rng, args.k, args.pretrain_steps, 64)
    curve = []
    for step in range(args.steps):
        index, sums = sequences(y_train, args.batch, args.k, rng)
        logits = extractor.logits(x_train[index.ravel()])
        choice = ml.reshape(gumbel_softmax(logits, args.temperature, rng, hard=not args.relaxed), (args.batch, args.k, DIGITS))
        estimate = adder(choice, args.k, frozen_weights=True)
        difference = estimate - sums / SCALE
        task = ml.mean(difference * difference) + args.entropy * entropy_penalty(ml.softmax(logits), 0.5)
        curve.append(float(await task.train()))
        if sampling.online_updates:  # the extractor's own outputs, labelled by the black box
            arguments = harden(np.reshape(await logits.predict(), (args.batch, args.k, DIGITS)))
            await estimator_loss(_black_box, lambda s: adder(s, args.k), [arguments]).train()
        if show:
            _progress(f"EstiNet ({sampling.name})", step + 1, args.steps, curve[-1])

    async def predicted_digits(images: ml.Array) -> ml.Array:
        digits: ml.Array = np.argmax(await extractor.logits(images).predict(), axis=-1)
        return digits

    test_rng = np.random.default_rng(args.seed + 1)
    mae = {}
    for k in args.test_k:
        index, sums = sequences(y_test, args.test_count, k, test_rng)
        digits = await predicted_digits(x_test[index.ravel()])
        mae[k] = float(np.mean(np.abs(digits.reshape(index.shape).sum(axis=1) - sums)))  # the real sum
    accuracy = float(np.mean(await predicted_digits(x_test) == y_test))
    return Result(f"EstiNet ({sampling.name})", mae, accuracy, time.perf_counter() - started, curve)


async def train_end_to_end(data: tuple[ml.Array, ml.Array, ml.Array, ml.Array], args: argparse.Namespace, show: bool) -> Result:
    x_train, y_train, x_test, y_test = data
    rng = np.random.default_rng(args.seed)
    extractor, adder = Extractor(rng, args.lr), Adder(rng, 3e-3)
    started = time.perf_counter()
    curve = []
    for step in range(args.steps):
        index, sums = sequences(y_train, args.batch, args.k, rng)
        probabilities = ml.reshape(ml.softmax(extractor.logits(x_train[index.ravel()])), (args.batch, args.k, DIGITS))
        difference = adder(probabilities, args.k) - sums / SCALE
        curve.append(float(await ml.mean(difference * difference).train()))
        if show:
            _progress("end-to-end", step + 1, args.steps, curve[-1])
    test_rng = np.random.default_rng(args.seed + 1)
    mae = {}
    for k in args.test_k:
        index, sums = sequences(y_test, args.test_count, k, test_rng)
        probabilities = ml.reshape(ml.softmax(extractor.logits(x_test[index.ravel()])), (args.test_count, k, DIGITS))
        predicted = await adder(probabilities, k).predict() * SCALE
        mae[k] = float(np.mean(np.abs(predicted - sums)))
    return Result("end-to-end", mae, None, time.perf_counter() - started, curve)


def _progress(name: str, done: int, total: int, loss: float, width: int = 24) -> None:
    if done % max(1, total // 100) and done != total:
        return
    filled = width * done // total
    sys.stderr.write(f"\r{name:18} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} loss {loss:.4f}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def table(results: Sequence[Result], test_k: Sequence[int]) -> str:
    head = f"{'model':20}" + "".join(f"{f'MAE k={k}':>12}" for k in test_k) + f"{'digit acc.':>12}{'seconds':>9}"
    rows = [head]
    for r in results:
        accuracy = "-" if r.digit_accuracy is None else f"{r.digit_accuracy:.3f}"
        rows.append(f"{r.name:20}" + "".join(f"{r.mae[k]:12.2f}" for k in test_k) + f"{accuracy:>12}{r.seconds:9.1f}")
    return "\n".join(rows)


async def run(args: argparse.Namespace, show: bool = True) -> list[Result]:
    data = load(args.seed)
    choices = {"offline": Sampling.offline(), "online": Sampling.online(), "hybrid": Sampling.hybrid()}
    names = list(choices) if args.sampling == "all" else [args.sampling]
    results = [await train_estinet(data, choices[n], args, show) for n in names]
    if not args.no_end_to_end:
        results.append(await train_end_to_end(data, args, show))
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--k", type=int, default=10, help="sequence length in training")
    p.add_argument("--test-k", type=int, nargs="+", default=[10, 100], help="sequence lengths tested")
    p.add_argument("--steps", type=int, default=3000, help="training steps (mini-batches of sequences)")
    p.add_argument("--pretrain-steps", type=int, default=3000, help="offline estimator steps before training")
    p.add_argument("--batch", type=int, default=16, help="sequences per mini-batch")
    p.add_argument("--test-count", type=int, default=500, help="test sequences per length")
    p.add_argument("--lr", type=float, default=3e-3, help="the extractor's Adam learning rate")
    p.add_argument("--temperature", type=float, default=1.0, help="Gumbel-softmax temperature")
    p.add_argument("--relaxed", action="store_true", help="soft Gumbel-softmax samples in training (no hard selection)")
    p.add_argument("--entropy", type=float, default=0.01, help="weight of the entropy penalty")
    p.add_argument("--sampling", choices=["offline", "online", "hybrid", "all"], default="hybrid")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the end-to-end baseline")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    results = anyio.run(run, args)
    print(table(results, args.test_k))


if __name__ == "__main__":
    main()
