"""A small convolutional network's training step: monadl, PyTorch eager, NumPy by hand.

The network is the beginner's conv net of `examples.conv_digits`, with both
convolutions padded so that any even side works: conv 3x3 (pad 1) -> ReLU ->
max pool 2 -> conv 3x3 (pad 1) -> ReLU -> max pool 2 -> dense, then the mean
cross-entropy, one SGD step. Inputs are random NCHW images of one channel and
random labels of ten classes, in float32, one thread (PyTorch's intra-op
threads and BLAS both), at each batch size and side:

* **monadl**: `ml.conv2d`, `ml.max_pool2d`, `ml.dense`, `ml.cross_entropy`,
  built anew each step as a user writes it, ``await loss.train()``;
* **torch**: the same in PyTorch eager, ``torch.optim.SGD``;
* **numpy**: the limit: the forward and backward written by hand in NumPy,
  batch last, (C, H, W, N), all the way, so that every convolution is one
  product over the whole batch, im2col a strided view.

Before timing, the three must give the same loss and gradients from the same
float64 weights. Rounds alternate between the variants (forwards, then
backwards); each figure is the best round's milliseconds a step, with the
speed relative to PyTorch (its time over the variant's).

Run: ``python benchmarks/conv.py`` (``--help``; a quick run: ``--sides 8
--batches 32 --rounds 3``).
"""

from __future__ import annotations

import argparse
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
from numpy.lib.stride_tricks import sliding_window_view
from threadpoolctl import ThreadpoolController

import monadl as ml

CLASSES = 10
LEARNING_RATE = 0.01
Weights = dict[str, np.ndarray]
Step = Callable[[np.ndarray, np.ndarray], Any]  # one training step on (images, labels); may be awaitable


def init_weights(side: int, channels: int, dtype: type, seed: int = 0) -> Weights:
    """He-initialised kernels and read-out for ``side`` x ``side`` images."""
    rng = np.random.default_rng(seed)
    features = 2 * channels * (side // 4) ** 2
    shapes = {"conv1": (channels, 1, 3, 3), "conv2": (2 * channels, channels, 3, 3), "readout": (features, CLASSES)}
    fan_in = {"conv1": 9, "conv2": 9 * channels, "readout": features}
    weights = {k: (rng.normal(size=s) * np.sqrt(2.0 / fan_in[k])).astype(dtype) for k, s in shapes.items()}
    weights["bias"] = np.zeros(CLASSES, dtype=dtype)
    return weights


# ---- monadl ---------------------------------------------------------------------------------------
def monadl_loss(w: dict[str, Any], images: np.ndarray, labels: np.ndarray) -> ml.ScalarLayer:
    hidden = ml.max_pool2d(ml.relu(ml.conv2d(images, w["conv1"], padding=1)), 2)
    hidden = ml.max_pool2d(ml.relu(ml.conv2d(hidden, w["conv2"], padding=1)), 2)
    logits = ml.dense(ml.reshape(hidden, (images.shape[0], -1)), w["readout"], w["bias"])
    return ml.cross_entropy(logits, labels)


def monadl_step(weights: Weights) -> Step:
    w = {k: ml.Weight(v.copy(), optimizer=ml.optim.sgd(LEARNING_RATE)) for k, v in weights.items()}
    return lambda images, labels: monadl_loss(w, images, labels).train()


async def monadl_gradients(weights: Weights, images: np.ndarray, labels: np.ndarray) -> tuple[float, Weights]:
    w = {k: ml.Weight(v.copy()) for k, v in weights.items()}
    loss = monadl_loss(w, images, labels)
    grads = await ml.gradients(loss, list(w.values()))
    return float(await loss.predict()), dict(zip(w, grads))


# ---- PyTorch eager --------------------------------------------------------------------------------
def torch_parts(weights: Weights) -> tuple[dict[str, Any], Callable[[Any, Any], Any]]:
    import torch
    import torch.nn.functional as F

    w = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}

    def loss(images: Any, labels: Any) -> Any:
        hidden = F.max_pool2d(F.relu(F.conv2d(images, w["conv1"], padding=1)), 2)
        hidden = F.max_pool2d(F.relu(F.conv2d(hidden, w["conv2"], padding=1)), 2)
        return F.cross_entropy(hidden.flatten(1) @ w["readout"] + w["bias"], labels)

    return w, loss


def torch_step(weights: Weights) -> Step:
    import torch

    w, loss = torch_parts(weights)
    optimizer = torch.optim.SGD(list(w.values()), lr=LEARNING_RATE)

    def step(images: np.ndarray, labels: np.ndarray) -> None:
        optimizer.zero_grad()
        loss(torch.from_numpy(images), torch.from_numpy(labels)).backward()
        optimizer.step()

    return step


def torch_gradients(weights: Weights, images: np.ndarray, labels: np.ndarray) -> tuple[float, Weights]:
    import torch

    w, loss = torch_parts(weights)
    value = loss(torch.from_numpy(images), torch.from_numpy(labels))
    value.backward()
    return float(value.detach()), {k: t.grad.numpy() for k, t in w.items()}


# ---- NumPy by hand (the limit): batch last, (C, H, W, N) ---------------------------------------
def _conv(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]]:
    """3x3, pad 1, stride 1, on (C, H, W, N); returns (O, H, W, N) and its backward."""
    c, h, wd, n = x.shape
    o = w.shape[0]
    padded = np.zeros((c, h + 2, wd + 2, n), dtype=x.dtype)
    padded[:, 1:-1, 1:-1] = x
    cols = sliding_window_view(padded, (3, 3), axis=(1, 2)).transpose(0, 4, 5, 1, 2, 3).reshape(c * 9, -1)
    w2 = w.reshape(o, -1)

    def backward(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g2 = g.reshape(o, -1)
        dcols = (w2.T @ g2).reshape(c, 3, 3, h, wd, n)
        dpadded = np.zeros_like(padded)
        for i in range(3):
            for j in range(3):
                dpadded[:, i : i + h, j : j + wd] += dcols[:, i, j]
        return dpadded[:, 1:-1, 1:-1], (cols @ g2.T).T.reshape(w.shape)

    return (w2 @ cols).reshape(o, h, wd, n), backward


def _pool(x: np.ndarray) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """2x2 max pooling of (C, H, W, N), even sides; the first maximum of a window takes its delta.

    Elementwise over the four strided views: an argmax along a stacked axis of
    four costs NumPy a loop per window, ten times slower.
    """
    views = [x[:, i::2, j::2] for i in range(2) for j in range(2)]
    out = np.maximum(np.maximum(views[0], views[1]), np.maximum(views[2], views[3]))

    def backward(g: np.ndarray) -> np.ndarray:
        dx, taken = np.empty_like(x), np.zeros(out.shape, dtype=bool)
        for i, view in enumerate(views):
            hit = (view == out) & ~taken
            taken |= hit
            dx[:, i // 2 :: 2, i % 2 :: 2] = g * hit
        return dx

    return out, backward


def numpy_gradients(weights: Weights, images: np.ndarray, labels: np.ndarray) -> tuple[float, Weights]:
    n = images.shape[0]
    a1, conv1 = _conv(images.transpose(1, 2, 3, 0), weights["conv1"])
    p1, pool1 = _pool(np.maximum(a1, 0))
    a2, conv2 = _conv(p1, weights["conv2"])
    p2, pool2 = _pool(np.maximum(a2, 0))
    features = p2.transpose(3, 0, 1, 2).reshape(n, -1)
    logits = features @ weights["readout"] + weights["bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    dlogits = np.exp(log_probs)
    dlogits[np.arange(n), labels] -= 1
    dlogits /= n
    dp2 = (dlogits @ weights["readout"].T).reshape(n, *p2.shape[:3]).transpose(1, 2, 3, 0)
    dp1, dconv2 = conv2(pool2(dp2) * (a2 > 0))
    _, dconv1 = conv1(pool1(dp1) * (a1 > 0))
    grads = {"conv1": dconv1, "conv2": dconv2, "readout": features.T @ dlogits, "bias": dlogits.sum(axis=0)}
    return float(-log_probs[np.arange(n), labels].mean()), grads


def numpy_step(weights: Weights) -> Step:
    w = {k: v.copy() for k, v in weights.items()}

    def step(images: np.ndarray, labels: np.ndarray) -> None:
        for k, g in numpy_gradients(w, images, labels)[1].items():
            w[k] -= LEARNING_RATE * g

    return step


VARIANTS: dict[str, Callable[[Weights], Step]] = {"monadl": monadl_step, "torch": torch_step, "numpy": numpy_step}


# ---- checking and timing --------------------------------------------------------------------------
def data(batch: int, side: int, dtype: type, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, 1, side, side)).astype(dtype), rng.integers(0, CLASSES, size=batch)


def check(side: int, channels: int, names: list[str]) -> float:
    """The largest difference of loss and gradients between the variants, float64."""
    weights = init_weights(side, channels, np.float64)
    images, labels = data(4, side, np.float64)
    results = [anyio.run(monadl_gradients, weights, images, labels), numpy_gradients(weights, images, labels)]
    if "torch" in names:
        results.append(torch_gradients(weights, images, labels))
    (loss, grads), worst = results[0], 0.0
    for other_loss, other in results[1:]:
        worst = max(worst, abs(loss - other_loss), *(float(np.max(np.abs(grads[k] - other[k]))) for k in grads))
    return worst


async def race(names: list[str], weights: Weights, batch: int, side: int, steps: int, rounds: int) -> dict[str, float]:
    """Best-of-rounds seconds a step of each variant; rounds alternate the order."""
    images, labels = data(batch, side, np.float32)
    steppers = {name: VARIANTS[name](weights) for name in names}
    best = dict.fromkeys(names, float("inf"))
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            step = steppers[name]
            started = time.perf_counter()
            for _ in range(steps):
                result = step(images, labels)
                if result is not None:
                    await result
            if r:  # round 0 warms up
                best[name] = min(best[name], (time.perf_counter() - started) / steps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", type=int, nargs="+", default=[8, 28], help="image sides (even)")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--channels", type=int, default=8, help="of the first convolution; the second has twice")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=float, default=0.3, help="seconds of PyTorch's steps in a round, about")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    versions = f"numpy {np.__version__}"
    if "torch" in args.variants:
        import torch

        torch.set_num_threads(1)
        versions += f", torch {torch.__version__}"
    print(f"# {platform.processor() or platform.machine()}, {versions}")
    print(f"# float32, one thread, channels {args.channels} and {2 * args.channels}, best of {args.rounds} rounds")
    print(f"{'side':>4} {'batch':>5} " + " ".join(f"{n + ' ms':>10}" for n in args.variants) + "  x torch")
    with ThreadpoolController().limit(limits=1, user_api="blas"), ml.settings(workers=1):
        for side in args.sides:
            print(f"# check (float64): largest difference {check(side, args.channels, args.variants):.1e}", flush=True)
            weights = init_weights(side, args.channels, np.float32)
            for batch in args.batches:
                steps = max(1, round(args.work / (2e-4 + 1.6e-8 * batch * side * side * args.channels)))
                best = anyio.run(race, args.variants, weights, batch, side, steps, args.rounds)
                ms = " ".join(f"{best[n] * 1e3:10.3f}" for n in args.variants)
                ratios = ", ".join(f"{n} {best['torch'] / best[n]:.2f}" for n in args.variants if "torch" in best)
                print(f"{side:>4} {batch:>5} {ms}  {ratios}", flush=True)


if __name__ == "__main__":
    main()
