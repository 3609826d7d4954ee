"""Optimizers as pairs of pure functions, composed with `chain` (after optax),
and the one place where they step weights (`apply_gradients`).

>>> import numpy as np
>>> opt = sgd(0.1)
>>> state = opt.init(np.zeros(2))
>>> update, state = opt.update(np.array([1.0, -2.0]), state, np.zeros(2))
>>> update
array([-0.1,  0.2])
"""

from monadl.optim._clip import clip_by_global_norm, global_norm
from monadl.optim._default import DEFAULT_LEARNING_RATE, default_optimizer, using_default
from monadl.optim._schedules import (
    Schedule,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from monadl.optim.apply import apply_gradients
from monadl.optim.transforms import (
    AdagradState,
    AdamState,
    GradientTransformation,
    RmsState,
    adagrad,
    adam,
    adamw,
    add_decayed_weights,
    add_l1_decay,
    chain,
    momentum,
    nesterov,
    rmsprop,
    scale,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rms,
    sgd,
    trace,
)

__all__ = [
    "DEFAULT_LEARNING_RATE",
    "AdagradState",
    "AdamState",
    "GradientTransformation",
    "RmsState",
    "Schedule",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "add_l1_decay",
    "apply_gradients",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "default_optimizer",
    "exponential_decay",
    "global_norm",
    "join_schedules",
    "linear_schedule",
    "momentum",
    "nesterov",
    "rmsprop",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "sgd",
    "trace",
    "using_default",
    "warmup_cosine_decay_schedule",
]
