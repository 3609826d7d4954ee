"""Per-operation overhead of monadl against PyTorch eager and a bare NumPy tape.

Two workloads, measured in one run on the same machine:

* chain: forward + backward + one SGD step of a 1,000-op elementwise chain
  on a 16x64 float32 array (ops cycle through *, +, tanh, -);
* mlp: one training step of a 3072 -> 64 -> 64 MLP (ReLU, cross-entropy,
  SGD) at batch 16, float32.

Prints a table: microseconds per step and per op, the ratio to PyTorch, and
minor page faults per step. Run: ``python benchmarks/overhead.py``.
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

import monadl as ml

CHAIN_OPS = 1000
SHAPE = (16, 64)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time(step: Callable[[], None], repeats: int, rounds: int = 5) -> tuple[float, float]:
    """Best-of-rounds mean seconds per step, and minor faults per step."""
    step()
    best = float("inf")
    faults = 0.0
    for _ in range(rounds):
        f0 = _faults()
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        elapsed = (time.perf_counter() - t0) / repeats
        if elapsed < best:
            best = elapsed
            faults = (_faults() - f0) / repeats
    return best, faults


async def _atime(step: Callable[[], Any], repeats: int, rounds: int = 5) -> tuple[float, float]:
    await step()
    best = float("inf")
    faults = 0.0
    for _ in range(rounds):
        f0 = _faults()
        t0 = time.perf_counter()
        for _ in range(repeats):
            await step()
        elapsed = (time.perf_counter() - t0) / repeats
        if elapsed < best:
            best = elapsed
            faults = (_faults() - f0) / repeats
    return best, faults


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


async def run_benchmarks(repeats: int) -> list[tuple[str, str, float, float, int]]:
    rows: list[tuple[str, str, float, float, int]] = []
    lr = 1e-4

    # chain: monadl
    xw = ml.Weight(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32), optimizer=ml.optim.sgd(lr))
    t, f = await _atime(lambda: monadl_chain(xw).train(), repeats)
    rows.append(("chain", "monadl", t, f, CHAIN_OPS))

    # chain: numpy tape
    x0 = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    state = {"x": x0}

    def np_step() -> None:
        state["x"], _ = numpy_chain_step(state["x"], lr)

    t, f = _time(np_step, repeats)
    rows.append(("chain", "numpy tape", t, f, CHAIN_OPS))

    # mlp
    d = mlp_data()
    w1, b1, w2, b2 = (ml.Weight(d[k], optimizer=ml.optim.sgd(0.01)) for k in ("w1", "b1", "w2", "b2"))

    x_in: ml.Array = d["x"]

    def mlp_loss() -> ml.ScalarLayer:
        hidden: ml.ArrayLayer = ml.relu(x_in @ w1 + b1)
        return ml.cross_entropy(hidden @ w2 + b2, d["y"])

    t, f = await _atime(lambda: mlp_loss().train(), repeats * 5)
    rows.append(("mlp", "monadl", t, f, 7))

    p = {k: d[k].copy() for k in ("w1", "b1", "w2", "b2")}

    def np_mlp() -> None:
        x, y = d["x"], d["y"]
        h_pre = x @ p["w1"] + p["b1"]
        h = np.maximum(h_pre, 0)
        logits = h @ p["w2"] + p["b2"]
        z = logits - logits.max(1, keepdims=True)
        soft = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        g = soft
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

    t, f = _time(np_mlp, repeats * 5)
    rows.append(("mlp", "numpy by hand", t, f, 7))

    # branches: four independent 3072 -> 64 -> 64 columns, summed (the paper's
    # multi-column shape): 1 worker thread against 2.
    rng = np.random.default_rng(1)
    xb = rng.standard_normal((16, 3072)).astype(np.float32)
    yb = rng.integers(0, 64, 16)
    for workers in (1, 2):
        cols = [
            (
                ml.Weight((rng.standard_normal((3072, 64)) * 0.02).astype(np.float32), optimizer=ml.optim.sgd(1e-3)),
                ml.Weight((rng.standard_normal((64, 64)) * 0.05).astype(np.float32), optimizer=ml.optim.sgd(1e-3)),
            )
            for _ in range(4)
        ]

        def branches_loss(cols: list[tuple[ml.ArrayWeight, ml.ArrayWeight]] = cols) -> ml.ScalarLayer:
            outs = [ml.relu(ml.relu(xb @ a) @ b) for a, b in cols]
            return ml.cross_entropy(outs[0] + outs[1] + outs[2] + outs[3], yb)

        with ml.settings(workers=workers):
            t, f = await _atime(lambda: branches_loss().train(), repeats * 5)
        rows.append(("branches", f"monadl {workers} thread{'s' if workers > 1 else ''}", t, f, 21))

    try:
        import torch
    except ImportError:
        print("torch not installed: pip install torch==2.13.0 (the bench extra)")
        return rows
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    xt = torch.tensor(x0, requires_grad=True)
    opt = torch.optim.SGD([xt], lr=lr)
    t, f = _time(lambda: torch_chain_step(torch, xt, opt), repeats)
    rows.append(("chain", "pytorch eager", t, f, CHAIN_OPS))

    tp = {k: torch.tensor(d[k], requires_grad=True) for k in ("w1", "b1", "w2", "b2")}
    xt_in, yt = torch.tensor(d["x"]), torch.tensor(d["y"])
    topt = torch.optim.SGD(list(tp.values()), lr=0.01)

    def torch_mlp() -> None:
        hidden = torch.relu(xt_in @ tp["w1"] + tp["b1"])
        loss = torch.nn.functional.cross_entropy(hidden @ tp["w2"] + tp["b2"], yt)
        topt.zero_grad(set_to_none=True)
        loss.backward()
        topt.step()

    t, f = _time(torch_mlp, repeats * 5)
    rows.append(("mlp", "pytorch eager", t, f, 7))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = anyio.run(run_benchmarks, args.repeats)
    peer = {w: t for w, who, t, _, _ in rows if who == "pytorch eager"}
    peer["branches"] = next(t for w, who, t, _, _ in rows if w == "branches")
    print(f"machine: {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    print(f"{'workload':8} {'implementation':17} {'us/step':>10} {'us/op':>8} {'vs torch':>9} {'minflt/step':>12}")
    for workload, who, t, faults, ops in rows:
        ratio = f"{t / peer[workload]:.2f}x" if workload in peer else "-"
        if workload == "branches":
            ratio += " (vs 1 thread)"
        print(f"{workload:8} {who:17} {t * 1e6:10.1f} {t * 1e6 / ops:8.2f} {ratio:>9} {faults:12.1f}")


if __name__ == "__main__":
    main()
