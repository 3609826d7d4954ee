"""mypy --strict in a user's own project, outside this repository (PEP 561).

A fresh virtual environment gets monadl as a user installs it: first
``pip install <repo>`` (a wheel), then ``pip install -e <repo>`` (editable).
Each time a user program and a must-reject program, copied to a temporary
directory with a ``pyproject.toml`` that says only ``strict = true``, are
checked by mypy with no MYPYPATH: the first must pass, the second must fail
for the reasons written in it.

The fresh environment holds monadl and its dependencies only (pip takes them
from its cache or PyPI, as a user's pip does). mypy itself is the one of the
test environment, pointed at the fresh one with ``--python-executable`` (as a
user's mypy installed with pipx is); it finds packages in the site-packages
of that interpreter and in the directories its ``.pth`` files name, which is
why the editable install must be a plain path (hatchling's) and not an
import hook (setuptools' for this layout, which mypy cannot follow).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parent.parent

USER_PROGRAM = '''\
"""A user's model: a linear guesser and a small conv net, with Adam."""

import anyio
import numpy as np

import monadl as ml

rng = np.random.default_rng(0)
weights = ml.Weight(rng.random(3), optimizer=ml.optim.adam(1e-2))
bias = ml.Weight(0.0)  # the default optimizer: ml.optim.default_optimizer()
kernel = ml.Weight(rng.normal(size=(4, 1, 3, 3)), optimizer=ml.optim.adam(1e-2))
readout = ml.Weight(rng.normal(size=(4 * 3 * 3, 10)), optimizer=ml.optim.adam(1e-2))


def guess(question: ml.Array) -> ml.ScalarLayer:
    return ml.sum(weights * question) + bias


def conv_net(images: ml.Array) -> ml.ArrayLayer:
    features = ml.max_pool2d(ml.relu(ml.conv2d(images, kernel)), 2)
    return ml.dense(ml.reshape(features, (images.shape[0], -1)), readout)


def polymorphic(a: ml.AsArray, b: ml.AsArray) -> ml.ArrayLayer:
    return ml.as_layer(a) * b + a


@ml.direct
async def gated(x: ml.ArrayLayer) -> ml.ArrayLayer:
    (score,) = await ml.values(ml.sum(x))
    return x * 2.0 if score > 0 else x


async def main() -> float:
    loss = (guess(np.array([3.0, 4.0, 5.0])) - 6.0) ** 2.0
    images = rng.random((2, 1, 8, 8))
    logits = conv_net(images)
    total = await (loss + ml.cross_entropy(logits, np.array([3, 7]))).train()
    return float(total)


if __name__ == "__main__":
    print(anyio.run(main))
'''

# Each line marked ``# E: <text>`` must be reported with <text> in its message.
MUST_REJECT = """\
import numpy as np

import monadl as ml

w = ml.Weight(np.zeros(3))
total: ml.ScalarLayer = ml.sum(w)
wrong: ml.ArrayLayer = ml.relu(total)  # E: Incompatible types in assignment
text = w * "three"  # E: Unsupported operand types
learning_rate = ml.Weight(np.zeros(3), optimizer=0.1)  # E: No overload variant of "Weight"
"""

CONFIG = """\
[tool.mypy]
strict = true
"""


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("MYPYPATH", "PYTHONPATH")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _expected_errors(program: str) -> dict[int, str]:
    return {
        number: line.split("# E: ")[1] for number, line in enumerate(program.splitlines(), start=1) if "# E: " in line
    }


def _check_user_project(python: Path, project: Path) -> None:
    mypy = (sys.executable, "-m", "mypy", "--python-executable", python, "--cache-dir", project / ".mypy_cache")
    accepted = _run(*mypy, "user_model.py", cwd=project)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "Success: no issues found in 1 source file" in accepted.stdout

    rejected = _run(*mypy, "must_reject.py", cwd=project)
    assert rejected.returncode == 1, rejected.stdout + rejected.stderr
    expected = _expected_errors(MUST_REJECT)
    errors = [
        line for line in rejected.stdout.splitlines() if line.startswith("must_reject.py:") and ": error:" in line
    ]
    reported = {int(line.split(":")[1]) for line in errors}
    assert reported == set(expected), rejected.stdout
    for number, text in expected.items():
        assert any(line.startswith(f"must_reject.py:{number}:") and text in line for line in errors), (number, text)


@pytest.mark.slow
def test_mypy_strict_in_a_user_project_after_pip_install_and_pip_install_editable(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # No pip inside: the test environment's pip installs into it (pip --python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python, "install", "--quiet")

    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(CONFIG)
    (project / "user_model.py").write_text(USER_PROGRAM)
    (project / "must_reject.py").write_text(MUST_REJECT)

    installed = _run(*pip, ROOT, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    site = _run(python, "-c", "import monadl, sys; print(monadl.__file__)", cwd=project)
    assert str(venv) in site.stdout, site.stdout  # the wheel's copy, not the repository
    _check_user_project(python, project)

    _run(sys.executable, "-m", "pip", "--python", python, "uninstall", "--yes", "--quiet", "monadl", cwd=tmp_path)
    editable = _run(*pip, "--editable", ROOT, cwd=tmp_path)
    assert editable.returncode == 0, editable.stderr
    site = _run(python, "-c", "import monadl, sys; print(monadl.__file__)", cwd=project)
    assert site.stdout.strip() == str(ROOT / "monadl" / "__init__.py"), site.stdout
    _check_user_project(python, project)
