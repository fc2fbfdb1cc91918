"""Where the job journal lives: one file per worker name in the platform's
state directory, or ``$KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR`` (creates nothing)."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Final

APP_DIR_NAME: Final = "koboldcpp-horde-chat"
SLUG_MAX_CHARS: Final = 40


def default_state_dir(
    *, platform: str = sys.platform, environ: Mapping[str, str] = os.environ,
    home: Path | None = None,
) -> Path:
    """This program's directory in the platform's state directory:
    ``%LOCALAPPDATA%`` (absolute) else ``<home>/AppData/Local`` on Windows,
    ``<home>/Library/Application Support`` on macOS, else ``$XDG_STATE_HOME``
    (absolute; a relative one is ignored) else ``<home>/.local/state``."""
    if platform == "win32":
        local = environ.get("LOCALAPPDATA", "")
        if local and PureWindowsPath(local).is_absolute():
            return Path(local) / APP_DIR_NAME
        return (home or Path.home()) / "AppData" / "Local" / APP_DIR_NAME
    if platform == "darwin":
        return (home or Path.home()) / "Library" / "Application Support" / APP_DIR_NAME
    state = environ.get("XDG_STATE_HOME", "")
    if state and PurePosixPath(state).is_absolute():
        return Path(state) / APP_DIR_NAME
    return (home or Path.home()) / ".local" / "state" / APP_DIR_NAME


JOURNAL_DIR_ENV: Final = "KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR"


def journal_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR`` when set, else :func:`default_state_dir`."""
    value = environ.get(JOURNAL_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else default_state_dir(environ=environ)


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def journal_path(worker_name: str, state_dir: Path) -> Path:
    """``jobs-<slug>-<hash>.json``: the name made safe (at most 40 characters,
    ``worker`` when nothing is left), then 8 hex digits of the SHA-256 of the
    exact name, so "My Worker", "My_Worker" and "my worker" get distinct files."""
    slug = _UNSAFE.sub("_", worker_name).strip("_-")[:SLUG_MAX_CHARS].strip("_-") or "worker"
    digest = hashlib.sha256(worker_name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return state_dir / f"jobs-{slug}-{digest}.json"
