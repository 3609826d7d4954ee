"""Every example with options runs both ways: ``python examples/x.py`` and
``python -m examples.x`` (asked for ``--help``, which parses the options after
every import).

The file way runs as after a plain ``pip install .``: with ``-S`` (no
``.pth`` files, so the editable install's path to the whole repository does
not hide a missing path set-up), the venv's site-packages and a directory
holding only a link to the package ``monadl`` on PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WITH_OPTIONS = [
    "conv_digits",
    "digits",
    "gated_network",
    "halide_tree_lstm",
    "image_addition",
    "image_lookup",
    "shift_reduce",
    "text_logic",
    "tree_lstm",
    "tree_lstm_fold",
]


def _help(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, *args, "--help"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_OPTIONS)
def test_an_example_runs_as_a_file_and_as_a_module(name: str, tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    as_module = _help(["-m", f"examples.{name}"], ROOT, env)
    installed = tmp_path / "installed"
    installed.mkdir()
    (installed / "monadl").symlink_to(ROOT / "monadl", target_is_directory=True)
    site_packages = {**env, "PYTHONPATH": os.pathsep.join([str(installed), sysconfig.get_paths()["purelib"]])}
    as_file = _help(["-S", str(ROOT / "examples" / f"{name}.py")], tmp_path, site_packages)
    assert as_module.startswith("usage: ")
    assert (
        as_file.split("\n", 1)[1] == as_module.split("\n", 1)[1]
    )  # the same options (the usage line names the program)


def test_every_example_with_options_is_listed() -> None:
    with_argparse = {p.stem for p in (ROOT / "examples").glob("[!_]*.py") if "argparse" in p.read_text()}
    assert with_argparse == set(WITH_OPTIONS)
