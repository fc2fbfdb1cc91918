"""The package under test: every ``koboldcpp_horde_chat`` module the benchmarks use.

The one place the benchmarks import the package's modules from (the devkit,
an independent oracle, is imported where the servers are built).
"""

from __future__ import annotations

from koboldcpp_horde_chat.errors import BackendBusy
from koboldcpp_horde_chat.horde.client import HordeClient
from koboldcpp_horde_chat.horde.declaration import BackendCapabilities, pop_body
from koboldcpp_horde_chat.hosts.standalone import LOG_DATEFMT, LOG_FORMAT, run_standalone
from koboldcpp_horde_chat.koboldcpp.client import BackendStream, KoboldClient
from koboldcpp_horde_chat.koboldcpp.manners import NoManners, StandaloneManners
from koboldcpp_horde_chat.koboldcpp.sse import SSEDecoder
from koboldcpp_horde_chat.service.loop import Worker
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state.journal import Journal, JournalEntry
from koboldcpp_horde_chat.state.journal_paths import default_state_dir, journal_path
from koboldcpp_horde_chat.state.shared import WorkerState

__all__ = [
    "LOG_DATEFMT",
    "LOG_FORMAT",
    "BackendBusy",
    "BackendCapabilities",
    "BackendStream",
    "HordeClient",
    "Journal",
    "JournalEntry",
    "KoboldClient",
    "NoManners",
    "SSEDecoder",
    "StandaloneManners",
    "Worker",
    "WorkerSettings",
    "WorkerState",
    "default_state_dir",
    "journal_path",
    "pop_body",
    "run_standalone",
]
