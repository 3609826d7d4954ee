"""Every test in this folder runs an example or a benchmark at a small size: marked `slow`
(``pytest -m "not slow"`` skips them; ``make test`` runs them all)."""

from __future__ import annotations

import pathlib
from collections.abc import Generator
from typing import Any

import pytest

from monadl.runtime.evaluation import Evaluation
from monadl.runtime.schedule import fibers

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def merged(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many fibers (examples) each merged run of the test took, in order."""
    counts: list[int] = []
    run = fibers.run

    def counting(ev: Evaluation, parked: fibers.Parked) -> Generator[Any, Any, list[Any]]:
        counts.append(len(parked.fibers))
        return (yield from run(ev, parked))

    monkeypatch.setattr(fibers, "run", counting)
    return counts
