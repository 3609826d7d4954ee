"""What the examples share: the digits, a digit classifier, a progress bar,
and the training loop and bag-of-symbols baseline of the tree examples."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, final

import numpy as np
from tqdm import std
from tqdm.auto import tqdm

import monadl as ml
from examples._device import host
from monadl.estimate import Sampling

DIGITS = 10


def load_digits_split(seed: int) -> tuple[ml.Array, ml.Array, ml.Array, ml.Array]:
    """scikit-learn's 8x8 digits (pixels scaled to [0, 1]) split 75/25 into train and test."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float64)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = len(y) * 3 // 4
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def dense_weights(
    rng: np.random.Generator, n_in: int, n_out: int, lr: float | ml.optim.Schedule
) -> tuple[ml.ArrayWeight, ml.ArrayWeight]:
    """He-initialised weights and zero biases of a dense layer, each with Adam."""
    w = ml.Weight(rng.normal(size=(n_in, n_out)) * np.sqrt(2.0 / n_in), optimizer=ml.optim.adam(lr))
    return w, ml.Weight(np.zeros(n_out), optimizer=ml.optim.adam(lr))


class Extractor:
    """The argument extractor of the image tasks: image -> scores of the 10 digits (64 -> hidden -> 10)."""

    def __init__(self, rng: np.random.Generator, lr: float, hidden: int = 32) -> None:
        self.w1, self.b1 = dense_weights(rng, 64, hidden, lr)
        self.w2, self.b2 = dense_weights(rng, hidden, DIGITS, lr)

    def logits(self, images: ml.Array) -> ml.ArrayLayer:
        return ml.dense(ml.relu(ml.dense(images, self.w1, self.b1)), self.w2, self.b2)

    async def digits(self, images: ml.Array) -> ml.Array:
        """The digits it reads (argmax), as plain integers."""
        digits: ml.Array = np.argmax(await self.logits(images).predict(), axis=-1)
        return digits


def progress_bar(description: str, steps: int, show: bool = True) -> tqdm[int]:
    """``range(steps)`` with a tqdm progress bar: on stderr in a terminal, a
    widget in a notebook, an update every ten seconds in a log file (not a
    line per step), nothing when ``show`` is false.

    >>> bar = progress_bar("training", 3, show=False)
    >>> [step for step in bar]
    [0, 1, 2]
    >>> bar.set_postfix(loss="0.1234")  # shown beside the bar when it is on
    """
    interactive = sys.stderr.isatty() or tqdm is not std.tqdm  # tqdm.auto chose the notebook widget
    return tqdm(range(steps), desc=description, disable=not show, mininterval=0.1 if interactive else 10.0)


SAMPLINGS = {"offline": Sampling.offline(), "online": Sampling.online(), "hybrid": Sampling.hybrid()}


def positive(text: str) -> int:
    """An argparse type: an int >= 1 (a count of steps, trees, a batch size).

    >>> positive("3")
    3
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


def add_estinet_options(p: argparse.ArgumentParser) -> None:
    """The options every Estimate-and-Replace example takes."""
    p.add_argument(
        "--temperature", type=float, default=3.0, help="Gumbel-softmax temperature (of the gradient's relaxation)"
    )
    p.add_argument("--sampling", choices=[*SAMPLINGS, "all"], default="hybrid", help="how the estimator learns")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the end-to-end baseline")
    p.add_argument("--seed", type=int, default=0)


def chosen_samplings(args: argparse.Namespace) -> list[Sampling]:
    """The estimator training procedures ``--sampling`` asks for."""
    return list(SAMPLINGS.values()) if args.sampling == "all" else [SAMPLINGS[args.sampling]]


# ---- the tree examples' training loop and baseline ------------------------------------------------
Item = TypeVar("Item")
Item_contra = TypeVar("Item_contra", contravariant=True)


class Classifier(Protocol[Item_contra]):
    """A model that scores a batch of items (trees): ``(items, classes)``."""

    def logits(self, items: Sequence[Item_contra]) -> ml.ArrayLayer: ...


@final
@dataclass(frozen=True, slots=True)
class Curve:
    """Per epoch: mean training loss and test accuracy; and the seconds spent."""

    losses: list[float]
    accuracies: list[float]
    seconds: float


@final
@dataclass(frozen=True, slots=True)
class Labelled(Generic[Item]):
    """How the tree examples train: a batch's labels, and its loss on a model."""

    labels: Callable[[Sequence[Item]], ml.Array]

    def loss(self, model: Classifier[Item], items: Sequence[Item]) -> ml.ScalarLayer:
        return ml.cross_entropy(model.logits(items), self.labels(items))

    async def accuracy(self, model: Classifier[Item], items: Sequence[Item], batch: int = 256) -> float:
        right = 0
        for start in range(0, len(items), batch):
            chunk = items[start : start + batch]
            scores = host(await model.logits(chunk).predict())
            right += int(np.count_nonzero(np.argmax(scores, axis=1) == self.labels(chunk)))
        return right / len(items)

    async def fit(
        self,
        model: Classifier[Item],
        train: Sequence[Item],
        test: Sequence[Item],
        epochs: int,
        batch: int,
        seed: int,
        name: str,
        progress: bool,
    ) -> Curve:
        """``epochs`` passes over ``train`` in shuffled batches, one ``train()``
        a batch, with a progress bar; the test accuracy after each pass."""
        rng = np.random.default_rng(seed)
        epoch_losses: list[float] = []
        accuracies: list[float] = []
        started = time.perf_counter()
        steps = epochs * -(-len(train) // batch)
        with tqdm(total=steps, desc=f"{name:14}", disable=not progress, leave=True) as bar:
            for _ in range(epochs):
                order = rng.permutation(len(train))
                losses = []
                for start in range(0, len(train), batch):
                    losses.append(
                        float(await self.loss(model, [train[i] for i in order[start : start + batch]]).train())
                    )
                    bar.update()
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
                epoch_losses.append(float(np.mean(losses)))
                accuracies.append(await self.accuracy(model, test))
                bar.set_postfix(loss=f"{epoch_losses[-1]:.3f}", test_accuracy=f"{accuracies[-1]:.3f}")
        return Curve(epoch_losses, accuracies, time.perf_counter() - started)


@final
class BagOfSymbols:
    """The structure-blind baseline of the tree examples: the sum of a tree's
    symbol embeddings (counts @ table is that sum), then a ReLU layer."""

    def __init__(self, symbols: int, classes: int, hidden: int, seed: int = 0, learning_rate: float = 0.01) -> None:
        rng = np.random.default_rng(seed)

        def weight(shape: tuple[int, ...], scale: float) -> ml.ArrayWeight:
            data = (rng.normal(0.0, 1.0, shape) * scale).astype(np.float32)
            return ml.Weight(data, optimizer=ml.optim.adam(learning_rate))

        self.table = weight((symbols, hidden), 0.5)
        self.w1, self.b1 = weight((hidden, hidden), np.sqrt(2.0 / hidden)), weight((hidden,), 0.0)
        self.w2, self.b2 = weight((hidden, classes), np.sqrt(1.0 / hidden)), weight((classes,), 0.0)

    def logits_of_counts(self, counts: ml.Array) -> ml.ArrayLayer:
        """``(rows, classes)`` from ``(rows, symbols)`` counts."""
        bag = ml.matmul(counts, self.table)
        return ml.dense(ml.relu(ml.dense(bag, self.w1, self.b1)), self.w2, self.b2)
