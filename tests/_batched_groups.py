"""Which groups a batched run computed as one kernel: for tests that assert
that batching really happened, not only that values agree."""

from __future__ import annotations

from typing import Any

import pytest

from monadl.runtime.schedule import batched_run


def groups_run(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """A list that each group run batched from now on adds to: its
    primitive's name and its size."""
    ran: list[tuple[str, int]] = []
    group = batched_run.Run.group

    def counting(self: Any, members: list[Any], numbers_stack: bool = True) -> None:
        before = self.batches
        group(self, members, numbers_stack)
        if self.batches > before:
            ran.append((members[0]._op.name, len(members)))

    monkeypatch.setattr(batched_run.Run, "group", counting)
    return ran
