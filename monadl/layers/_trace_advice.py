"""The advice for an operation that keeps many traces (`monadl.layers._operation`):
which of its arguments differ from call to call, and what to do about each.

A trace records the arguments it was traced for (`called`: the data arrays'
shapes and dtypes, the static values, the lengths of lists and tuples, and
which layers are outputs of which other operation's call, by their place in
the call), a few microseconds beside the trace's own milliseconds. Only the
advice reads them (the DEBUG lines at 8, 16, 32, ... traces, the WARNING at
the limit, and the batching log's line of nodes that found no partner,
`monadl.runtime.schedule.batched_log`): which arguments differ among the
traces, and how the traced program uses each. The advice depends on that
use. An array that a step takes as its index (``h[src]``, an embedding's
indices, ``segment_sum``'s ids) must stay plain data, and so must an int
that a step takes as a count (``segment_sum``'s ``num_segments``). Calls of
other shapes or values then cannot share a trace, and no way of passing
them helps: the advice is to leave the cell unmarked, or to batch the
examples by hand. An array used as values can become a layer, and a number
a float, but only a number the trace's arithmetic used as it is (one of its
constants, as ``h * n`` keeps ``n``). An int that no step takes and no
constant equals, Python read: a loop count (``range(depth)``), or an index
or count computed from it (``h[i + 1]``, ``n + 1`` segments). A float is
refused there, so it too stays an int, each value its own trace.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from monadl.layers._layer import Layer
from monadl.layers._primitives import shown
from monadl.layers._site import site_text

if TYPE_CHECKING:  # (the traces hold what `called` records: `monadl.layers._tracing` imports this module)
    from monadl.layers._tracing import Trace

__all__ = ["called", "why_traces"]

Path = tuple[int | str, ...]
"""Where an argument is: its place in the call, then the field, key or item inside it."""

Argument = tuple[Path, str, Any, int | None]
"""One part of a call's signature: where, what kind (``"array"``, ``"value"``,
``"items"``), what (a shape and dtype, a value, a length), and an array's
leaf (its index among the call's operand leaves)."""

_PARTS: Final = 64  # (the most a trace records: a cell of a hundred arguments is advised on its first)
_STATIC: Final = (int, bool, str, np.integer, np.bool_)
_SHOWN: Final = 3  # (values or shapes shown per argument)

_UNMARKED: Final = "leave the operation unmarked (its operations still batch with those of other calls of equal shapes)"
_BY_HAND: Final = (
    f"{_UNMARKED}, or batch the examples by hand: stack their rows into one array, offset each example's indices "
    "by the rows before it, and run the cell once on the stack (ml.segment_sum by the offset ids sums each "
    "example's rows apart, as torch's index_add does)"
)


def called(
    call: tuple[tuple[Any, ...], dict[str, Any]], leaves: list[Any], views: dict[int, tuple[int, int]]
) -> tuple[Argument, ...]:
    """The parts of a call's signature that the advice compares (see the
    module); ``views``, the leaves that are outputs of other operations'
    calls, as `monadl.layers._tracing.traced` takes them."""
    args, kwargs = call
    leaf = {id(x): j for j, x in enumerate(leaves)}
    found: list[Argument] = []
    todo: list[tuple[Path, Any]] = [((k,), v) for k, v in reversed(kwargs.items())]
    todo += [((i,), x) for i, x in reversed(list(enumerate(args)))]
    while todo and len(found) < _PARTS:
        path, x = todo.pop()
        if isinstance(x, np.ndarray):
            found.append((path, "array", (x.shape, x.dtype), leaf.get(id(x))))
        elif type(x) is Layer:  # (which call's output it is, if any: read from that call's node)
            j = leaf.get(id(x))
            found.append((path, "source", None if j is None else views.get(j), j))
        elif isinstance(x, _STATIC) or x is None:
            found.append((path, "value", x, None))
        elif type(x) is tuple or type(x) is list:
            found.append((path, "items", len(x), None))
            todo += [((*path, i), y) for i, y in reversed(list(enumerate(x)))]
        elif type(x) is dict:
            todo += [((*path, f"[{k!r}]"), y) for k, y in reversed(list(x.items()))]
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            todo += [((*path, f.name), getattr(x, f.name)) for f in reversed(dataclasses.fields(x))]
    return tuple(found)


def why_traces(f: Callable[..., Any], traces: dict[Any, Trace]) -> str:
    """The advice for an operation of many traces: which of ``f``'s
    arguments differ among ``traces``, and what to do for each by how the
    cell uses it (see the module)."""
    seen: dict[tuple[Path, str], list[tuple[Trace, Argument]]] = {}  # (by kind too: an int here, an array there)
    for trace in traces.values():
        for part in trace.called:
            seen.setdefault(part[:2], []).append((trace, part))
    differ = {where: parts for where, parts in seen.items() if len({p[2] for _, p in parts}) > 1}
    lists = [path for path, kind in differ if kind == "items"]
    if lists:  # (a new user's attention over per-example lengths concatenated, as once advised: no group grew)
        name = _named(f, lists[0])
        return (
            "one per signature: a list or tuple argument whose length differs per call traces each length apart "
            f"(here {name}), and calls of different lengths never batch together; its items concatenated or "
            "stacked into one layer (ml.concatenate or ml.stack) make one trace for all lengths, but still no "
            "group: calls batch only where their operands' shapes match, so calls of per-example lengths batch "
            f"once padded to one length (the items of {name} and rows of zeros up to the longest, or to one of a "
            "few sizes), with a mask of the real rows passed as data, a bool array (np.arange(longest)[:, None] "
            f"< len({name}) for a column of scores) that the cell applies, ml.where(mask, scores, -np.inf); inside "
            "ml.loom(), build the padded layer in a marked cell of the block, or pass data arrays (a layer built "
            "outside the block's calls makes each call that reads it a node, not recorded)"
        )
    general = (
        "one per signature: calls whose ints, strings or other static arguments, or data arrays' shapes or dtypes, "
        "differ never batch together"
    )
    if differ and all(kind == "source" for _, kind in differ):
        general = "one per signature: calls that pass outputs of other operations' calls in different ways never batch"
    if not differ:  # (objects the closure holds, or arguments past those recorded)
        return (
            f"{general} (pass a number that differs per call as a float, and an array whose shape differs as a "
            "layer, ml.as_layer(x), whose shape is no part of the signature where the cell reads none)"
        )
    kept: dict[str, list[str]] = {}  # indices and counts, by the step that takes them: plain data they stay
    read: list[tuple[Path, str]] = []  # static values that Python reads (a loop count, an index computed from an int)
    advice: list[str] = []
    differing: list[str] = []
    passed: list[str] = []  # layers that are one call's output here, another's there, or no call's
    for (path, kind), parts in differ.items():
        name = _named(f, path)
        if kind == "source":
            differing.append(f"{name}'s source ({_sources(f, parts)})")
            passed.append(name)
            continue
        differing.append(f"{name}'s {_differs_in(kind, parts)} ({_examples(parts)})")
        use = _as_index(parts) if kind == "array" else _as_count(parts)
        if use is not None and kind == "value" and use.startswith(_LOOKUPS):  # (an array index is read as data)
            advice.append(
                f"pass {name} as an integer array, np.asarray({name}), data whose value is no part of the signature"
            )
        elif use is not None:
            kept.setdefault(use, []).append(name)
        elif kind == "array":
            advice += _array_advice(name, parts)
        elif _computed_with(parts):
            advice.append(
                f"pass a number that differs per call as a float, float({name}), as the cell computes with it"
            )
        else:
            read.append((path, kind))
    text = f"{general}; here they differ in {', '.join(differing)}"
    if advice:
        text += f": {'; '.join(advice)}"
    if kept:
        uses = [f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} {use}" for use, names in kept.items()]
        text += (
            f"; {', '.join(uses)}: index arrays and counts must stay plain data (an integer array, an int), each "
            f"shape or value its own trace, and no way of passing them inside a cell changes that: {_BY_HAND}"
        )
    if read:
        ints = all(isinstance(p[2], int | np.integer) for key in read for _, p in differ[key])
        names = [_named(f, path) for path, _ in read]
        text += (
            f"; {' and '.join(names)} {'is' if len(names) == 1 else 'are'} read by Python, not computed with (no "
            "step takes it as it is and no constant of the trace equals it: a loop count, a flag, or an index, a "
            "slice or a count computed from it), so it must stay "
            + (f"an int (float({names[0]}) is refused where Python reads it)" if ints else "as it is")
            + ", each value its own trace: give it a few values (round it up to one of a few sizes, padding the data "
            f"to match), or {'do as for those above' if kept else _BY_HAND}"
        )
    if passed:
        text += (
            "; a trace reads an argument that is one of another operation's call's several outputs from that call's "
            "node, so which arguments are outputs of one call, which of another, and which are none (a marked call's "
            "only output, a layer built outside marked cells, or one a cell returned as it was given it) is part of "
            "its signature: to batch such calls, "
            "pass their arguments alike (a cell that returns an argument unchanged, return h, m, can return its own "
            "output, m * 1.0, so that the next cell gets all of them from one call)"
        )
    return text


def _sources(f: Callable[..., Any], parts: list[tuple[Trace, Argument]]) -> str:
    """Where a layer argument comes from in each of a few traces: which
    output of which call of several outputs (named by the first argument
    from that call), or none (a call's only output is its node, no view of
    it: a new user's cell of one output was said to give "no operation's
    output")."""
    texts: list[str] = []
    for trace, (path, _, view, _) in parts:
        if view is None:
            text = "a layer that is none of a call's several outputs"
        else:
            firsts: dict[int, Path] = {}  # each call's first argument among the trace's
            for p in trace.called:
                if p[1] == "source" and p[2] is not None:
                    firsts.setdefault(p[2][0], p[0])
            source, k = view
            output = f"the {_ORDINALS[k]} output" if k < len(_ORDINALS) else f"output {k} (from 0)"
            first = firsts.get(source, path)
            if first != path:
                text = f"{output} of {_named(f, first)}'s call"
            elif source and 0 in firsts:
                text = f"{output} of a call other than {_named(f, firsts[0])}'s"
            else:
                text = f"{output} of a call"
        if text not in texts:
            texts.append(text)
    more = f", ... {len(texts)} in all" if len(texts) > _SHOWN else ""
    return ", ".join(texts[:_SHOWN]) + more


_ORDINALS: Final = ("first", "second", "third", "fourth")


def _differs_in(kind: str, parts: list[tuple[Trace, Argument]]) -> str:
    """What differs of an argument among its traces: its value, or an array's shape, dtype or both."""
    if kind != "array":
        return "value"
    shapes, dtypes = len({p[2][0] for _, p in parts}) > 1, len({p[2][1] for _, p in parts}) > 1
    return "shape and dtype" if shapes and dtypes else "shape" if shapes else "dtype"


def _array_advice(name: str, parts: list[tuple[Trace, Argument]]) -> list[str]:
    """What to do for an array of values whose shape or dtype differs per call."""
    advice = []
    if len({p[2][0] for _, p in parts}) > 1:
        advice.append(
            f"pass an array whose shape differs as a layer, ml.as_layer({name}), whose shape is no part of the "
            "signature where the cell reads none (one trace for all its shapes; calls batch only where their "
            "operands' shapes match, so calls of per-example lengths batch once padded to one length, with a mask "
            "of the real rows passed as data)"
        )
    dtypes = {p[2][1] for _, p in parts}
    if len(dtypes) > 1:
        first = parts[0][1][2][1]
        advice.append(f"convert {name} to one dtype before the call ({name}.astype(np.{first}))")
    return advice


def _computed_with(parts: list[tuple[Trace, Argument]]) -> bool:
    """Whether every one of ``parts``' traces holds its call's number as
    a constant of its arithmetic (``h * n``, ``h * float(n)``): a value
    that a float argument, a layer in the cell, can take the place of."""
    for trace, (_, _, value, _) in parts:
        if not isinstance(value, int | np.integer) or isinstance(value, bool | np.bool_):
            return False
        consts = getattr(getattr(trace.op, "rule", None), "consts", ())
        if not any(_number(c) and c == value for c in consts):
            return False
    return True


def _number(x: Any) -> bool:
    """Whether a trace's constant is a number (not an array, not a bool)."""
    return isinstance(x, int | float | np.number) and not isinstance(x, bool)


def _as_index(parts: list[tuple[Trace, Argument]]) -> str | None:
    """The step that takes the array of ``parts`` as its parameter (an
    index, indices, segment ids) in one of their traces, as ``getitem's
    index at FILE:LINE``; None where none does (it feeds the values)."""
    for trace, (_, _, _, leaf) in parts:
        program = getattr(trace.op, "rule", None)
        if leaf is None or leaf not in trace.used or program is None:
            continue
        slot = trace.used.index(leaf)
        for step in getattr(program, "steps", ()):
            for position, read in enumerate(step.takes or ()):
                if read == slot or (type(read) is tuple and slot in read):
                    return f"{_parameter(step.op, position)} at {site_text(step.site)}"
    return None


def _as_count(parts: list[tuple[Trace, Argument]]) -> str | None:
    """The parameter that every one of ``parts``' traces gives the int of
    its call (``segment_sum``'s ``num_segments``), as ``segment_sum's
    num_segments at FILE:LINE``; None where there is none (or the values
    are no ints)."""
    common: dict[tuple[str, int], str] | None = None
    for trace, (_, _, value, _) in parts:
        if type(value) is not int and not isinstance(value, np.integer):
            return None
        program = getattr(trace.op, "rule", None)
        found: dict[tuple[str, int], str] = {}
        for step in getattr(program, "steps", ()):
            for position, p in enumerate(step.params):
                if type(p) is int and p == value:
                    found.setdefault((shown(step.op), position), site_text(step.site))
        common = found if common is None else {k: v for k, v in common.items() if k in found}
        if not common:
            return None
    if not common:
        return None
    (op, position), site = next(iter(common.items()))
    return f"{_NAMES.get(op, (op,) * (position + 1))[position]} at {site}"


_LOOKUPS: Final = ("getitem's index", "embedding's indices")

_NAMES: Final = {
    "getitem": ("getitem's index",),
    "embedding": ("embedding's indices",),
    "segment_sum": ("segment_sum's segment_ids", "segment_sum's num_segments"),
    "cross_entropy": ("cross_entropy's labels",),
}


def _parameter(op: Any, position: int) -> str:
    """What a primitive's parameter is called (``getitem's index``)."""
    name = shown(op)
    names = _NAMES.get(name)
    return names[position] if names is not None and position < len(names) else f"{name}'s parameter {position}"


def _examples(parts: list[tuple[Trace, Argument]]) -> str:
    """A few of the shapes or values an argument takes, and how many there are."""
    shown_: list[str] = []
    for _, (_, kind, what, _) in parts:
        text = f"{what[1]}{list(what[0])}" if kind == "array" else repr(what)
        if text not in shown_:
            shown_.append(text)
    more = f", ... {len(shown_)} in all" if len(shown_) > _SHOWN else ""
    return ", ".join(shown_[:_SHOWN]) + more


def _named(f: Callable[..., Any], path: Path) -> str:
    """An argument by its parameter's name and the fields, keys or items
    inside it (``g.src``, ``xs[2]``, ``idx[0]`` of ``*idx``); ``argument 3``
    where the name is unknown."""
    head, *rest = path
    if isinstance(head, int):
        try:
            parameters = list(inspect.signature(f).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        rests = [p.name for p in parameters if p.kind == p.VAR_POSITIONAL]
        if head < len(names):
            text = names[head]
        elif rests:
            text = f"{rests[0]}[{head - len(names)}]"
        else:
            text = f"argument {head + 1}"
    else:
        text = str(head)
    for part in rest:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += part if part.startswith("[") else f".{part}"
    return text
