from __future__ import annotations

from typing import Any

import pytest

from monadl.deltas import Outer


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on both of anyio's backends."""
    return str(request.param)


@pytest.fixture
def outers(monkeypatch: pytest.MonkeyPatch) -> list[Outer]:
    """Every `Outer` made while the test runs (a weight's delta kept as factors), in order."""
    made: list[Outer] = []
    init = Outer.__init__

    def spy(self: Outer, left: Any, right: Any) -> None:
        made.append(self)
        init(self, left, right)

    monkeypatch.setattr(Outer, "__init__", spy)
    return made
