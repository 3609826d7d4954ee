"""The DEBUG log of dynamic batching (the ``monadl.batching`` logger): a
graph the cost rule leaves unbatched and why (`unbatched`), or whose
batched run grouped nothing that pays (`paid_nothing`), what a batched run or a merge
grouped (`ran`, `merged`), and a group that ran node by node although its
size would batch (`declined`)."""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from typing import Any, Final, final

from monadl.layers._primitives import Primitive, shown
from monadl.layers._program import Program, batching_rule
from monadl.layers._site import site_text
from monadl.layers._trace_advice import why_traces
from monadl.layers._weight import Weight
from monadl.runtime.schedule.batched_signature import operand_parts

__all__ = [
    "FORCES",
    "NO_FORCE",
    "Alone",
    "declined",
    "merged",
    "paid_nothing",
    "ran",
    "unbatched",
    "watching",
]

_log: Final = logging.getLogger("monadl.batching")

FORCES: Final = "; ml.settings(batching=True) forces it"
NO_FORCE: Final = (
    "; ml.settings(batching=True) would not batch them either: it groups nodes under their group's minimum, and "
    "these had none of their signature"
)


def unbatched(order: list[Any], why: str, advice: str = FORCES) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a graph the cost rule leaves to run node by node."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "a graph of %d nodes (its last built at %s) runs unbatched: %s%s",
            len(order),
            site_text(order[-1]._site),
            why,
            advice,
        )


def paid_nothing(order: list[Any], why: str, then: str, alone: Alone | None, records: Any, where: Any) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a graph whose batched run
    grouped nothing that pays, and why its nodes ran one by one (`Alone`; a
    new user's graph of per-example lengths was told only 'no group of one
    signature', and to force batching, which groups no node that has no
    partner); ``then``: when it is analysed again."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    reasons = "" if alone is None else _why_alone(alone, records or {}, where or {})
    forces = alone is None or alone.small or alone.coarse  # (what forcing batches: small groups, coarse members)
    unbatched(order, f"{why}{reasons}; {then}", FORCES if forces else NO_FORCE)


@final
class Alone:
    """What a batched run ran one by one, and why, kept only while the log is
    on for DEBUG (`watching`): the nodes that had no partner of their
    signature among those ready with them (``single``), and how many ran in
    groups under their minimum (``small``), of coarse members (``coarse``)
    or had no signature (``unsigned``; ``looms``: ``ml.loom()`` blocks'
    nodes, ``reads``: of their calls' outputs). Groups declined for another
    reason have their own lines (`declined`)."""

    __slots__ = ("coarse", "looms", "reads", "single", "small", "unsigned")

    def __init__(self) -> None:
        self.single: list[Any] = []
        self.small = self.coarse = self.unsigned = self.looms = self.reads = 0

    def few(self, members: list[Any]) -> None:
        """A group too small to batch: one node alone, or under its minimum."""
        if len(members) == 1:
            self.single.append(members[0])
        else:
            self.small += len(members)


def watching() -> Alone | None:
    """An `Alone` for a batched run where the log is on for DEBUG, else None
    (the run then keeps nothing: one check where a group runs one by one)."""
    return Alone() if _log.isEnabledFor(logging.DEBUG) else None


def ran(
    order: list[Any], groups: int, members: int, alone: Alone | None = None, records: Any = None, where: Any = None
) -> None:
    """Log (at DEBUG, to ``monadl.batching``) what a batched run of a graph
    grouped: how many nodes ran in how many groups, the rest one by one (a
    new user forced batching on examples of different lengths, which never
    group, and the log said nothing), and why they did (`Alone`; a new
    user's graph network got counts only)."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    why = "" if alone is None else _why_alone(alone, records or {}, where or {})
    if not groups:  # (forced, and no two nodes alike)
        _log.debug(
            "a graph of %d nodes (its last built at %s) went through batching, and no two of its nodes were alike: "
            "all ran one by one%s",
            len(order),
            site_text(order[-1]._site),
            why,
        )
    else:
        _log.debug(
            "a graph of %d nodes (its last built at %s) ran batched: %d nodes in %d groups, %d one by one%s",
            len(order),
            site_text(order[-1]._site),
            members,
            groups,
            len(order) - members,
            why,
        )


_NAMED: Final = 3  # (the primitives named among the nodes that ran alone, most first)
_COMPARED: Final = 64  # (nodes of one primitive compared with the first, to find a signature that differs)


def _why_alone(alone: Alone, records: Any, where: Any) -> str:
    """The reasons `Alone` kept, as the log line's end (empty where none)."""
    said: list[str] = []
    single = alone.single
    if single:
        names = {_cell(node._op): shown(node._op) for node in single}
        counts = Counter(_cell(node._op) for node in single)
        top = counts.most_common(_NAMED)
        labels, apart = _labels([cell for cell, _ in counts.most_common()], names, {names[c] for c, _ in top})
        named = ", ".join(f"{labels[cell]} {count}" for cell, count in top)
        more = ", ..." if len(counts) > _NAMED else ""
        said.append(
            f"{len(single)} had no partner of their signature among the nodes ready with them ({named}{more}{apart}); "
            "nodes run as one kernel only with nodes of one primitive (one trace of a marked operation) whose "
            "operands have equal shapes and dtypes and whose parameters are equal"
            + _differ([n for n in single if _cell(n._op) == top[0][0]], records, where, labels[top[0][0]])
        )
    if alone.small:
        said.append(
            f"{alone.small} in groups too small to pay (MIN_GROUP; a marked operation's group from 2 to 4: marked_minimum)"
        )
    if alone.coarse:
        said.append(f"{alone.coarse} in groups of coarse members (MAX_MEMBER_SIZE), which batching would not speed")
    if alone.unsigned:
        said.append(f"{alone.unsigned} with no signature (a plain number or another library's array among operands)")
    reads = f"{alone.reads} read{'' if alone.reads == 1 else 's'}"
    if alone.looms == 1:
        said.append(
            f"the node of an ml.loom() block (its calls run inside it, by depth) and {reads} of its calls' outputs"
        )
    elif alone.looms or alone.reads:
        said.append(
            f"the nodes of {alone.looms} ml.loom() blocks and {reads} of their calls' outputs: each block runs its own "
            "calls, by depth, not with another block's (a block in each of many examples evaluated together: make "
            "one block around them all, or none)"
        )
    return f": {'; '.join(said)}" if said else ""


def merged(order: list[Any], fibers: int) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a merge of fibers' graphs that
    runs batched: batching across control flow, one line a merge."""
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "a merge of %d fibers' graphs (%d nodes, the last built at %s) runs batched",
            fibers,
            len(order),
            site_text(order[-1]._site),
        )


def declined(members: list[Any], why: str | None) -> None:
    """Log (at DEBUG, to ``monadl.batching``) a group of equal signature that
    runs node by node although its size would batch, and why."""
    if not _log.isEnabledFor(logging.DEBUG):
        return
    node = members[0]
    if why is None:
        step = node._op.rule.declined if type(node._op.rule) is Program else None
        if step is None:
            why = "its batching rule does not take these operands"
        else:
            why = f"its step {shown(step.op)} at {site_text(step.site)} " + (
                "has no batching rule" if batching_rule(step.op) is None else "does not batch with these operands"
            )
    _log.debug(
        "%d nodes of %s built at %s ran one by one: %s", len(members), shown(node._op), site_text(node._site), why
    )


def _cell(op: Primitive) -> Any:
    """What the nodes of ``op`` are counted by: a marked operation's function
    (its traces' nodes are one operation's; functions of one name, three
    lambdas one helper made, are not), else the primitive's name."""
    trace = op.rule.trace() if type(op.rule) is Program and op.rule.trace is not None else None
    cell = None if trace is None else trace.cell
    return shown(op) if cell is None else _Function(cell)


@final
class _Function:
    """A function by identity, as a key (a bound method hashes as its object,
    which may not hash: a dataclass's)."""

    __slots__ = ("f",)

    def __init__(self, f: Any) -> None:
        self.f = f

    def __eq__(self, other: object) -> bool:
        return type(other) is _Function and other.f is self.f

    def __hash__(self) -> int:
        return id(self.f)


def _labels(cells: list[Any], names: dict[Any, str], said_of: set[str]) -> tuple[dict[Any, str], str]:
    """Each of ``cells`` (`_cell`'s) as the log names it: by its name
    (``names``), and functions of one name told apart, by where each is
    defined, or, defined at one line (by a helper called once per
    function), numbered in the order of ``cells``; the text returned second
    says so of the names in ``said_of`` (else it is empty)."""
    labels = dict(names)
    by_name: dict[str, list[Any]] = {}
    for cell in cells:
        by_name.setdefault(names[cell], []).append(cell)
    said = []
    for name, cells in by_name.items():
        if len(cells) < 2:
            continue
        sites = [_defined_at(cell) for cell in cells]
        if None not in sites and len(set(sites)) == len(sites):
            labels.update({cell: f"{name} (defined at {site})" for cell, site in zip(cells, sites)})
        else:
            labels.update({cell: f"{name} [{k}]" for k, cell in enumerate(cells, 1)})
            at = "" if sites[0] is None or len(set(sites)) > 1 else f", all defined at {sites[0]}"
            if name in said_of:
                said.append(f"{name} [1], [2], ...: {len(cells)} different functions of that name{at}")
    return labels, "".join(f"; {text}" for text in said)


def _defined_at(cell: Any) -> str | None:
    """``file:line`` where a function (a bound method's too) is defined; None for other callables."""
    f = cell.f if type(cell) is _Function else None
    code = getattr(getattr(f, "__func__", f), "__code__", None)
    return None if code is None else f"{code.co_filename}:{code.co_firstlineno}"


def _why_traces(ops: list[Primitive]) -> str:
    """Which arguments differ among the traces of ``ops`` (one operation's),
    as the operation's own advice says it (`why_traces`)."""
    traces = {op: op.rule.trace() for op in ops if type(op.rule) is Program and op.rule.trace is not None}
    cells = {id(t.cell) for t in traces.values() if t is not None}
    if (
        len(traces) < len(ops) or None in traces.values() or len(cells) != 1
    ):  # (a trace forgotten: `_operation_traces.evict`)
        return "one per signature of its calls"
    return why_traces(next(iter(traces.values())).cell, traces)


def _differ(nodes: list[Any], records: Any, where: Any, label: str) -> str:
    """Why ``nodes`` (of one primitive, or one marked operation, named
    ``label``) found no partner: that they come from different traces of
    the operation, and which of its arguments differ among them, and an
    example of two whose signatures differ, and in what (``operand 1's
    shape: int64[57] against int64[80]``), or of two of one signature at
    different depths."""
    by_op: dict[Any, list[Any]] = {}
    for node in nodes:
        by_op.setdefault(node._op, []).append(node)
    first = nodes[0]
    said = ""
    if type(first._op.rule) is Program and len(by_op) > 1:
        said = (
            f"; the {len(nodes)} {label} nodes come from {len(by_op)} traces of the operation, and nodes of "
            f"different traces never run as one; the traces are {_why_traces(list(by_op))}"
        )
    same = max(by_op.values(), key=len)
    if len(same) < 2:
        return said
    first = same[0]
    mine = operand_parts(records, first, where)
    for other in same[1:_COMPARED]:
        found = _difference(first._op, mine, operand_parts(records, other, where))
        if found is not None:
            return (
                f"{said}; e.g. two {label} nodes built at {site_text(first._site)} and "
                f"{site_text(other._site)} differ in {found}"
            )
    return (
        f"{said}; {len(same)} {label} nodes of one signature (built at {site_text(first._site)}) "
        "ran apart, at different depths of the graph (a group's members are ready together: one that feeds "
        "another never joins it)"
    )


def _difference(op: Primitive, mine: list[tuple[str, Any]], theirs: list[tuple[str, Any]]) -> str | None:
    """In what two nodes' signatures (`operand_parts`) differ, in words
    (``operand 1's shape: int64[57] against int64[80]``, ``their index:
    [0, 1] against [0, 2]``); None where they do not. Operands of another
    count first: their parts, zipped, would pair an operand with a
    parameter."""
    counts = [sum(name.startswith("operand") for name, _ in parts) for parts in (mine, theirs)]
    if counts[0] != counts[1]:
        return f"their number of operands: {counts[0]} against {counts[1]}"
    for (what, x), (_, y) in zip(mine, theirs):
        if x != y:
            if what.startswith("parameter"):
                name = _parameter_name(op, counts[0], int(what.split()[1]))
                shown_ = _part if name != "index" else _index
                return f"{what if name is None else f'their {name}'}: {shown_(x)} against {shown_(y)}"
            return f"{what}'s {_aspect(x, y)}"
    return None


def _parameter_name(op: Primitive, operands: int, j: int) -> str | None:
    """The name of a primitive's parameter ``j`` (after its ``operands``), as
    its rule's signature gives it (``getitem``'s ``index``); None where the
    rule takes its operands as ``*args``, or is a marked operation's."""
    try:
        parameters = list(inspect.signature(op.rule).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters) or operands + j >= len(parameters):
        return None
    return parameters[operands + j].name


def _aspect(x: Any, y: Any) -> str:
    """What differs between two operands' parts of signatures, and how, in words."""
    if _is_array_part(x) and _is_array_part(y):
        if x[1] != y[1]:
            return f"shape: {x[2]}{list(x[1])} against {y[2]}{list(y[1])}"
        if x[2] != y[2]:
            return f"dtype: {x[2]} against {y[2]}"
        return f"type: {x[0].__name__} against {y[0].__name__}"
    if isinstance(x, Weight) or isinstance(y, Weight):
        return "weight: two different weights" if isinstance(x, Weight) and isinstance(y, Weight) else "kind"
    if isinstance(x, Primitive) and isinstance(y, Primitive):
        return f"primitive: {x.name} against {y.name}"
    return f"value: {_part(x)} against {_part(y)}"


def _is_array_part(x: Any) -> bool:
    return type(x) is tuple and len(x) == 3 and type(x[1]) is tuple and hasattr(x[2], "itemsize")


def _part(x: Any) -> str:
    """A parameter's or plain number's part of a signature (`operand_parts`)
    as a user writes it: a slice as ``1:3``, a tuple as ``(0, 1)``, a number
    as itself (``-0.0`` too), a number that any of its kind matches as ``any
    float``, an array as ``a float32 scalar`` or ``a float32[2, 3] array``
    (a new user's log showed ``(<class 'tuple'>, (<class 'int'>, 0), ...)``)."""
    if type(x) is not tuple or not x:
        return "none" if x is None else repr(x)
    head = x[0]
    if head is slice:
        return ":".join("" if v is None else str(v) for v in x[1:3]) + ("" if x[3] is None else f":{x[3]}")
    if head is tuple:
        items = [_part(p) for p in x[1:]]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if _is_array_part(x):
        article = "an" if str(x[2]).startswith("i") else "a"
        return f"{article} {x[2]} scalar" if x[1] == () else f"{article} {x[2]}{list(x[1])} array"
    if type(head) is type and len(x) == 1:
        return f"any {head.__name__}"
    if type(head) is type and len(x) == 2:
        value = x[1][0] if type(x[1]) is tuple else x[1]  # (`number_key`'s zero: the value and its text)
        return "..." if value is Ellipsis else repr(value)
    if type(head) is int and all(_is_array_part(p) for p in x[1:]):  # an operation node's outputs
        return f"{head} outputs ({', '.join(_part(p) for p in x[1:])})"
    return repr(x)


def _index(x: Any) -> str:
    """An index's part of a signature as the user wrote it between brackets
    (``[0, 1]``, ``[:, 2:]``); an index array alone, as `_part` says it."""
    if type(x) is tuple and x and x[0] is tuple:
        return f"[{', '.join(_part(p) for p in x[1:])}]"
    return _part(x) if _is_array_part(x) else f"[{_part(x)}]"
