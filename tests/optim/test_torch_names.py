"""An optimizer called with PyTorch's keyword names (``lr=``, ``betas=``,
``momentum=``...) is refused with the call in monadl's names: a GAN's
``adam(lr=2e-4, betas=(0.5, 0.999))`` got Python's bare "unexpected keyword
argument 'betas'"."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
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
        "adam() got unexpected keyword arguments 'lr', 'betas' "
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


RMS_MOMENTUM = (
    "; PyTorch's RMSprop momentum is a trace of the scaled gradients (buf = momentum * buf + g / (sqrt(v) + eps)),"
    " not rmsprop's decay (its alpha, the squared gradients' average)"
)
POSITIONAL: list[tuple[str, tuple[Any, ...], dict[str, Any], str]] = [
    (  # (it was ml.optim.rmsprop(0.01, decay=0.9): the squares' average, not a momentum)
        "rmsprop",
        (),
        {"lr": 0.01, "momentum": 0.9},
        "ml.optim.chain(scale_by_rms(), trace(0.9), scale_by_learning_rate(0.01))" + RMS_MOMENTUM,
    ),
    (  # (alpha's mapping was overwritten by momentum's)
        "rmsprop",
        (),
        {"lr": 0.01, "alpha": 0.99, "momentum": 0.9, "weight_decay": 1e-4},
        "ml.optim.chain(add_decayed_weights(0.0001), scale_by_rms(decay=0.99), trace(0.9),"
        " scale_by_learning_rate(0.01))" + RMS_MOMENTUM,
    ),
    ("rmsprop", (0.01,), {"momentum": 0}, "ml.optim.rmsprop(0.01)"),  # (PyTorch's default: none)
    (  # (it was ml.optim.adam(0.001, <generator ...>): the parameters as b1)
        "adam",
        ((x for x in [1.0]),),  # (PyTorch's model.parameters(): a generator)
        {"lr": 1e-3},
        "adam() got an unexpected keyword argument 'lr' (PyTorch's name); monadl's optimizers take optax's:"
        " ml.optim.adam(0.001); the first argument is the learning rate, got generator: monadl's optimizers take no"
        " parameters; a weight gets its optimizer with ml.Weight(data, optimizer=...), or every weight built in a"
        " block with ml.optim.using_default(...)",
    ),
    (  # (it was ml.optim.adam(0.1, 0.1): b1 0.1)
        "adam",
        (0.1,),
        {"lr": 0.2},
        "adam() got an unexpected keyword argument 'lr' (PyTorch's name); monadl's optimizers take optax's:"
        " ml.optim.adam(0.1); learning_rate given twice, 0.1 by position and as lr=0.2 (PyTorch's name for it):"
        " give it once",
    ),
    (
        "adam",
        (1e-3, 0.5),
        {"betas": (0.6, 0.9)},
        "ml.optim.adam(0.001, 0.5, b2=0.9); b1 given twice, 0.5 by position and as betas=(0.6, 0.9)",
    ),
    (  # (it was ml.optim.nesterov(0.1): a decay of 0.9 no one chose)
        "sgd",
        (0.1,),
        {"nesterov": True},
        "sgd() got an unexpected keyword argument 'nesterov' (PyTorch's name); nesterov=True needs a momentum, as"
        " PyTorch's SGD says ('Nesterov momentum requires a momentum and zero dampening'): give it, as nesterov's"
        " decay, ml.optim.nesterov(0.1, decay=momentum)",
    ),
    ("momentum", (0.1,), {"nesterov": True}, "ml.optim.nesterov(0.1)"),  # (momentum's decay, 0.9, was chosen)
]


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "message"), POSITIONAL, ids=[f"{c[0]}-{len(c[1])}-{'-'.join(c[2])}" for c in POSITIONAL]
)
def test_pytorchs_arguments_beside_monadls_are_refused_with_what_they_mean(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError) as caught:
        getattr(optim, name)(*args, **kwargs)
    assert message in str(caught.value)


def test_the_call_given_for_rmsprops_momentum_steps_as_pytorchs() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError) as caught:
        optim.rmsprop(lr=0.01, alpha=0.99, momentum=0.9)  # type: ignore[call-arg]
    call = str(caught.value).split("ml.optim.", 1)[1].split("; ", 1)[0]
    made = eval(call, vars(optim))  # (the call the message gives, as written)
    rng = np.random.default_rng(0)
    p, grads = rng.normal(size=3), rng.normal(size=(5, 3))
    theirs = torch.tensor(p, requires_grad=True)
    stepper = torch.optim.RMSprop([theirs], lr=0.01, alpha=0.99, momentum=0.9)
    state = made.init(p)
    for g in grads:
        update, state = made.update(g, state, p)
        p = p + update
        theirs.grad = torch.tensor(g)
        stepper.step()
    np.testing.assert_allclose(p, theirs.detach().numpy(), rtol=1e-12)
