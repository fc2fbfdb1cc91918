"""What both hosts do before their pop loops start, so they refuse the same things
in the same words: the start-up checks, the start lines, the journal and its
recovery, the shared state, and the clients of one loop.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..horde.client import HordeClient
from ..horde.declaration import BackendCapabilities, chat_features
from ..horde.watch import HordeWatch
from ..inflight import CallDeadlines
from ..koboldcpp.api import BackendInfo
from ..koboldcpp.client import KoboldClient
from ..koboldcpp.manners import LocalManners
from ..koboldcpp.versions import CHAT_ROUTE_SINCE, since
from ..service.loop import Worker
from ..service.recovery import Recovery
from ..settings import WorkerSettings
from ..state.journal import Journal, check_directory, reason
from ..state.journal_paths import JOURNAL_DIR_ENV, journal_path
from ..state.shared import WorkerState
from .key_check import check_api_key, owner_trusted

log = logging.getLogger("koboldcpp_horde_chat.hosting")

#: The standalone worker's name when ``--hordeworkername`` is not given (a
#: service's or a container's environment, beside ``AI_HORDE_API_KEY``).
WORKER_NAME_ENV = "HORDE_WORKER_NAME"


#: The longest worker name the Horde stores (its worker table's ``db.String(100)``),
#: once stripped.
WORKER_NAME_MAX_CHARS = 100


def check_worker_name(name: str, source: str) -> str:
    """``name`` stripped, as the Horde stores it; ConfigError naming ``source`` when
    the Horde would refuse it (blank, or too long once stripped)."""
    stripped = name.strip()
    if not stripped:
        raise ConfigError(f"{source}: a worker name is required (not empty or only spaces)")
    if len(stripped) > WORKER_NAME_MAX_CHARS:
        raise ConfigError(
            f"{source}: the name is {len(stripped)} characters long; the Horde takes at "
            f"most {WORKER_NAME_MAX_CHARS}"
        )
    return stripped


def worker_name_from(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``--hordeworkername`` when given, else ``HORDE_WORKER_NAME``, checked; ConfigError
    when neither gives one."""
    if flag is not None:
        return check_worker_name(flag, "--hordeworkername")
    value = (os.environ if environ is None else environ).get(WORKER_NAME_ENV)
    if value is None:
        raise ConfigError(f"--hordeworkername is required (or set {WORKER_NAME_ENV})")
    return check_worker_name(value, WORKER_NAME_ENV)


def check_url(value: str, source: str, *, horde: bool = False) -> str:
    """``value`` as a base URL without a trailing slash; a Horde URL given with its
    API path is cut back to its base, with a warning. ConfigError naming
    ``source`` for anything but an http(s) URL with a host."""
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


def check_limits(max_length: int, max_context_length: int) -> None:
    """ConfigError when ``--hordegenlen`` or ``--hordemaxctx`` is negative (0: the default)."""
    if max_length < 0 or max_context_length < 0:
        raise ConfigError("--hordegenlen and --hordemaxctx must not be negative")


def check_journal_dir(directory: Path, source: str) -> None:
    """Make sure a journal directory the operator named (by ``source``) can keep the
    journal, making it when missing; ConfigError in one line otherwise."""
    try:
        check_directory(directory)
    except OSError as exc:
        raise ConfigError(
            f"{source} {directory}: the job journal cannot be kept there ({reason(exc)})"
        ) from None


def capabilities(settings: WorkerSettings, *, chat: bool = True) -> BackendCapabilities:
    """What both hosts declare for the same settings (the same pop body); ``chat``
    False: koboldcpp is too old for chat."""
    return BackendCapabilities(
        vision=settings.vision, image_url=settings.image_url_transport, chat=chat
    )


def serving_line(settings: WorkerSettings, *, chat: bool = True) -> str:
    """The start line both hosts log: what the Horde will send, for which model,
    from which Horde, via which koboldcpp. Only a Horde with the chat routes
    sends chat jobs (the public one sends text jobs today), so the line
    promises text jobs first; ``chat`` False: koboldcpp is too old for chat."""
    slots = f", {settings.threads} at once" if settings.threads > 1 else ""
    where = f"for {settings.model_id} from {settings.horde_url} via {settings.kcpp_url}{slots}"
    if not chat:
        return f"serving text jobs {where} (this koboldcpp has no chat route: chat is not declared)"
    if not settings.prompt_jobs:
        return (
            f"serving chat jobs only {where} (pops declare prompt_jobs: false; a Horde "
            "without the chat routes ignores it and sends text jobs, which this worker serves)"
        )
    return (
        f"serving text jobs {where}, and chat jobs once that Horde sends them (chat is "
        "declared on every pop; a Horde without the chat routes sends text jobs only)"
    )


def koboldcpp_found_line(
    info: BackendInfo, settings: WorkerSettings, caps: BackendCapabilities
) -> str:
    """E.g. ``"koboldcpp 1.116.1 at http://127.0.0.1:5001: model SmolLM2-135M-Instruct,
    context 4096, chat template yes, vision no; declaring chat (seed, ...), text"``;
    the template is ``unknown`` before koboldcpp 1.79, which does not say."""
    model = info.model_name.removeprefix("koboldcpp/")
    template = {None: "unknown", "": "none"}.get(info.chat_template, "yes")
    route = "" if caps.chat else f", no chat route (koboldcpp {since(CHAT_ROUTE_SINCE)} added it)"
    declared: list[str] = []
    if caps.chat:
        features = chat_features(caps, settings.chat_withhold)
        declared.append(f"chat ({', '.join(features)})")
    if settings.prompt_jobs:
        declared.append("text")
    return (
        f"koboldcpp {info.version or '(version not reported)'} at {settings.kcpp_url}: "
        f"model {model}, context {info.max_context_length}, chat template {template}, "
        f"vision {'yes' if info.vision else 'no'}{route}; "
        f"declaring {', '.join(declared) or 'nothing'}"
    )


def say_koboldcpp_found(
    info: BackendInfo, settings: WorkerSettings, caps: BackendCapabilities
) -> None:
    """Log :func:`koboldcpp_found_line`, and a WARNING for a model without a chat
    template: koboldcpp then renders chat with its fallback tags (1.116.1
    ``koboldcpp.py`` L4264-4270). Chat stays declared, as the seed's worked example
    declares it for any loaded model: the fallback is right for models trained on
    Alpaca's tags."""
    log.info("%s", koboldcpp_found_line(info, settings, caps))
    if info.chat_template == "" and caps.chat:
        log.warning(
            "koboldcpp reports no chat template for model %s: chat replies go through "
            "koboldcpp's fallback template (Alpaca's '### Instruction:' / '### Response:', or "
            "the tags of --chatcompletionsadapter), which a model trained on other tags may "
            "answer poorly; chat is declared all the same (load a model with a chat template, "
            "or give koboldcpp one with --jinjatemplate, for better replies)",
            info.model_name.removeprefix("koboldcpp/"),
        )


def start_recovery(
    settings: WorkerSettings,
    journal_directory: Path,
    stop_event: threading.Event,
    deadlines: CallDeadlines | None = None,
    *,
    journal_setting: str = JOURNAL_DIR_ENV,
    abort_kcpp: bool = False,
) -> Recovery | None:
    """Open the worker's journal, locked by this process, and start ending the jobs
    an earlier run left unfinished, on a thread of its own; it needs the Horde,
    the key, the name and the model only (the settings' ``model_id``: the ``model_id``
    of a chat fault whose entry has none). The journal is the recovery's ``journal``.

    None, after one WARNING naming ``journal_setting``, when the journal cannot be
    kept in ``journal_directory``; ConfigError when another process serves the
    same worker name. ``abort_kcpp``: abort the orphaned generations on the
    settings' koboldcpp (not inside koboldcpp, whose restart ended them).
    ``deadlines``: at a stop, the recovery's calls end by them and unanswered
    jobs stay in the journal (None: a stop keeps them at once).
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
        return None
    if holder is not None:
        raise ConfigError(
            f"another worker named {settings.worker_name!r} runs on this machine"
            + (f" (process {holder})" if holder else "")
            + ": the Horde sees one worker per name; stop that one, or give this one "
            "another --hordeworkername"
        )
    journal.serve(settings.horde_url)  # its jobs record this Horde; another Horde's are left alone
    return Recovery(
        journal,
        horde_factory=lambda: horde_client(settings, deadlines),
        backend_factory=(lambda: kcpp_client(settings, deadlines)) if abort_kcpp else None,
        model_id_default=settings.model_id,
        stop_event=stop_event,
        deadlines=deadlines,
    )


def new_state(
    settings: WorkerSettings,
    recovery: Recovery | None,
    deadlines: CallDeadlines,
    stop_event: threading.Event | None = None,
) -> WorkerState:
    """A worker's shared state with the recovery under way (the loops wait for it
    before their first pop): its journal and its stop event. Without a recovery
    the state has no journal, and ``stop_event`` (None: a new one)."""
    state = WorkerState(
        settings,
        stop_event=recovery.stop_event if recovery is not None else stop_event,
        journal=recovery.journal if recovery is not None else None,
        call_deadlines=deadlines,
    )
    state.recovery = recovery
    return state


def horde_client(
    settings: WorkerSettings,
    deadlines: CallDeadlines | None = None,
    watch: HordeWatch | None = None,
) -> HordeClient:
    """A Horde client for one thread; its calls end by the stop's ``deadlines``."""
    return HordeClient(
        settings.horde_url,
        settings.api_key,
        bridge_agent=settings.bridge_agent,
        connect_timeout_s=settings.connect_timeout_s,
        deadlines=deadlines,
        watch=watch,
    )


_WATCHES: weakref.WeakKeyDictionary[WorkerState, HordeWatch] = weakref.WeakKeyDictionary()
_WATCHES_LOCK = threading.Lock()


def kcpp_client(
    settings: WorkerSettings, deadlines: CallDeadlines | None = None
) -> KoboldClient:
    """A koboldcpp client for one thread; its calls other than generations end by
    the stop's ``deadlines``."""
    client = KoboldClient(
        settings.kcpp_url, settings.kcpp_password, connect_timeout_s=settings.connect_timeout_s
    )
    client.deadlines = deadlines
    return client


def run_worker(
    settings: WorkerSettings,
    *,
    state: WorkerState,
    manners: LocalManners | None = None,
    caps: BackendCapabilities | None = None,
    worker_id: int = 1,
) -> int:
    """Build one thread's clients and run one pop loop of ``state``'s worker until
    stopped; the exit code (3, after one ERROR line, when the Horde refuses the
    key before any pop)."""
    deadlines = state.call_deadlines
    refused = check_api_key(
        settings.horde_url, settings.api_key, deadlines=deadlines,
        connect_timeout_s=min(5.0, settings.connect_timeout_s),
    )
    if refused is not None:  # before any pop: the key would only be refused there
        log.error("worker %d: not started: %s", worker_id, refused)
        return 3
    if state.owner_trusted is None:  # the suspicion warning need not ask again
        state.owner_trusted = owner_trusted(settings.horde_url, settings.api_key)
    with _WATCHES_LOCK:  # one HordeWatch for all a worker's loops' Horde clients
        watch = _WATCHES.setdefault(state, HordeWatch())
    return Worker(
        settings,
        horde=horde_client(settings, deadlines, watch),
        backend=kcpp_client(settings, deadlines),
        manners=manners,
        caps=caps,
        worker_id=worker_id,
        state=state,
        pop_horde=horde_client(settings, deadlines, watch),
        abort_backend=kcpp_client(settings, deadlines),
        retry_horde=lambda: horde_client(settings, deadlines, watch),
    ).run()
