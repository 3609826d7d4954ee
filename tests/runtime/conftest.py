"""Fixtures shared by the runtime's tests."""

from __future__ import annotations

from typing import Any

import pytest

from monadl.deltas import Outer
from monadl.runtime.schedule import batched_records, batched_run


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


@pytest.fixture
def grouped(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The groups that ran batched, their operation and size (so a test knows its case batched)."""
    names: list[tuple[str, int]] = []
    record = batched_records.group_records

    def counted(groups: Any, members: list[Any], *args: Any) -> None:
        names.append((members[0]._op.name, len(members)))
        record(groups, members, *args)

    monkeypatch.setattr(batched_run, "group_records", counted)
    return names
