"""PyTorch's keyword names for an optimizer's hyperparameters, refused with
monadl's (optax's): ``adam(lr=1e-3, betas=(0.5, 0.999))`` is
``adam(0.001, b1=0.5, b2=0.999)``, and ``sgd(lr=0.1, momentum=0.9)`` is
``momentum(0.1, decay=0.9)`` (RMSprop's ``momentum=``, no ``decay``, is a
chain with `trace`). A user coming from ``torch.optim`` writes
these first; Python's own refusal ("unexpected keyword argument 'betas'")
names the word but not the spelling monadl wants. mypy rejects them before
the program runs (the optimizers' signatures are unchanged); this is the
message for the run that was not checked.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar

__all__ = ["refuses_torch_names"]

P = ParamSpec("P")
R = TypeVar("R")

_RENAMED: Final = {"lr": "learning_rate", "alpha": "decay", "initial_accumulator_value": "initial_accumulator"}
"""PyTorch's name -> monadl's, where the optimizer has monadl's."""

_UNSUPPORTED: Final = {
    "amsgrad": "monadl has no AMSGrad",
    "maximize": "monadl minimizes: negate the loss",
    "dampening": "monadl's momentum has no dampening (PyTorch's default, 0, is its update)",
    "centered": "monadl's rmsprop is not centered",
    "lr_decay": "give a schedule as the rate: learning_rate=lambda step: lr / (1 + step * lr_decay)",
    "foreach": "drop it (PyTorch's choice of implementation)",
    "fused": "drop it (PyTorch's choice of implementation)",
    "capturable": "drop it (PyTorch's choice of implementation)",
    "differentiable": "drop it (PyTorch's choice of implementation)",
}
"""PyTorch's keywords that monadl has no counterpart for, and what to do instead."""


def refuses_torch_names(optimizer: Callable[P, R]) -> Callable[P, R]:
    """``optimizer``, refusing PyTorch's keyword names with a `TypeError` that
    gives the call in monadl's names. Only a call with a keyword the
    optimizer lacks pays more than a set comparison."""
    parameters = tuple(inspect.signature(optimizer).parameters)
    accepted = frozenset(parameters)

    @functools.wraps(optimizer)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        if not kwargs.keys() <= accepted:
            raise TypeError(_refusal(optimizer.__name__, parameters, args, kwargs))
        return optimizer(*args, **kwargs)

    return checked


def _refusal(name: str, parameters: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The refusal of ``name(*args, **kwargs)``: its foreign keywords, and
    the call in monadl's names where they all have one, else the names
    ``name`` takes."""
    accepted = frozenset(parameters)
    foreign = [k for k in kwargs if k not in accepted]
    prefix = (
        f"{name}() got {'unexpected keyword arguments' if len(foreign) > 1 else 'an unexpected keyword argument'} "
        f"{', '.join(map(repr, foreign))}"
    )
    notes: list[str] = []
    if args and not (isinstance(args[0], numbers.Number) or callable(args[0])):  # (PyTorch's Adam(params, lr=...))
        notes.append(
            f"the first argument is the learning rate, got {type(args[0]).__name__}: monadl's optimizers take no"
            " parameters; a weight gets its optimizer with ml.Weight(data, optimizer=...), or every weight built"
            " in a block with ml.optim.using_default(...)"
        )
        args = args[1:]
    given = dict(kwargs)
    taken = set(parameters[: len(args)]) | (kwargs.keys() & accepted)  # (monadl's names given already)
    made = name  # (sgd's momentum= is another optimizer: momentum, or nesterov)
    unknown: list[str] = []
    decay = given.pop("weight_decay", None) if "weight_decay" in foreign else None
    nesterov = bool(given.pop("nesterov", False)) if "nesterov" in foreign else False
    if nesterov and name == "sgd" and not given.get("momentum"):  # (PyTorch refuses it; nesterov's decay is 0.9)
        rates = [*args[:1], *(given[k] for k in ("lr", "learning_rate") if k in given)]
        return (
            f"{prefix} (PyTorch's name{'s' if len(foreign) > 1 else ''}); nesterov=True needs a momentum, as PyTorch's"
            " SGD says ('Nesterov momentum requires a momentum and zero dampening'): give it, as nesterov's decay,"
            f" ml.optim.nesterov({repr(rates[0]) if rates else 'learning_rate'}, decay=momentum)"
        )
    if "momentum" in foreign and "decay" not in accepted and name == "sgd":
        made = "nesterov" if nesterov else "momentum"
        given["decay"] = given.pop("momentum")
    elif nesterov and name in ("sgd", "momentum"):
        made = "nesterov"
    rms_momentum = given.pop("momentum", None) if "momentum" in foreign and name == "rmsprop" else None
    for k in foreign:
        if k not in given:
            continue
        value = given.pop(k)
        if k == "betas" and {"b1", "b2"} <= accepted and _pair(value):
            mapped = dict(zip(("b1", "b2"), value))
        elif k == "momentum" and name in ("momentum", "nesterov"):
            mapped = {"decay": value}
        elif _RENAMED.get(k) in accepted:
            mapped = {_RENAMED[k]: value}
        elif k in _UNSUPPORTED:
            notes.append(f"{k}: {_UNSUPPORTED[k]}")
            continue
        else:
            unknown.append(k)
            continue
        for target, v in mapped.items():
            if target in taken:  # (Python's "multiple values for argument": the one in monadl's name kept)
                notes.append(
                    f"{target} given twice, {_where(target, parameters, args, kwargs)} and as {k}={value!r}"
                    f" (PyTorch's name for it): give it once"
                )
            else:
                given[target] = v
    if unknown:
        return f"{prefix}; {name}'s parameters are {', '.join(parameters)}"
    if rms_momentum:  # (PyTorch's RMSprop(momentum=): a trace of the scaled gradient, no decay of the squares)
        call = _rms_with_momentum(args, given, rms_momentum)
        notes.append(
            "PyTorch's RMSprop momentum is a trace of the scaled gradients (buf = momentum * buf + g / (sqrt(v) + eps)),"
            " not rmsprop's decay (its alpha, the squared gradients' average)"
        )
    else:
        call = _call(made, args, given)
    if decay is not None:
        call = f"chain(add_decayed_weights({decay!r}), {call[len('chain(') :] if call.startswith('chain(') else call + ')'}"
        if name == "adam":
            notes.append(
                f"that is PyTorch's Adam(weight_decay=) (L2 in the gradient); "
                f"AdamW's decoupled decay is adamw(..., weight_decay={decay!r})"
            )
    text = (
        f"{prefix} (PyTorch's name{'s' if len(foreign) > 1 else ''}); monadl's optimizers take optax's: ml.optim.{call}"
    )
    return text + "".join(f"; {note}" for note in notes)


def _where(target: str, parameters: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """How ``target`` was given already: by position, or by its name."""
    if target in kwargs:
        return f"as {target}={kwargs[target]!r}"
    return f"{args[parameters.index(target)]!r} by position"


def _rms_with_momentum(args: tuple[Any, ...], given: dict[str, Any], momentum: object) -> str:
    """``rmsprop(...)`` with PyTorch's momentum, as monadl's chain: the same
    RMS scaling, then `trace`, then the rate (``rmsprop`` is the first and
    the last)."""
    named = {**dict(zip(("learning_rate", "decay", "eps"), args)), **given}
    rate = repr(named.pop("learning_rate")) if "learning_rate" in named else "learning_rate"
    rms = ", ".join(f"{k}={v!r}" for k, v in named.items())
    return f"chain(scale_by_rms({rms}), trace({momentum!r}), scale_by_learning_rate({rate}))"


def _pair(value: object) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2


def _call(name: str, args: tuple[Any, ...], given: dict[str, Any]) -> str:
    """``name(...)`` as written with monadl's names (the rate first, by position)."""
    shown = [repr(a) for a in args]
    if "learning_rate" in given:
        shown.insert(0, repr(given.pop("learning_rate")))
    shown += [f"{k}={v!r}" for k, v in given.items()]
    return f"{name}({', '.join(shown)})"
