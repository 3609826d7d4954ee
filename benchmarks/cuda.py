"""monadl on CuPy against PyTorch CUDA eager, in one run on one GPU.

Three workloads, each timed as whole training steps (the step's loss read
back, so the GPU's work is inside the time), rounds alternating between
contenders:

* chain: the op-overhead chain of ``overhead.py`` (1,000 elementwise ops on
  16x64 float32), forward + backward + SGD;
* columns: the paper's multi-column network (``columns.py``), 4 columns,
  skipping unmatched fine classifiers, at batch 16 and batch 256;
* streams: two large independent branches (a chain of 4096x4096 matmuls
  each), on one CUDA stream against one stream per branch.

Needs CuPy (``pip install -e '.[cuda,bench]'``) and a CUDA build of PyTorch
for the peer; without PyTorch CUDA the peer rows are left out. Run:
``python -m benchmarks.cuda``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

import monadl as ml
from benchmarks.columns import COARSE, FINE, Config, MonadlColumns, init_weights, make_batches, torch_columns

Step = Callable[[], Awaitable[float]]


async def _race(contenders: dict[str, Step], seconds: float, rounds: int) -> dict[str, float]:
    """Best-of-rounds milliseconds per step; round 0 warms up."""
    best = dict.fromkeys(contenders, float("inf"))
    names = list(contenders)
    for r in range(rounds + 1):
        for name in names if r % 2 else names[::-1]:
            count, started = 0, time.perf_counter()
            while True:
                await contenders[name]()
                count += 1
                elapsed = time.perf_counter() - started
                if elapsed >= seconds / rounds:
                    break
            if r:
                best[name] = min(best[name], 1e3 * elapsed / count)
    return best


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def chain(cupy: Any, torch: Any) -> dict[str, Step]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w0 = rng.standard_normal((16, 64)).astype(np.float32) * 0.1
    xg = cupy.asarray(x)
    w = ml.Weight(cupy.asarray(w0), optimizer=ml.optim.sgd(1e-3))

    def build() -> ml.ScalarLayer:
        h = w * ml.as_layer(xg)
        for i in range(998):
            k = i % 4
            h = h * 0.9 if k == 0 else (h + ml.as_layer(xg) if k == 1 else (ml.tanh(h) if k == 2 else h - 0.1))
        return ml.sum(h)

    async def monadl_step() -> float:
        return float(await build().train())

    contenders: dict[str, Step] = {"monadl (cupy)": monadl_step}
    if torch is not None:
        xt = torch.from_numpy(x).cuda()
        wt = torch.from_numpy(w0).cuda().requires_grad_()
        opt = torch.optim.SGD([wt], lr=1e-3)

        async def torch_step() -> float:
            h = wt * xt
            for i in range(998):
                k = i % 4
                h = h * 0.9 if k == 0 else (h + xt if k == 1 else (torch.tanh(h) if k == 2 else h - 0.1))
            loss = h.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return float(loss)

        contenders["pytorch cuda eager"] = torch_step
    return contenders


def columns(cupy: Any, torch: Any, batch: int) -> dict[str, Step]:
    config = Config(columns=4, batch=batch)
    weights = init_weights(config)
    batches = make_batches(config, 8)
    model = MonadlColumns(config, {k: cupy.asarray(v) for k, v in weights.items()})
    gpu_batches = [(cupy.asarray(x), coarse, cupy.asarray(fine)) for x, coarse, fine in batches]
    cursor = [0]

    async def monadl_step() -> float:
        x, coarse, fine = gpu_batches[cursor[0] % len(gpu_batches)]
        cursor[0] += 1
        return float(await model.loss(x, coarse, fine, True).train())

    contenders: dict[str, Step] = {"monadl (cupy)": monadl_step}
    if torch is not None:
        _, step, _ = torch_columns(config, weights, device="cuda")
        torch_batches = [
            (torch.from_numpy(x).cuda(), coarse, torch.from_numpy(fine).cuda()) for x, coarse, fine in batches
        ]

        async def torch_step() -> float:
            x, coarse, fine = torch_batches[cursor[0] % len(torch_batches)]
            cursor[0] += 1
            return float(step(x, coarse, fine, True))

        contenders["pytorch cuda eager"] = torch_step
    assert COARSE * FINE == 100
    return contenders


def streams(cupy: Any, size: int, depth: int) -> dict[str, Step]:
    rng = np.random.default_rng(0)
    ws = [
        ml.Weight(cupy.asarray((rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)))
        for _ in range(2)
    ]
    x = ml.as_layer(cupy.asarray(rng.standard_normal((size, size)).astype(np.float32)))

    def build() -> ml.ScalarLayer:
        branches = []
        for w in ws:
            h = x
            for _ in range(depth):
                h = ml.tanh(h @ w)
            branches.append(ml.sum(h))
        return branches[0] + branches[1]

    def on(count: int) -> Step:
        async def step() -> float:
            with ml.settings(cuda_streams=count):
                return float(await build().predict())

        return step

    return {"1 stream": on(1), "2 streams": on(2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per contender and workload")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    try:
        import cupy
    except ImportError:
        raise SystemExit("benchmarks/cuda.py needs CuPy and a CUDA GPU: pip install -e '.[cuda,bench]'") from None

    torch = _torch_cuda()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()}; cupy {cupy.__version__}; torch {getattr(torch, '__version__', 'absent')}")
    workloads: list[tuple[str, dict[str, Step]]] = [
        ("chain 1000 ops", chain(cupy, torch)),
        ("columns b16", columns(cupy, torch, 16)),
        ("columns b256", columns(cupy, torch, 256)),
        ("streams 2x(8 matmuls 4096)", streams(cupy, 4096, 8)),
    ]
    print(f"{'workload':28} {'implementation':22} {'ms/step':>9} {'speed vs last row':>18}")
    for name, contenders in workloads:
        times = anyio.run(_race, contenders, args.seconds, args.rounds)
        reference = list(times.values())[-1]
        for who, ms in times.items():
            print(f"{name:28} {who:22} {ms:9.3f} {reference / ms:17.2f}x")


if __name__ == "__main__":
    main()
