"""Checkpoints: save a model's weights and optimizer state, and load them back.

`save(path, model)` finds every `Weight` reachable from ``model`` (through
dicts, lists, tuples, dataclasses and plain objects' attributes) under a
stable dotted name (``encoder.0.weight``), and writes each weight's data and
every array of its optimizer state (Adam's moments ...) to one safetensors
file, with a JSON manifest (names, shapes, dtypes, the optimizer state's
structure and its numbers, such as step counts, a shared weight's other
paths as aliases of its name, and a digest of each array's bytes) in the
file's header, with a digest of the manifest itself
beside it: a damaged file, its arrays or its header, is refused on load.
`load(path, model)` restores them into a model of the same structure that the
program has built again in code, as PyTorch's
``model.load_state_dict(torch.load(path))`` does.

Why these names and this order: ``save`` and ``load`` are what a PyTorch user
tries first; the path comes first in both, as in equinox
(``tree_serialise_leaves(path, pytree)``, ``tree_deserialise_leaves(path,
like)``) and orbax (``checkpointer.save(path, tree)``), since ``load`` fills a
model rather than returning one. ``save(model, path)``, PyTorch's order, is
refused with a message that says so.

Why safetensors: it stores arrays and a text header only, so loading a file
never runs code (pickle does), and PyTorch, JAX and Hugging Face tools read it.
Why one file: a single ``os.replace`` of a fully written temporary file makes
the save atomic; a crash mid-save leaves the previous checkpoint intact, and
the next save of the same path removes the folder the crash left
(`monadl._atomic_file`: not the plain ``.tmp`` files an earlier monadl left).

>>> import os, tempfile, numpy as np, monadl as ml
>>> model = {"w": ml.Weight(np.ones(2), optimizer=ml.optim.adam(0.1))}
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> ml.save(path, model, metadata={"epoch": 3})
>>> fresh = {"w": ml.Weight(np.zeros(2), optimizer=ml.optim.adam(0.1))}
>>> ml.load(path, fresh)
{'epoch': 3}
>>> fresh["w"].data
array([1., 1.])
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Final, final

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from monadl._atomic_file import write_atomically
from monadl._checkpoint_args import ADDRESS, check_metadata, json_scalar, no_weights, not_a_directory, stable
from monadl._checkpoint_file import FORMAT, MANIFEST_DIGEST_KEY, MANIFEST_KEY, VERSION, digest, opened, text_digest
from monadl._checkpoint_match import match, nothing_in_common
from monadl._named import named_weights, named_weights_and_aliases
from monadl._namespace import library_name
from monadl._state_file import arrays_of, decode, encode, put, to_library
from monadl.errors import CheckpointError, MonadlError
from monadl.layers._commits import COMMIT_LOCK, TRAINING, pin_for_readers
from monadl.layers._replace import replace_data, replace_state
from monadl.layers._traced_now import refuse_while_tracing
from monadl.runtime.process import Held, hold, release

__all__ = ["load", "named_weights", "save"]


def __dir__() -> list[str]:
    """The module's API and its errors, for ``dir()`` and a user's tab
    completion (not the helpers it imports: ``decode``, ``match``, ``put`` ...)."""
    return sorted([*__all__, "CheckpointError"])


_STATE_PREFIX: Final = "optimizer_state/"


def save(path: str | os.PathLike[str], model: object, *, metadata: Mapping[str, Any] | None = None) -> None:
    """Write the weights of ``model`` and their optimizer state to ``path``
    (a ``.safetensors`` file), atomically.

    Args:
        path: where to write; a previous file there is replaced only once the
            new one is complete (written in a hidden folder beside it,
            ``.NAME.<hex>.tmp``, synced, then renamed over it). Such a folder
            that a killed save left is removed by the next save of ``path``.
        model: any object that holds weights (see `named_weights`).
        metadata: JSON data to keep beside the weights (an epoch, a data
            loader's position), a dict with str keys; `load` returns it.
            NumPy scalars in it (``np.int64(3)``, a float32 loss) are kept
            as Python numbers, tuples come back as lists; a key that is no
            str (JSON would make ``{3: 0.9}`` ``{'3': 0.9}``) is refused.

    Raises:
        CheckpointError: ``model`` holds no weight (nothing is written).
        TypeError: metadata that would not load as given.
        OSError: the file could not be written (a full disk, a read-only
            folder); the previous checkpoint at ``path`` is intact.

    The file holds one model that existed: every weight's data and state as
    they were at one instant, between two steps. A ``train()`` in flight
    meanwhile on another thread or event loop commits its step either before
    that instant (all of it is saved) or after it (none of it is), and goes
    on while the file is written: the snapshot holds references, not copies,
    and a step never writes into an array someone holds. So, as save blocks
    on file I/O, ``await anyio.to_thread.run_sync(ml.save, path, model)``
    inside the event loop that trains keeps the loop, and the training, going.

    >>> import os, tempfile, numpy as np, monadl as ml
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> ml.save(path, [ml.Weight(np.zeros(3))])
    >>> os.path.exists(path)
    True
    """
    refuse_while_tracing("ml.save")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"save(path, model): the path comes first (as in equinox and orbax; PyTorch's torch.save "
            f"takes the object first), got {type(path).__name__} as the path"
        )
    not_a_directory(path)
    named, aliases, left_out = named_weights_and_aliases(model)
    weights = stable(named)
    if not weights:  # (refused before anything is written: no empty checkpoint is left behind)
        raise CheckpointError(no_weights(model))
    with COMMIT_LOCK:  # (a step commits under it: before the whole snapshot or after it, never inside)
        taken = [(name, weight._data, weight._state) for name, weight in weights.items()]
    tensors: dict[str, Any] = {}
    entries = []
    for name, data, state in taken:
        put(tensors, name, data)
        entries.append(
            {
                "name": name,
                "shape": list(data.shape),
                "dtype": str(data.dtype),
                "scalar": isinstance(data, np.generic),
                "library": library_name(data),
                "optimizer_state": encode(state, f"{_STATE_PREFIX}{name}", tensors),
            }
        )
    check_metadata(metadata)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "weights": entries,
        "aliases": {alias: name for alias, name in aliases.items() if not ADDRESS.search(alias)},
        "aliases_left_out": left_out,
        "metadata": dict(metadata or {}),
        "digests": {key: digest(array) for key, array in tensors.items()},  # (a damaged file is refused)
    }
    try:
        text = json.dumps(manifest, default=json_scalar)
    except (TypeError, ValueError) as error:
        raise TypeError(f"save: metadata must be JSON data (str, numbers, lists, dicts): {error}") from None
    header = {MANIFEST_KEY: text, MANIFEST_DIGEST_KEY: text_digest(text)}  # (a damaged step count is refused)
    write_atomically(os.fspath(path), lambda target: _write_tensors(tensors, target, header))
    if left_out:
        warnings.warn(
            f"{os.fspath(path)}: {left_out} other paths of shared weights were not recorded (past "
            f"{len(aliases)} aliases, the shortest kept): a model that unties those weights (a block shared "
            "by many layers, held by a copy of its own in each) may find them missing when it loads this file",
            stacklevel=2,
        )


def _write_tensors(tensors: dict[str, Any], path: str, header: dict[str, str]) -> None:
    try:
        save_file(tensors, path, metadata=header)
    except SafetensorError as error:  # (its own error for a failed write, a full disk: an OSError as open's)
        raise OSError(f"save: writing {path} failed: {error}") from error


def load(
    path: str | os.PathLike[str], model: object, *, optimizer_state: bool = True, strict: bool = True
) -> dict[str, Any]:
    """Restore the weights and optimizer state saved at ``path`` into
    ``model``, a model built again in code the way the saved one was (with
    the same optimizers). Returns the ``metadata`` given to `save`.

    With ``optimizer_state=False``, only the weights' values are restored
    and each weight keeps its own optimizer and state: a model for inference,
    or one fine-tuned with other optimizers, from a training checkpoint (as
    PyTorch's ``model.load_state_dict`` without the optimizer's). The
    optimizers' hyperparameters (a learning rate) are never in a checkpoint:
    they are the code's. With ``strict=False`` (PyTorch's word), weights of
    the model missing from the checkpoint keep their values and weights the
    model does not have are passed over, with a warning that names them: a
    model grown since, or a checkpoint written before `named_weights` walked
    what closures, partials and defaults hold. A load that would load no
    weight at all is refused all the same, naming both sides' weights (a
    part of a model saved alone, loaded into the whole: pass the part,
    ``load(path, model["trunk"])``).

    A weight the model reaches by several paths (tied: an embedding that is
    also the output projection) is saved once, under its first path, and
    its other paths are recorded as aliases of it; a weight loads from the
    checkpoint by any of its paths in the model, each found among the
    checkpoint's names and aliases. So a tied weight loads whichever of its
    paths comes first in either model, and two weights of the model that
    the saved model tied both load the one array saved, strict or not (as
    PyTorch's ``load_state_dict`` does from a ``state_dict`` that holds the
    tied tensor under both names): untying a projection to fine-tune it.
    The other way, one weight of the model that the checkpoint holds as two
    arrays apart is refused, or under ``strict=False`` loads the array of
    its first path that has one, with a warning that names both. (A
    checkpoint written before aliases names a tied weight by its first path
    alone: it loads into a model that reaches the weight by that path.)

    Everything is checked before anything changes: the names of the weights
    (none missing, none extra), each one's shape and dtype, the structure
    of each one's optimizer state, and the digest of every array it loads.
    A mismatch raises `CheckpointError` listing every offending weight by
    name, and leaves the model as it was. Only the arrays that load are
    read (not the optimizer state with ``optimizer_state=False``, nor
    weights passed over), each into the array its weight then holds, so a
    load holds what it loads once, beside the weights it replaces until
    they go (a damaged array it does not read is not noticed). Each
    weight keeps the array library and the type it has in memory (a NumPy
    scalar stays one; a CuPy weight gets its values copied to its device).
    Load between steps: a ``train()`` in flight would then step the loaded
    weights along gradients of the weights it read before the load (a load
    that replaces weights such a ``train()`` has read warns, naming them).

    >>> import os, tempfile, numpy as np, monadl as ml
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> ml.save(path, {"w": ml.Weight(np.zeros(3))})
    >>> ml.load(path, {"w": ml.Weight(np.zeros(4))})
    Traceback (most recent call last):
    ...
    monadl.errors.CheckpointError: ...w.safetensors does not fit the model:
      - weight 'w': expected shape (4,), got (3,)
    """
    refuse_while_tracing("ml.load")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"load(path, model): the path comes first, as in save(path, model); got {type(path).__name__} as the path"
        )
    not_a_directory(path)  # (safetensors said only "No such device (os error 19)")
    weights, aliases, _ = named_weights_and_aliases(model)
    with opened(os.fspath(path)) as file:
        manifest = file.manifest
        if not weights:
            raise CheckpointError(no_weights(model, "load", "nothing would load"))
        saved = {entry["name"]: entry for entry in manifest["weights"]}
        found = match(weights, aliases, saved, manifest.get("aliases", {}))
        if len(found.extra) == len(saved):  # (strict or not: a load that loads nothing is never meant)
            raise CheckpointError(nothing_in_common(os.fspath(path), model, list(weights), list(saved), strict))
        used = [sources[0] for sources in found.sources.values() if sources]
        # (only what loads is read: not the optimizer state optimizer_state=False leaves, nor weights passed over)
        states = [key for name in used for key in arrays_of(saved[name]["optimizer_state"])] if optimizer_state else []
        tensors = _Once(file.read([*used, *states]))
    problems = []
    missing, extra = found.missing, found.extra
    left_out = manifest.get("aliases_left_out", 0)
    cut = (
        f" (the checkpoint left {left_out} other paths of its shared weights unrecorded, past the aliases it "
        "records: a weight the saved model shared may be one of these)"
        if left_out
        else ""
    )
    unmatched = [
        *(
            [f"weights of the model missing from the checkpoint: {', '.join(map(repr, missing))}{cut}"]
            if missing
            else []
        ),
        *([f"weights in the checkpoint that the model does not have: {', '.join(map(repr, extra))}"] if extra else []),
    ]
    apart = found.held_apart(strict)
    if strict:
        problems += [*unmatched, *apart]
    updates: list[tuple[Any, Any, Any]] = []
    for name, weight in weights.items():
        if not found.sources[name]:
            continue
        source = found.sources[name][0]
        label = repr(name) if source == name else f"{name!r} (saved as {source!r})"
        try:
            stored = tensors[source]
            if isinstance(weight.dtype, np.dtype) and stored.dtype != weight.dtype:  # (a file is not converted)
                shapes = (
                    f" and shape {tuple(stored.shape)} (the model's: {weight.shape})"
                    if tuple(stored.shape) != weight.shape
                    else ""
                )
                raise CheckpointError(
                    f"weight {label}: the checkpoint holds {stored.dtype}{shapes}, the model's weight is "
                    f"{weight.dtype}; build the weight in the dtype it was saved in (a checkpoint loads as saved, "
                    "not converted)"
                )
            data = replace_data(weight._data, to_library(stored, weight._data), f"weight {label}", copy=False)
            state = None  # (none: the weight keeps its own, read when it is written, not a copy read before)
            if optimizer_state:
                where = f"weight {label}, optimizer state"
                decoded = decode(saved[source]["optimizer_state"], weight._state, tensors, where)
                state = replace_state(weight._state, decoded, where, copy=False)
        except MonadlError as error:
            problems.append(str(error))
            continue
        updates.append((weight, data, state))
    if problems:
        if any(", optimizer state" in problem for problem in problems):  # (say why a state may differ)
            problems.append(
                "an optimizer state of another structure comes from another optimizer: build the model with "
                "the optimizers it was saved with (a schedule where a float rate was, or another chain, differ), "
                "or load the weights' values alone: load(path, model, optimizer_state=False)"
            )
        if unmatched and strict:
            problems.append("load(path, model, strict=False) loads the weights both have and passes the others over")
        raise CheckpointError(f"{os.fspath(path)} does not fit the model:\n  - " + "\n  - ".join(problems))
    if unmatched or apart:  # (strict=False, and everything else fits: said once it loads)
        warnings.warn(f"{os.fspath(path)}: {'; '.join([*unmatched, *apart])} (strict=False: passed over)", stacklevel=2)
    held: Held = None
    try:
        with COMMIT_LOCK:
            _warn_in_flight(weights, updates)
            pin_for_readers([weight for weight, _, _ in updates])
            held = hold()  # (checked and copied above: nothing fails half way, and a Ctrl-C waits for the last write)
            for weight, data, state in updates:
                weight._data = data
                if state is not None:
                    weight._state = state
    finally:
        release(held)  # (after the lock: a handler may save a checkpoint, which takes it)
    return dict(manifest["metadata"])


@final
class _Once(Mapping[str, Any]):
    """Arrays read for a load, each given away the first time it is asked
    for (a weight takes it as its data or state, no copy) and copied after:
    two weights of the model that load one saved array (a tie the model
    undid) each get an array of their own."""

    __slots__ = ("_arrays", "_given")

    def __init__(self, arrays: dict[str, Any]) -> None:
        self._arrays, self._given = arrays, set[str]()

    def __getitem__(self, key: str) -> Any:
        array = self._arrays[key]
        if key in self._given:
            return array.copy()
        self._given.add(key)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def _warn_in_flight(weights: dict[str, Any], updates: list[tuple[Any, Any, Any]]) -> None:
    """Warn where a ``train()`` (or ``gradients()``) running now read some of
    the weights a load replaces: its step will be taken from the loaded
    values along gradients of the ones it read (a mix of two models)."""
    loaded = {weight for weight, _, _ in updates}
    read = [
        name for name, weight in weights.items() if weight in loaded and any(weight in r for r in TRAINING.values())
    ]
    if read:
        shown = ", ".join(map(repr, read[:5])) + (f" and {len(read) - 5} more" if len(read) > 5 else "")
        warnings.warn(
            f"load: a train() in flight has read {shown}; its step will be taken from the loaded values along "
            "gradients of the values it read: load between steps (await the train() first)",
            stacklevel=3,
        )
