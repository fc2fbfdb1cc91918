"""Style and types cannot drift: ``ruff check`` and ``mypy --strict`` run with the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check_passes() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", "koboldcpp_horde_chat", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_passes() -> None:
    result = _run(sys.executable, "-m", "mypy", "--strict", "koboldcpp_horde_chat")
    assert result.returncode == 0, result.stdout + result.stderr
