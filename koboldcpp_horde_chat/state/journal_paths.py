"""Where the job journal lives: one file per worker name in the platform's
state directory (pure given its arguments; nothing is created here).

``$KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR`` (or the standalone worker's
``--journal-dir``) moves it; ``state.journal`` writes the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Final

#: The program's directory name under the platform's state directory.
APP_DIR_NAME: Final = "koboldcpp-horde-chat"
#: The readable part of a journal file name, at most this many characters.
SLUG_MAX_CHARS: Final = 40



def default_state_dir(
    *,
    platform: str = sys.platform,
    environ: Mapping[str, str] = os.environ,
    home: Path | None = None,
) -> Path:
    """The platform's state directory for this program (``koboldcpp-horde-chat`` under it).

    - Windows (``"win32"``): ``%LOCALAPPDATA%`` when set to an absolute path,
      else ``<home>/AppData/Local``;
    - macOS (``"darwin"``): ``<home>/Library/Application Support``;
    - Linux and other Unix: ``$XDG_STATE_HOME`` when set, non-empty and
      absolute (the XDG rule: a relative value is ignored), else
      ``<home>/.local/state``.

    Args:
        platform: ``sys.platform``'s value.
        environ: the environment to read.
        home: the user's home directory; None reads ``Path.home()``.

    Pure given its arguments (with ``home`` given); creates nothing.
    """
    if platform == "win32":
        local = environ.get("LOCALAPPDATA", "")
        if local and PureWindowsPath(local).is_absolute():
            return Path(local) / APP_DIR_NAME
        return _home(home) / "AppData" / "Local" / APP_DIR_NAME
    if platform == "darwin":
        return _home(home) / "Library" / "Application Support" / APP_DIR_NAME
    state = environ.get("XDG_STATE_HOME", "")
    if state and PurePosixPath(state).is_absolute():
        return Path(state) / APP_DIR_NAME
    return _home(home) / ".local" / "state" / APP_DIR_NAME


JOURNAL_DIR_ENV: Final = "KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR"
"""Environment variable moving the journal's directory (the standalone worker's
``--journal-dir`` defaults to it; inside koboldcpp it is the only way)."""


def journal_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The journal's directory: ``$KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR`` when set and
    not empty, else :func:`default_state_dir`."""
    value = environ.get(JOURNAL_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else default_state_dir(environ=environ)


def _home(home: Path | None) -> Path:
    return Path.home() if home is None else home


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def journal_path(worker_name: str, state_dir: Path) -> Path:
    """The journal file of the worker named ``worker_name`` in ``state_dir``.

    ``jobs-<slug>-<hash>.json``: the slug is the name with every run of other
    characters than ASCII letters, digits, ``_`` and ``-`` turned into ``_``,
    at most 40 characters (``worker`` when nothing is left); the hash is the
    first 8 hex digits of the SHA-256 of the exact name (UTF-8), so names that
    share a slug ("My Worker", "My_Worker") or differ only in case (for a
    file system that ignores case) get distinct files. Example:
    ``jobs-My_Worker-<8 hex>.json``.
    """
    slug = _UNSAFE.sub("_", worker_name).strip("_-")[:SLUG_MAX_CHARS].strip("_-") or "worker"
    digest = hashlib.sha256(worker_name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return state_dir / f"jobs-{slug}-{digest}.json"


