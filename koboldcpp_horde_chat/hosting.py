"""What a host does before its pop loops start: the shared state and the journal.

Both hosts (``standalone.py`` beside koboldcpp, ``kcpp_hook.py`` inside it)
give a worker's loops one :class:`~state.WorkerState` holding the worker's job
journal, and fault the jobs the journal says an earlier run left in hand
before any loop pops (``journal.recover``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from .backend import KoboldClient
from .errors import ConfigError
from .horde import HordeClient
from .journal import Journal, journal_path, recover
from .settings import WorkerSettings
from .state import WorkerState


def open_state(
    settings: WorkerSettings,
    journal_directory: Path,
    *,
    stop_event: threading.Event | None = None,
) -> WorkerState:
    """A worker's shared state, with its journal opened and the jobs an earlier run
    left in hand faulted (their genkeys aborted on koboldcpp).

    Args:
        settings: the worker's configuration (name, Horde, koboldcpp, model_id).
        journal_directory: where the worker's journal file is
            (``journal.journal_path(settings.worker_name, journal_directory)``).
        stop_event: the loops' stop event (a new one when None); it also ends
            the recovery's pauses between attempts.

    Returns:
        The state to give every loop of the worker. Never raises for the
        Horde's or koboldcpp's answers (``journal.recover`` logs them).

    Raises:
        ConfigError: another process on this machine serves the same worker
            name (it holds the journal, ``Journal.claim``).
    """
    journal = Journal(journal_path(settings.worker_name, journal_directory))
    holder = journal.claim()
    if holder is not None:
        raise ConfigError(
            f"another worker named {settings.worker_name!r} runs on this machine"
            + (f" (process {holder})" if holder else "")
            + ": the Horde sees one worker per name; stop that one, or give this one "
            "another --hordeworkername"
        )
    state = WorkerState(settings, stop_event=stop_event, journal=journal)
    stopper = state.stop_event

    def pause(seconds: float) -> None:
        stopper.wait(seconds)

    horde = HordeClient(
        settings.horde_url,
        settings.api_key,
        bridge_agent=settings.bridge_agent,
        connect_timeout_s=settings.connect_timeout_s,
    )
    backend = KoboldClient(
        settings.kcpp_url, settings.kcpp_password, connect_timeout_s=settings.connect_timeout_s
    )
    try:
        recover(
            journal,
            horde=horde,
            backend=backend,
            wall=time.time,
            model_id_default=settings.model_id,
            pause=pause,
        )
    finally:
        horde.close()
        backend.close()
    return state
