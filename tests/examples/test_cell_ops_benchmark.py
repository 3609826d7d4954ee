"""The cell-ops benchmark runs each body, batched and not (no timing is asserted)."""

from __future__ import annotations

from benchmarks import cell_ops


def test_every_body_runs_batched_and_not() -> None:
    results = cell_ops.timing(rounds=1)
    assert list(results) == list(cell_ops.BODIES)
    for off, on in results.values():
        assert off > 0 and on > 0
