"""The README's demo, small: a dynamic gated network on scikit-learn's digits."""

from __future__ import annotations

import os

import anyio
import numpy as np
import pytest

from examples import digits

pytestmark = pytest.mark.anyio


async def test_small_demo_reaches_accuracy_and_plots(tmp_path: object) -> None:
    result = await digits.run(epochs=5, show_progress=False)
    assert result.test_accuracy >= 0.85
    assert result.losses[-1] < result.losses[0]
    path = os.path.join(str(tmp_path), "curve.png")
    digits.plot(result, path)
    assert (await anyio.Path(path).read_bytes())[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_training_step_skips_the_unmatched_fine_classifiers() -> None:
    x_train, y_train, _, _ = digits.load_digits()
    model = digits.GatedDigits()
    rows = np.flatnonzero(y_train // 2 == 3)[:16]
    before = [[d.weight.data.copy() for d in pair] for pair in model.fine]
    await model.training_loss(x_train[rows], y_train[rows]).train()
    for group, pair in enumerate(model.fine):
        changed = [not np.array_equal(d.weight.data, b) for d, b in zip(pair, before[group])]
        assert changed == ([True, True] if group == 3 else [False, False]), group


async def test_routed_scores_match_choosing_by_hand() -> None:
    _, _, x_test, _ = digits.load_digits()
    model = digits.GatedDigits(seed=3)
    x = x_test[:40]
    routed = await model.digit_scores(x).predict()
    hidden = model.hidden(x)
    groups = np.argmax(await model.coarse(hidden).predict(), axis=1)
    assert len(set(groups.tolist())) > 1  # the batch really is split
    for group in range(digits.GROUPS):
        fine = await model.fine_logits(group, hidden).predict()
        log_probs = fine - np.log(np.exp(fine).sum(axis=1, keepdims=True))
        rows = groups == group
        np.testing.assert_allclose(routed[rows][:, 2 * group : 2 * group + 2], log_probs[rows], rtol=1e-5, atol=1e-6)
        others = np.delete(routed[rows], [2 * group, 2 * group + 1], axis=1)
        assert np.all(others <= -1e8)


def test_batches_hold_one_group_each() -> None:
    x_train, y_train, _, _ = digits.load_digits()
    batches = digits.group_batches(x_train, y_train, 16, np.random.default_rng(0))
    assert sum(len(yb) for _, yb in batches) == len(y_train)
    assert all(len(set((yb // 2).tolist())) == 1 for _, yb in batches)
