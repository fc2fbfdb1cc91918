"""What a host does before its pop loops start: the start-up checks, the shared
state and the journal.

Both hosts (``service/standalone.py`` beside koboldcpp, ``kcpp/hook.py`` inside it)
check their settings with the same functions here, so they refuse the same
things in the same words: the worker name (:func:`check_worker_name`), the
URLs (:func:`check_url`), the limits (:func:`check_limits`) and, standalone,
a journal directory the operator named (:func:`check_journal_dir`). Both
then give a worker's loops one :class:`~state.WorkerState` holding the
worker's job journal, and fault the jobs the journal says an earlier run left
in hand before any loop pops (``recovery.recover``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..horde.client import HordeClient
from ..horde.declaration import BackendCapabilities
from ..kcpp.api import KcppAPI
from ..kcpp.client import KoboldClient
from ..kcpp.manners import LocalManners
from ..settings import WorkerSettings, worker_name_problem
from .journal import Journal, check_directory, reason
from .journal_paths import JOURNAL_DIR_ENV, journal_path
from .loop import Worker
from .recovery import recover
from .state import WorkerState

log = logging.getLogger("koboldcpp_horde_chat.hosting")


def check_worker_name(name: str, source: str) -> str:
    """``name`` stripped, as the Horde stores it.

    Raises ConfigError naming ``source`` (``"--hordeworkername"``) for a name
    the Horde refuses (:func:`settings.worker_name_problem`: empty once
    stripped, or over 100 characters), e.g. ``"--hordeworkername: the name is
    101 characters long; the Horde takes at most 100"``.
    """
    problem = worker_name_problem(name)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return name.strip()


def check_url(value: str, source: str, *, horde: bool = False) -> str:
    """``value`` as a base URL without a trailing slash.

    ``source`` names where the value came from (``--horde-url``,
    ``AI_HORDE_URL``, ``--kcpp-url`` or ``KCPP_URL``). A Horde URL
    (``horde=True``) given with the API path (``https://aihorde.net/api/v2``)
    is cut back to its base, with a warning. Raises ConfigError, naming
    ``source``, for anything but an http(s) URL with a host, e.g.
    ``"AI_HORDE_URL needs an http:// or https:// URL, not 'aihorde.net'"``.
    """
    url = value.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{source} needs an http:// or https:// URL, not {value!r}")
    for suffix in ("/api/v2", "/api"):
        if horde and parts.path.endswith(suffix):
            url = url[: -len(suffix)]
            log.warning("%s: using %s (the worker adds the /api/v2 routes itself)", source, url)
            break
    return url


def check_limits(
    max_length: int,
    max_context_length: int,
    sources: tuple[str, str] = ("--hordegenlen", "--hordemaxctx"),
) -> None:
    """The operator's token limits (``--hordegenlen``, ``--hordemaxctx``; 0 = the default).

    Raises ConfigError when either is negative, naming ``sources``:
    ``"--hordegenlen and --hordemaxctx must not be negative"``.
    """
    if max_length < 0 or max_context_length < 0:
        raise ConfigError(f"{sources[0]} and {sources[1]} must not be negative")


def check_journal_dir(directory: Path, source: str) -> None:
    """A journal directory the operator named (``source``: ``--journal-dir`` or
    ``KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR``) can keep the journal.

    Makes the directory when missing (``journal.check_directory``). Raises
    ConfigError in one line otherwise, e.g. ``"--journal-dir /proc/nope:
    the job journal cannot be kept there (No such file or directory)"``.
    """
    try:
        check_directory(directory)
    except OSError as exc:
        raise ConfigError(
            f"{source} {directory}: the job journal cannot be kept there ({reason(exc)})"
        ) from None


def serving_line(settings: WorkerSettings) -> str:
    """The start line both hosts log: what is served, for which model, from
    which Horde, via which koboldcpp.

    E.g. ``"serving chat and text jobs for koboldcpp/Qwen3-8B from
    https://aihorde.net via http://127.0.0.1:5001"`` (``"chat jobs"`` with
    ``prompt_jobs`` off; ``", 2 at once"`` added for two slots).
    """
    kinds = "chat and text jobs" if settings.prompt_jobs else "chat jobs"
    slots = f", {settings.threads} at once" if settings.threads > 1 else ""
    return (
        f"serving {kinds} for {settings.model_id} from {settings.horde_url} "
        f"via {settings.kcpp_url}{slots}"
    )


def open_state(
    settings: WorkerSettings,
    journal_directory: Path,
    *,
    stop_event: threading.Event | None = None,
    journal_setting: str = JOURNAL_DIR_ENV,
) -> WorkerState:
    """A worker's shared state, with its journal opened and the jobs an earlier run
    left in hand faulted (their genkeys aborted on koboldcpp).

    Args:
        settings: the worker's configuration (name, Horde, koboldcpp, model_id).
        journal_directory: where the worker's journal file is
            (``journal_paths.journal_path(settings.worker_name, journal_directory)``).
        stop_event: the loops' stop event (a new one when None); it also ends
            the recovery's pauses between attempts.
        journal_setting: how the operator moves the journal (``--journal-dir``
            standalone), named in the line below.

    Returns:
        The state to give every loop of the worker. Never raises for the
        Horde's or koboldcpp's answers (``recovery.recover`` logs them). When
        the journal cannot be kept in ``journal_directory`` the state has no
        journal and one WARNING line says crash recovery is off and why.

    Raises:
        ConfigError: another process on this machine serves the same worker
            name (it holds the journal, ``Journal.lock``).
    """
    journal = Journal(journal_path(settings.worker_name, journal_directory))
    try:
        holder = journal.lock()
    except OSError as exc:
        log.warning(
            "job journal directory %s cannot be used (%s): crash recovery is off, so a job "
            "in hand when the worker dies is left to expire on the Horde; point %s at a "
            "writable directory to turn it on",
            journal_directory,
            reason(exc),
            journal_setting,
        )
        return WorkerState(settings, stop_event=stop_event, journal=None)
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

    horde, backend = horde_client(settings), kcpp_client(settings)
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
    # The faults the Horde still counts toward maintenance, an earlier process's and
    # the recovery's: the first pop's declaration already knows them.
    state.restore_faults(
        journal.recent_faults(time.time()), now=time.monotonic(), wall=time.time()
    )
    return state


def horde_client(settings: WorkerSettings) -> HordeClient:
    """A Horde client for the worker's Horde, key and bridge agent (one per thread)."""
    return HordeClient(
        settings.horde_url,
        settings.api_key,
        bridge_agent=settings.bridge_agent,
        connect_timeout_s=settings.connect_timeout_s,
    )


def kcpp_client(settings: WorkerSettings) -> KoboldClient:
    """A koboldcpp client for the worker's koboldcpp (one per thread)."""
    return KoboldClient(
        settings.kcpp_url, settings.kcpp_password, connect_timeout_s=settings.connect_timeout_s
    )


def run_worker(
    settings: WorkerSettings,
    *,
    stop_event: threading.Event | None = None,
    manners: LocalManners | None = None,
    caps: BackendCapabilities | None = None,
    worker_id: int = 1,
    backend: KcppAPI | None = None,
    state: WorkerState | None = None,
) -> int:
    """Build the clients and run one pop loop until stopped; returns the exit code.

    One ``requests.Session`` per client and per thread: call this once per
    worker thread. ``state`` is shared with the worker's other loops.
    """
    worker = Worker(
        settings,
        horde=horde_client(settings),
        backend=backend if backend is not None else kcpp_client(settings),
        stop_event=stop_event,
        manners=manners,
        caps=caps,
        worker_id=worker_id,
        state=state,
        pop_horde=horde_client(settings),
        abort_backend=kcpp_client(settings),
        retry_horde=lambda: horde_client(settings),
    )
    return worker.run()
