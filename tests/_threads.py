"""Training from several threads at once, each with its own event loop: how
the tests show that commits are atomic (no update lost, none taken twice)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio


def train_in_threads(loss: Callable[[], Any], steps: int, threads: int = 2) -> None:
    """``steps`` ``train()``s of ``loss()`` in each of ``threads`` threads, each its own event loop."""

    def trainer() -> None:
        async def loop() -> None:
            for _ in range(steps):
                await loss().train()

        anyio.run(loop)

    running = [threading.Thread(target=trainer) for _ in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join()
