"""The documentation says what the code does: the tour's and the home page's
Python blocks run, and every public name is in the API reference and in the
README's API section. (`make test` builds the pages with ``mkdocs --strict``.)
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from tests._mypy import mypy_errors as run_mypy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    """The page's Python blocks that are meant to run, in order."""
    return [code for skip, code in BLOCK.findall(page.read_text()) if not skip]


@pytest.mark.parametrize("page", ["tour.md", "index.md"])
def test_the_python_blocks_of_a_page_run_in_order(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # anything a block writes lands here
    namespace: dict[str, object] = {"__name__": f"docs_{page.removesuffix('.md')}"}
    blocks = python_blocks(DOCS / page)
    assert blocks
    for code in blocks:
        exec(compile(code, str(DOCS / page), "exec"), namespace)


@pytest.mark.parametrize("page", ["tour.md", "index.md"])
def test_the_python_blocks_of_a_page_pass_mypy_strict(page: str, tmp_path: Path) -> None:
    # The tour says mypy --strict checks its programs before they run: a user's trial found
    # a block it rejected (a NumPy array's @ typed as Any, returned where a Do was declared).
    pytest.importorskip("mypy.api")
    name = f"docs_{page.removesuffix('.md')}"
    assert run_mypy(tmp_path, {name: "\n\n".join(python_blocks(DOCS / page))}) == {name: []}


def test_the_readmes_padded_attention_batches_examples_of_any_length(caplog: pytest.LogCaptureFixture) -> None:
    """The README's answer to attention over per-example lengths (a new
    user's seq2seq found none): padded with a mask, calls of 8 lengths are
    one trace and one group, with the unpadded attention's values."""
    readme = (ROOT / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "def attend" in block]
    cell, call = code.split("\n\n\n")  # (the cell marked once; the call per example)
    rng = np.random.default_rng(0)
    d, T = 3, 8
    query = rng.normal(size=(1, d))
    namespace: dict[str, object] = {"np": np, "ml": ml, "s": ml.as_layer(query), "T": T, "d": d}
    exec(compile(cell, "README.md", "exec"), namespace)
    ctxs: list[Any] = []
    want = []
    for n in range(1, T + 1):
        rows = rng.normal(size=(n, d))
        namespace["states"] = [ml.as_layer(rows[i : i + 1]) for i in range(n)]
        exec(compile(call, "README.md", "exec"), namespace)
        ctxs.append(namespace["ctx"])
        a = np.exp(rows @ query.T - (rows @ query.T).max())
        want.append((a / a.sum() * rows).sum(axis=0, keepdims=True))
    with caplog.at_level(logging.DEBUG, logger="monadl.batching"), ml.settings(batching=True):
        got = anyio.run(ml.concatenate(ctxs, axis=0).predict)
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-12)
    (ran,) = [r.getMessage() for r in caplog.records if "ran batched" in r.getMessage()]
    assert "attend" not in ran, ran  # (no call of attend ran alone)


def test_the_tour_trains_its_model() -> None:
    namespace: dict[str, object] = {"__name__": "docs_tour"}
    for code in python_blocks(DOCS / "tour.md")[:2]:  # the model, then 200 steps of Adam
        exec(compile(code, "tour.md", "exec"), namespace)
    losses = namespace["losses"]
    assert isinstance(losses, list)
    assert losses[-1] < 0.5 * losses[0]


def test_only_the_gpu_block_is_not_run() -> None:
    skipped = [code for skip, code in BLOCK.findall((DOCS / "tour.md").read_text()) if skip]
    assert len(skipped) == 1
    assert "cupy" in skipped[0]


def test_every_public_name_has_an_entry_in_the_api_reference() -> None:
    page = (DOCS / "api" / "monadl.md").read_text()
    documented = set(re.findall(r"^::: monadl\.(\w+)$", page, re.MULTILINE))
    assert documented == set(ml.__all__) - {"optim"}  # monadl.optim has a page of its own
    assert "::: monadl.optim" in (DOCS / "api" / "optim.md").read_text()


def test_the_readme_lists_every_public_function_and_class() -> None:
    readme = (ROOT / "README.md").read_text()
    api = readme[readme.index("\n## API\n") :]
    api = api[: api.find("\n## ", 1)] if "\n## " in api[1:] else api
    code = " ".join(re.findall(r"`([^`]+)`", api))  # the names as the README writes them: in backticks
    missing = [name for name in ml.__all__ if not re.search(rf"\bml\.{name}\b", code)]
    missing += [name for name in ml.optim.__all__ if not re.search(rf"(?<![\w.]){name}\b|\bml\.optim\.{name}\b", code)]
    assert missing == []
    assert "default_optimizer" in api and "sgd(0.0005)" in api


def test_every_docstring_parses_as_the_api_pages_parse_it(caplog: pytest.LogCaptureFixture) -> None:
    """The warnings ``mkdocs build --strict`` aborts on, in a third of a
    second: griffe's parse of each docstring in Google's style, as the API
    pages render it (an ``Args:`` entry ``settled, converged:`` in
    `monadl.dyna.ArrayRun` stopped the build, and no test ran it)."""
    griffe = pytest.importorskip("griffe")
    package = griffe.load("monadl", search_paths=[str(ROOT)], resolve_aliases=False)
    seen: set[str] = set()
    stack = [package]
    with caplog.at_level("WARNING", logger="griffe"):
        while stack:
            obj = stack.pop()
            if obj.path in seen:
                continue
            seen.add(obj.path)
            if obj.docstring is not None:
                obj.docstring.parse("google")
            stack.extend(m for m in obj.members.values() if not m.is_alias)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("griffe")] == []
    assert "monadl.dyna.array_run.ArrayRun" in seen


def _anchor(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub and MkDocs make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_to_sections_reach_a_heading() -> None:
    """Every ``(#anchor)`` and ``(docs/page.md#anchor)`` link of the README
    names a heading of its page (a renamed section leaves no dead link)."""
    readme = ROOT / "README.md"
    links = re.findall(r"\]\(((?:docs/[\w/]+\.md)?)#([\w\-]+)\)", readme.read_text())
    assert len(links) > 20
    for page, anchor in links:
        text = (ROOT / page if page else readme).read_text()
        headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
        assert anchor in headings, f"README links to {page or 'README.md'}#{anchor}, which has no such heading"
