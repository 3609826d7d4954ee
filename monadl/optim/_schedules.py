"""Learning-rate schedules: a rate as a function of the step count, which
`monadl.optim.transforms.scale_by_learning_rate` (and every optimizer's
``learning_rate``) takes in place of a constant."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np

from monadl.optim._hyper import checked, finite

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "warmup_cosine_decay_schedule",
]

Schedule: TypeAlias = Callable[[int], float]
"""A learning rate as a function of the step count (0 for the first step)."""


def constant_schedule(value: float) -> Schedule:
    """The same learning rate at every step."""
    return lambda step: value


def exponential_decay(init_value: float, decay_rate: float, transition_steps: float = 1) -> Schedule:
    """``init_value * decay_rate ** (step / transition_steps)``.

    Not optax's order (``init_value, transition_steps, decay_rate``): what a
    call in its order passes here, a rate above 1 or fractional steps, is refused.

    >>> exponential_decay(1.0, 0.5, 2)(4)
    0.25
    >>> exponential_decay(0.1, 1000, 0.5)
    Traceback (most recent call last):
    ...
    ValueError: exponential_decay(init_value, decay_rate, transition_steps): decay_rate must be at most 1 (above 1, the learning rate would grow at every step), got 1000; optax's order is (init_value, transition_steps, decay_rate)
    """
    order = "exponential_decay(init_value, decay_rate, transition_steps)"
    optax = "optax's order is (init_value, transition_steps, decay_rate)"
    init_value = checked("init_value", init_value)
    decay_rate = checked("decay_rate", decay_rate)  # (a negative one gave negative or complex rates)
    if decay_rate > 1.0:
        raise ValueError(
            f"{order}: decay_rate must be at most 1 (above 1, the learning rate would grow at every step), "
            f"got {decay_rate:g}; {optax}"
        )
    if not (finite(transition_steps) and float(transition_steps).is_integer() and transition_steps > 0):
        raise ValueError(f"{order}: transition_steps must be a whole number > 0, got {transition_steps!r}; {optax}")
    transition_steps = int(transition_steps)  # (100.0 read from a config is 100 steps)
    return lambda step: init_value * decay_rate ** (step / transition_steps)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over
    ``decay_steps`` (Loshchilov & Hutter, SGDR, 2017), then held there, as
    optax's (PyTorch's ``CosineAnnealingLR`` climbs back up after its
    ``T_max``: it is periodic).

    >>> round(cosine_decay_schedule(1.0, 10, alpha=0.1)(25), 6)
    0.1
    """
    if decay_steps <= 0:
        raise ValueError("decay_steps must be positive")

    def schedule(step: int) -> float:
        t = min(step, decay_steps) / decay_steps
        return init_value * ((1 - alpha) * 0.5 * (1 + float(np.cos(np.pi * t))) + alpha)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """From ``init_value`` to ``end_value`` in a straight line over
    ``transition_steps``, then held there (optax's; a warmup from 0).

    >>> [linear_schedule(0.0, 1.0, 4)(s) for s in (0, 2, 4, 9)]
    [0.0, 0.5, 1.0, 1.0]
    """
    if transition_steps <= 0:
        raise ValueError(f"linear_schedule: transition_steps must be positive, got {transition_steps!r}")
    return lambda step: init_value + (end_value - init_value) * min(step, transition_steps) / transition_steps


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[0]`` until ``boundaries[0]``, then ``schedules[1]`` counting
    its steps from there, and so on (optax's): a warmup, then a decay.

    >>> warm = join_schedules([linear_schedule(0.0, 1.0, 2), cosine_decay_schedule(1.0, 4)], [2])
    >>> [round(warm(s), 3) for s in (0, 1, 2, 4, 6)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules: one more schedule than boundaries, got {len(schedules)} and {len(boundaries)}"
        )
    if any(b <= a for a, b in zip([0, *boundaries], boundaries)):
        raise ValueError(f"join_schedules: boundaries must be positive and increasing, got {list(boundaries)}")
    starts = [0, *boundaries]

    def schedule(step: int) -> float:
        k = bisect.bisect_right(boundaries, step)
        return schedules[k](step - starts[k])

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """A linear warmup from ``init_value`` to ``peak_value`` over
    ``warmup_steps``, then a cosine decay to ``end_value`` by step
    ``decay_steps`` (counted from 0, the warmup included), as optax's.

    >>> s = warmup_cosine_decay_schedule(0.0, 1.0, 2, 6)
    >>> [round(s(k), 3) for k in (0, 1, 2, 4, 6, 9)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    if not 0 < warmup_steps < decay_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: 0 < warmup_steps < decay_steps, got {warmup_steps!r} and {decay_steps!r}"
        )
    alpha = end_value / peak_value if peak_value else 0.0
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha),
        ],
        [warmup_steps],
    )
