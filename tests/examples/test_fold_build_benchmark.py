"""`benchmarks.fold_build` measures what it says: its three variants give
the same loss and gradients, and only its "path only" variant takes the
loom's general path for the calls on rows."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import fold_build
from tests.fold.test_loom_recorders import counted


def test_the_variants_agree_and_recorders_take_the_calls_on_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fold_build.Model()
    rng = np.random.default_rng(1)
    trees = [fold_build.make_tree(rng, 3) for _ in range(8)]
    assert fold_build.check(model, trees) <= 1e-12
    nodes = sum(map(fold_build.size, trees))
    calls = 2 * nodes - len(trees)  # (a cell's call a leaf, an operator, and a child of each)
    counts = []
    for on in (True, False):
        with counted(monkeypatch) as paths, fold_build.recorders(on):
            model.fold_loss(trees)
        counts.append(paths[0])
    assert counts[0] <= 6 and counts[1] == calls  # (the first calls of each structure; every call)
