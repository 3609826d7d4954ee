"""Which array of a checkpoint each weight of a model loads (`monadl.checkpoint.load`).

A weight is found in a checkpoint by any of its paths in the model, its name
or one of its aliases (`monadl._named.named_weights_and_aliases`), each
looked up among the checkpoint's names and its aliases: the paths by which
the saved model reached a weight it stored once. So a tied weight loads
whichever of its paths comes first in either model, and two weights of a
model that the saved one tied both load the one array saved (as PyTorch's
``state_dict``, which holds a tied tensor under each of its names, loads
them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, final

from monadl.layers import Weight

__all__ = ["Match", "match"]


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
