"""A picture of what a model built: Graphviz DOT text of a layer graph.

`to_dot` walks the graph under one or more layers (iteratively: a chain of
100,000 nodes is fine) and writes one DOT node per layer, weight and constant
operand, each shared node once however many consumers it has, with an edge
from each operand to its consumer. A primitive layer's node shows its
operation, the shape and dtype of its value, and the file and line of the
user's code that built it (the full path and source line are its tooltip);
weights are filled and rounded; the roots have a double border.

Shapes and dtypes need values. With ``values=True`` (the default) `to_dot`
runs each primitive's forward rule once, in construction order, on the
weights' current data: plain forward work, no backward, no gradient, and each
value is dropped as soon as its last consumer has run, so memory stays that of
an evaluation. A node whose rule fails shows the error instead of a shape (a
picture of a broken model is still a picture). Layers built from a ``Do``
(``forward().bind``, `monadl.direct`) are opaque: what they run is decided
while they run, so they show as dashed nodes, and so does what depends on
them (and on a node whose rule failed). ``values=False`` skips the evaluation: nodes show their operation and
line only.

`render_graph` writes the picture as SVG, PNG or PDF through Graphviz's ``dot``
program, where it is installed (it is not a dependency of monadl), or the
DOT text itself for ``.dot`` and ``.gv``.
"""

from __future__ import annotations

import linecache
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

from monadl.layers._layer import Expr, Layer
from monadl.layers._primitives import shown
from monadl.layers._site import site_place
from monadl.layers._weight import Weight

__all__ = ["render_graph", "to_dot"]

_WEIGHT_STYLE: Final = 'shape=box, style="rounded,filled", fillcolor="#cfe2ff", color="#3d6bb3"'
_DO_STYLE: Final = 'shape=box, style=dashed, color="#888888"'
_CONSTANT_STYLE: Final = 'shape=box, style="dotted", fontsize=10, color="#888888"'
_ERROR_STYLE: Final = 'style=filled, fillcolor="#f8d7da"'
_Node = TypeVar("_Node", bound=Expr[Any, Any])  # a weight or a layer, as keys of `names`
_UNKNOWN: Final = object()  # no value: under a layer built from a Do, or values=False


def to_dot(
    *roots: Expr[Any, Any],
    names: Mapping[_Node, str] | None = None,
    values: bool = True,
) -> str:
    """Graphviz DOT text of the graph under ``roots``.

    Args:
        roots: the layers (or weights) to draw; what they share is drawn once.
        names: labels for some weights or layers (``{w1: "w1"}``), shown on
            their nodes.
        values: evaluate the forward rules once to show shapes and dtypes
            (see the module's documentation).

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((3, 2)))
    >>> h = ml.tanh(np.ones((4, 3)) @ w)
    >>> text = to_dot(ml.sum(h * h), names={w: "w"})  # h is drawn once
    >>> text.count('label="tanh'), text.count('label="w\\\\n'), "float64[4, 2]" in text
    (1, 1, True)
    """
    if not roots:
        raise ValueError("to_dot: give at least one layer")
    for root in roots:
        if not isinstance(root, Expr):
            raise TypeError(f"to_dot: takes layers and weights, got {type(root).__name__}")
    labels: Mapping[Any, str] = {} if names is None else names
    layers, weights, consumers = _walk(roots)
    lines = ["digraph monadl {", '  node [fontname="Helvetica", fontsize=11];', '  edge [color="#555555"];']
    ids: dict[int, str] = {}
    for i, weight in enumerate(weights):
        ids[id(weight)] = f"w{i}"
        label = _join(labels.get(weight, "Weight"), _describe(weight._data))
        lines.append(f"  w{i} [label={_quote(label)}, {_WEIGHT_STYLE}{_root_style(weight, roots)}];")
    known: dict[int, Any] = {id(w): w._data for w in weights} if values else {}
    constants = 0
    for i, layer in enumerate(layers):  # (numbered in the graph, not by serial: one graph, one text)
        me = ids[id(layer)] = f"n{i}"
        edges = []
        args: list[Any] = []
        for x in layer._inputs:
            if isinstance(x, Expr):
                edges.append(f"  {ids[id(x)]} -> {me};")
                args.append(known.get(id(x), _UNKNOWN) if values else _UNKNOWN)
                _release(x, consumers, known)
            else:
                lines.append(f"  c{constants} [label={_quote(_describe(x))}, {_CONSTANT_STYLE}];")
                edges.append(f"  c{constants} -> {me};")
                constants += 1
                args.append(x)
        text: str | None
        if layer._op is None:
            text, style = "a Do (decided while it runs)", _DO_STYLE
        else:
            text, style = _evaluate(layer, args, known) if values else (None, "shape=box")
            if layer._op.name == "getitem":
                text = f"[{_index_text(layer._params[0])}]" + ("" if text is None else f" {text}")
        head = shown(layer._op) if layer._op is not None else "dynamic"
        label = _join(labels.get(layer, head), text, _short_site(layer))
        tooltip = _quote(_long_site(layer))
        lines.append(f"  {me} [label={_quote(label)}, tooltip={tooltip}, {style}{_root_style(layer, roots)}];")
        lines.extend(edges)
        if not consumers.get(id(layer)):
            known.pop(id(layer), None)  # a root: nothing consumes its value here
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_graph(
    *roots: Expr[Any, Any],
    path: str | os.PathLike[str],
    names: Mapping[_Node, str] | None = None,
    values: bool = True,
) -> Path:
    """Write the picture of `to_dot` to ``path``, in the format its suffix
    names: ``.svg``, ``.png``, ``.pdf`` (through Graphviz's ``dot`` program),
    or ``.dot`` / ``.gv`` (the text). Returns the path.

    Raises:
        FileNotFoundError: Graphviz's ``dot`` is not installed (write a
            ``.dot`` file instead, or install Graphviz).
        ValueError: an unknown suffix.

    >>> import tempfile, numpy as np, monadl as ml
    >>> where = Path(tempfile.mkdtemp()) / "model.dot"
    >>> render_graph(ml.Weight(np.ones(2)) * 2.0, path=where).read_text().startswith("digraph")
    True
    """
    target = Path(path)
    kind = target.suffix.lower().lstrip(".")
    if kind not in ("dot", "gv", "svg", "png", "pdf"):
        raise ValueError(
            f"render_graph: cannot tell the format from {target.name!r}: use .svg, .png, .pdf, .dot or .gv"
        )
    text = to_dot(*roots, names=names, values=values)
    if kind in ("dot", "gv"):
        target.write_text(text)
        return target
    program = shutil.which("dot")
    if program is None:
        raise FileNotFoundError(
            f"render_graph: Graphviz's `dot` program is not installed, so {target.name} cannot be drawn "
            "(apt install graphviz, brew install graphviz or conda install graphviz); "
            "a .dot path writes the text instead"
        )
    subprocess.run([program, f"-T{kind}", "-o", str(target)], input=text.encode(), check=True)
    return target


def _walk(roots: Iterable[Expr[Any, Any]]) -> tuple[list[Layer[Any, Any]], list[Weight[Any, Any]], dict[int, int]]:
    """The layers under ``roots`` in construction order (operands first), the
    weights in the order met, and how many consumers each node has (by id)."""
    layers: list[Layer[Any, Any]] = []
    weights: list[Weight[Any, Any]] = []
    consumers: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:  # iterative: graphs may be 100,000 nodes deep
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Weight):
            weights.append(node)
            continue
        assert isinstance(node, Layer)
        layers.append(node)
        for x in node._inputs:
            if isinstance(x, Expr):
                consumers[id(x)] = consumers.get(id(x), 0) + 1
                stack.append(x)
    layers.sort(key=lambda layer: layer._serial)  # a layer is always built after its operands
    return layers, weights, consumers


def _evaluate(layer: Layer[Any, Any], args: list[Any], known: dict[int, Any]) -> tuple[str | None, str]:
    """Run one primitive's forward rule: the text of its value, and a node style."""
    assert layer._op is not None
    if any(a is _UNKNOWN for a in args):
        return None, _DO_STYLE
    try:
        value, _ = layer._op.rule(*args, *layer._params)
    except Exception as exc:  # drawn, not raised: the picture is how one finds it
        return f"{type(exc).__name__}: {exc}"[:80], f"shape=box, {_ERROR_STYLE}"
    known[id(layer)] = value
    return _describe(value), "shape=box"


def _release(x: Expr[Any, Any], consumers: dict[int, int], known: dict[int, Any]) -> None:
    """One consumer of ``x`` has run: drop its value after the last."""
    left = consumers[id(x)] - 1
    consumers[id(x)] = left
    if not left:
        known.pop(id(x), None)


def _describe(x: Any) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return repr(x) if isinstance(x, (int, float)) else type(x).__name__
    name = str(dtype).rsplit(".", 1)[-1]
    return f"{name}{list(shape)}" if shape else f"{name} scalar"


def _index_text(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)
    # (a weight in an index, which indexing refuses when run, is shown as it is, not as an array)
    return ", ".join(_describe(i) if hasattr(i, "shape") and type(i) is not Weight else _slice_text(i) for i in items)


def _slice_text(i: Any) -> str:
    if isinstance(i, slice):
        text = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
        return text + (f":{i.step}" if i.step is not None else "")
    return "..." if i is Ellipsis else repr(i)


def _short_site(layer: Layer[Any, Any]) -> str:
    path, line = site_place(layer._site)
    return f"{os.path.basename(path)}:{line}"


def _long_site(layer: Layer[Any, Any]) -> str:
    path, line = site_place(layer._site)
    where = f"{path}:{line}"
    source = linecache.getline(path, line).strip()
    return f"{where}: {source}" if source else where


def _root_style(node: object, roots: tuple[Expr[Any, Any], ...]) -> str:
    return ", peripheries=2" if any(node is r for r in roots) else ""


def _join(*parts: str | None) -> str:
    return "\n".join(p for p in parts if p)


def _quote(text: str) -> str:
    """A DOT string: quotes and backslashes escaped, newlines as centred line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
