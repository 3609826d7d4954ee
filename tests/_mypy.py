"""mypy --strict over programs written for a test, with the project's
typing setup (the returns plugin, the stubs in ``typings/``): one call of
mypy's API for many programs, so that ones written to fail stay out of the
project's own mypy run. Used by the typing corpus, the Fold blocks' typing
tests and the docs' tests."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ERROR = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+): error: (?P<message>.*?)(?:  \[(?P<code>[\w-]+)\])?$")


def mypy_errors(folder: Path, programs: Mapping[str, str]) -> dict[str, list[tuple[int, str, str]]]:
    """Write each program to ``folder/<name>.py``, check them all with one
    run of mypy --strict, and return each one's errors as (line, message,
    error code)."""
    from mypy import api

    for name, text in programs.items():
        (folder / f"{name}.py").write_text(text)
    config = folder / "mypy.ini"
    config.write_text(
        "[mypy]\nstrict = True\npython_version = 3.11\nplugins = returns.contrib.mypy.returns_plugin\n"
        f"mypy_path = {ROOT}{os.pathsep}{ROOT / 'typings'}\n"
        f"cache_dir = {folder / '.mypy_cache'}\n"
    )
    stdout, stderr, _ = api.run(
        ["--config-file", str(config), "--no-error-summary", *sorted(str(folder / f"{name}.py") for name in programs)]
    )
    assert not stderr, stderr
    errors: dict[str, list[tuple[int, str, str]]] = {name: [] for name in programs}
    for line in stdout.splitlines():
        match = _ERROR.match(line)
        if match:
            errors[Path(match["file"]).stem].append((int(match["line"]), match["message"], match["code"] or ""))
    return errors
