"""What mypy infers and rejects for Fold blocks beyond the corpus of
tests/test_typing_corpus.py: blocks of one's own typed with `Build`, `Record`
of five blocks and more, and cases of different input types (with the
workarounds that docs/api/fold.md gives, whose Python blocks are checked here
and run). As in the corpus, the programs are strings, checked by one call to
mypy's API, so the project's own mypy run does not see the ones written to fail.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import anyio
import pytest

import monadl as ml
from tests._mypy import mypy_errors as run_mypy

pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "docs" / "api" / "fold.md"

PRELUDE = """\
from collections.abc import Mapping, Sequence
from typing import Any, assert_type
import numpy as np
import monadl as ml
from monadl.fold import Block, Build, InputTransform, OneOf, Optional, Record, Scalar, Vector, Zeros, call

def is_empty(v: Sequence[float]) -> bool:
    return len(v) == 0
"""


def page_blocks() -> list[str]:
    """The Python blocks of the API page, in order."""
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)


ACCEPT = {
    "record_of_five_blocks_and_more": """
        s = Scalar()
        assert_type(Record(s, s, s, s, s), Record[tuple[Any, ...], tuple[Any, ...]])
        assert_type(Record(s, s, s, s, s, Vector(2))((1.0, 2.0, 3.0, 4.0, 5.0, [6.0, 7.0])), tuple[Any, ...])
        R = float | np.floating[Any] | np.integer[Any]  # (Scalar's input: NumPy's real scalars too)
        assert_type(Record(s, s, s, s), Record[tuple[R, R, R, R], tuple[ml.ArrayLayer, ml.ArrayLayer, ml.ArrayLayer, ml.ArrayLayer]])
    """,
    "a_block_of_ones_own_is_typed_with_build": """
        class Parsed(Block[str, int]):
            def _build(self, text: str) -> Build[int]:
                try:
                    y = yield from call(InputTransform(int), text)
                    assert_type(y, int)
                except ValueError:
                    y = -1
                return y

        assert_type(Parsed()("12"), int)
        assert_type(Parsed() >> InputTransform(str), Block[str, str])
    """,
    "cases_of_different_inputs_with_their_types_named": """
        a: Block[Sequence[float], ml.ArrayLayer] = OneOf(is_empty, {True: Zeros((2,)), False: Vector(2)})
        b: OneOf[Sequence[float], ml.ArrayLayer] = OneOf(is_empty, {True: Zeros((2,)), False: Vector(2)})
        c = OneOf[Sequence[float], ml.ArrayLayer](is_empty, {True: Zeros((2,)), False: Vector(2)})
        cases: dict[bool, Block[Sequence[float], ml.ArrayLayer]] = {True: Zeros((2,)), False: Vector(2)}
        assert_type(OneOf(is_empty, cases), OneOf[Sequence[float], ml.ArrayLayer])
        assert_type(OneOf(is_empty, {True: InputTransform(is_empty) >> Zeros((2,)), False: Vector(2)}), OneOf[Sequence[float], ml.ArrayLayer])
    """,
    "an_rnn_step_passes_the_state_through_identity": """
        from monadl.fold import Fold, Function, Identity

        def cell(sx: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
            return sx[0] + sx[1]

        step = Record(Identity[ml.ArrayLayer](), Vector(2)) >> Function(cell)
        assert_type(step, Block[tuple[ml.ArrayLayer, Sequence[float]], ml.ArrayLayer])
        assert_type(Fold(step, Zeros((2,))), Fold[Sequence[float], ml.ArrayLayer])
        assert_type(Identity[str]()("x"), str)
    """,
    "record_fields_of_different_inputs_with_their_types_named": """
        bonus = Optional(Scalar(np.float64), Zeros((), np.float64))
        r: Block[Mapping[str, Any], tuple[ml.ArrayLayer, ...]] = Record({"bonus": bonus, "pos": Vector(2)})
        fields: dict[str, Block[Any, ml.ArrayLayer]] = {"bonus": bonus, "pos": Vector(2)}
        assert_type(Record(fields), Record[Mapping[str, Any], tuple[ml.ArrayLayer, ...]])
    """,
}

# name: (program, the error code mypy must report)
REJECT = {
    "a_build_returns_the_type_it_declares": (
        "class Length(Block[str, int]):\n"
        "    def _build(self, text: str) -> Build[int]:\n"
        "        y = yield from call(InputTransform(str.upper), text)\n"
        "        return y",
        "return-value",
    ),
    "call_is_typed_as_its_block": (
        "def build(text: str) -> Build[int]:\n    y: str = yield from call(InputTransform(len), text)\n    return 0",
        "assignment",
    ),
    # A limitation of mypy, pinned: it joins blocks of different input types to ``object`` (a contravariant type
    # argument joined as an invariant one). Where these pass, the workarounds above can leave the docs.
    # The message the docs explain (Fold's docstring, the API page): mypy names no mismatch between init's
    # output and the step's state, only that no state type fits both.
    "a_fold_whose_init_is_not_the_steps_state": (
        "from monadl.fold import Fold, Function, Identity\n"
        "def cell(sx: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:\n"
        "    return sx[0] + sx[1]\n"
        "Fold(Record(Identity[ml.ArrayLayer](), Vector(2)) >> Function(cell), InputTransform[None, int](lambda _: 0))",
        "misc",
    ),
    "cases_of_different_inputs_in_a_dict_literal": (
        "OneOf(is_empty, {True: Zeros((2,)), False: Vector(2)})",
        "arg-type",
    ),
    "record_fields_of_different_inputs_in_a_dict_literal": (
        'Record({"bonus": Optional(Scalar(), Zeros(())), "pos": Vector(2)})',
        "arg-type",
    ),
}


def _program(body: str) -> str:
    return PRELUDE + textwrap.dedent(body).strip() + "\n"


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str, str]]]:
    """Run mypy once over every program; errors by program name, lines counted from the body
    (a page's block: from its own first line)."""
    programs = {f"accept_{n}": _program(b) for n, b in ACCEPT.items()}
    programs.update({f"reject_{n}": _program(p) for n, (p, _) in REJECT.items()})
    programs.update(
        {f"page_{i}": code for i, code in enumerate(page_blocks())}
    )  # (as they are: each imports what it uses)
    found = run_mypy(tmp_path_factory.mktemp("fold_typing"), programs)
    prelude_lines = PRELUDE.count("\n")
    return {
        name: [
            (line - (0 if name.startswith("page_") else prelude_lines), message, code) for line, message, code in errs
        ]
        for name, errs in found.items()
    }


@pytest.mark.parametrize("name", list(ACCEPT))
def test_mypy_accepts(name: str, mypy_errors: dict[str, list[tuple[int, str, str]]]) -> None:
    assert mypy_errors[f"accept_{name}"] == []


def test_mypy_accepts_the_api_pages_blocks(mypy_errors: dict[str, list[tuple[int, str, str]]]) -> None:
    pages = {name: errors for name, errors in mypy_errors.items() if name.startswith("page_")}
    assert len(pages) == 3 and all(errors == [] for errors in pages.values()), pages


@pytest.mark.parametrize("name", list(REJECT))
def test_mypy_rejects(name: str, mypy_errors: dict[str, list[tuple[int, str, str]]]) -> None:
    errors = mypy_errors[f"reject_{name}"]
    expected = REJECT[name][1]
    assert errors, "mypy accepted a program it must reject"
    assert all(line >= 1 for line, _, _ in errors), f"the prelude itself failed: {errors}"
    assert expected in {code for _, _, code in errors}, errors


def test_the_api_pages_blocks_run() -> None:
    blocks = page_blocks()
    assert len(blocks) == 3
    namespace: dict[str, object] = {"__name__": "docs_api_fold"}
    for code in blocks:
        exec(compile(code, str(PAGE), "exec"), namespace)
    parsed = namespace["Parsed"]
    assert isinstance(parsed, type) and parsed().batch(["12", "x"]) == [12, -1]
    last = namespace["last"]
    assert isinstance(last, ml.Layer) and anyio.run(last.predict).shape == (1, 3)


def test_mypy_says_of_a_fold_whose_init_is_not_the_steps_state_what_the_docs_explain(
    mypy_errors: dict[str, list[tuple[int, str, str]]],
) -> None:
    messages = [message for _, message, _ in mypy_errors["reject_a_fold_whose_init_is_not_the_steps_state"]]
    assert 'Cannot infer value of type parameter "S" of "Fold"' in messages, messages
