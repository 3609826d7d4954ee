"""Which array of a checkpoint each weight of a model loads (`monadl.checkpoint.load`).

A weight is found in a checkpoint by any of its paths in the model, its name
or one of its aliases (`monadl._named.named_weights_and_aliases`), each
looked up among the checkpoint's names and its aliases: the paths by which
the saved model reached a weight it stored once. So a tied weight loads
whichever of its paths comes first in either model, and two weights of a
model that the saved one tied both load the one array saved (as PyTorch's
``state_dict``, which holds a tied tensor under each of its names, loads
them). Where nothing matches at all, `nothing_in_common` says what the names
suggest: a part of a model saved alone, a larger model saved whole, or a
`DataParallel` saved when its checkpoint named its own fields.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

from monadl.layers import Weight

__all__ = ["Match", "match", "nothing_in_common"]


@final
@dataclass(frozen=True, slots=True)
class Match:
    """Each weight of a model (by its name) with its paths in the model
    (``paths``) and the names, in the checkpoint, of the arrays those paths
    reach (``sources``): none (missing), one, or several (the saved model
    held apart what the model ties; the first is its first path's); and the
    checkpoint's names that no path of the model reaches (``extra``)."""

    paths: dict[str, list[str]]
    sources: dict[str, list[str]]
    extra: list[str]

    @property
    def missing(self) -> list[str]:
        return [name for name, found in self.sources.items() if not found]

    def held_apart(self, strict: bool) -> list[str]:
        """What is wrong, or was done, where a weight of the model has several
        sources (the model ties what the saved model held apart): refused
        under ``strict``, its first path's loaded under ``strict=False``."""
        texts = []
        for name, sources in self.sources.items():
            if len(sources) < 2:
                continue
            text = (
                f"weight {name!r} is one Weight in the model, reached as {', '.join(map(repr, self.paths[name]))}, "
                f"and the checkpoint holds {len(sources)} arrays apart for it, {', '.join(map(repr, sources))}"
            )
            if strict:
                text += (
                    ": build the model with them apart, as saved, or load(path, model, strict=False) loads "
                    f"{sources[0]!r} into it"
                )
            else:
                text += f": loaded {sources[0]!r}, passed over {', '.join(map(repr, sources[1:]))}"
            texts.append(text)
        return texts


def match(
    weights: Mapping[str, Weight[Any, Any]],
    aliases: Mapping[str, str],
    saved: Mapping[str, Any],
    saved_aliases: Mapping[str, str],
) -> Match:
    """Match a model's weights (``weights`` by name, ``aliases`` their other
    paths) with a checkpoint's names (``saved``) and aliases (a checkpoint
    written before aliases has none)."""
    paths: dict[str, list[str]] = {name: [name] for name in weights}
    for alias, name in aliases.items():
        paths[name].append(alias)

    def stored(path: str) -> str | None:
        if path in saved:
            return path
        target = saved_aliases.get(path)
        return target if target in saved else None

    sources = {
        name: list(dict.fromkeys(s for s in map(stored, reached) if s is not None)) for name, reached in paths.items()
    }
    used = {source for found in sources.values() for source in found}
    return Match(paths, sources, [name for name in saved if name not in used])


def nothing_in_common(path: str, model: object, names: Sequence[str], saved: Sequence[str], strict: bool) -> str:
    """Why a load that would load no weight at all is refused (under
    ``strict=False`` too: a load that loads nothing is never meant), with the
    names of both sides, and what to load into where one side's names are
    the other's under a prefix."""
    text = (
        f"{path} does not fit the model: no weight of the model is in the checkpoint, so nothing would load"
        f"{'' if strict else ', even with strict=False'} (the checkpoint holds {_few(saved)}; the model "
        f"{_few(names)})"
    )
    inner = _prefix(names, saved)
    outer = _prefix(saved, names)
    if saved and all(_OLD_DATA_PARALLEL.fullmatch(name) for name in saved):
        text += (
            "; those are a DataParallel's own fields, as ml.save(path, dp) named them before it saved the "
            "model's names ('_weights.0' is dp.weights[0]); with the model built as when saved, load it by that "
            "order once, ml.load(path, {'_weights': dp.weights}) (into the plain model: "
            "{'_weights': monadl.distributed.find_weights(model)}), then ml.save(path, dp) writes the model's names"
        )
    elif inner is not None:
        prefix, example = inner
        text += (
            f"; the model holds the checkpoint's weights under {prefix!r} ({prefix + '.' + example!r} for "
            f"{example!r}): load into that part of the model, {_part(model, prefix)}"
        )
    elif outer is not None:
        prefix, example = outer
        text += (
            f"; the checkpoint holds the model's weights under {prefix!r} ({prefix + '.' + example!r} for the "
            f"model's {example!r}): it was saved from a larger model; load it into that model, built whole, and "
            f"take its {prefix!r}"
        )
    return text + "; nothing was loaded"


_OLD_DATA_PARALLEL: Final = re.compile(r"_weights\.\d+")
"""A name ``ml.save(path, dp)`` wrote for a `DataParallel`'s weights before
the walk saw it as its model (`monadl._named.ModelWrapper`): its field."""


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(map(repr, names[:4]))
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _prefix(longer: Sequence[str], shorter: Sequence[str]) -> tuple[str, str] | None:
    """The prefix under which ``longer`` holds most of ``shorter``'s names,
    with one of them; None where it holds none of them so."""
    short = set(shorter)
    found: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for name in longer:
        parts = name.split(".")
        for cut in range(1, len(parts)):
            rest = ".".join(parts[cut:])
            if rest in short:
                prefix = ".".join(parts[:cut])
                found[prefix] += 1
                examples.setdefault(prefix, rest)
    if not found:
        return None
    prefix = found.most_common(1)[0][0]
    return prefix, examples[prefix]


def _part(model: object, prefix: str) -> str:
    """How to pass the part of ``model`` at the dotted path ``prefix``:
    ``ml.load(path, model['trunk'])``, as its containers reach it."""
    node, text = model, "model"
    for part in prefix.split("."):
        if isinstance(node, Mapping):
            key = next((k for k in node if str(k) == part), None)
            if key is None:
                break
            node, text = node[key], f"{text}[{key!r}]"
        elif isinstance(node, Sequence) and not isinstance(node, str) and part.isdigit() and int(part) < len(node):
            node, text = node[int(part)], f"{text}[{part}]"
        elif part.isidentifier() and hasattr(node, part):
            node, text = getattr(node, part), f"{text}.{part}"
        else:
            break
    else:
        return f"ml.load(path, {text})"
    return f"the object at {prefix!r} (ml.load(path, part))"
