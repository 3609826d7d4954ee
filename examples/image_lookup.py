"""Image-Lookup (Estimate and Replace, section 4.3) on scikit-learn's 8x8 digits.

A sequence of k digit images is labelled only with the entry of a k-dimensional
lookup table (10 ** k random digits) at the digits the images show. EstiNet
learns an argument extractor (image -> one of 10 digits, a hard Gumbel-softmax
choice in training) through a black-box estimator (a ReLU network that learned
the table from the black box's own outputs), and at inference replaces the
estimator with the lookup itself. The black box is an interface, not a part of
the model: given a *different* table at inference, without retraining, EstiNet
answers as well as with the first, since its extractor reads digits, not the
table. An end-to-end network of the same size (the same extractor and the same
ReLU network, trained on the labels) has the first table baked into its
weights, and is at chance with the second.

Run: ``python -m examples.image_lookup`` or ``python examples/image_lookup.py``
(``--help`` for the options: ``--k``,
``--sampling offline|online|hybrid|all``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np

if not __package__:  # run as a file, python examples/x.py: the repository root holds the package examples
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import monadl as ml
from examples._common import (
    DIGITS,
    Extractor,
    add_estinet_options,
    chosen_samplings,
    dense_weights,
    load_digits_split,
    progress_bar,
)
from monadl.estimate import Sampling, estimator_loss, frozen, gumbel_softmax, harden


def random_table(k: int, rng: np.random.Generator) -> ml.Array:
    """A lookup table: a random digit for each of the 10 ** k tuples of digits."""
    table: ml.Array = rng.integers(0, DIGITS, size=(DIGITS,) * k)
    return table


def look_up(table: ml.Array, one_hots: ml.Array) -> ml.Array:
    """The black box: the table's entries at the digits of (batch, k, 10) one-hots."""
    digits = np.argmax(one_hots, axis=-1)
    entries: ml.Array = table[tuple(digits.T)]
    return entries


class Estimator:
    """(batch, k, 10) one-hots -> scores of the 10 possible entries (k*10 -> 64 -> 64 -> 10, ReLU)."""

    def __init__(self, rng: np.random.Generator, k: int, lr: float, decay_steps: int, hidden: int = 64) -> None:
        schedule = ml.optim.cosine_decay_schedule(lr, max(decay_steps, 1), alpha=0.1)
        self.k = k
        self.w1, self.b1 = dense_weights(rng, k * DIGITS, hidden, schedule)
        self.w2, self.b2 = dense_weights(rng, hidden, hidden, schedule)
        self.w3, self.b3 = dense_weights(rng, hidden, DIGITS, schedule)

    def weights(self) -> list[ml.ArrayWeight]:
        return [self.w1, self.b1, self.w2, self.b2, self.w3, self.b3]

    def __call__(self, one_hots: ml.ArrayOperand, frozen_weights: bool = False) -> ml.ArrayLayer:
        w1, b1, w2, b2, w3, b3 = frozen(self.weights()) if frozen_weights else self.weights()
        x = ml.reshape(one_hots, (-1, self.k * DIGITS))
        return ml.dense(ml.relu(ml.dense(ml.relu(ml.dense(x, w1, b1)), w2, b2)), w3, b3)


@dataclass
class Result:
    name: str
    accuracy: float  # the task, with the table it was trained with
    swapped: float  # the task, with a different table and no retraining
    estimator_accuracy: float | None  # EstiNet in test mode: the estimator in place of the table
    digit_accuracy: float | None
    seconds: float
    curve: list[float] = field(default_factory=list)


Data = tuple[ml.Array, ml.Array, ml.Array, ml.Array]


def _batch(
    data: Data, table: ml.Array, k: int, count: int, rng: np.random.Generator, test: bool = False
) -> tuple[ml.Array, ml.Array, ml.Array]:
    """``count`` sequences of ``k`` images: their pixels (count * k, 64), digits (count, k), entries (count,)."""
    x, y = (data[2], data[3]) if test else (data[0], data[1])
    index = rng.integers(0, len(y), size=(count, k))
    digits = y[index]
    return x[index.ravel()], digits, table[tuple(digits.T)]


def edge_samples(table: ml.Array, k: int, batch: int, rng: np.random.Generator) -> tuple[ml.Array, ml.Array]:
    """Offline samples on the edges between tuples of one-hot digits, labelled by the black box.

    Each sample mixes two random tuples that differ in one position,
    ``lam * a + (1 - lam) * b``, and its target mixes the black box's two
    answers the same way. The estimator then learns how the answer changes as
    one digit turns into another: exactly what the extractor's straight-through
    gradient reads from it at a one-hot input. (Fitted on one-hot tuples alone,
    a table of 1,000 random entries is memorised with gradients that point
    anywhere: at k = 3 the extractor then stays near chance.)
    """
    a = rng.integers(0, DIGITS, size=(batch, k))
    b = a.copy()
    b[np.arange(batch), rng.integers(0, k, size=batch)] = rng.integers(0, DIGITS, size=batch)
    lam = rng.uniform(0.0, 1.0, size=(batch, 1))
    one_hot_a, one_hot_b = np.eye(DIGITS)[a], np.eye(DIGITS)[b]
    inputs = lam[:, :, None] * one_hot_a + (1 - lam[:, :, None]) * one_hot_b
    targets = lam * np.eye(DIGITS)[look_up(table, one_hot_a)] + (1 - lam) * np.eye(DIGITS)[look_up(table, one_hot_b)]
    return inputs, targets


async def pretrain(estimator: Estimator, table: ml.Array, rng: np.random.Generator, steps: int, batch: int) -> float:
    """Offline sampling: fit the estimator to the black box on `edge_samples` (cross-entropy to the mixed answers)."""
    loss = 0.0
    for _ in range(steps):
        inputs, targets = edge_samples(table, estimator.k, batch, rng)
        fit = -ml.mean(ml.sum(targets * ml.log_softmax(estimator(inputs)), axis=-1))
        loss = float(await fit.train())
    return loss


async def train_estinet(
    data: Data, tables: tuple[ml.Array, ml.Array], sampling: Sampling, args: argparse.Namespace, show: bool
) -> Result:
    table, other = tables
    rng = np.random.default_rng(args.seed)
    decay = (args.pretrain_steps if sampling.pretrain else 0) + (args.steps if sampling.online_updates else 0)
    extractor, estimator = Extractor(rng, args.lr), Estimator(rng, args.k, 3e-3, decay)
    started = time.perf_counter()
    if sampling.pretrain:
        await pretrain(estimator, table, rng, args.pretrain_steps, 64)
    curve = []
    bar = progress_bar(f"EstiNet ({sampling.name})", args.steps, show)
    for _ in bar:
        images, _, entries = _batch(data, table, args.k, args.batch, rng)
        logits = extractor.logits(images)
        choice = ml.reshape(gumbel_softmax(logits, args.temperature, rng), (args.batch, args.k, DIGITS))
        curve.append(float(await ml.cross_entropy(estimator(choice, frozen_weights=True), entries).train()))
        if sampling.online_updates:  # the extractor's own outputs, labelled by the black box
            arguments = harden(np.reshape(await logits.predict(), (args.batch, args.k, DIGITS)))
            await estimator_loss(lambda s: look_up(table, s), estimator, [arguments], loss=ml.cross_entropy).train()
        bar.set_postfix(loss=f"{curve[-1]:.4f}", refresh=False)

    test_rng = np.random.default_rng(args.seed + 1)
    images, digits, entries = _batch(data, table, args.k, args.test_count, test_rng, test=True)
    read = (await extractor.digits(images)).reshape(digits.shape)
    one_hots = np.eye(DIGITS)[read]
    estimated = np.argmax(await estimator(one_hots).predict(), axis=-1)
    return Result(
        f"EstiNet ({sampling.name})",
        accuracy=float(np.mean(look_up(table, one_hots) == entries)),
        swapped=float(np.mean(look_up(other, one_hots) == other[tuple(digits.T)])),
        estimator_accuracy=float(np.mean(estimated == entries)),
        digit_accuracy=float(np.mean(read == digits)),
        seconds=time.perf_counter() - started,
        curve=curve,
    )


async def train_end_to_end(
    data: Data, tables: tuple[ml.Array, ml.Array], args: argparse.Namespace, show: bool
) -> Result:
    table, other = tables
    rng = np.random.default_rng(args.seed)
    extractor, network = Extractor(rng, args.lr), Estimator(rng, args.k, 3e-3, args.steps)
    started = time.perf_counter()
    curve = []
    bar = progress_bar("end-to-end", args.steps, show)
    for _ in bar:
        images, _, entries = _batch(data, table, args.k, args.batch, rng)
        probabilities = ml.reshape(ml.softmax(extractor.logits(images)), (args.batch, args.k, DIGITS))
        curve.append(float(await ml.cross_entropy(network(probabilities), entries).train()))
        bar.set_postfix(loss=f"{curve[-1]:.4f}", refresh=False)
    test_rng = np.random.default_rng(args.seed + 1)
    images, digits, entries = _batch(data, table, args.k, args.test_count, test_rng, test=True)
    probabilities = ml.reshape(ml.softmax(extractor.logits(images)), (args.test_count, args.k, DIGITS))
    answers = np.argmax(await network(probabilities).predict(), axis=-1)
    return Result(
        "end-to-end",
        accuracy=float(np.mean(answers == entries)),
        swapped=float(np.mean(answers == other[tuple(digits.T)])),  # it cannot be given another table
        estimator_accuracy=None,
        digit_accuracy=None,
        seconds=time.perf_counter() - started,
        curve=curve,
    )


def table(results: Sequence[Result]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = [f"{'model':20}{'table 1':>10}{'table 2':>10}{'estimator':>11}{'digits':>8}{'seconds':>9}"]
    for r in results:
        rows.append(
            f"{r.name:20}{r.accuracy:10.3f}{r.swapped:10.3f}{cell(r.estimator_accuracy):>11}"
            f"{cell(r.digit_accuracy):>8}{r.seconds:9.1f}"
        )
    return "\n".join(rows)


async def run(args: argparse.Namespace, show: bool = True) -> list[Result]:
    data = load_digits_split(args.seed)
    table_rng = np.random.default_rng(args.seed + 100)
    tables = (random_table(args.k, table_rng), random_table(args.k, table_rng))
    results = [await train_estinet(data, tables, sampling, args, show) for sampling in chosen_samplings(args)]
    if not args.no_end_to_end:
        results.append(await train_end_to_end(data, tables, args, show))
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--k", type=int, default=2, help="images per lookup (the table has 10 ** k entries)")
    p.add_argument("--steps", type=int, help="training steps (default: 3000 for k = 2, 6000 beyond)")
    p.add_argument("--pretrain-steps", type=int, default=3000, help="offline estimator steps before training")
    p.add_argument("--batch", type=int, help="sequences per mini-batch (default: 32 for k = 2, 128 beyond)")
    p.add_argument("--test-count", type=int, default=2000, help="test sequences")
    p.add_argument("--lr", type=float, default=3e-3, help="the extractor's Adam learning rate")
    add_estinet_options(p)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, with the defaults that depend on k filled in."""
    args = parser().parse_args(argv)
    if args.k < 1:
        raise SystemExit("--k must be at least 1")
    if args.steps is None:
        args.steps = 3000 if args.k <= 2 else 6000
    if args.batch is None:
        args.batch = 32 if args.k <= 2 else 128
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    results = anyio.run(run, args)
    print(f"Image-Lookup, k = {args.k}: accuracy of the task (table 2: a different table at inference, no retraining)")
    print(table(results))


if __name__ == "__main__":
    main()
