"""A dynamic gated network on real data: scikit-learn's 8x8 handwritten digits.

As in the paper's CIFAR-100 benchmark, a coarse classifier sorts an image
into a group of digits ({0,1}, {2,3}, ...), and only the fine classifier of
that group runs to pick the digit. Training uses mini-batches of one group
each, so each step trains the coarse classifier and the one matching fine
classifier, skipping the other four. At test time the coarse prediction
decides, per image, which fine classifier runs (written in direct style).

Run: ``make demo`` (or ``python examples/digits.py --help``). Prints a progress
bar and the test accuracy, and writes the training curve to ``digits.png``.
``--save ckpt.safetensors`` checkpoints after each epoch; ``--resume
ckpt.safetensors --epochs 10`` trains 10 more epochs from there, exactly as an
uninterrupted run would have.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import anyio
import numpy as np
from tqdm.auto import tqdm

import monadl as ml

GROUPS = 5  # digit d belongs to group d // 2
HIDDEN = 64
FINE_HIDDEN = 32


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[ml.Array, ml.Array, ml.Array, ml.Array]:
    """The bundled digits (no download), scaled to [0, 1], split per class."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test


@dataclass
class Dense:
    weight: ml.ArrayWeight
    bias: ml.ArrayWeight

    def __call__(self, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.dense(x, self.weight, self.bias)


class GatedDigits:
    def __init__(self, seed: int = 0, learning_rate: float = 0.05) -> None:
        rng = np.random.default_rng(seed)

        def dense(n_in: int, n_out: int) -> Dense:
            scale = np.sqrt(2.0 / n_in)
            return Dense(
                ml.Weight(
                    (rng.standard_normal((n_in, n_out)) * scale).astype(np.float32),
                    optimizer=ml.optim.momentum(learning_rate),
                ),
                ml.Weight(np.zeros(n_out, np.float32), optimizer=ml.optim.momentum(learning_rate)),
            )

        self.features = dense(64, HIDDEN)
        self.coarse = dense(HIDDEN, GROUPS)
        self.fine = [(dense(HIDDEN, FINE_HIDDEN), dense(FINE_HIDDEN, 2)) for _ in range(GROUPS)]

    def hidden(self, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.relu(self.features(x))

    def fine_logits(self, group: int, hidden: ml.ArrayLayer) -> ml.ArrayLayer:
        first, second = self.fine[group]
        return second(ml.relu(first(hidden)))

    def training_loss(self, x: ml.Array, digits: ml.Array) -> ml.ScalarLayer:
        """A mini-batch of one group: the coarse loss plus that group's fine loss.
        The other fine classifiers are not part of the expression at all."""
        group = int(digits[0]) // 2
        assert np.all(digits // 2 == group), "a training batch holds one group"
        hidden = self.hidden(x)
        coarse = ml.cross_entropy(self.coarse(hidden), digits // 2)
        fine = ml.cross_entropy(self.fine_logits(group, hidden), digits % 2)
        return coarse + fine

    def digit_scores(self, x: ml.Array) -> ml.ArrayLayer:
        """Scores of the 10 digits for each image, routed per image."""
        return self._routed(self.hidden(x), len(x))

    @ml.direct
    async def _routed(self, hidden: ml.ArrayLayer, batch: int) -> ml.ArrayLayer:
        coarse_layer = self.coarse(hidden)
        (coarse_scores,) = await ml.values(coarse_layer)
        groups = np.argmax(coarse_scores, axis=1)
        # Digits outside an image's chosen group score -1e9; inside it, the
        # fine classifier's log-probabilities.
        scores: ml.ArrayLayer | None = None
        mask = np.full((batch, 10), -1e9, np.float32)
        for group in np.unique(groups):
            rows = np.flatnonzero(groups == group)
            mask[rows, 2 * group : 2 * group + 2] = 0.0
            place = np.zeros((batch, len(rows)), np.float32)
            place[rows, np.arange(len(rows))] = 1.0  # rows of this group back in batch order
            spread = np.zeros((2, 10), np.float32)
            spread[[0, 1], [2 * group, 2 * group + 1]] = 1.0  # its two digits among ten
            part = place @ (ml.log_softmax(self.fine_logits(int(group), hidden[rows])) @ spread)
            scores = part if scores is None else scores + part
        assert scores is not None
        return scores + mask


def group_batches(
    x: ml.Array, y: ml.Array, batch_size: int, rng: np.random.Generator
) -> list[tuple[ml.Array, ml.Array]]:
    """Shuffled mini-batches, each of one coarse group (as the paper trains)."""
    batches = []
    for group in range(GROUPS):
        rows = rng.permutation(np.flatnonzero(y // 2 == group))
        batches += [(x[chunk], y[chunk]) for chunk in np.array_split(rows, max(1, len(rows) // batch_size))]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


async def accuracy(model: GatedDigits, x: ml.Array, y: ml.Array) -> float:
    scores = await model.digit_scores(x).predict()
    return float(np.mean(np.argmax(scores, axis=1) == y))


@dataclass
class Result:
    test_accuracy: float
    losses: list[float]
    accuracies: list[float]
    seconds: float


async def run(
    epochs: int = 30,
    batch_size: int = 16,
    seed: int = 0,
    show_progress: bool = True,
    save: str | None = None,
    resume: str | None = None,
) -> Result:
    """Train for ``epochs`` epochs; with ``resume``, first restore the weights,
    the optimizers' state and the shuffling's position from that checkpoint,
    so that the run goes on exactly as if it had never stopped; with ``save``,
    write a checkpoint after each epoch (atomically: a crash keeps the last)."""
    x_train, y_train, x_test, y_test = load_digits(seed)
    model = GatedDigits(seed)
    rng = np.random.default_rng(seed)
    done = 0
    if resume is not None:
        saved = ml.load(resume, model)
        rng.bit_generator.state = saved["rng"]
        done = saved["epoch"]
    losses, accuracies = [], []
    started = time.perf_counter()
    bar = tqdm(total=epochs, desc="epochs", disable=not show_progress)
    for epoch in range(epochs):
        epoch_losses = [
            float(await model.training_loss(xb, yb).train())
            for xb, yb in group_batches(x_train, y_train, batch_size, rng)
        ]
        losses.append(float(np.mean(epoch_losses)))
        accuracies.append(await accuracy(model, x_test, y_test))
        if save is not None:
            ml.save(save, model, metadata={"epoch": done + epoch + 1, "rng": rng.bit_generator.state})
        bar.set_postfix(loss=f"{losses[-1]:.3f}", test_accuracy=f"{accuracies[-1]:.3f}", refresh=False)
        bar.update()
    bar.close()
    return Result(accuracies[-1], losses, accuracies, time.perf_counter() - started)


def plot(result: Result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    epochs = np.arange(1, len(result.losses) + 1)
    loss_axis.plot(epochs, result.losses, color="tab:blue", label="training loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("training loss (coarse + fine cross-entropy)", color="tab:blue")
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(epochs, result.accuracies, color="tab:orange", label="test accuracy")
    accuracy_axis.set_ylabel("test accuracy", color="tab:orange")
    accuracy_axis.set_ylim(0, 1)
    loss_axis.set_title(
        f"Gated digits: coarse group, then one fine classifier (final accuracy {result.test_accuracy:.3f})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a dynamic gated network on scikit-learn's digits.")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="digits.png", help="where to write the training curve (PNG)")
    parser.add_argument("--save", metavar="PATH", help="write a checkpoint (.safetensors) after each epoch")
    parser.add_argument(
        "--resume", metavar="PATH", help="continue from a checkpoint that --save wrote (same --seed and --batch-size)"
    )
    args = parser.parse_args(argv)
    result = anyio.run(run, args.epochs, args.batch_size, args.seed, True, args.save, args.resume)
    plot(result, args.plot)
    print(f"test accuracy: {result.test_accuracy:.3f}  ({result.seconds:.1f} s of training; curve in {args.plot})")


if __name__ == "__main__":
    main()
