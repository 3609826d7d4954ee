"""An optimizer called with PyTorch's keyword names (``lr=``, ``betas=``,
``momentum=``...) is refused with the call in monadl's names: a GAN's
``adam(lr=2e-4, betas=(0.5, 0.999))`` got Python's bare "unexpected keyword
argument 'betas'"."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from monadl import optim

CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "adam",
        {"lr": 1e-3},
        "adam() got an unexpected keyword argument 'lr' (PyTorch's name); monadl's optimizers "
        "take optax's: ml.optim.adam(0.001)",
    ),
    (
        "adam",
        {"lr": 2e-4, "betas": (0.5, 0.999)},
        "adam() got an unexpected keyword arguments 'lr', 'betas' "
        "(PyTorch's names); monadl's optimizers take optax's: ml.optim.adam(0.0002, b1=0.5, b2=0.999)",
    ),
    (
        "adam",
        {"lr": 1e-3, "weight_decay": 0.01},
        "ml.optim.chain(add_decayed_weights(0.01), adam(0.001)); that is "
        "PyTorch's Adam(weight_decay=) (L2 in the gradient); AdamW's decoupled decay is adamw(..., weight_decay=0.01)",
    ),
    ("sgd", {"lr": 0.1, "momentum": 0.9}, "ml.optim.momentum(0.1, decay=0.9)"),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "ml.optim.nesterov(0.1, decay=0.9)"),
    ("sgd", {"lr": 0.1, "weight_decay": 1e-4}, "ml.optim.chain(add_decayed_weights(0.0001), sgd(0.1))"),
    ("momentum", {"learning_rate": 0.1, "momentum": 0.8}, "ml.optim.momentum(0.1, decay=0.8)"),
    ("rmsprop", {"lr": 0.1, "alpha": 0.99}, "ml.optim.rmsprop(0.1, decay=0.99)"),
    (
        "adagrad",
        {"lr": 0.1, "initial_accumulator_value": 0.0, "lr_decay": 0.1},
        "ml.optim.adagrad(0.1, "
        "initial_accumulator=0.0); lr_decay: give a schedule as the rate: learning_rate=lambda step: lr / (1 + step "
        "* lr_decay)",
    ),
    ("adam", {"lr": 1e-3, "amsgrad": True}, "ml.optim.adam(0.001); amsgrad: monadl has no AMSGrad"),
    ("scale_by_adam", {"betas": (0.5, 0.9)}, "ml.optim.scale_by_adam(b1=0.5, b2=0.9)"),
    (
        "adam",
        {"learning_rate": 1e-3, "bettas": 1},
        "adam() got an unexpected keyword argument 'bettas'; adam's parameters are learning_rate, b1, b2, eps",
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "message"), CASES, ids=[f"{c[0]}-{'-'.join(c[1])}" for c in CASES])
def test_pytorch_keywords_are_refused_with_monadls_call(name: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as caught:
        getattr(optim, name)(**kwargs)
    assert message in str(caught.value)


def test_monadls_names_still_build_the_same_optimizer() -> None:
    assert repr(optim.adam(2e-4, b1=0.5, b2=0.999)) == (
        "GradientTransformation(chain(scale_by_adam(b1=0.5, b2=0.999, eps=1e-08), scale(-0.0002)))"
    )
    assert list(inspect.signature(optim.adam).parameters) == ["learning_rate", "b1", "b2", "eps"]
    assert optim.adam.__name__ == "adam" and optim.adam.__module__ == "monadl.optim.transforms"
