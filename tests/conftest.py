"""Settings every test shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from koboldcpp_horde_chat.state.journal_paths import JOURNAL_DIR_ENV


@pytest.fixture(autouse=True)
def journal_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Keep every worker's job journal in a folder of the test's own, never in the
    user's state directory (the variable reaches worker subprocesses too)."""
    directory = tmp_path_factory.mktemp("journal")
    monkeypatch.setenv(JOURNAL_DIR_ENV, str(directory))
    yield directory
