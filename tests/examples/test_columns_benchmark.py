"""The columns benchmark's models agree before anything is timed."""

from __future__ import annotations

import pytest

from benchmarks import columns


@pytest.mark.parametrize("skip", [True, False])
def test_monadl_and_numpy_take_the_same_step(skip: bool) -> None:
    worst = columns.check_equivalence(columns.Config(2), skip, with_torch=False)
    assert worst < 1e-5


def test_all_mode_trains_every_fine_classifier_and_skip_mode_one() -> None:
    import anyio
    import numpy as np

    config = columns.Config(1)
    weights = columns.init_weights(config)
    x, coarse, fine = columns.make_batches(config, 1)[0]
    for skip, touched in ((True, {coarse}), (False, set(range(columns.COARSE)))):
        model = columns.MonadlColumns(config, weights)
        anyio.run(model.loss(x, coarse, fine, skip).train)
        changed = {
            f
            for f in range(columns.COARSE)
            if not np.array_equal(model.w[f"fine{f}.2.w"].data, weights[f"fine{f}.2.w"])
        }
        assert changed == touched
