"""What a host does before its pop loops start: the start-up checks, the shared
state and the journal.

Both hosts (``hosts/standalone.py`` beside koboldcpp, ``hosts/inside_kcpp.py`` inside it)
check their settings with the same functions here, so they refuse the same
things in the same words: the worker name (:func:`check_worker_name`), the
URLs (:func:`check_url`), the limits (:func:`check_limits`) and, standalone,
a journal directory the operator named (:func:`check_journal_dir`). Both
then give a worker's loops one :class:`~koboldcpp_horde_chat.state.shared.WorkerState` holding the
worker's job journal, and end the jobs the journal says an earlier run left
in hand before any loop pops (``recovery.Recovery``, started as soon as the
Horde and the key are known).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import BRIDGE_AGENT
from ..errors import ConfigError
from ..horde.client import HordeClient
from ..horde.declaration import BackendCapabilities, chat_features
from ..horde.watch import HordeWatch
from ..inflight import CallDeadlines
from ..koboldcpp.api import BackendInfo, KcppAPI
from ..koboldcpp.client import KoboldClient
from ..koboldcpp.manners import LocalManners
from ..koboldcpp.versions import CHAT_ROUTE_SINCE, since
from ..service.loop import Worker
from ..service.recovery import Recovery
from ..settings import WorkerSettings, worker_name_problem
from ..state.journal import Journal, check_directory, reason
from ..state.journal_paths import JOURNAL_DIR_ENV, journal_path
from ..state.shared import WorkerState
from .key_check import check_api_key, owner_trusted

log = logging.getLogger("koboldcpp_horde_chat.hosting")

#: The standalone worker's name when ``--hordeworkername`` is not given (a
#: service's or a container's environment, beside ``AI_HORDE_API_KEY``).
WORKER_NAME_ENV = "HORDE_WORKER_NAME"


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


def worker_name_from(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The worker name: ``--hordeworkername`` when given, else the
    ``HORDE_WORKER_NAME`` environment variable, stripped.

    Raises ConfigError naming where the name came from when the Horde would
    refuse it, or ``"--hordeworkername is required (or set HORDE_WORKER_NAME)"``
    when neither gives one.
    """
    if flag is not None:
        return check_worker_name(flag, "--hordeworkername")
    value = (os.environ if environ is None else environ).get(WORKER_NAME_ENV)
    if value is None:
        raise ConfigError(f"--hordeworkername is required (or set {WORKER_NAME_ENV})")
    return check_worker_name(value, WORKER_NAME_ENV)


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


def serving_line(settings: WorkerSettings, *, chat: bool = True) -> str:
    """The start line both hosts log: what the Horde will send, for which model,
    from which Horde, via which koboldcpp.

    The worker declares chat on every pop, but only a Horde with the chat
    routes sends chat jobs (the public one hands out text jobs today), so the
    line promises text jobs and names chat jobs as what comes once the Horde
    has those routes; the loop says so again when the first chat job comes
    (``status.first_chat_job_line``). E.g. ``"serving text jobs for
    koboldcpp/Qwen3-8B from https://aihorde.net via http://127.0.0.1:5001, and
    chat jobs once that Horde sends them (chat is declared on every pop; a
    Horde without the chat routes sends text jobs only)"``; a chat-only worker
    (``prompt_jobs`` off): ``"serving chat jobs only ... (pops declare
    prompt_jobs: false; a Horde without the chat routes ignores it and sends
    text jobs, which this worker serves)"``: the real AI Horde without those
    routes knows no chat key and ignores ``prompt_jobs`` without a word;
    ``", 2 at once"`` added after the koboldcpp URL for two slots. With a
    koboldcpp too old for chat (``chat`` False: ``koboldcpp.versions``):
    ``"serving text jobs ... (this koboldcpp has no chat route: chat is not
    declared)"``.
    """
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
    """The one line saying what the worker found at koboldcpp's URL and what it
    declares for it (at start, and again when koboldcpp came back serving
    something else), e.g. ``"koboldcpp 1.116.1 at http://127.0.0.1:5001: model
    SmolLM2-135M-Instruct, context 4096, chat template yes, vision no; declaring
    chat (seed, presence_penalty, tools, json_object, json_schema,
    reasoning_effort, prompt_overflow_refused), text"``.

    The chat template is ``yes``, ``none`` (koboldcpp's fallback renders chat:
    :func:`no_chat_template_line`) or ``unknown`` (koboldcpp before 1.79 does not
    say). A koboldcpp too old for chat reads ``..., no chat route (koboldcpp
    1.46 added it); declaring text``; a chat-only worker declares no text.
    """
    model = info.model_name.removeprefix("koboldcpp/")
    template = (
        "unknown" if info.chat_template is None else "yes" if info.chat_template else "none"
    )
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


def no_chat_template_line(info: BackendInfo) -> str:
    """The WARNING for a model that carries no chat template (``/props`` says
    ``""``): koboldcpp renders its chat with its fallback tags (Alpaca's
    ``### Instruction:`` and ``### Response:``, 1.116.1 ``koboldcpp.py``
    L4264-4270), which a model trained on other tags answers poorly.

    Chat is still declared. The seed's worked example ("koboldcpp's embedded
    worker") declares chat for whatever model koboldcpp loaded, with no
    condition on its template, and the template koboldcpp renders is the one
    the worker serves with: the fallback one here (the right one for a model
    trained on Alpaca's tags, as many older finetunes without an embedded
    template are). Its tool turns are rendered in koboldcpp's own words, so
    ``tools`` stays declared too. The Horde does not test declarations: the
    line tells the operator, who can load a model with a template.
    """
    model = info.model_name.removeprefix("koboldcpp/")
    return (
        f"koboldcpp reports no chat template for model {model}: chat replies go through "
        "koboldcpp's fallback template (Alpaca's '### Instruction:' / '### Response:', or "
        "the tags of --chatcompletionsadapter), which a model trained on other tags may "
        "answer poorly; chat is declared all the same (load a model with a chat template, "
        "or give koboldcpp one with --jinjatemplate, for better replies)"
    )


def say_koboldcpp_found(
    info: BackendInfo, settings: WorkerSettings, caps: BackendCapabilities
) -> None:
    """Log :func:`koboldcpp_found_line`, and :func:`no_chat_template_line` as a
    WARNING when the model carries no chat template and chat is declared."""
    log.info("%s", koboldcpp_found_line(info, settings, caps))
    if info.chat_template == "" and caps.chat:
        log.warning("%s", no_chat_template_line(info))


def open_journal(
    worker_name: str,
    journal_directory: Path,
    *,
    journal_setting: str = JOURNAL_DIR_ENV,
) -> Journal | None:
    """The worker's job journal, held by this process (``Journal.lock``).

    Returns None, after one WARNING line saying crash recovery is off and
    why, when the journal cannot be kept in ``journal_directory``
    (``journal_setting`` names how the operator moves it).

    Raises:
        ConfigError: another process on this machine serves the same worker
            name (it holds the journal).
    """
    journal = Journal(journal_path(worker_name, journal_directory))
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
            f"another worker named {worker_name!r} runs on this machine"
            + (f" (process {holder})" if holder else "")
            + ": the Horde sees one worker per name; stop that one, or give this one "
            "another --hordeworkername"
        )
    return journal


def start_recovery(
    journal: Journal,
    *,
    horde_url: str,
    api_key: str,
    model_id_default: str,
    stop_event: threading.Event,
    kcpp: tuple[str, str] | None = None,
    connect_timeout_s: float | None = None,
    deadlines: CallDeadlines | None = None,
) -> Recovery:
    """Start the recovery of the jobs an earlier run left in hand, on a thread of
    its own, now: it needs the Horde and the API key only, not koboldcpp
    (``recovery.Recovery``).

    Args:
        journal: the worker's journal (:func:`open_journal`).
        horde_url, api_key: the Horde and the key (sent only there).
        model_id_default: the ``model_id`` of a chat fault whose entry has none.
        stop_event: the worker's stop; it ends the recovery's pauses.
        kcpp: ``(url, password)`` of the koboldcpp whose orphaned generations
            to abort (standalone); None inside koboldcpp, whose restart ended
            them.
        connect_timeout_s: the clients' connect timeout (None: theirs).
        deadlines: the stop's deadlines (``WorkerState.call_deadlines``, or
            the host's before the state exists): at a stop the recovery's
            pauses and calls end by them and the jobs the Horde has not
            answered by then stay in the journal. None: a stop keeps them at once.
    """
    journal.serve(horde_url)  # its jobs record this Horde; another Horde's are left alone
    extra: dict[str, Any] = {}
    if connect_timeout_s is not None:
        extra["connect_timeout_s"] = connect_timeout_s

    def horde() -> HordeClient:
        return HordeClient(
            horde_url, api_key, bridge_agent=BRIDGE_AGENT, deadlines=deadlines, **extra
        )

    backend_factory = None
    if kcpp is not None:
        url, password = kcpp

        def backend_factory() -> KoboldClient:
            client = KoboldClient(url, password, **extra)
            client.deadlines = deadlines
            return client

    return Recovery(
        journal,
        horde_factory=horde,
        backend_factory=backend_factory,
        model_id_default=model_id_default,
        stop_event=stop_event,
        deadlines=deadlines,
    )


def open_state(
    settings: WorkerSettings,
    journal_directory: Path,
    *,
    stop_event: threading.Event | None = None,
    journal_setting: str = JOURNAL_DIR_ENV,
    journal: Journal | None = None,
    recovery: Recovery | None = None,
    abort_orphans: bool = True,
    call_deadlines: CallDeadlines | None = None,
) -> WorkerState:
    """A worker's shared state, with its journal and the recovery of the jobs an
    earlier run left in hand under way (the loops wait for it before their
    first pop: ``WorkerState.wait_recovered``).

    Args:
        settings: the worker's configuration (name, Horde, koboldcpp, model_id).
        journal_directory: where the worker's journal file is
            (``journal_paths.journal_path(settings.worker_name, journal_directory)``).
        stop_event: the loops' stop event (a new one when None); it also ends
            the recovery's pauses between attempts.
        journal_setting: how the operator moves the journal (``--journal-dir``
            standalone), named in the warning when it cannot be kept.
        journal, recovery: a journal already opened and its recovery already
            started (:func:`open_journal`, :func:`start_recovery`: the
            standalone worker starts them before koboldcpp answers); None:
            both are opened and started here.
        abort_orphans: abort the recovered jobs' generations on the
            configured koboldcpp (False inside koboldcpp).
        call_deadlines: the stop's deadlines the host made before the state
            (the ones its recovery already uses); None: the state's own, which
            the recovery started here uses.

    Returns:
        The state to give every loop of the worker; without a journal when it
        cannot be kept in ``journal_directory`` (one WARNING line).

    Raises:
        ConfigError: another process on this machine serves the same worker
            name (it holds the journal, ``Journal.lock``).
    """
    if journal is None:
        journal = open_journal(
            settings.worker_name, journal_directory, journal_setting=journal_setting
        )
    if journal is None:
        return WorkerState(
            settings, stop_event=stop_event, journal=None, call_deadlines=call_deadlines
        )
    journal.serve(settings.horde_url)
    state = WorkerState(
        settings, stop_event=stop_event, journal=journal, call_deadlines=call_deadlines
    )
    if recovery is None:
        recovery = start_recovery(
            journal,
            horde_url=settings.horde_url,
            api_key=settings.api_key,
            model_id_default=settings.model_id,
            stop_event=state.stop_event,
            kcpp=(settings.kcpp_url, settings.kcpp_password) if abort_orphans else None,
            connect_timeout_s=settings.connect_timeout_s,
            deadlines=state.call_deadlines,
        )
    state.recovery = recovery
    return state


def horde_client(
    settings: WorkerSettings,
    deadlines: CallDeadlines | None = None,
    watch: HordeWatch | None = None,
) -> HordeClient:
    """A Horde client for the worker's Horde, key and bridge agent (one per thread);
    its calls end by the stop's ``deadlines`` (``WorkerState.call_deadlines``) and
    are watched by ``watch`` (:func:`horde_watch`)."""
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


def horde_watch(state: WorkerState) -> HordeWatch:
    """The one ``watch.HordeWatch`` of a worker (all its loops' Horde clients):
    it says when the Horde stops answering and answers again, once per episode."""
    with _WATCHES_LOCK:
        watch = _WATCHES.get(state)
        if watch is None:
            watch = _WATCHES[state] = HordeWatch()
        return watch


def kcpp_client(
    settings: WorkerSettings, deadlines: CallDeadlines | None = None
) -> KoboldClient:
    """A koboldcpp client for the worker's koboldcpp (one per thread); its calls
    other than generations end by the stop's ``deadlines``."""
    client = KoboldClient(
        settings.kcpp_url, settings.kcpp_password, connect_timeout_s=settings.connect_timeout_s
    )
    client.deadlines = deadlines
    return client


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
    worker thread. ``state`` is shared with the worker's other loops. The API
    key is checked first (``key_check.check_api_key``, once for all the loops):
    a key the Horde refuses returns 3 before any pop, after one ERROR line.
    """
    if state is None:
        state = WorkerState(settings, stop_event=stop_event)
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
    if backend is None:
        backend = kcpp_client(settings, deadlines)
    watch = horde_watch(state)
    worker = Worker(
        settings,
        horde=horde_client(settings, deadlines, watch),
        backend=backend,
        stop_event=stop_event,
        manners=manners,
        caps=caps,
        worker_id=worker_id,
        state=state,
        pop_horde=horde_client(settings, deadlines, watch),
        abort_backend=kcpp_client(settings, deadlines),
        retry_horde=lambda: horde_client(settings, deadlines, watch),
    )
    return worker.run()
