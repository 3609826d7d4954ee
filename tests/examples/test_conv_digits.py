"""The conv-net example learns the digits (a reduced run: 5 epochs instead of 10)."""

from __future__ import annotations

import numpy as np
import pytest

from examples import conv_digits


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.anyio
async def test_a_small_conv_net_reads_the_digits(seed: int) -> None:
    # 5 epochs reach 0.93-0.98 over seeds 0-9; chance is 0.1.
    result = await conv_digits.run(epochs=5, seed=seed, show_progress=False)
    assert result.test_accuracy >= 0.9
    first, last = np.mean(result.losses[:10]), np.mean(result.losses[-10:])
    assert last < 0.2 * first


def test_the_network_has_the_shapes_of_its_docstring() -> None:
    model = conv_digits.ConvNet.create(np.random.default_rng(0), channels=4)
    assert model.conv1.data.shape == (4, 1, 3, 3)
    assert model.conv2.data.shape == (8, 4, 3, 3)
    assert model.readout.data.shape == (8 * 3 * 3, 10)  # 8 -> 8 (padded) -> 6 -> pooled to 3
