"""PyTorch's keyword names for an optimizer's hyperparameters, refused with
monadl's (optax's): ``adam(lr=1e-3, betas=(0.5, 0.999))`` is
``adam(0.001, b1=0.5, b2=0.999)``, and ``sgd(lr=0.1, momentum=0.9)`` is
``momentum(0.1, decay=0.9)``. A user coming from ``torch.optim`` writes
these first; Python's own refusal ("unexpected keyword argument 'betas'")
names the word but not the spelling monadl wants. mypy rejects them before
the program runs (the optimizers' signatures are unchanged); this is the
message for the run that was not checked.
"""

from __future__ import annotations

import functools
import inspect
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
        f"{name}() got an unexpected keyword argument{'s' if len(foreign) > 1 else ''} {', '.join(map(repr, foreign))}"
    )
    given = dict(kwargs)
    made = name  # (sgd's momentum= is another optimizer: momentum, or nesterov)
    notes: list[str] = []
    unknown: list[str] = []
    decay = given.pop("weight_decay", None) if "weight_decay" in foreign else None
    nesterov = bool(given.pop("nesterov", False)) if "nesterov" in foreign else False
    if "momentum" in foreign and "decay" not in accepted and name == "sgd":
        made = "nesterov" if nesterov else "momentum"
        given["decay"] = given.pop("momentum")
    elif nesterov and name in ("sgd", "momentum"):
        made = "nesterov"
    for k in foreign:
        if k not in given:
            continue
        value = given.pop(k)
        if k == "betas" and {"b1", "b2"} <= accepted and _pair(value):
            given["b1"], given["b2"] = value
        elif k == "momentum" and "decay" in accepted:
            given["decay"] = value
        elif _RENAMED.get(k) in accepted:
            given[_RENAMED[k]] = value
        elif k in _UNSUPPORTED:
            notes.append(f"{k}: {_UNSUPPORTED[k]}")
        else:
            unknown.append(k)
    if unknown:
        return f"{prefix}; {name}'s parameters are {', '.join(parameters)}"
    call = _call(made, args, given)
    if decay is not None:
        call = f"chain(add_decayed_weights({decay!r}), {call})"
        if name == "adam":
            notes.append(
                f"that is PyTorch's Adam(weight_decay=) (L2 in the gradient); "
                f"AdamW's decoupled decay is adamw(..., weight_decay={decay!r})"
            )
    text = (
        f"{prefix} (PyTorch's name{'s' if len(foreign) > 1 else ''}); monadl's optimizers take optax's: ml.optim.{call}"
    )
    return text + "".join(f"; {note}" for note in notes)


def _pair(value: object) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2


def _call(name: str, args: tuple[Any, ...], given: dict[str, Any]) -> str:
    """``name(...)`` as written with monadl's names (the rate first, by position)."""
    shown = [repr(a) for a in args]
    if "learning_rate" in given:
        shown.insert(0, repr(given.pop("learning_rate")))
    shown += [f"{k}={v!r}" for k, v in given.items()]
    return f"{name}({', '.join(shown)})"
