"""The schedules a warmup needs, against PyTorch's and by their refusals."""

from __future__ import annotations

import numpy as np
import pytest

import monadl as ml


def test_a_warmup_then_cosine_decay_gives_pytorchs_rates() -> None:
    torch = pytest.importorskip("torch")
    peak, warmup, total = 0.1, 5, 20
    ours = ml.optim.warmup_cosine_decay_schedule(0.0, peak, warmup, total)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak)
    theirs = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-12, end_factor=1.0, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup),
        ],
        milestones=[warmup],
    )
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        theirs.step()
    np.testing.assert_allclose([ours(k) for k in range(total)], rates, rtol=1e-9, atol=1e-12)


def test_the_schedules_refuse_what_they_cannot_mean() -> None:
    with pytest.raises(ValueError, match="transition_steps must be positive"):
        ml.optim.linear_schedule(0.0, 1.0, 0)
    with pytest.raises(ValueError, match="one more schedule than boundaries"):
        ml.optim.join_schedules([ml.optim.constant_schedule(1.0)], [3])
    with pytest.raises(ValueError, match="positive and increasing"):
        ml.optim.join_schedules([ml.optim.constant_schedule(1.0)] * 3, [5, 5])
    with pytest.raises(ValueError, match="0 < warmup_steps < decay_steps"):
        ml.optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10)


def test_global_norm_is_what_clipping_reads() -> None:
    w, v = ml.Weight(np.zeros(2)), ml.Weight(np.zeros((2, 2)))
    grads = {w: np.array([3.0, 4.0]), v: np.full((2, 2), 6.0)}
    assert ml.optim.global_norm(grads) == pytest.approx(13.0)
    clipped = ml.optim.clip_by_global_norm(grads, 1.0)
    assert ml.optim.global_norm(clipped) == pytest.approx(1.0, rel=1e-6)
