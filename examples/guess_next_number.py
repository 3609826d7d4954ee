"""The paper's first listing: learn to guess the next number of a progression.

Run: ``python examples/guess_next_number.py`` (or ``python -m
examples.guess_next_number``). Trains a linear model ``sum(question * weights)
+ bias`` with plain SGD (learning rate 0.0005: the default optimizer, which a
weight built without ``optimizer=`` gets) on four arithmetic progressions,
then asks it about (42, 43, 44).
"""

from __future__ import annotations

import anyio
import numpy as np

import monadl as ml

weights = ml.Weight(np.random.rand(3))
bias = ml.Weight(np.random.rand())  # a scalar weight


def guess_next_number(question: ml.Array) -> ml.ScalarLayer:
    return ml.sum(weights * question) + bias


def square_loss(answer: ml.ScalarLayer, expected: float) -> ml.ScalarLayer:
    difference = answer - expected
    return difference * difference


questions = [np.array(q) for q in ([3.0, 4.0, 5.0], [13.0, 19.0, 25.0], [2.0, 5.0, 8.0], [10.0, 8.0, 6.0])]
answers = [6.0, 31.0, 11.0, 4.0]


async def main(iterations: int = 3000) -> float:
    for _ in range(iterations):
        for question, answer in zip(questions, answers):
            await square_loss(guess_next_number(question), answer).train()
    guess = float(await guess_next_number(np.array([42.0, 43.0, 44.0])).predict())
    return guess


if __name__ == "__main__":
    print(f"next after 42, 43, 44: {anyio.run(main):.3f}  (expected 45)")
