"""Style and types cannot drift: ``ruff check`` and ``mypy --strict`` run with the tests.

The linters are pinned to exact versions (the ``lint`` extra in ``setup.cfg``):
another version may add or change rules, so a linter that is missing or at
another version skips these tests with the reason, and the behaviour tests run
on. With ``KCPP_HORDE_REQUIRE_LINT=1`` in the environment (``.ci/run`` and the
README's test command set it) a skip is a failure instead.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "KCPP_HORDE_REQUIRE_LINT"


def lint_pins() -> dict[str, str]:
    """The ``lint`` extra of ``setup.cfg`` as ``{distribution: exact version}``."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    pins: dict[str, str] = {}
    for line in config["options.extras_require"]["lint"].splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;]+)\s*", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
        elif line.strip():
            raise AssertionError(f"setup.cfg lint extra: not an exact pin: {line.strip()!r}")
    return pins


def require_pinned(*names: str) -> None:
    """Skip (or fail under KCPP_HORDE_REQUIRE_LINT=1) unless each tool is at its pin."""
    pins = lint_pins()
    problems = []
    for name in names:
        want = pins[name]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed (pinned to {want})")
            continue
        if have != want:
            problems.append(f"{name} {have} is installed, the lint is pinned to {want}")
    if not problems:
        return
    reason = "; ".join(problems) + ": pip install '.[lint]' to run this check"
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{REQUIRE_ENV} is set and {reason}", pytrace=False)
    pytest.skip(reason)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_lint_extra_pins_exact_versions() -> None:
    assert set(lint_pins()) == {"ruff", "mypy", "types-requests"}


def test_ruff_check_passes() -> None:
    require_pinned("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", "koboldcpp_horde_chat", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_passes() -> None:
    require_pinned("mypy", "types-requests")
    result = _run(sys.executable, "-m", "mypy", "--strict", "koboldcpp_horde_chat")
    assert result.returncode == 0, result.stdout + result.stderr


#: The fakes of the worker's seams and the tests that build the worker on them:
#: ``mypy --strict`` checks each fake against the Protocol it stands in for
#: (``horde.api.HordeAPI``, ``koboldcpp.api.KcppAPI``, ``koboldcpp.manners.LocalManners``).
TYPED_TESTS = (
    "bench/harness/fakes.py",
    "tests/pops.py",
    "tests/unit/test_pop_loop.py",
    "tests/unit/test_loop_decisions.py",
    "tests/unit/test_job_life.py",
    "tests/unit/test_job_state_machine.py",
    "tests/integration/test_fuzz.py",
)


def test_mypy_strict_passes_on_the_fakes_and_the_tests_built_on_them() -> None:
    require_pinned("mypy", "types-requests")
    result = _run(sys.executable, "-m", "mypy", "--strict", *TYPED_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
