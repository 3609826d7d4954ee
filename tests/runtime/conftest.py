"""Fixtures shared by the runtime's tests."""

from __future__ import annotations

from typing import Any

import pytest

from monadl.deltas import Outer


@pytest.fixture
def outer_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every factor that a weight's `Outer` multiplies out, in order."""
    rows: list[int] = []
    dense = Outer.dense

    def counting(self: Outer) -> Any:
        rows.extend(left.shape[0] for left in self.lefts)
        return dense(self)

    monkeypatch.setattr(Outer, "dense", counting)
    return rows
