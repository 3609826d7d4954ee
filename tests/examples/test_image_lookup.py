"""Image-Lookup (EstiNet) at a small, seeded size: the table can be swapped at inference."""

from __future__ import annotations

import anyio
import numpy as np

from examples import image_lookup


def test_a_different_table_at_inference_answers_as_well_as_the_trained_one() -> None:
    args = image_lookup.parse(
        ["--k", "2", "--steps", "800", "--pretrain-steps", "800", "--test-count", "1000", "--sampling", "offline"]
    )
    estinet, end_to_end = anyio.run(image_lookup.run, args, False)
    assert estinet.name == "EstiNet (offline)" and end_to_end.name == "end-to-end"
    assert estinet.digit_accuracy is not None and estinet.digit_accuracy > 0.8  # digits learned from lookups alone
    assert estinet.accuracy > 0.8
    assert abs(estinet.swapped - estinet.accuracy) <= 0.02  # the claim: within 2 points
    # The end-to-end network learned the first table, and knows nothing of the second.
    assert end_to_end.accuracy > 0.5 and end_to_end.swapped < 0.3
    assert "table 2" in image_lookup.table([estinet, end_to_end])


def test_the_black_box_and_its_edge_samples() -> None:
    table = np.arange(100).reshape(10, 10) % 10
    one_hots = np.eye(10)[np.array([[3, 4], [9, 0]])]
    np.testing.assert_array_equal(image_lookup.look_up(table, one_hots), [4, 0])
    inputs, targets = image_lookup.edge_samples(table, 2, 64, np.random.default_rng(0))
    assert inputs.shape == (64, 2, 10) and targets.shape == (64, 10)
    np.testing.assert_allclose(inputs.sum(axis=-1), 1.0)  # each position a distribution over digits
    np.testing.assert_allclose(targets.sum(axis=-1), 1.0)
    assert ((inputs > 0) & (inputs < 1)).any(axis=(1, 2)).mean() > 0.5  # mostly strictly between one-hots
