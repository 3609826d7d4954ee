"""Learning-rate schedules: a rate as a function of the step count, which
`monadl.optim.transforms.scale_by_learning_rate` (and every optimizer's
``learning_rate``) takes in place of a constant."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np

from monadl.optim._hyper import finite, valid_rate

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
    """The same learning rate at every step.

    >>> constant_schedule(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: constant_schedule: value must be a finite number >= 0 (a learning rate), got nan
    """
    value = _rate("constant_schedule", "value", value)
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
    init_value = _rate(order, "init_value", init_value)
    decay_rate = _rate(order, "decay_rate", decay_rate, "a factor")  # (a negative one gave negative or complex rates)
    if decay_rate > 1.0:
        raise ValueError(
            f"{order}: decay_rate must be at most 1 (above 1, the learning rate would grow at every step), "
            f"got {decay_rate:g}; {optax}"
        )
    if not _whole(transition_steps):
        raise ValueError(f"{order}: transition_steps must be a whole number > 0, got {transition_steps!r}; {optax}")
    transition_steps = int(transition_steps)  # (100.0 read from a config is 100 steps)
    return lambda step: init_value * decay_rate ** (step / transition_steps)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over
    ``decay_steps`` (Loshchilov & Hutter, SGDR, 2017), then held there, as
    optax's (PyTorch's ``CosineAnnealingLR`` climbs back up after its
    ``T_max``: it is periodic).

    An ``alpha`` below 0 would give negative rates in the decay's last part,
    refused here rather than hundreds of steps later; above 1 the cosine
    rises to ``alpha * init_value``, as optax's and PyTorch's do.

    >>> round(cosine_decay_schedule(1.0, 10, alpha=0.1)(25), 6)
    0.1
    >>> cosine_decay_schedule(1e-3, 1000, alpha=-0.1)
    Traceback (most recent call last):
    ...
    ValueError: cosine_decay_schedule: alpha must be a finite number >= 0 (the rate ends at alpha * init_value), got -0.1
    """
    init_value = _rate("cosine_decay_schedule", "init_value", init_value)
    decay_steps = _steps("cosine_decay_schedule", "decay_steps", decay_steps)
    if not valid_rate(alpha):
        raise ValueError(
            f"cosine_decay_schedule: alpha must be a finite number >= 0 (the rate ends at alpha * init_value), "
            f"got {alpha!r}"
        )
    alpha = float(alpha)
    return lambda step: _cosine(init_value, decay_steps, alpha, step)


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """From ``init_value`` to ``end_value`` in a straight line over
    ``transition_steps``, then held there (optax's; a warmup from 0).

    >>> [linear_schedule(0.0, 1.0, 4)(s) for s in (0, 2, 4, 9)]
    [0.0, 0.5, 1.0, 1.0]
    """
    init_value = _rate("linear_schedule", "init_value", init_value)
    end_value = _rate("linear_schedule", "end_value", end_value)
    transition_steps = _steps("linear_schedule", "transition_steps", transition_steps)
    return lambda step: _linear(init_value, end_value, transition_steps, step)


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[0]`` until ``boundaries[0]``, then ``schedules[1]`` counting
    its steps from there, and so on (optax's): a warmup, then a decay.

    >>> warm = join_schedules([linear_schedule(0.0, 1.0, 2), cosine_decay_schedule(1.0, 4)], [2])
    >>> [round(warm(s), 3) for s in (0, 1, 2, 4, 6)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), list(boundaries)  # (copies: the caller's lists may change after)
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules: one more schedule than boundaries, got {len(schedules)} and {len(boundaries)}"
        )
    for position, piece in enumerate(schedules):
        if not callable(piece):
            raise TypeError(
                f"join_schedules: schedules[{position}] is {type(piece).__name__} {piece!r}, not a schedule "
                "(a function of the step: constant_schedule(0.1) for a constant rate)"
            )
    if not all(map(_whole, boundaries)) or any(b <= a for a, b in zip([0, *boundaries], boundaries)):
        raise ValueError(
            f"join_schedules: boundaries must be whole numbers of steps, positive and increasing, got {boundaries}"
        )
    boundaries = [int(b) for b in boundaries]

    def schedule(step: int) -> float:
        k = bisect.bisect_right(boundaries, step)
        return schedules[k](step - boundaries[k - 1] if k else step)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """A linear warmup from ``init_value`` to ``peak_value`` over
    ``warmup_steps``, then a cosine decay to ``end_value`` by step
    ``decay_steps`` (counted from 0, the warmup included), as optax's
    (`linear_schedule`, then `cosine_decay_schedule` with ``alpha =
    end_value / peak_value``).

    >>> s = warmup_cosine_decay_schedule(0.0, 1.0, 2, 6)
    >>> [round(s(k), 3) for k in (0, 1, 2, 4, 6, 9)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    made = "warmup_cosine_decay_schedule"
    init_value, peak_value = _rate(made, "init_value", init_value), _rate(made, "peak_value", peak_value)
    end_value = _rate(made, "end_value", end_value)
    warmup_steps, decay_steps = _steps(made, "warmup_steps", warmup_steps), _steps(made, "decay_steps", decay_steps)
    if not warmup_steps < decay_steps:
        raise ValueError(f"{made}: 0 < warmup_steps < decay_steps, got {warmup_steps!r} and {decay_steps!r}")

    # (Its own closure, not join_schedules' of two: its text is the call, `monadl.optim._spec`.)
    def schedule(step: int) -> float:
        if step < warmup_steps:
            return _linear(init_value, peak_value, warmup_steps, step)
        alpha = end_value / peak_value if peak_value else 0.0
        return _cosine(peak_value, decay_steps - warmup_steps, alpha, step - warmup_steps)

    return schedule


def _linear(init_value: float, end_value: float, transition_steps: int, step: int) -> float:
    return init_value + (end_value - init_value) * min(step, transition_steps) / transition_steps


def _cosine(init_value: float, decay_steps: int, alpha: float, step: int) -> float:
    t = min(step, decay_steps) / decay_steps
    return init_value * ((1 - alpha) * 0.5 * (1 + float(np.cos(np.pi * t))) + alpha)


def _rate(made: str, name: str, value: float, what: str = "a learning rate") -> float:
    """A schedule's rate, refused where ``made`` (the schedule) is built when
    it is no finite number >= 0: the step that reached it failed, hundreds
    of steps in (a negative end of a decay, a NaN read from a config)."""
    if not valid_rate(value):
        raise ValueError(f"{made}: {name} must be a finite number >= 0 ({what}), got {value!r}")
    return float(value)


def _steps(made: str, name: str, value: float) -> int:
    if not _whole(value):
        raise ValueError(f"{made}: {name} must be a whole number of steps > 0, got {value!r}")
    return int(value)


def _whole(value: float) -> bool:
    """A whole number > 0, as a Python or NumPy int or float (100.0 read from a config)."""
    return finite(value) and float(value).is_integer() and value > 0
