"""Per-operation overhead of monadl against PyTorch eager and a bare NumPy tape.

Three workloads, measured in one run on the same machine:

* chain: forward + backward + one SGD step of a 1,000-op elementwise chain
  on a 16x64 float32 array (ops cycle through *, +, tanh, -);
* mlp: one training step of a 3072 -> 64 -> 64 MLP (ReLU, cross-entropy,
  SGD) at batch 16, float32;
* branches: four independent 3072 -> 64 -> 64 columns summed (the paper's
  multi-column shape, 21 ops), with one worker thread and with two.

Prints a table: microseconds per step and per op, the ratio to PyTorch, and
minor page faults per step. Run: ``python benchmarks/overhead.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

import monadl as ml

CHAIN_OPS = 1000
SHAPE = (16, 64)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


Step = Callable[[], Awaitable[object]]


@dataclass
class Contender:
    workload: str
    name: str
    step: Step
    steps_per_round: int
    ops: int
    workers: int = 1
    best: float = float("inf")
    faults: float = 0.0


async def _race(contenders: list[Contender], rounds: int) -> None:
    """Best-of-rounds seconds per step. Rounds visit the contenders in turn,
    forwards then backwards, so that all of them see the same machine noise."""
    for c in contenders:
        with ml.settings(workers=c.workers):
            await c.step()  # warm up: first-touch allocations, caches
    for r in range(rounds):
        for c in contenders if r % 2 else contenders[::-1]:
            with ml.settings(workers=c.workers):
                f0 = _faults()
                t0 = time.perf_counter()
                for _ in range(c.steps_per_round):
                    await c.step()
                elapsed = (time.perf_counter() - t0) / c.steps_per_round
            if elapsed < c.best:
                c.best = elapsed
                c.faults = (_faults() - f0) / c.steps_per_round


def _sync(step: Callable[[], object]) -> Step:
    async def run() -> object:
        return step()

    return run


# ---- the chain ------------------------------------------------------------------------
def monadl_chain(x: ml.ArrayWeight) -> ml.ScalarLayer:
    y: ml.ArrayLayer = x * 1.0
    for i in range(CHAIN_OPS - 2):
        k = i % 4
        if k == 0:
            y = y * 1.01
        elif k == 1:
            y = y + 0.01
        elif k == 2:
            y = ml.tanh(y)
        else:
            y = y - 0.01
    return ml.sum(y)


def _tanh_backward(out: Any) -> Callable[[Any], Any]:
    return lambda g: g * (1 - out * out)


def numpy_chain_step(x: Any, lr: float) -> Any:
    """A bare closure tape: a list of backward closures, popped in reverse."""
    tape: list[Callable[[Any], Any]] = []
    y = x * 1.0
    tape.append(lambda g: g * 1.0)
    for i in range(CHAIN_OPS - 2):
        k = i % 4
        if k == 0:
            y = y * 1.01
            tape.append(lambda g: g * 1.01)
        elif k == 1:
            y = y + 0.01
            tape.append(lambda g: g)
        elif k == 2:
            out = np.tanh(y)
            tape.append(_tanh_backward(out))
            y = out
        else:
            y = y - 0.01
            tape.append(lambda g: g)
    loss = y.sum()
    g = np.ones_like(y)
    for backward in reversed(tape):
        g = backward(g)
    return x - lr * g, loss


def torch_chain_step(torch: Any, x: Any, opt: Any) -> None:
    y = x * 1.0
    for i in range(CHAIN_OPS - 2):
        k = i % 4
        if k == 0:
            y = y * 1.01
        elif k == 1:
            y = y + 0.01
        elif k == 2:
            y = torch.tanh(y)
        else:
            y = y - 0.01
    loss = y.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


# ---- the MLP --------------------------------------------------------------------------------
def mlp_data(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((16, 3072)).astype(np.float32),
        "y": rng.integers(0, 64, 16),
        "w1": (rng.standard_normal((3072, 64)) * 0.02).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": (rng.standard_normal((64, 64)) * 0.1).astype(np.float32),
        "b2": np.zeros(64, np.float32),
    }


async def run_benchmarks(repeats: int, rounds: int) -> list[Contender]:
    lr = 1e-4
    race: list[Contender] = []

    # chain
    xw = ml.Weight(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32), optimizer=ml.optim.sgd(lr))
    race.append(Contender("chain", "monadl", lambda: monadl_chain(xw).train(), repeats, CHAIN_OPS))
    state = {"x": np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)}

    def np_chain() -> None:
        state["x"], _ = numpy_chain_step(state["x"], lr)

    race.append(Contender("chain", "numpy tape", _sync(np_chain), repeats, CHAIN_OPS))

    # mlp
    d = mlp_data()
    w1, b1, w2, b2 = (ml.Weight(d[k], optimizer=ml.optim.sgd(0.01)) for k in ("w1", "b1", "w2", "b2"))
    x_in: ml.Array = d["x"]

    def mlp_loss() -> ml.ScalarLayer:
        hidden: ml.ArrayLayer = ml.relu(x_in @ w1 + b1)
        return ml.cross_entropy(hidden @ w2 + b2, d["y"])

    race.append(Contender("mlp", "monadl", lambda: mlp_loss().train(), repeats * 5, 7))
    p = {k: d[k].copy() for k in ("w1", "b1", "w2", "b2")}

    def np_mlp() -> None:
        x, y = d["x"], d["y"]
        h_pre = x @ p["w1"] + p["b1"]
        h = np.maximum(h_pre, 0)
        logits = h @ p["w2"] + p["b2"]
        z = logits - logits.max(1, keepdims=True)
        g = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        g[np.arange(16), y] -= 1
        g /= 16
        gw2 = h.T @ g
        gb2 = g.sum(0)
        gh = (g @ p["w2"].T) * (h_pre > 0)
        gw1 = x.T @ gh
        gb1 = gh.sum(0)
        p["w1"] = p["w1"] - 0.01 * gw1
        p["b1"] = p["b1"] - 0.01 * gb1
        p["w2"] = p["w2"] - 0.01 * gw2
        p["b2"] = p["b2"] - 0.01 * gb2

    race.append(Contender("mlp", "numpy by hand", _sync(np_mlp), repeats * 5, 7))

    # branches: four independent 3072 -> 64 -> 64 columns, summed (the paper's
    # multi-column shape), 1 worker thread against 2.
    rng = np.random.default_rng(1)
    xb = rng.standard_normal((16, 3072)).astype(np.float32)
    yb = rng.integers(0, 64, 16)
    cols = [
        (
            ml.Weight((rng.standard_normal((3072, 64)) * 0.02).astype(np.float32), optimizer=ml.optim.sgd(1e-3)),
            ml.Weight((rng.standard_normal((64, 64)) * 0.05).astype(np.float32), optimizer=ml.optim.sgd(1e-3)),
        )
        for _ in range(4)
    ]

    def branches_loss() -> ml.ScalarLayer:
        outs = [ml.relu(ml.relu(xb @ a) @ b) for a, b in cols]
        return ml.cross_entropy(outs[0] + outs[1] + outs[2] + outs[3], yb)

    for workers in (1, 2):
        name = f"monadl {workers} thread{'s' if workers > 1 else ''}"
        race.append(Contender("branches", name, lambda: branches_loss().train(), repeats * 5, 21, workers))

    try:
        import torch
    except ImportError:
        print("torch not installed: pip install torch==2.13.0 (the bench extra)")
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        xt = torch.tensor(state["x"], requires_grad=True)
        opt = torch.optim.SGD([xt], lr=lr)
        race.append(
            Contender("chain", "pytorch eager", _sync(lambda: torch_chain_step(torch, xt, opt)), repeats, CHAIN_OPS)
        )
        tp = {k: torch.tensor(d[k], requires_grad=True) for k in ("w1", "b1", "w2", "b2")}
        xt_in, yt = torch.tensor(d["x"]), torch.tensor(d["y"])
        topt = torch.optim.SGD(list(tp.values()), lr=0.01)

        def torch_mlp() -> None:
            hidden = torch.relu(xt_in @ tp["w1"] + tp["b1"])
            loss = torch.nn.functional.cross_entropy(hidden @ tp["w2"] + tp["b2"], yt)
            topt.zero_grad(set_to_none=True)
            loss.backward()
            topt.step()

        race.append(Contender("mlp", "pytorch eager", _sync(torch_mlp), repeats * 5, 7))
    await _race(race, rounds)
    return race


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=20, help="steps per round (x5 for the small workloads)")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    race = anyio.run(run_benchmarks, args.repeats, args.rounds)
    peer = {c.workload: c.best for c in race if c.name == "pytorch eager"}
    peer["branches"] = next(c.best for c in race if c.workload == "branches")
    print(
        f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        f"python {platform.python_version()}, numpy {np.__version__}"
    )
    print(f"{'workload':8} {'implementation':17} {'us/step':>10} {'us/op':>8} {'ratio':>22} {'minflt/step':>12}")
    for workload in ("chain", "mlp", "branches"):
        for c in (c for c in race if c.workload == workload):
            against = "1 thread" if workload == "branches" else "pytorch"
            ratio = f"{c.best / peer[workload]:.2f}x vs {against}" if workload in peer else "-"
            print(
                f"{workload:8} {c.name:17} {c.best * 1e6:10.1f} {c.best * 1e6 / c.ops:8.2f} {ratio:>22} {c.faults:12.1f}"
            )


if __name__ == "__main__":
    main()
