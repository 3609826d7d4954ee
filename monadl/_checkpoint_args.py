"""The arguments of `ml.save` and `ml.load` (`monadl.checkpoint`), checked
before a file is touched: a path that is a directory (`not_a_directory`), a
model that holds no weight (`no_weights`, the message), weight names that
another process would not give the same weights (`stable`: a memory address
in a name), metadata that would not load as it was given (`check_metadata`),
and the one conversion metadata gets on its way to JSON (`json_scalar`: a
NumPy scalar as the Python number it holds).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

from monadl.errors import CheckpointError
from monadl.layers import Layer

__all__ = ["ADDRESS", "check_metadata", "json_scalar", "no_weights", "not_a_directory", "stable"]

ADDRESS: Final = re.compile(r"0x[0-9a-fA-F]{6,}")  # (a default repr's " at 0x7f3a...>", or another repr's address)


def not_a_directory(path: str | os.PathLike[str]) -> None:
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "a checkpoint is a file, and this is a directory", os.fspath(path))


def stable(weights: dict[str, Any]) -> dict[str, Any]:
    """The weights, if the process that loads them names them the same: not
    if a dict key on a name's path reads as a memory address (an object of no
    ``__str__`` of its own, a function). (Data parallelism takes such names:
    its ranks compare them with the addresses masked.)"""
    for name in weights:
        if ADDRESS.search(name):
            raise CheckpointError(
                f"a weight is named {name}: a dict key on its path reads as a memory address, which differs "
                "in the process that loads the checkpoint: key weights by str or int (or give the key's type "
                "a __str__)"
            )
    return weights


def no_weights(model: object, call: str = "save", consequence: str = "the checkpoint would be empty") -> str:
    """Why a model that holds no weight is refused (by ``call``)."""
    text = (
        f"{call}(path, model): the model, a {type(model).__name__}, holds no Weight, so {consequence}; "
        "pass the object that holds the weights (a dict, list or tuple of them, a dataclass or any "
        "object whose attributes hold them: see ml.checkpoint.named_weights)"
    )
    if isinstance(model, Iterator):
        text += (
            "; an iterator (a generator, map or zip) is not walked into (reading it would use it up): pass a list "
            "of what it gives"
        )
    elif isinstance(model, Layer):
        text += (
            "; a built Layer (a loss, a prediction) is not walked into (its weights belong to the model that "
            "built it): pass that model"
        )
    return text


def check_metadata(metadata: object) -> None:
    """Refuse metadata that would not come back as it was given: not a
    mapping, or a mapping with a key that is not a str (JSON's keys are
    strings: ``{3: 0.9}`` would load as ``{'3': 0.9}``)."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise TypeError(f"save: metadata is a dict of JSON data (str keys), got a {type(metadata).__name__}")
    todo: list[tuple[str, object]] = [("metadata", metadata)]
    seen: set[int] = set()  # (metadata that holds itself: JSON says so below)
    while todo:
        where, x = todo.pop()
        if isinstance(x, (Mapping, list, tuple)):
            if id(x) in seen:
                continue
            seen.add(id(x))
        if isinstance(x, Mapping):
            for key, value in x.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"save: {where} has a key that is no str, {key!r} ({type(key).__name__}); JSON keys are "
                        f"strings, so it would load as {str(key)!r}: use str keys, or a list of pairs"
                    )
                todo.append((f"{where}[{key!r}]", value))
        elif isinstance(x, (list, tuple)):
            todo.extend((f"{where}[{i}]", value) for i, value in enumerate(x))


def json_scalar(x: object) -> Any:
    """A NumPy scalar in metadata (a step count, a loss) as the Python number it holds."""
    if isinstance(x, np.generic) and x.dtype.kind in "biuf":
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")
