"""A loom's recorders: calls like one recorded before, recorded by straight-line code.

`Loom.record` reads a call as any operation's call is read (its leaves walked,
its trace found by their types, shapes and views: `Operation.found`), then
checks each operand and records it: a Tree-LSTM's batch of 32 trees of 255
nodes took 28 ms to build at 3.5 us a tree node, half of the 57 ms its run
takes at H = 128 (NumPy by hand's whole step: 57). Calls of one operation in a
batch are alike: the same types nested the same way, index arrays of one
shape and dtype, each layer one of the loom's slots. So once a call is
recorded, `learn` gives the loom a *recorder* of calls like it: Python source
written for its structure (each field read by name, each leaf checked by its
type, as one of this loom's slots, or by its shape and dtype), compiled once
per structure and bound to the loom, the trace and its key. A call it does
not match (another type, length, shape or dtype, a layer that is not this
loom's slot, a closure that now holds other objects, a closed loom, another
thread) gets `MISS` and takes `Loom.record`'s path, which records it or
builds its node as before. So a recorder records the calls that path would
record with this trace, as it would (the same group, operands, slots, line
and result), where the operation's plan finds the trace by types and shapes;
the build above takes 14 ms (`BENCHMARKS.md`). Calls with rows of data
(``X[i:i + 1]``) take the path.

As `dataclasses` writes its methods, the recorders are written as source and
compiled (`_source`): a closure looping over lists of checks would cost the
loops it saves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from sys import _getframe
from threading import get_ident
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from monadl.fold._loom_run import SLOT
from monadl.layers._layer import Layer, _new, _next_serial
from monadl.layers._plans import same
from monadl.layers._recording import MISS
from monadl.layers._site import PACKAGE_DIR
from monadl.layers._structures import _fields

if TYPE_CHECKING:
    from monadl.fold._loom import Loom
    from monadl.layers._operation import Operation
    from monadl.layers._tracing import Trace

__all__ = ["MOST", "CallRecorder", "learn"]

CallRecorder = Callable[[tuple[Any, ...]], Any]

MOST: Final = 4  # (recorders per operation in one loom: past it, its other calls take the path)
_COMPILED: dict[Any, Callable[..., CallRecorder]] = {}  # (per structure: its recorders' maker)
_KEPT: Final = 256


def learn(loom: Loom, op: Operation[Any, Any], args: tuple[Any, ...], leaves: list[Any], trace: Trace) -> None:
    """Give ``loom`` a recorder of ``op``'s calls like this one (``args``,
    read as ``leaves``, found ``trace``), just recorded with each of its
    layers one of the loom's slots and its data index arrays; none where
    such a call's trace is not one the operation's plan finds by types and
    shapes (the walk's), or the operation has its most."""
    from monadl.fold._loom import _Group  # (the loom's: it imports this module)

    kinds = tuple(map(type, args))
    plan = op._plans.get(kinds)
    if plan is None or not op._planned or not same(plan.leaves(args), leaves):
        return
    if any(type(x) is Layer and x._inputs is not loom.inputs for x in leaves):
        return
    parts: list[tuple[str, type]] = []  # (per leaf: how it is read from the arguments, its type)
    structures: list[tuple[str, type, int]] = []  # (per nested value: how read, its type, its length or -1)
    read: list[Any] = []
    for i, x in enumerate(args):
        if not _walk(x, f"a{i}", parts, structures, read):
            return
    if not same(read, leaves):  # (read as the plan reads them, leaf for leaf)
        return
    key, _, layers, fill, _ = loom.traces[id(trace)]
    used = trace.used
    for j, i in enumerate(used):
        if (j in layers) != (parts[i][1] is Layer):
            return
    shape = (
        len(args),
        tuple(structures),
        tuple(parts),
        used,
        trace.outputs,
        op._site is None,
        op._live is not None,
        _result(trace.template, trace.outputs),
    )
    make = _COMPILED.get(shape)
    if make is None:
        if len(_COMPILED) >= _KEPT:  # (they hold the types they check: a program of many keeps the latest)
            _COMPILED.clear()
        make = _COMPILED[shape] = _compiled(*shape)
    arrays = [x for x in leaves if type(x) is np.ndarray]
    loom.recorders.setdefault(op, []).append(
        make(
            loom,
            op,
            trace,
            key,
            fill,
            [kind for _, kind, _ in structures],
            [(x.shape, x.dtype) for x in arrays],
            _Group,
        )
    )


def _walk(
    x: Any, at: str, parts: list[tuple[str, type]], structures: list[tuple[str, type, int]], read: list[Any]
) -> bool:
    """Read ``x`` (found at expression ``at``) as `read_parts` reads it, its
    leaves to ``read``: a dataclass's fields, a tuple's or list's items, else
    a layer or an array (a leaf a recorder checks); False for anything else."""
    kind = type(x)
    if kind is Layer or kind is np.ndarray:
        parts.append((at, kind))
        read.append(x)
        return True
    if kind is tuple or kind is list:
        structures.append((at, kind, len(x)))
        return all(_walk(y, f"{at}[{k}]", parts, structures, read) for k, y in enumerate(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        structures.append((at, kind, -1))
        return all(
            name.isidentifier() and _walk(getattr(x, name), f"{at}.{name}", parts, structures, read)
            for name in _fields(kind)
        )
    return False


def _result(template: Any, outputs: int) -> str:
    """How a recorder makes a call's result from its slots: "output" (the
    one output is the result), "maker" (a dataclass of every output in
    order, or a named tuple's: ``maker(o0, o1)``), else by the trace's filler, given the call's
    leaves ("arguments": the result holds some of them) or not ("outputs")."""
    tag = template[0]
    if tag == "out":
        return "output" if outputs == 1 else "outputs"
    if tag == "call" and list(template[2]) == [("out", k) for k in range(outputs)]:
        return "maker"  # (its maker: the template's, `monadl.layers._structures.template`)
    return "arguments" if _reads(template) else "outputs"


def _reads(template: Any) -> bool:
    """Whether a result's template rebuilds any of the call's leaves (``("arg", j)``)."""
    if template[0] == "arg":
        return True
    if template[0] in ("out", "const"):
        return False
    return any(_reads(t) for t in template[2])


def _compiled(
    count: int,
    structures: tuple[tuple[str, type, int], ...],
    parts: tuple[tuple[str, type], ...],
    used: tuple[int, ...],
    outputs: int,
    own_site: bool,
    live: bool,
    result: str,
) -> Callable[..., CallRecorder]:
    """The maker of recorders of calls of this structure (see `_source`)."""
    namespace: dict[str, Any] = {}
    exec(_source(count, structures, parts, used, outputs, own_site, live, result), _GLOBALS, namespace)
    made: Callable[..., CallRecorder] = namespace["make"]
    return made


_GLOBALS: Final = {
    "MISS": MISS,
    "SLOT": SLOT,
    "Layer": Layer,
    "ndarray": np.ndarray,
    "new": _new,
    "next_serial": _next_serial,
    "get_ident": get_ident,
    "getframe": _getframe,
    "PACKAGE_DIR": PACKAGE_DIR,
}


def _source(
    count: int,
    structures: tuple[tuple[str, type, int], ...],
    parts: tuple[tuple[str, type], ...],
    used: tuple[int, ...],
    outputs: int,
    own_site: bool,
    live: bool,
    result: str,
) -> str:
    """A recorder's maker, as source: ``make(loom, op, trace, key, fill,
    kinds, arrays, Group)`` binds a loom, the operation, its trace and key,
    the result's filler, the nested values' types, the arrays' shapes and
    dtypes and the loom's group type, and returns ``record(args)``: the call
    recorded as `Loom.record` would, or `MISS`."""
    names = ", ".join(f"a{i}" for i in range(count))
    lines = [
        "def make(loom, op, trace, key, fill, kinds, arrays, Group):",
        "    maker = trace.template[1]",
        "    last = [(None, -1)]  # (the line of the last call: its site)",
        "    inputs, groups, thread, base, sites = loom.inputs, loom.groups, loom.thread, loom.base, loom.sites",
        "    seen, unchanged, op_site = op._seen, op._unchanged, op._site",
        *[f"    k{n} = kinds[{n}]" for n in range(len(structures))],
        *[f"    (s{n}, d{n}) = arrays[{n}]" for n in range(sum(kind is np.ndarray for _, kind in parts))],
        "    def record(args):",
        "        if loom.closed or get_ident() != thread:",
        "            return MISS",
        f"        if len(args) != {count}:",
        "            return MISS",
        f"        ({names},) = args",
        "        try:",
    ]
    for n, (at, _kind, length) in enumerate(structures):
        lines.append(f"            if type({at}) is not k{n}{f' or len({at}) != {length}' if length >= 0 else ''}:")
        lines.append("                return MISS")
    for i, (at, _) in enumerate(parts):
        lines.append(f"            x{i} = {at}")
    array = 0
    for i, (_, kind) in enumerate(parts):
        if kind is np.ndarray:
            lines.append(
                f"            if type(x{i}) is not ndarray or x{i}.shape != s{array} or x{i}.dtype is not d{array}:"
            )
            array += 1
        else:  # (one of this loom's slots: only they hold its inputs tuple)
            lines.append(f"            if x{i}._inputs is not inputs:")
        lines.append("                return MISS")
    lines += ["        except AttributeError:", "            return MISS"]
    if live:  # (a closure's cells: the plan holds while they hold the objects it was learned with)
        lines += ["        if op._seen is not seen or not unchanged():", "            return MISS"]
    slots = [i for i in used if parts[i][1] is Layer]
    lines += [f"        p{i} = x{i}._params" for i in slots]  # (a slot's: its first row, its depth)
    lines.append("        depth = 0")
    for i in slots:
        lines += [f"        if p{i}[1] >= depth:", f"            depth = p{i}[1] + 1"]
    lines += [
        "        group = groups.get((depth, key))",
        "        if group is None:",
        "            group = groups[(depth, key)] = Group(trace, key, depth, op_site)",
        "        group.members.append(["
        + ", ".join(f"p{i}[0]" if parts[i][1] is Layer else f"x{i}" for i in used)
        + "])",
    ]
    if own_site:
        lines += [
            "        frame = getframe(2)",
            "        site = last[0]",
            "        if frame.f_lasti != site[1] or frame.f_code is not site[0]:  # (not the last call's line)",
            "            while frame.f_code.co_filename.startswith(PACKAGE_DIR) and frame.f_back is not None:",
            "                frame = frame.f_back",
            "            line = (frame.f_code, frame.f_lasti)",
            "            site = last[0] = sites.setdefault(line, line)",
            "        group.sites.append(site)",
        ]
    else:
        lines.append("        site = op_site")
    lines += [
        "        serial = next_serial()",
        "        first = serial - base",
        "        group.firsts.append(first)",
    ]
    for k in range(outputs):
        lines += [
            f"        o{k} = new(Layer)",
            f"        o{k}._op, o{k}._inputs, o{k}._params, o{k}._site = SLOT, inputs, (first + {k}, depth), site",
            f"        o{k}._serial = {'serial' if k == 0 else 'next_serial()'}",
        ]
    outs = ", ".join(f"o{k}" for k in range(outputs))
    if result == "maker":  # (a dataclass of the outputs in order: a cell's state)
        lines.append(f"        return maker({outs})")
    elif result == "output":
        lines.append("        return o0")
    else:
        leaves = "[" + ", ".join(f"x{i}" for i in range(len(parts))) + "]" if result == "arguments" else "None"
        lines.append(f"        return fill(({outs},), {leaves})")
    lines.append("    return record")
    return "\n".join(lines) + "\n"
