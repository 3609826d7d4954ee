"""Every test in this folder runs an example or a benchmark at a small size: marked `slow`
(``pytest -m "not slow"`` skips them; ``make test`` runs them all)."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
