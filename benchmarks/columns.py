"""The paper's benchmark: a multi-column network for CIFAR-100-shaped data.

n columns of two dense layers (64 outputs, ReLU) read the 3072 input
features; their outputs are summed; a coarse classifier (dense to 20) and 20
fine classifiers (dense 64, ReLU, dense 64, ReLU, dense to 5) read the sum.
Each mini-batch (16 samples, SGD) holds samples of one coarse class.

* **skip**: only the matched fine classifier is part of the loss (the coarse
  cross-entropy plus the matched classifier's over its 5 classes); the 19
  others are never evaluated. This is the dynamic network.
* **all**: all 20 fine classifiers run; their 100 logits form one softmax over
  the 100 fine classes (so every classifier takes part in the loss).

The same model is written three times, monadl, PyTorch eager (``nn.Module`` +
``optim.SGD``) and NumPy by hand; before timing, one step from identical
weights must give the same loss and the same updated weights (within 1e-5) in
all three. Then each is timed in trained mini-batches per second over a grid
of columns x threads x {skip, all}. The data is synthetic (no dataset can be
downloaded here): class-dependent Gaussian means in 3072 dimensions.

Run: ``python benchmarks/columns.py`` (``--help`` for the grid and sizes).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from threadpoolctl import ThreadpoolController

import monadl as ml

CORES = len(os.sched_getaffinity(0))
FEATURES = 3072
COARSE = 20
FINE = 5


@dataclass
class Config:
    columns: int
    hidden: int = 64
    batch: int = 16
    learning_rate: float = 0.01


def init_weights(config: Config, seed: int = 0) -> dict[str, ml.Array]:
    """One set of float32 weights, shared by all three implementations."""
    rng = np.random.default_rng(seed)
    h = config.hidden

    def dense(name: str, n_in: int, n_out: int, out: dict[str, ml.Array]) -> None:
        out[name + ".w"] = (rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in)).astype(np.float32)
        out[name + ".b"] = np.zeros(n_out, np.float32)

    weights: dict[str, ml.Array] = {}
    for c in range(config.columns):
        dense(f"col{c}.0", FEATURES, h, weights)
        dense(f"col{c}.1", h, h, weights)
    dense("coarse", h, COARSE, weights)
    for f in range(COARSE):
        dense(f"fine{f}.0", h, h, weights)
        dense(f"fine{f}.1", h, h, weights)
        dense(f"fine{f}.2", h, FINE, weights)
    return weights


def make_batches(config: Config, count: int, seed: int = 1) -> list[tuple[ml.Array, int, ml.Array]]:
    """Mini-batches of one coarse class each: (x, coarse class, fine labels)."""
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((COARSE * FINE, FEATURES)).astype(np.float32)
    batches = []
    for i in range(count):
        coarse = i % COARSE
        fine = rng.integers(0, FINE, config.batch)
        x = means[coarse * FINE + fine] + rng.standard_normal((config.batch, FEATURES)).astype(np.float32)
        batches.append((x, coarse, fine))
    return batches


# ---- monadl ----------------------------------------------------------------------------------
class MonadlColumns:
    def __init__(self, config: Config, weights: dict[str, ml.Array]) -> None:
        self.config = config
        self.w = {k: ml.Weight(v.copy(), optimizer=ml.optim.sgd(config.learning_rate)) for k, v in weights.items()}

    def dense(self, name: str, x: ml.ArrayOperand) -> ml.ArrayLayer:
        return ml.dense(x, self.w[name + ".w"], self.w[name + ".b"])

    def fine_logits(self, f: int, summed: ml.ArrayLayer) -> ml.ArrayLayer:
        h = ml.relu(self.dense(f"fine{f}.0", summed))
        h = ml.relu(self.dense(f"fine{f}.1", h))
        return self.dense(f"fine{f}.2", h)

    def loss(self, x: ml.Array, coarse: int, fine: ml.Array, skip: bool) -> ml.ScalarLayer:
        columns = [
            ml.relu(self.dense(f"col{c}.1", ml.relu(self.dense(f"col{c}.0", x)))) for c in range(self.config.columns)
        ]
        summed = columns[0]
        for column in columns[1:]:
            summed = summed + column
        labels = fine * 0 + coarse  # in the library (and on the device) of the data
        coarse_loss = ml.cross_entropy(self.dense("coarse", summed), labels)
        if skip:
            return coarse_loss + ml.cross_entropy(self.fine_logits(coarse, summed), fine)
        every = ml.concatenate([self.fine_logits(f, summed) for f in range(COARSE)], axis=1)
        return coarse_loss + ml.cross_entropy(every, coarse * FINE + fine)

    def weights(self) -> dict[str, ml.Array]:
        return {k: w.data for k, w in self.w.items()}


# ---- NumPy by hand ------------------------------------------------------------------------------
class NumpyColumns:
    def __init__(self, config: Config, weights: dict[str, ml.Array]) -> None:
        self.config = config
        self.w = {k: v.copy() for k, v in weights.items()}

    @staticmethod
    def _softmax_ce(logits: ml.Array, labels: ml.Array) -> tuple[float, ml.Array]:
        z = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        p = e / e.sum(axis=1, keepdims=True)
        n = len(labels)
        loss = float(-np.mean(np.log(p[np.arange(n), labels])))
        grad = p
        grad[np.arange(n), labels] -= 1.0
        return loss, grad / n

    def step(self, x: ml.Array, coarse: int, fine: ml.Array, skip: bool) -> float:
        w, lr, cols = self.w, self.config.learning_rate, self.config.columns
        grads: dict[str, ml.Array] = {}
        pre0, act0, pre1, act1 = [], [], [], []
        for c in range(cols):
            pre0.append(x @ w[f"col{c}.0.w"] + w[f"col{c}.0.b"])
            act0.append(np.maximum(pre0[-1], 0))
            pre1.append(act0[-1] @ w[f"col{c}.1.w"] + w[f"col{c}.1.b"])
            act1.append(np.maximum(pre1[-1], 0))
        summed = sum(act1[1:], act1[0])
        labels = np.full(len(fine), coarse)
        loss, g_coarse = self._softmax_ce(summed @ w["coarse.w"] + w["coarse.b"], labels)
        grads["coarse.w"], grads["coarse.b"] = summed.T @ g_coarse, g_coarse.sum(0)
        g_summed = g_coarse @ w["coarse.w"].T
        heads = [coarse] if skip else list(range(COARSE))
        caches = []
        for f in heads:
            p0 = summed @ w[f"fine{f}.0.w"] + w[f"fine{f}.0.b"]
            a0 = np.maximum(p0, 0)
            p1 = a0 @ w[f"fine{f}.1.w"] + w[f"fine{f}.1.b"]
            a1 = np.maximum(p1, 0)
            caches.append((f, p0, a0, p1, a1, a1 @ w[f"fine{f}.2.w"] + w[f"fine{f}.2.b"]))
        if skip:
            fine_loss, g_logits = self._softmax_ce(caches[0][5], fine)
            g_heads = [g_logits]
        else:
            fine_loss, g_all = self._softmax_ce(np.concatenate([c[5] for c in caches], axis=1), coarse * FINE + fine)
            g_heads = [g_all[:, FINE * i : FINE * (i + 1)] for i in range(COARSE)]
        loss += fine_loss
        for (f, p0, a0, p1, a1, _), g in zip(caches, g_heads):
            grads[f"fine{f}.2.w"], grads[f"fine{f}.2.b"] = a1.T @ g, g.sum(0)
            g = (g @ w[f"fine{f}.2.w"].T) * (p1 > 0)
            grads[f"fine{f}.1.w"], grads[f"fine{f}.1.b"] = a0.T @ g, g.sum(0)
            g = (g @ w[f"fine{f}.1.w"].T) * (p0 > 0)
            grads[f"fine{f}.0.w"], grads[f"fine{f}.0.b"] = summed.T @ g, g.sum(0)
            g_summed = g_summed + g @ w[f"fine{f}.0.w"].T
        for c in range(cols):
            g = g_summed * (pre1[c] > 0)
            grads[f"col{c}.1.w"], grads[f"col{c}.1.b"] = act0[c].T @ g, g.sum(0)
            g = (g @ w[f"col{c}.1.w"].T) * (pre0[c] > 0)
            grads[f"col{c}.0.w"], grads[f"col{c}.0.b"] = x.T @ g, g.sum(0)
        for k, g in grads.items():
            w[k] -= lr * g  # in place: the fastest step written by hand
        return loss


# ---- PyTorch eager ------------------------------------------------------------------------------
def torch_columns(
    config: Config, weights: dict[str, ml.Array], device: str = "cpu"
) -> tuple[Any, Any, Callable[..., Any]]:
    import torch
    from torch import nn

    class Columns(nn.Module):  # type: ignore[misc]  # torch is untyped here (skipped by mypy)
        def __init__(self) -> None:
            super().__init__()
            h = config.hidden
            self.columns = nn.ModuleList(
                nn.Sequential(nn.Linear(FEATURES, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
                for _ in range(config.columns)
            )
            self.coarse = nn.Linear(h, COARSE)
            self.fine = nn.ModuleList(
                nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, FINE))
                for _ in range(COARSE)
            )

        def forward(self, x: Any, coarse: int, fine: Any, skip: bool) -> Any:
            summed = sum(column(x) for column in self.columns)
            labels = torch.full((len(fine),), coarse, device=fine.device)
            loss = nn.functional.cross_entropy(self.coarse(summed), labels)
            if skip:
                return loss + nn.functional.cross_entropy(self.fine[coarse](summed), fine)
            every = torch.cat([head(summed) for head in self.fine], dim=1)
            return loss + nn.functional.cross_entropy(every, coarse * FINE + fine)

    model = Columns()
    with torch.no_grad():
        for c, column in enumerate(model.columns):
            for i, layer in ((0, column[0]), (1, column[2])):
                layer.weight.copy_(torch.from_numpy(weights[f"col{c}.{i}.w"].T))
                layer.bias.copy_(torch.from_numpy(weights[f"col{c}.{i}.b"]))
        model.coarse.weight.copy_(torch.from_numpy(weights["coarse.w"].T))
        model.coarse.bias.copy_(torch.from_numpy(weights["coarse.b"]))
        for f, head in enumerate(model.fine):
            for i, layer in ((0, head[0]), (1, head[2]), (2, head[4])):
                layer.weight.copy_(torch.from_numpy(weights[f"fine{f}.{i}.w"].T))
                layer.bias.copy_(torch.from_numpy(weights[f"fine{f}.{i}.b"]))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)

    def tensor(a: Any) -> Any:  # batches may already be tensors on the device
        return a if isinstance(a, torch.Tensor) else torch.from_numpy(a).to(device)

    def step(x: ml.Array, coarse: int, fine: ml.Array, skip: bool) -> float:
        loss = model(tensor(x), coarse, tensor(fine), skip)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def exported() -> dict[str, ml.Array]:
        out: dict[str, ml.Array] = {}
        for c, column in enumerate(model.columns):
            for i, layer in ((0, column[0]), (1, column[2])):
                out[f"col{c}.{i}.w"] = layer.weight.detach().numpy().T
                out[f"col{c}.{i}.b"] = layer.bias.detach().numpy()
        out["coarse.w"] = model.coarse.weight.detach().numpy().T
        out["coarse.b"] = model.coarse.bias.detach().numpy()
        for f, head in enumerate(model.fine):
            for i, layer in ((0, head[0]), (1, head[2]), (2, head[4])):
                out[f"fine{f}.{i}.w"] = layer.weight.detach().numpy().T
                out[f"fine{f}.{i}.b"] = layer.bias.detach().numpy()
        return out

    return torch, step, exported


# ---- check, then time -------------------------------------------------------------------------------
def check_equivalence(config: Config, skip: bool, with_torch: bool) -> float:
    """One step from identical weights in each implementation: the largest
    difference in loss or any updated weight (raises above 1e-5)."""
    weights = init_weights(config)
    x, coarse, fine = make_batches(config, 1)[0]
    m = MonadlColumns(config, weights)
    monadl_loss = float(anyio.run(m.loss(x, coarse, fine, skip).train))
    n = NumpyColumns(config, weights)
    numpy_loss = n.step(x, coarse, fine, skip)
    results = [(numpy_loss, n.w)]
    if with_torch:
        _, torch_step, exported = torch_columns(config, weights)
        results.append((torch_step(x, coarse, fine, skip), exported()))
    worst = 0.0
    for loss, updated in results:
        worst = max(worst, abs(loss - monadl_loss))
        for k, v in m.weights().items():
            worst = max(worst, float(np.max(np.abs(v - updated[k]))))
    if worst > 1e-5:
        raise AssertionError(f"implementations disagree by {worst:.2e} (columns={config.columns}, skip={skip})")
    return worst


async def _race(
    steps: dict[tuple[str, int], Callable[[], Any]], threads: dict[tuple[str, int], int], seconds: float, rounds: int
) -> dict[tuple[str, int], float]:
    """Best-of-rounds mini-batches per second. Rounds visit every contender in
    turn (forwards, then backwards) so that all see the same machine noise."""
    controller = ThreadpoolController()
    best = dict.fromkeys(steps, 0.0)
    keys = list(steps)
    for r in range(rounds + 1):
        for key in keys if r % 2 else keys[::-1]:
            # BLAS and PyTorch get at most one thread per core: more only makes
            # their spinning threads fight (4 on 2 cores ran 100x slower here).
            # monadl caps BLAS by itself, at cores // workers per branch.
            blas = min(threads[key], CORES)
            with ml.settings(workers=threads[key]), controller.limit(limits=blas, user_api="blas"):
                count, started = 0, time.perf_counter()
                while True:
                    result = steps[key]()
                    if hasattr(result, "__await__"):
                        await result
                    count += 1
                    elapsed = time.perf_counter() - started
                    if elapsed >= seconds / rounds:
                        break
            if r:  # round 0 warms up
                best[key] = max(best[key], count / elapsed)
    return best


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        torch = None
        print("torch not installed: pip install torch==2.13.0 (the bench extra); timing monadl and NumPy only")
    rows = []
    for columns in args.columns:
        config = Config(columns, hidden=args.hidden, batch=args.batch)
        for skip in (True, False):
            worst = check_equivalence(config, skip, torch is not None)
            batches = make_batches(config, 2 * COARSE)
            steps: dict[tuple[str, int], Callable[[], Any]] = {}
            threads: dict[tuple[str, int], int] = {}
            for t in args.threads:
                weights = init_weights(config)
                cursor = iter(range(10**9))

                def batch(
                    cursor: Iterator[int] = cursor, batches: list[tuple[ml.Array, int, ml.Array]] = batches
                ) -> tuple[ml.Array, int, ml.Array]:
                    return batches[next(cursor) % len(batches)]

                model = MonadlColumns(config, weights)
                numpy_model = NumpyColumns(config, weights)

                Batch = Callable[[], tuple[ml.Array, int, ml.Array]]

                def monadl_in(model: MonadlColumns = model, batch: Batch = batch, skip: bool = skip) -> Any:
                    x, coarse, fine = batch()
                    return model.loss(x, coarse, fine, skip).train()

                def numpy_in(numpy_model: NumpyColumns = numpy_model, batch: Batch = batch, skip: bool = skip) -> float:
                    x, coarse, fine = batch()
                    return numpy_model.step(x, coarse, fine, skip)

                steps["monadl", t] = monadl_in
                steps["numpy", t] = numpy_in
                if torch is not None:
                    _, torch_step, _ = torch_columns(config, weights)

                    def torch_in(
                        t: int = t, torch_step: Any = torch_step, batch: Any = batch, skip: bool = skip
                    ) -> float:
                        torch.set_num_threads(min(t, CORES))
                        return float(torch_step(*batch(), skip))

                    steps["torch", t] = torch_in
                for who in ("monadl", "numpy", "torch"):
                    threads[who, t] = t
            rates = anyio.run(_race, steps, threads, args.seconds, args.rounds)
            for t in args.threads:
                row = {"columns": columns, "threads": t, "skip": skip, "agree": worst}
                row.update({who: rates[who, t] for who in ("monadl", "numpy", "torch") if (who, t) in rates})
                rows.append(row)
                print(_format(row), flush=True)
    return rows


HEADER = (
    f"{'columns':>7} {'threads':>7} {'mode':>5} {'monadl':>9} {'pytorch':>9} {'numpy':>9} {'monadl/pytorch':>15} "
    f"{'monadl/numpy':>13} {'agree':>9}"
)


def _format(row: dict[str, Any]) -> str:
    torch_rate = row.get("torch")
    ratio = f"{row['monadl'] / torch_rate:.2f}x" if torch_rate else "-"
    torch_text = f"{torch_rate:9.2f}" if torch_rate else f"{'-':>9}"
    return (
        f"{row['columns']:7d} {row['threads']:7d} {'skip' if row['skip'] else 'all':>5} {row['monadl']:9.2f} "
        f"{torch_text} {row['numpy']:9.2f} {ratio:>15} {row['monadl'] / row['numpy']:12.2f}x {row['agree']:9.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="The paper's multi-column benchmark: trained mini-batches per second.")
    parser.add_argument("--columns", type=int, nargs="+", default=[4, 2, 1])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--seconds", type=float, default=1.5, help="timing per implementation and cell, over all rounds"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, python {platform.python_version()}, "
        f"numpy {np.__version__}; hidden {args.hidden}, batch {args.batch}; mini-batches per second"
    )
    print(HEADER)
    run_grid(args)


if __name__ == "__main__":
    main()
