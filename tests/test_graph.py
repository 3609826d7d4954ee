"""``ml.to_dot`` and ``ml.render_graph``: a picture of what a model built."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import monadl as ml

HERE = Path(__file__).name


def line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


def nodes(text: str) -> dict[str, str]:
    """DOT node id -> its attributes."""
    return {k: v for k, v in re.findall(r"^  (\w+) \[(.*)\];$", text, flags=re.MULTILINE) if k not in ("node", "edge")}


def edges(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^  (\w+) -> (\w+);$", text, flags=re.MULTILINE)


def test_a_shared_node_is_drawn_once_with_an_edge_per_use() -> None:
    w = ml.Weight(np.ones((3, 2)))
    h = ml.tanh(np.ones((4, 3)) @ w)  # GRAPH-SITE-1
    loss = ml.sum(h * h + h)
    text = ml.to_dot(loss)
    found = nodes(text)
    # one weight, one constant, matmul, tanh, multiply, add, sum
    assert len(found) == 7
    tanh = next(k for k, v in found.items() if v.startswith('label="tanh'))
    assert len([e for e in edges(text) if e[0] == tanh]) == 3  # h * h, + h
    assert f"tanh\\nfloat64[4, 2]\\n{HERE}:{line_of('GRAPH-SITE-1')}" in found[tanh]
    assert f"{__file__}:{line_of('GRAPH-SITE-1')}: h = ml.tanh" in found[tanh]  # the tooltip


def test_a_graphs_nodes_are_numbered_in_the_graph_so_its_text_repeats() -> None:
    """Layers were numbered by a counter of the whole process: the third
    graph of a session began at n34004, and one graph's text changed from
    one build to the next."""

    def build() -> ml.ScalarLayer:
        w = ml.Weight(np.ones(2))
        return ml.sum(ml.tanh(w * 2.0) + 1.0)

    first = ml.to_dot(build())
    _ = [ml.Weight(np.ones(2)) * 1.0 for _ in range(100)]  # (layers built between: no other numbers)
    second = ml.to_dot(build())
    assert [k for k in nodes(first) if k.startswith("n")] == ["n0", "n1", "n2", "n3"]
    assert second == first


def test_weights_are_distinct_and_named_and_roots_have_a_double_border() -> None:
    w1, w2 = ml.Weight(np.ones((2, 3))), ml.Weight(np.ones(3, np.float32))
    out = (np.ones(2) @ w1) * 2.0
    text = ml.to_dot(out, ml.sum(w2), names={w1: "w1", out: "hidden"})
    found = nodes(text)
    weights = [v for v in found.values() if "fillcolor" in v and "rounded" in v]
    assert sorted(v.split("\\n")[0] for v in weights) == ['label="Weight', 'label="w1']
    assert any("float32[3]" in v for v in weights)
    assert sum("peripheries=2" in v for v in found.values()) == 2
    assert any(v.startswith('label="hidden\\nfloat64[3]') for v in found.values())


def test_a_layer_from_a_do_is_opaque_and_so_is_what_depends_on_it() -> None:
    w = ml.Weight(np.ones(2))
    dynamic = ml.Layer(w.forward())
    found = nodes(ml.to_dot(ml.sum(dynamic * 2.0)))
    assert any(v.startswith('label="dynamic\\na Do') and "dashed" in v for v in found.values())
    total = next(v for v in found.values() if v.startswith('label="sum'))
    assert "dashed" in total and "scalar" not in total


def test_a_failing_node_shows_its_error_and_nothing_is_raised() -> None:
    bad = ml.Weight(np.ones((4, 2))) * np.ones(5)
    found = nodes(ml.to_dot(ml.sum(bad)))
    multiply = next(v for v in found.values() if v.startswith('label="multiply'))
    assert "ValueError: operands could not be broadcast" in multiply and "fillcolor" in multiply


def test_without_values_nothing_is_computed() -> None:
    from monadl.layers._layer import Layer
    from monadl.layers._primitives import Primitive

    calls: list[int] = []

    def rule(a: Any) -> tuple[Any, tuple[Any, ...]]:
        calls.append(1)
        return a, (lambda g: g,)

    counted = Primitive("counted", rule)
    layer = Layer._make(counted, (ml.Weight(np.ones(2)),))
    assert "counted" in ml.to_dot(layer, values=False)
    assert calls == []
    assert "float64[2]" in ml.to_dot(layer)
    assert calls == [1]


def test_getitem_shows_its_index() -> None:
    scores = ml.sigmoid(ml.Weight(np.ones(2)))
    found = nodes(ml.to_dot(scores[0] * scores[1:]))
    labels = sorted(v.split("\\n")[0] for v in found.values() if v.startswith('label="getitem'))
    assert labels == ['label="getitem', 'label="getitem']
    assert any("[0] float64 scalar" in v for v in found.values())
    assert any("[1:] float64[1]" in v for v in found.values())


def test_a_chain_of_100000_nodes_without_recursion() -> None:
    x: ml.ArrayLayer = ml.Weight(np.ones(2)) * 1.0
    for _ in range(100_000 - 1):
        x = x + 1.0
    text = ml.to_dot(x)
    assert text.count(" -> ") == 2 * 100_000  # each node: the chain (or the weight) and a constant
    root = next(v for v in nodes(text).values() if "peripheries=2" in v)
    assert root.startswith('label="add\\nfloat64[2]')


def test_render_writes_dot_text_and_refuses_unknown_formats(tmp_path: Path) -> None:
    layer = ml.Weight(np.ones(2)) * 2.0
    target = ml.render_graph(layer, path=tmp_path / "model.gv")
    assert target.read_text() == ml.to_dot(layer)
    with pytest.raises(ValueError, match=r"\.svg, \.png"):
        ml.render_graph(layer, path=tmp_path / "model.jpeg")
    with pytest.raises(ValueError, match="at least one"):
        ml.to_dot()


def test_render_without_graphviz_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="Graphviz's `dot` program is not installed"):
        ml.render_graph(ml.Weight(1.0) * 2.0, path=tmp_path / "model.svg")
    assert not (tmp_path / "model.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_render_svg_with_graphviz(tmp_path: Path) -> None:
    target = ml.render_graph(ml.sum(ml.Weight(np.ones(2)) * 2.0), path=tmp_path / "model.svg")
    assert "<svg" in target.read_text()


def test_the_gated_network_picture_shows_both_branches_and_what_they_share(tmp_path: Path) -> None:
    from examples import gated_network as gn

    written = gn.draw(tmp_path / "gated.dot")
    text = written.read_text()
    labels = [v.split("\\n")[0].removeprefix('label="') for v in nodes(text).values()]
    for name in ("input", "gate", "left 1", "left 2", "right 1", "right 2"):
        assert labels.count(name) == 1, name
    assert labels.count("count input") == 1 and labels.count("count gate") == 1  # shared, drawn once
    assert labels.count("getitem") == 2  # the two scores
    assert sum("peripheries=2" in v for v in nodes(text).values()) == 2  # the two branches
    assert "gated_network.py:" in text
