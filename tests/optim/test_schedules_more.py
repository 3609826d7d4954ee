"""The schedules a warmup needs, against PyTorch's and by their refusals."""

from __future__ import annotations

from collections.abc import Callable

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
    with pytest.raises(
        ValueError, match=r"^linear_schedule: transition_steps must be a whole number of steps > 0, got 0$"
    ):
        ml.optim.linear_schedule(0.0, 1.0, 0)
    with pytest.raises(ValueError, match="one more schedule than boundaries"):
        ml.optim.join_schedules([ml.optim.constant_schedule(1.0)], [3])
    with pytest.raises(ValueError, match="positive and increasing"):
        ml.optim.join_schedules([ml.optim.constant_schedule(1.0)] * 3, [5, 5])
    with pytest.raises(ValueError, match="0 < warmup_steps < decay_steps"):
        ml.optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: ml.optim.cosine_decay_schedule(1e-3, 1000, alpha=-0.1),
            "cosine_decay_schedule: alpha must be a finite number >= 0 (the rate ends at alpha * init_value), got -0.1",
        ),
        (
            lambda: ml.optim.linear_schedule(1e-3, -1e-4, 1000),
            "linear_schedule: end_value must be a finite number >= 0 (a learning rate), got -0.0001",
        ),
        (
            lambda: ml.optim.warmup_cosine_decay_schedule(0.0, -1e-3, 10, 100),
            "warmup_cosine_decay_schedule: peak_value must be a finite number >= 0 (a learning rate), got -0.001",
        ),
        (
            lambda: ml.optim.constant_schedule(float("nan")),
            "constant_schedule: value must be a finite number >= 0 (a learning rate), got nan",
        ),
        (
            lambda: ml.optim.constant_schedule(float("inf")),
            "constant_schedule: value must be a finite number >= 0 (a learning rate), got inf",
        ),
        (
            lambda: ml.optim.cosine_decay_schedule(1e-3, 0),
            "cosine_decay_schedule: decay_steps must be a whole number of steps > 0, got 0",
        ),
        (
            lambda: ml.optim.cosine_decay_schedule(1e-3, "100"),  # type: ignore[arg-type]  # on purpose
            "cosine_decay_schedule: decay_steps must be a whole number of steps > 0, got '100'",
        ),
        (
            lambda: ml.optim.linear_schedule(0.0, 1e-3, 12.5),  # type: ignore[arg-type]  # on purpose
            "linear_schedule: transition_steps must be a whole number of steps > 0, got 12.5",
        ),
        (
            lambda: ml.optim.warmup_cosine_decay_schedule(0.0, 1e-3, -5, 100),
            "warmup_cosine_decay_schedule: warmup_steps must be a whole number of steps > 0, got -5",
        ),
        (
            lambda: ml.optim.join_schedules(
                [ml.optim.constant_schedule(1.0), ml.optim.constant_schedule(0.5)],
                [2.5],  # type: ignore[list-item]  # on purpose
            ),
            "join_schedules: boundaries must be whole numbers of steps, positive and increasing, got [2.5]",
        ),
    ],
)
def test_a_schedule_that_would_fail_a_later_step_is_refused_where_it_is_built(
    build: Callable[[], ml.optim.Schedule], message: str
) -> None:
    """They were accepted, and the step that reached a negative or NaN rate
    failed: at step 806 for a cosine's negative alpha, at step 0 for a NaN."""
    with pytest.raises(ValueError) as raised:
        build()
    assert str(raised.value) == message


def test_whole_steps_given_as_floats_are_steps() -> None:
    """(100.0 read from a config: typed as an int, taken as one.)"""
    assert ml.optim.cosine_decay_schedule(1.0, 100.0)(50) == pytest.approx(0.5)  # type: ignore[arg-type]
    constants = [ml.optim.constant_schedule(1.0), ml.optim.constant_schedule(2.0)]
    assert ml.optim.join_schedules(constants, [2.0])(3) == 2.0  # type: ignore[list-item]


def test_using_default_given_an_optimizer_uncalled_says_to_call_it() -> None:
    with pytest.raises(TypeError) as raised, ml.optim.using_default(ml.optim.adam):  # type: ignore[arg-type]  # on purpose
        pass
    assert str(raised.value) == (
        "ml.optim.using_default: the optimizer is the function adam, not called: call it, as in adam(learning_rate)"
    )


def test_global_norm_is_what_clipping_reads() -> None:
    w, v = ml.Weight(np.zeros(2)), ml.Weight(np.zeros((2, 2)))
    grads = {w: np.array([3.0, 4.0]), v: np.full((2, 2), 6.0)}
    assert ml.optim.global_norm(grads) == pytest.approx(13.0)
    clipped = ml.optim.clip_by_global_norm(grads, 1.0)
    assert ml.optim.global_norm(clipped) == pytest.approx(1.0, rel=1e-6)
