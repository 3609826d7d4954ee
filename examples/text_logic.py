"""Text-Logic (Estimate and Replace, section 4.4, reduced): "is x greater than y?"
questions from ten templates, answered through a black-box comparison.

Each question is a template with two numbers from 0 to 99 filled in; some
templates name the larger candidate first ("is 7 greater than 3?"), others
second ("is 3 less than 7?"). Both models see the same input: each token's
word (numbers as one word, NUM) and, for numbers, its value. The label is
whether x > y.

EstiNet's argument extractor encodes the question (a bag of its words) and
selects, with two hard Gumbel-softmax selectors over the token positions, the
token that is x and the token that is y (the paper's selectors: the positions'
embeddings against the encoded query). A black-box estimator (a small network
fitted, from the black box's own answers, to compare two numbers) stands in
for the comparison in training; at inference the real comparison answers on
the selected tokens. The end-to-end network of about the same size reads the
same features and answers directly.

As the training set shrinks, the end-to-end network must learn comparison
itself from a few hundred questions; EstiNet only learns where the arguments
are. Run: ``python -m examples.text_logic`` or ``python examples/text_logic.py``
(``--help`` for the options).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np

if not __package__:  # run as a file, python examples/x.py: the repository root holds the package examples
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import monadl as ml
from examples._common import add_estinet_options, chosen_samplings, dense_weights, progress_bar
from monadl.estimate import Sampling, estimator_loss, frozen, gumbel_softmax, harden

# "X" is the number that must be greater for the answer to be yes, "Y" the other.
TEMPLATES = (
    "is X greater than Y ?",
    "is X larger than Y ?",
    "is X bigger than Y ?",
    "is Y less than X ?",
    "is Y smaller than X ?",
    "X is more than Y , true or false ?",
    "does X exceed Y ?",
    "is it true that Y is below X ?",
    "compared with Y , is X greater ?",
    "Y is lower than X , yes or no ?",
)
WORDS = ("<pad>", "NUM", *sorted({w for t in TEMPLATES for w in t.split() if w not in ("X", "Y")}))
LENGTH = max(len(t.split()) for t in TEMPLATES)
EMBED = 16


@dataclass(frozen=True)
class Questions:
    words: ml.Array  # (n, LENGTH) word ids, numbers as NUM, padded with <pad>
    values: ml.Array  # (n, LENGTH) each token's number / 99, 0 for other words
    answers: ml.Array  # (n,) 1 if x > y else 0
    where: ml.Array  # (n, 2) the positions of x and y (to score the selectors, never for training)

    def __len__(self) -> int:
        return len(self.answers)

    def take(self, index: ml.Array) -> Questions:
        return Questions(self.words[index], self.values[index], self.answers[index], self.where[index])


def questions(count: int, rng: np.random.Generator) -> Questions:
    """``count`` questions: a random template, two different random numbers, in random roles."""
    words = np.zeros((count, LENGTH), dtype=np.int64)
    values = np.zeros((count, LENGTH))
    answers = np.zeros(count, dtype=np.int64)
    where = np.zeros((count, 2), dtype=np.int64)
    ids = {w: i for i, w in enumerate(WORDS)}
    for n in range(count):
        template = TEMPLATES[rng.integers(len(TEMPLATES))].split()
        first, second = rng.choice(100, size=2, replace=False)
        x, y = (first, second) if rng.random() < 0.5 else (second, first)
        answers[n] = int(x > y)
        for position, word in enumerate(template):
            number = {"X": x, "Y": y}.get(word)
            words[n, position] = ids["NUM"] if number is not None else ids[word]
            values[n, position] = 0.0 if number is None else number / 99.0
        where[n] = template.index("X"), template.index("Y")
    return Questions(words, values, answers, where)


def compare(pair: ml.Array) -> ml.Array:
    """The black box: 1 where the first of a (batch, 2) pair of numbers is the greater, else 0."""
    greater: ml.Array = (pair[:, 0] > pair[:, 1]).astype(np.int64)
    return greater


class Comparator:
    """The black-box estimator: (batch, 2) numbers -> scores of no and yes (2 -> 16 -> 2)."""

    def __init__(self, rng: np.random.Generator, lr: float, decay_steps: int) -> None:
        schedule = ml.optim.cosine_decay_schedule(lr, max(decay_steps, 1), alpha=0.1)
        self.w1, self.b1 = dense_weights(rng, 2, 16, schedule)
        self.w2, self.b2 = dense_weights(rng, 16, 2, schedule)

    def weights(self) -> list[ml.ArrayWeight]:
        return [self.w1, self.b1, self.w2, self.b2]

    def __call__(self, pair: ml.ArrayOperand, frozen_weights: bool = False) -> ml.ArrayLayer:
        w1, b1, w2, b2 = frozen(self.weights()) if frozen_weights else self.weights()
        return ml.dense(ml.relu(ml.dense(pair, w1, b1)), w2, b2)


class Selectors:
    """The argument extractor: a question -> scores over its token positions, for x and for y.

    The query is the mean of its words' embeddings; each position is its word's
    embedding and a one-hot of the position; a selector scores the positions as
    ``positions @ (query @ W + b)``. Padding is never selected.
    """

    def __init__(self, rng: np.random.Generator, lr: float) -> None:
        self.embedding = ml.Weight(rng.normal(size=(len(WORDS), EMBED)) * 0.3, optimizer=ml.optim.adam(lr))
        self.heads = [dense_weights(rng, EMBED, EMBED + LENGTH, lr) for _ in range(2)]

    def scores(self, q: Questions) -> list[ml.ArrayLayer]:
        batch = len(q)
        embedded = ml.reshape(ml.embedding(self.embedding, q.words.ravel()), (batch, LENGTH, EMBED))
        real = (q.words != 0).astype(np.float64)
        query = ml.sum(embedded * real[:, :, None], axis=1) / real.sum(axis=1, keepdims=True)
        positions = ml.concatenate([embedded, np.broadcast_to(np.eye(LENGTH), (batch, LENGTH, LENGTH))], axis=2)
        padding = (1.0 - real) * -30.0
        return [
            ml.reshape(positions @ ml.reshape(ml.dense(query, w, b), (batch, EMBED + LENGTH, 1)), (batch, LENGTH))
            + padding
            for w, b in self.heads
        ]


class EndToEnd:
    """The same features, answered directly: each position's word embedding, value and
    one-hot position, flattened, -> 32 -> 2."""

    def __init__(self, rng: np.random.Generator, lr: float) -> None:
        self.embedding = ml.Weight(rng.normal(size=(len(WORDS), EMBED)) * 0.3, optimizer=ml.optim.adam(lr))
        features = LENGTH * (EMBED + 1)
        self.w1, self.b1 = dense_weights(rng, features, 32, lr)
        self.w2, self.b2 = dense_weights(rng, 32, 2, lr)

    def logits(self, q: Questions) -> ml.ArrayLayer:
        batch = len(q)
        embedded = ml.reshape(ml.embedding(self.embedding, q.words.ravel()), (batch, LENGTH, EMBED))
        features = ml.reshape(ml.concatenate([embedded, q.values[:, :, None]], axis=2), (batch, LENGTH * (EMBED + 1)))
        return ml.dense(ml.relu(ml.dense(features, self.w1, self.b1)), self.w2, self.b2)


@dataclass
class Result:
    name: str
    size: int  # training questions
    accuracy: float
    selection_accuracy: float | None  # both arguments selected right (EstiNet only)
    seconds: float


def _selected_pairs(selections: Sequence[ml.Array], q: Questions) -> ml.Array:
    """The values at the hardened selections of x and y, as (batch, 2)."""
    return np.stack([np.sum(harden(s) * q.values, axis=1) for s in selections], axis=1)


async def pretrain(comparator: Comparator, rng: np.random.Generator, steps: int, batch: int) -> None:
    """Offline sampling: pairs of numbers 0..99 (scaled), labelled by the black box."""
    for _ in range(steps):
        pair = rng.integers(0, 100, size=(batch, 2)) / 99.0
        await estimator_loss(compare, comparator, [pair], loss=ml.cross_entropy).train()


async def train_estinet(
    train: Questions, test: Questions, sampling: Sampling, args: argparse.Namespace, show: bool
) -> Result:
    rng = np.random.default_rng(args.seed)
    selectors = Selectors(rng, args.lr)
    comparator = Comparator(rng, 3e-3, args.pretrain_steps if sampling.pretrain else args.steps)
    started = time.perf_counter()
    if sampling.pretrain:
        await pretrain(comparator, rng, args.pretrain_steps, 64)
    name = f"EstiNet ({sampling.name})"
    bar = progress_bar(f"{name} n={len(train)}", args.steps, show)
    for _ in bar:
        q = train.take(rng.integers(0, len(train), size=args.batch))
        scores = selectors.scores(q)
        chosen = [ml.sum(gumbel_softmax(s, args.temperature, rng) * q.values, axis=1) for s in scores]
        loss = float(
            await ml.cross_entropy(comparator(ml.stack(chosen, axis=1), frozen_weights=True), q.answers).train()
        )
        if sampling.online_updates:  # the selected numbers, labelled by the black box
            pair = _selected_pairs([await s.predict() for s in scores], q)
            await estimator_loss(compare, comparator, [pair], loss=ml.cross_entropy).train()
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    selections = [await s.predict() for s in selectors.scores(test)]
    answers = compare(_selected_pairs(selections, test))  # the real comparison at inference
    right = np.all(np.stack([np.argmax(s, axis=1) for s in selections], axis=1) == test.where, axis=1)
    return Result(
        name, len(train), float(np.mean(answers == test.answers)), float(np.mean(right)), time.perf_counter() - started
    )


async def train_end_to_end(train: Questions, test: Questions, args: argparse.Namespace, show: bool) -> Result:
    rng = np.random.default_rng(args.seed)
    model = EndToEnd(rng, args.lr)
    started = time.perf_counter()
    bar = progress_bar(f"end-to-end n={len(train)}", args.steps, show)
    for _ in bar:
        q = train.take(rng.integers(0, len(train), size=args.batch))
        loss = float(await ml.cross_entropy(model.logits(q), q.answers).train())
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
    answers = np.argmax(await model.logits(test).predict(), axis=1)
    return Result(
        "end-to-end", len(train), float(np.mean(answers == test.answers)), None, time.perf_counter() - started
    )


def table(results: Sequence[Result]) -> str:
    sizes = sorted({r.size for r in results})
    names = list(dict.fromkeys(r.name for r in results))
    by = {(r.name, r.size): r for r in results}
    rows = [f"{'accuracy / training questions':30}" + "".join(f"{n:>8}" for n in sizes)]
    for name in names:
        rows.append(f"{name:30}" + "".join(f"{by[name, n].accuracy:8.3f}" for n in sizes))
        if by[name, sizes[0]].selection_accuracy is not None:
            rows.append(
                f"{'  x and y selected right':30}"
                + "".join(f"{by[name, n].selection_accuracy or 0:8.3f}" for n in sizes)
            )
    return "\n".join(rows)


async def run(args: argparse.Namespace, show: bool = True) -> list[Result]:
    data_rng = np.random.default_rng(args.seed + 7)
    test = questions(args.test_count, data_rng)
    pool = questions(max(args.sizes), data_rng)
    results = []
    for size in args.sizes:
        train = pool.take(np.arange(size))
        results += [await train_estinet(train, test, sampling, args, show) for sampling in chosen_samplings(args)]
        if not args.no_end_to_end:
            results.append(await train_end_to_end(train, test, args, show))
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", type=int, nargs="+", default=[25, 100, 400, 1600, 6400], help="training set sizes")
    p.add_argument("--steps", type=int, default=2000, help="training steps (mini-batches, drawn from the training set)")
    p.add_argument("--pretrain-steps", type=int, default=2000, help="offline estimator steps before training")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--test-count", type=int, default=2000, help="test questions")
    p.add_argument(
        "--lr", type=float, default=1e-2, help="Adam learning rate of the extractor and the end-to-end network"
    )
    add_estinet_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if min(args.sizes) < 1:
        raise SystemExit("--sizes must be positive")
    results = anyio.run(run, args)
    print("Text-Logic: test accuracy against the number of training questions")
    print(table(results))


if __name__ == "__main__":
    main()
