"""What may run inside a running evaluation: a training step may not.

A step (``train()``, ``ml.optim.apply_gradients``, ``DataParallel.train()``)
started inside a running ``train()`` or gradients, from an ``@ml.direct``
step, an effect, a task the evaluation started or a backward, would land in
the middle of that evaluation and stay if it failed. `READING`, which names
the evaluation whose driver runs and which the tasks it starts inherit,
tells where one is called from. Here, apart from the evaluation itself, so
that the optimizers (`monadl.optim.apply`) may ask it too.
"""

from __future__ import annotations

from monadl.direct import inside_direct
from monadl.errors import OperandError
from monadl.runtime.evaluation import READING

__all__ = ["refuse_inside_evaluation"]


def refuse_inside_evaluation(what: str) -> None:
    """`OperandError` where ``what`` (a training step) is called inside a
    running evaluation: by a step of an ``@ml.direct`` function, or by an
    effect, a task or a backward of the evaluation (`READING`, which the
    tasks it starts inherit, names it while its driver runs). Its step
    would land in the middle of that evaluation, which would then read
    weights half updated, and stay if that evaluation failed. A
    ``predict()`` or ``gradients()`` there changes no weight, and is fine;
    so is a step inside a ``predict()``'s effect (it reads the weights as
    they were when it began, and keeps nothing to undo)."""
    if inside_direct.get().live:
        raise OperandError(
            f"{what} inside an @ml.direct function: its step would be taken in the middle of the evaluation "
            "around it (which would then read weights half updated) and kept if that one failed; return the "
            "loss from the model and train it outside, or add it to the outer loss"
        )
    ev = READING.get()
    while ev is not None:
        if ev.running and ev.train:
            raise OperandError(
                f"{what} inside a running evaluation (from a Do.from_async effect, a task that a model started, or "
                "a backward): its step would be taken in the middle of that evaluation (which would then read "
                "weights half updated) and kept if that one failed; return the loss from the model and train it "
                "outside, or add it to the outer loss"
            )
        ev = ev.outer
