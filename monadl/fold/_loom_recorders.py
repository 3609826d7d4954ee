"""A loom's groups of recorded calls, and its recorders: calls like one recorded before, recorded by straight-line code.

`Loom.record` reads a call as any operation's call is read (its leaves walked,
its trace found by their types, shapes and views: `Operation.found`), then
checks each operand and records it in a `Group`: a Tree-LSTM's batch of 32
trees of 255 nodes took 28 ms to build at 3.5 us a tree node, half of the
57 ms its run takes at H = 128 (NumPy by hand's whole step: 57). Calls of one
operation in a batch are alike: the same types nested the same way, index
arrays of one shape and dtype, each layer one of the loom's slots. So once a
call is recorded, `learn` gives the loom a *recorder* of calls like it:
Python source written for its structure (each field read by name, each
nested value's type checked, each layer as one of this loom's slots, each
array by its type, shape and dtype), compiled once per structure and bound to
the loom, the trace and its key. A call it does not match (another type,
length, shape or dtype, a layer that is neither this loom's slot nor a row of
NumPy data given as ``ml.as_layer`` (a `Vector`'s) of the shape and dtype it
learned, a closure that now holds other objects, a trace
the operation has since forgotten, a closed loom, another thread) gets `MISS`
and takes `Loom.record`'s path, which records it or builds its node as
before. So a recorder records the calls that path would record with this
trace, as it would (the same group, operands, slots, line and result), where
the operation's plan finds the trace by types and shapes; the build above
takes 14 ms (`BENCHMARKS.md`).

As `dataclasses` writes its methods, the recorders are written as source and
compiled (`_source`; a traceback shows its lines): a closure looping over
lists of checks would cost the loops it saves.
"""

from __future__ import annotations

import dataclasses
import itertools
import keyword
import linecache
from collections.abc import Callable
from sys import _getframe
from threading import get_ident
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import numpy as np

from monadl.fold._loom_run import SLOT
from monadl.layers._dataclasses import SLOTTED, fields
from monadl.layers._layer import Layer, _new, _next_serial
from monadl.layers._plans import same
from monadl.layers._primitives import AS_LAYER
from monadl.layers._recording import MISS
from monadl.layers._site import PACKAGE_DIR

if TYPE_CHECKING:
    from monadl.fold._loom import Loom
    from monadl.layers._operation import Operation
    from monadl.layers._site import Site
    from monadl.layers._tracing import Trace

__all__ = ["MOST", "CallRecorder", "Group", "learn"]

CallRecorder = Callable[[tuple[Any, ...]], Any]

MOST: Final = 4  # (recorders tried per operation in one loom: past it, its other calls take the path)
_NESTED: Final = 8  # (levels of nested tuples, lists and dataclasses a recorder reads; deeper: the path)
_LEAVES: Final = 64  # (leaves a recorder reads; more: the path)


@final
class Group:
    """The calls of one trace at one depth: per operand position (per leaf
    the program takes) the members' operands, each a slot or a data array,
    and per member its first slot. A call's slots are numbered from its
    first layer's number (less the loom's), so that an error finds the input
    of the batch it was built for. Kept by position, not a list per member:
    the schedule reads them so, and a call appends its operands with no list
    made (a Tree-LSTM's batch: 8,000 lists made, transposed and freed)."""

    __slots__ = ("columns", "depth", "firsts", "key", "site", "sites", "trace")

    def __init__(self, trace: Trace, key: int, depth: int, site: Site | None) -> None:
        self.trace = trace
        self.key = key  # (its outputs' first key: which arena each goes to, `Schedule`)
        self.depth = depth
        self.site = site  # (its block's line: where each of its calls was built)
        self.sites: list[Site] = []  # (else, per member, the line that called it: an ``ml.loom()`` block's)
        self.columns: list[list[Any]] = [[] for _ in trace.used]
        self.firsts: list[int] = []

    def member(self, row: int) -> list[Any]:
        """The operands of call ``row``."""
        return [column[row] for column in self.columns]

    def add(self, operands: list[Any]) -> None:
        for column, x in zip(self.columns, operands):
            column.append(x)


class _Structure(NamedTuple):
    """What a recorder's source is written for (`_source`), and its key among those compiled."""

    arguments: int
    nested: tuple[tuple[str, type, int], ...]  # (per nested value: where it is read, its type, its length or -1)
    leaves: tuple[tuple[str, type], ...]  # (per leaf: where it is read, its type: a layer, an array or a `_Row`)
    used: tuple[int, ...]  # (the leaves the trace's program takes)
    outputs: int
    own_site: bool  # (each call's line is its site: an ``ml.loom()`` block's; else the operation's)
    live: bool  # (a closure whose cells may come to hold other objects: checked per call)
    result: str  # (how the result is made: `_result`)


_COMPILED: dict[_Structure, Callable[..., CallRecorder]] = {}  # (per structure: its recorders' maker)
_KEPT: Final = 256  # (makers kept: they hold the types they check; a program of more keeps the latest)
_NUMBERS: Final = itertools.count()  # (of their sources' file names)


def learn(loom: Loom, op: Operation[Any, Any], args: tuple[Any, ...], leaves: list[Any], trace: Trace) -> None:
    """Give ``loom`` a recorder of ``op``'s calls like this one (``args``,
    read as ``leaves``, found ``trace``), just recorded with its layers the
    loom's slots; none where the operation's plan does not find such a
    call's trace by types and shapes (the walk does), or the call's
    structure is not one a recorder reads (a dict, an int, a keyword's
    field name, nesting past `_NESTED`)."""
    kinds = tuple(map(type, args))
    plan = op._plans.get(kinds)
    if plan is None or not op._planned or not same(plan.leaves(args), leaves) or len(leaves) > _LEAVES:
        return
    if any(type(x) is Layer and x._inputs is not loom.inputs and not _row(x) for x in leaves):
        return
    parts: list[tuple[str, type]] = []
    nested: list[tuple[str, type, int]] = []
    read: list[Any] = []
    if not all(_walk(x, f"a{i}", parts, nested, read, 0) for i, x in enumerate(args)):
        return
    if not same(read, leaves):  # (read as the plan reads them, leaf for leaf)
        return
    key, _, layers, fill, _ = loom.traces[id(trace)]
    used = trace.used
    if any((j in layers) != (parts[i][1] is not np.ndarray) for j, i in enumerate(used)):
        return
    # The group key's part for rows, as `Loom.record` makes it: which operands are rows, and each one's data.
    rows = [(j, read[i]._inputs[0]) for j, i in enumerate(used) if parts[i][1] is _Row]
    rowkey = (sum(1 << j for j, _ in rows), *[(type(x), x.shape, x.dtype) for _, x in rows]) if rows else ()
    live = op._live is not None
    structure = _Structure(
        len(args), tuple(nested), tuple(parts), used, trace.outputs, op._site is None, live, _result(trace)
    )
    make = _COMPILED.get(structure)
    if make is None:
        if len(_COMPILED) >= _KEPT:
            _COMPILED.clear()
        make = _COMPILED[structure] = _compiled(structure, getattr(op, "__name__", "operation"))
    data = [x if kind is np.ndarray else x._inputs[0] for x, (_, kind) in zip(read, parts) if kind is not Layer]
    arrays = [(x.shape, x.dtype) for x in data]
    recorder = make(loom, op, trace, key, rowkey, fill, [kind for _, kind, _ in nested], arrays, Group)
    loom.recorders.setdefault(op, []).append(recorder)


def _walk(
    x: Any, at: str, parts: list[tuple[str, type]], nested: list[tuple[str, type, int]], read: list[Any], level: int
) -> bool:
    """Read ``x`` (found at expression ``at``) as `read_parts` reads it, its
    leaves to ``read``: a dataclass's fields, a tuple's or list's items, else
    a layer or an array (a leaf a recorder checks); False for anything else."""
    kind = type(x)
    if kind is Layer or kind is np.ndarray:
        parts.append((at, _Row if kind is Layer and _row(x) else kind))
        read.append(x)
        return True
    if level >= _NESTED:
        return False
    if kind is tuple or kind is list:
        nested.append((at, kind, len(x)))
        return all(_walk(y, f"{at}[{k}]", parts, nested, read, level + 1) for k, y in enumerate(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        nested.append((at, kind, -1))
        return all(
            name.isidentifier()
            and not keyword.iskeyword(name)
            and _walk(getattr(x, name), f"{at}.{name}", parts, nested, read, level + 1)
            for name in fields(kind)
        )
    return False


@final
class _Row:
    """A leaf's kind in a recorder's structure: a row of NumPy data given
    as a layer (``ml.as_layer(x)``, a `Vector`'s), which its group stacks."""


def _row(x: Layer[Any, Any]) -> bool:
    """Whether ``x`` is a row of NumPy data given as a layer (`_Row`)."""
    return x._op is AS_LAYER and type(x._inputs[0]) is np.ndarray


def _result(trace: Trace) -> str:
    """How a recorder makes a call's result from its slots: "output" (the
    one output is the result), "maker" (a dataclass or named tuple of every
    output in order: ``maker(o0, o1)``, the template's maker; "slots" where
    that maker only stores them in its slots, `SLOTTED`: its stores), else by the
    trace's filler, given the call's leaves ("arguments": the result holds
    some of them) or not ("outputs")."""
    template, outputs = trace.template, trace.outputs
    tag = template[0]
    if tag == "out":
        return "output" if outputs == 1 else "outputs"
    if tag == "call" and list(template[2]) == [("out", k) for k in range(outputs)]:
        return "slots" if template[1] in SLOTTED else "maker"
    return "arguments" if _reads(template) else "outputs"


def _reads(template: Any) -> bool:
    """Whether a result's template rebuilds any of the call's leaves (``("arg", j)``)."""
    if template[0] == "arg":
        return True
    if template[0] in ("out", "const"):
        return False
    return any(_reads(t) for t in template[2])


_GLOBALS: Final = {
    "MISS": MISS,
    "SLOTTED": SLOTTED,
    "SLOT": SLOT,
    "AS_LAYER": AS_LAYER,
    "Layer": Layer,
    "ndarray": np.ndarray,
    "new": _new,
    "next_serial": _next_serial,
    "get_ident": get_ident,
    "getframe": _getframe,
    "PACKAGE_DIR": PACKAGE_DIR,
}


def _compiled(structure: _Structure, name: str) -> Callable[..., CallRecorder]:
    """The maker of recorders of calls of ``structure`` (see `_source`), its
    lines kept for tracebacks under a file name of its own."""
    source = _source(structure)
    filename = f"<monadl.loom recorder {next(_NUMBERS)}: {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), _GLOBALS, namespace)
    made: Callable[..., CallRecorder] = namespace["make"]
    return made


def _source(structure: _Structure) -> str:
    """A recorder's maker, as source: ``make(loom, op, trace, key, rowkey,
    fill, kinds, arrays, Group)`` binds a loom, the operation, its trace and
    key, its rows' part of its groups' keys, the result's filler, the nested
    values' types, the arrays' (and rows' data's) shapes and dtypes and the
    group type, and returns ``record(args)``: the call
    recorded as `Loom.record` would, or `MISS`.

    >>> source = _source(_Structure(1, (), (("a0", Layer),), (0,), 1, False, False, "output"))
    >>> [line.strip() for line in source.splitlines() if "x0" in line]
    ['x0 = a0', 'if x0._inputs is not inputs:', 'p0 = x0._params']
    """
    count, nested, parts, used, outputs, own_site, live, result = structure  # (count: arguments)
    lines = [
        "def make(loom, op, trace, key, rowkey, fill, kinds, arrays, Group):",
        "    maker = trace.template[1]",
        *(
            [f"    kind, ({''.join(f'store{k}, ' for k in range(outputs))}) = SLOTTED[maker]"]
            if result == "slots"
            else []
        ),
        "    site, code, at = None, None, -1  # (the last call's site: its line's code and instruction)",
        "    inputs, groups, thread, base, site_of = loom.inputs, loom.groups, loom.thread, loom.base, loom.site_of",
        "    seen, unchanged, op_site, evictions = op._seen, op._unchanged, op._site, op._evictions",
        "    appends = {}  # (per depth, its group's appends: no key made and hashed, no method looked up, per call)",
        *[f"    k{n} = kinds[{n}]" for n in range(len(nested))],
        *[f"    (s{n}, d{n}) = arrays[{n}]" for n in range(sum(kind is not Layer for _, kind in parts))],
        "    def record(args):",
        *(["        nonlocal site, code, at"] if own_site else []),
        "        if loom.closed or get_ident() != thread or op._evictions != evictions:",
        "            return MISS",
        f"        if len(args) != {count}:",
        "            return MISS",
    ]
    if count:
        lines.append(f"        ({', '.join(f'a{i}' for i in range(count))},) = args")
    lines.append("        try:")
    for n, (at, _, length) in enumerate(nested):
        lines.append(f"            if type({at}) is not k{n}{f' or len({at}) != {length}' if length >= 0 else ''}:")
        lines.append("                return MISS")
    for i, (at, _) in enumerate(parts):
        lines.append(f"            x{i} = {at}")
    array = 0
    for i, (_, kind) in enumerate(parts):
        if kind is Layer:  # (one of this loom's slots: only they hold its inputs tuple)
            lines.append(f"            if x{i}._inputs is not inputs:")
        else:  # (an array, or a row's: a layer of NumPy data)
            data = f"x{i}"
            if kind is _Row:
                lines += [f"            if x{i}._op is not AS_LAYER:", "                return MISS"]
                data = f"x{i}._inputs[0]"
                lines.append(f"            r{i} = {data}")
                data = f"r{i}"
            lines.append(
                f"            if type({data}) is not ndarray or {data}.shape != s{array} or {data}.dtype is not d{array}:"
            )
            array += 1
        lines.append("                return MISS")
    lines += ["            pass", "        except AttributeError:", "            return MISS"]
    if live:  # (a closure's cells: the plan holds while they hold the objects it was learned with)
        lines += ["        if op._seen is not seen or not unchanged():", "            return MISS"]
    slots = [i for i in used if parts[i][1] is Layer]
    rows = any(parts[i][1] is _Row for i in used)  # (its group's key holds them: `Loom.record`'s)
    lines += [f"        p{i} = x{i}._params" for i in slots]  # (a slot's: its first row, its depth)
    lines.append("        depth = 0")
    for i in slots:
        lines += [f"        if p{i}[1] >= depth:", f"            depth = p{i}[1] + 1"]
    operands = [f"p{i}[0]" if parts[i][1] is Layer else f"x{i}" for i in used]
    at = "(depth, key, *rowkey)" if rows else "(depth, key)"
    lines += [
        "        found = appends.get(depth)",
        "        if found is None:",
        f"            group = groups.get({at})",
        "            if group is None:",
        f"                group = groups[{at}] = Group(trace, key, depth, op_site)",
        "            found = appends[depth] = (group.sites.append, group.firsts.append,"
        " *[column.append for column in group.columns])",
        f"        (add_site, add_first, {''.join(f'c{p}, ' for p in range(len(used)))}) = found",
        *[f"        c{p}({x})" for p, x in enumerate(operands)],
    ]
    if own_site:  # (as `Loom.record` finds it; the last call's line kept: a tree's calls come from two lines)
        lines += [
            "        frame = getframe(2)",
            "        if frame.f_lasti != at or frame.f_code is not code:",
            "            while frame.f_code.co_filename.startswith(PACKAGE_DIR) and frame.f_back is not None:",
            "                frame = frame.f_back",
            "            code, at = frame.f_code, frame.f_lasti",
            "            site = site_of(code, at)",
            "        add_site(site)",
        ]
    else:
        lines.append("        site = op_site")
    lines += ["        serial = next_serial()", "        first = serial - base", "        add_first(first)"]
    for k in range(outputs):
        lines += [
            f"        o{k} = new(Layer)",
            f"        o{k}._op, o{k}._inputs, o{k}._params, o{k}._site = SLOT, inputs, (first + {k}, depth), site",
            f"        o{k}._serial = {'serial' if k == 0 else 'next_serial()'}",
        ]
    outs = ", ".join(f"o{k}" for k in range(outputs))
    if result == "slots":  # (`maker`'s own lines: a new object, each output in its slot)
        lines.append("        made = new(kind)")
        lines += [f"        store{k}(made, o{k})" for k in range(outputs)]
        lines.append("        return made")
    elif result == "maker":
        lines.append(f"        return maker({outs})")
    elif result == "output":
        lines.append("        return o0")
    else:
        leaves = f"[{', '.join(f'x{i}' for i in range(len(parts)))}]" if result == "arguments" else "None"
        lines.append(f"        return fill(({outs},), {leaves})")
    lines.append("    return record")
    return "\n".join(lines) + "\n"
