"""The hook inside koboldcpp: run our pop loop in place of koboldcpp's embedded worker.

koboldcpp starts its embedded AI Horde worker, ``run_horde_worker(args, api_key,
worker_name, worker_id, parallel_batching_threads)`` in ``koboldcpp.py``, in one
daemon thread per worker (``--parallelrequests`` of them when above 1) once the
model is loaded, when ``--hordekey`` and ``--hordeworkername`` are both set. The
patches in ``patches/`` add a guarded import at the top of that function: when
this package imports, koboldcpp calls :func:`run_horde_worker` below with its own
module object and returns. Not installed: koboldcpp's own worker runs as before,
silently; installed but failing to import: one line says what failed and how to
fix it, then the same. Either way, with AI_HORDE_URL naming a Horde other than
https://aihorde.net, one line says so and koboldcpp's own worker is not started.

This is the only module that knows koboldcpp's module globals and ``args``
(koboldcpp 1.116.1 ``koboldcpp.py`` L88-186, L11452-11472). It reads, once at start:

- ``friendlymodelname``: the model name koboldcpp registers, already built by
  its rule from ``--hordemodelname``, ``--debugmode``, ``--gendefaults`` and the
  model file (:func:`declaration.koboldcpp_model_name` is the same rule);
- ``maxctx`` (``--contextsize``), ``maxhordectx`` (``--hordemaxctx``, 0 = ``maxctx``)
  and ``maxhordelen`` (``--hordegenlen``), in tokens;
- ``args.mmproj`` and ``has_vision_support``: vision only when a projector is
  loaded and it reads images;
- ``password`` (``--password``), sent to koboldcpp only;
- ``args.host``, ``args.port`` (``args.proxy_port`` in router mode) and
  ``sslvalid``: the local URL, the way koboldcpp's ``get_my_epurl`` builds it;
- ``args.maxrequestsize`` (``--maxrequestsize``, MB): the largest request body
  koboldcpp accepts, so a larger chat request is faulted without sending it;
- ``args.genlimit`` (``--genlimit``, tokens, 0 = none): koboldcpp stops every
  generation there (``koboldcpp.py`` L2175-2176) and reports a normal stop, so
  the worker declares and budgets at most that many tokens;

and, on every pass of the loop, its live state (:class:`KcppManners`):
``last_non_horde_req_time``, ``modelbusy``, ``currentusergenkey`` and ``exitcounter``.

The Horde URL comes from the ``AI_HORDE_URL`` environment variable, else
``https://aihorde.net`` (koboldcpp hard-codes the latter).

This module never writes koboldcpp's globals: ``exitcounter``,
``punishcounter`` and the kudos statistics stay koboldcpp's own.

Seed: "Worked example: koboldcpp's embedded worker"; seed 004 (the embedded
worker declares the ``messages_url`` and ``base64`` transports).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..horde.declaration import INACTIVE_MODEL_NAME, BackendCapabilities, model_id_warnings
from ..koboldcpp.api import BackendInfo
from ..service.recovery import Recovery
from ..settings import DEFAULT_HORDE_URL, MIB, WorkerSettings
from ..state.journal import Journal
from ..state.journal_paths import journal_dir
from ..state.shared import WorkerState
from . import hosting
from .hosting import check_limits, check_url, check_worker_name, open_state, serving_line

log = logging.getLogger("koboldcpp_horde_chat.kcpp_hook")

HORDE_URL_ENV = "AI_HORDE_URL"
"""Environment variable naming the Horde's base URL (e.g. a local dev Horde)."""

KCPP_DEFAULT_MAX_REQUEST_MB = 32
"""koboldcpp's ``--maxrequestsize`` default, MB."""

KCPP_SHUTDOWN_EXITCOUNTER = 100
"""koboldcpp sets ``exitcounter`` to 999 when it shuts down; 100 and above means closing."""

LOG_FORMAT = "[%(asctime)s] %(threadName)s %(levelname)s: %(message)s"
LOG_DATEFMT = "%H:%M:%S"
"""koboldcpp prints ``[HH:MM:SS] text``; our lines add the worker thread and level."""

STOPPED_BECAUSE = {
    0: "stopped: koboldcpp is shutting down",
    2: "stopped: the Horde refused a setting (above); koboldcpp serves on without this worker",
    3: "stopped: the Horde refused the API key (above); koboldcpp serves on without this worker",
}
"""The last line of a worker thread, by ``run_worker``'s code: nothing exits inside
koboldcpp, so the line says why the worker stopped, never an exit code."""
STOPPED_OTHERWISE = "stopped; koboldcpp serves on without this worker"

_LOGGING_LOCK = threading.Lock()
_logging_configured = False
_SHARED_LOCK = threading.Lock()
_SHARED: dict[tuple[str, str, str], WorkerState] = {}
#: The journals and recoveries :func:`start_recovery` opened before the model
#: loaded, by (worker name, Horde URL), until the first worker thread takes them.
_EARLY: dict[tuple[str, str], tuple[Journal, Recovery]] = {}


def _get(obj: object, name: str, default: Any = None) -> Any:
    """``obj.name``, or ``default`` when koboldcpp has no such attribute."""
    return getattr(obj, name, default)


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            return int(str(value))
        except ValueError:
            raise ConfigError(f"koboldcpp's {what} is not an integer: {value!r}") from None
    return value


def horde_url_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The Horde's base URL without a trailing slash.

    ``AI_HORDE_URL`` when set and not empty, else ``"https://aihorde.net"``,
    checked as the standalone worker checks it (:func:`hosting.check_url`).
    Raises ConfigError when the variable is not an ``http://`` or ``https://`` URL.
    """
    env = os.environ if environ is None else environ
    url = env.get(HORDE_URL_ENV, "").strip()
    if not url:
        return DEFAULT_HORDE_URL
    return check_url(url, HORDE_URL_ENV, horde=True)


def kcpp_url(kcpp: types.ModuleType, args: object) -> str:
    """koboldcpp's own base URL, as its ``get_my_epurl`` builds it (``koboldcpp.py`` L4780-4787).

    ``https`` when ``sslvalid`` else ``http``; the port is ``args.proxy_port`` when
    set (router mode) else ``args.port``; the host is ``args.host`` when set, else
    ``localhost``. An IPv6 literal host is put in brackets (koboldcpp does not).
    Example: ``--host 192.168.1.5 --port 6000`` gives ``http://192.168.1.5:6000``.
    """
    scheme = "https" if _get(kcpp, "sslvalid", False) else "http"
    proxy_port = _get(args, "proxy_port", None)
    port = _as_int(proxy_port if proxy_port else _get(args, "port", 5001), "port")
    host = str(_get(args, "host", "") or "") or "localhost"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def settings_from_kcpp(
    kcpp: types.ModuleType,
    args: object,
    api_key: str,
    worker_name: str,
    parallel_batching_threads: int,
    *,
    environ: Mapping[str, str] | None = None,
) -> WorkerSettings:
    """Read koboldcpp's globals and ``args`` into :class:`WorkerSettings`.

    Fields set (tokens unless said otherwise): ``model_id`` =
    ``friendlymodelname``; ``backend_max_context_length`` = ``maxctx``;
    ``horde_max_context_length`` = ``maxhordectx`` (negative read as 0);
    ``max_length`` = ``maxhordelen``; ``vision`` = ``bool(args.mmproj) and
    has_vision_support``; ``kcpp_password`` = ``password``; ``kcpp_url`` from
    :func:`kcpp_url`; ``horde_url`` from :func:`horde_url_from_env`; ``threads``
    = ``parallel_batching_threads``; ``kcpp_max_request_bytes`` =
    ``args.maxrequestsize`` MB (koboldcpp reads 0 or a missing value as 32)
    times 1024 * 1024; ``kcpp_genlimit`` = ``args.genlimit`` (0, a missing or
    negative value: none). Everything else keeps its default (text
    jobs served, nothing withheld, not trusted, and with vision the ``url``
    image transport beside ``base64``, beyond seed 004's embedded worker, as
    the standalone CLI declares it).

    The worker name and the limits are checked as the standalone worker
    checks them (:mod:`hosting`): a name the Horde refuses (over 100
    characters once stripped, or blank) and a negative ``--hordegenlen`` or
    ``--hordemaxctx`` (which koboldcpp itself ignores) are refused.

    Raises ConfigError for a refused name, a negative or non-integer limit or
    a bad ``AI_HORDE_URL``.
    """
    worker_name = check_worker_name(worker_name, "--hordeworkername")
    check_limits(
        _as_int(_get(args, "hordegenlen", 0) or 0, "--hordegenlen"),
        _as_int(_get(args, "hordemaxctx", 0) or 0, "--hordemaxctx"),
    )
    horde_max_ctx = _as_int(_get(kcpp, "maxhordectx", 0), "maxhordectx")
    vision = bool(_get(args, "mmproj", "")) and bool(_get(kcpp, "has_vision_support", False))
    return WorkerSettings(
        api_key=api_key,
        worker_name=worker_name,
        model_id=str(_get(kcpp, "friendlymodelname", INACTIVE_MODEL_NAME)),
        backend_max_context_length=_as_int(_get(kcpp, "maxctx", 0), "maxctx"),
        horde_max_context_length=max(0, horde_max_ctx),
        max_length=_as_int(_get(kcpp, "maxhordelen", 1024), "maxhordelen"),
        horde_url=horde_url_from_env(environ),
        kcpp_url=kcpp_url(kcpp, args),
        kcpp_password=str(_get(kcpp, "password", "") or ""),
        vision=vision,
        threads=max(1, _as_int(parallel_batching_threads, "parallel_batching_threads")),
        kcpp_max_request_bytes=max_request_mb(args) * MIB,
        kcpp_genlimit=max(0, _as_int(_get(args, "genlimit", 0) or 0, "genlimit")),
    )


def max_request_mb(args: object) -> int:
    """koboldcpp's request body limit in MB (of 1024 * 1024 bytes), ``koboldcpp.py`` L6424-6425.

    koboldcpp 1.116.1 defines ``--maxrequestsize`` as an int, default 32, and
    answers a POST whose ``Content-Length`` is above ``maxrequestsize * 1024 *
    1024`` with 500 "Payload is too big", reading 0 or None as 32. Raises
    ConfigError for a value that is not an integer.
    """
    value = _get(args, "maxrequestsize", None)
    return _as_int(value, "maxrequestsize") if value else KCPP_DEFAULT_MAX_REQUEST_MB


def capabilities(settings: WorkerSettings) -> BackendCapabilities:
    """The capabilities behind the declaration: vision as read, offloaded messages
    fetched, the ``url`` image transport only when ``WorkerSettings.image_url_transport``.

    Built the same way as the standalone CLI's, so the same settings give the
    same pop body (:func:`declaration.pop_body`).
    """
    return BackendCapabilities(vision=settings.vision, image_url=settings.image_url_transport)


class KcppManners:
    """The loop's manners, read live from koboldcpp's module globals.

    Args:
        kcpp: koboldcpp's module object.
        check_busy: consult ``modelbusy``; koboldcpp's own worker skips that check
            with batching (``parallel_batching_threads > 1``), since batched
            requests release the lock at once (1.116.1 ``koboldcpp.py`` L7116-7119, L10174).
    """

    def __init__(self, kcpp: types.ModuleType, *, check_busy: bool = True) -> None:
        self._kcpp = kcpp
        self._check_busy = check_busy

    #: koboldcpp's own globals are always readable: the gate never probes it for this.
    unreachable = False

    def last_local_request_time(self) -> float | None:
        """``last_non_horde_req_time`` (epoch seconds), read anew on each call.

        koboldcpp refreshes it for every text generation whose ``genkey`` does
        not start with ``HORDEREQ_``. None when it is missing or not a number.
        """
        value = _get(self._kcpp, "last_non_horde_req_time", None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    def model_busy(self) -> bool:
        """``modelbusy.locked()``: koboldcpp is generating (False when not checked)."""
        if not self._check_busy:
            return False
        lock = _get(self._kcpp, "modelbusy", None)
        locked = _get(lock, "locked", None)
        return bool(locked()) if callable(locked) else False

    def requests_queued(self) -> bool:
        """``requestsinqueue > 0``: requests wait for koboldcpp's model lock (a local
        user's, say, behind the tail of the worker's own request)."""
        queued = _get(self._kcpp, "requestsinqueue", 0)
        return isinstance(queued, int) and queued > 0

    def should_stop(self) -> bool:
        """koboldcpp is shutting down: ``exitcounter >= 100`` (it sets 999 when
        closing), the interpreter is finalising, or koboldcpp's main thread ended."""
        counter = _get(self._kcpp, "exitcounter", -1)
        if isinstance(counter, int) and counter >= KCPP_SHUTDOWN_EXITCOUNTER:
            return True
        return sys.is_finalizing() or not threading.main_thread().is_alive()

    def recheck(self) -> str | None:
        """None: inside koboldcpp a restart restarts the worker too."""
        return None

    def running_genkey(self) -> str | None:
        """``currentusergenkey`` while ``modelbusy`` is held: the genkey of the
        generation koboldcpp runs now (None when idle, unset or not a string)."""
        lock = _get(self._kcpp, "modelbusy", None)
        locked = _get(lock, "locked", None)
        if not (callable(locked) and locked()):
            return None
        genkey = _get(self._kcpp, "currentusergenkey", None)
        return genkey if isinstance(genkey, str) and genkey else None

    def own_worker_running(self) -> bool:
        """False: the patched koboldcpp runs this worker in place of its own."""
        return False

    def note_own_request(self) -> None:
        """Nothing to note: koboldcpp tells a Horde request by its ``HORDEREQ_`` genkey."""

    def note_own_request_done(self) -> None:
        """Nothing to note (see :meth:`note_own_request`)."""


def shared_state(
    settings: WorkerSettings, *, environ: Mapping[str, str] | None = None
) -> WorkerState:
    """The state koboldcpp's worker threads of one worker share in this process.

    koboldcpp starts one thread per ``--parallelrequests`` slot, each calling
    :func:`run_horde_worker`; they share one :class:`~koboldcpp_horde_chat.state.shared.WorkerState`
    (statistics, chat withdrawal, stop, the job journal), keyed by worker
    name, Horde URL and model. The first thread opens the job journal
    (``$KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR``, else the platform's state
    directory) and starts the recovery of the jobs an earlier run left in
    hand at once, on a thread of its own that needs only the Horde
    (``recovery.Recovery``: nothing to abort on koboldcpp, whose restart
    ended every earlier generation); every thread waits for it before its
    first pop.
    """
    key = (settings.worker_name, settings.horde_url, settings.model_id)
    with _SHARED_LOCK:
        state = _SHARED.get(key)
        if state is None:
            env = os.environ if environ is None else environ
            early = _EARLY.pop((settings.worker_name, settings.horde_url), None)
            if early is not None:  # the recovery already runs (start_recovery)
                journal, recovery = early
                state = open_state(
                    settings, journal_dir(env), stop_event=recovery.stop_event,
                    journal=journal, recovery=recovery, abort_orphans=False,
                )
            else:
                state = open_state(settings, journal_dir(env), abort_orphans=False)
            _SHARED[key] = state
        return state


def start_recovery(
    kcpp: types.ModuleType, args: object, *, environ: Mapping[str, str] | None = None
) -> bool:
    """Start the recovery of the jobs the last run left in hand now, before the
    model loads, so that their leases do not run out while it does.

    Called by the patches early in koboldcpp's start-up, once ``args`` is read
    (``--hordekey``, ``--hordeworkername``; ``friendlymodelname`` is set, the
    ``model_id`` of a chat fault whose entry has none). Opens the worker's
    journal (``$KOBOLDCPP_HORDE_CHAT_JOURNAL_DIR``, else the platform's state
    directory) and starts ``recovery.Recovery`` on a thread of its own, with
    the Horde of ``AI_HORDE_URL`` (else ``https://aihorde.net``) and the key
    only. The worker threads koboldcpp starts after the model loads then use
    that journal and wait for that recovery (:func:`shared_state`); without
    this call (a patch that does not make it) the first of them starts the
    recovery, as before. Once per worker name and Horde: a second call
    changes nothing.

    Returns True when a recovery was started now. Never raises: a name or URL
    the Horde refuses, or a journal held by another process, is logged in one
    line and left to the worker thread, which says it again and does not start.
    """
    try:
        configure_logging(debug=_get(args, "debugmode", 0) == 1, kcpp=kcpp)
        api_key = str(_get(args, "hordekey", "") or "")
        name = str(_get(args, "hordeworkername", "") or "")
        worker_name = check_worker_name(name, "--hordeworkername")
        horde_url = horde_url_from_env(environ)
        if not api_key:
            return False
        env = os.environ if environ is None else environ
        with _SHARED_LOCK:
            if (worker_name, horde_url) in _EARLY or any(
                key[:2] == (worker_name, horde_url) for key in _SHARED
            ):
                return False
            journal = hosting.open_journal(worker_name, journal_dir(env))
            if journal is None:
                return False
            recovery = hosting.start_recovery(
                journal,
                horde_url=horde_url,
                api_key=api_key,
                model_id_default=str(_get(kcpp, "friendlymodelname", INACTIVE_MODEL_NAME)),
                stop_event=threading.Event(),
            )
            _EARLY[(worker_name, horde_url)] = (journal, recovery)
        return True
    except ConfigError as exc:
        log.error("the jobs in hand at the last stop are not recovered yet: %s", exc)
    except Exception:  # never stop koboldcpp's start
        log.exception("the jobs in hand at the last stop are not recovered yet")
    return False


class ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record on a line of its own on koboldcpp's console.

    koboldcpp ends each generation with a statistics line it leaves
    unterminated (``printf("\n[%s] CtxLimit:... Total:%.2fs")`` in
    ``gpttype_adapter.cpp``), and prints its progress with ``\r``; its own
    worker prints an empty line after each generation (``print("")`` in
    ``run_horde_worker``). This handler starts a record with a newline when
    koboldcpp may have printed since the last record: a generation started
    since (``totalgens`` changed), or one was running then or is now
    (``modelbusy`` held, ``requestsinqueue`` above 0, or ``currentusergenkey``
    set); and before the first record. Otherwise the console's last output is
    the previous record, which ended its line, and no empty line is added.

    Args:
        kcpp: koboldcpp's module object, read on every record.
    """

    def __init__(self, kcpp: types.ModuleType) -> None:
        super().__init__(sys.stdout)
        self._kcpp = kcpp
        self._last: tuple[object, bool] | None = None

    def _mark(self) -> tuple[object, bool]:
        """(``totalgens``, a generation is running or waiting)."""
        lock = _get(self._kcpp, "modelbusy", None)
        locked = _get(lock, "locked", None)
        queued = _get(self._kcpp, "requestsinqueue", 0)
        busy = (
            (callable(locked) and bool(locked()))
            or (isinstance(queued, int) and queued > 0)
            or bool(_get(self._kcpp, "currentusergenkey", ""))
        )
        return _get(self._kcpp, "totalgens", None), busy

    def emit(self, record: logging.LogRecord) -> None:
        """Write the record, after a newline when koboldcpp may be mid-line."""
        try:
            msg = self.format(record)
            mark = self._mark()
            last, self._last = self._last, mark
            fresh_line = last is not None and last[0] == mark[0] and not (last[1] or mark[1])
            self.stream.write(("" if fresh_line else "\n") + msg + self.terminator)
            self.flush()
        except Exception:  # logging's rule: a failing handler never raises
            self.handleError(record)


def configure_logging(*, debug: bool = False, kcpp: types.ModuleType | None = None) -> bool:
    """Print this package's logs to stdout like koboldcpp's own lines, once.

    Only when the root logger has no handlers (koboldcpp configures none) and
    this package's logger has none yet: one handler on the
    ``koboldcpp_horde_chat`` logger with :data:`LOG_FORMAT`, level INFO (DEBUG
    with ``--debugmode 1``): a :class:`ConsoleHandler` reading ``kcpp`` (so
    each record starts on a line of its own), a plain ``StreamHandler`` when
    ``kcpp`` is None. Returns True when it added the handler. Safe to call
    from several worker threads at once.
    """
    global _logging_configured
    with _LOGGING_LOCK:
        if _logging_configured:
            return False
        _logging_configured = True
        package_logger = logging.getLogger(__name__.split(".")[0])
        if logging.getLogger().handlers or package_logger.handlers:
            return False
        handler = logging.StreamHandler(sys.stdout) if kcpp is None else ConsoleHandler(kcpp)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.DEBUG if debug else logging.INFO)
        package_logger.propagate = False
        return True


def found_info(kcpp: types.ModuleType, settings: WorkerSettings) -> BackendInfo:
    """What this koboldcpp is, from its globals, as the standalone worker reads
    it over HTTP: ``KcppVersion``, the model's ``cached_chat_template`` (``""``
    when the model carries none, 1.116.1 ``koboldcpp.py`` L11694-11695; None
    when not read), the model, context and vision of ``settings``."""
    template = _get(kcpp, "cached_chat_template", None)
    return BackendInfo(
        model_name=settings.model_id,
        max_context_length=settings.backend_max_context_length,
        vision=settings.vision,
        version=str(_get(kcpp, "KcppVersion", "") or ""),
        protected=bool(settings.kcpp_password),
        jinja=bool(_get(_get(kcpp, "args"), "jinja", False)),
        chat_template=template if isinstance(template, str) else None,
    )


def run_horde_worker(
    kcpp: types.ModuleType,
    args: object,
    api_key: str,
    worker_name: str,
    worker_id: int,
    parallel_batching_threads: int,
) -> None:
    """Serve Horde chat and text jobs in this koboldcpp worker thread until koboldcpp stops.

    Called by the patched ``run_horde_worker`` of ``koboldcpp.py`` as
    ``run_horde_worker(sys.modules[__name__], args, api_key, worker_name,
    worker_id, parallel_batching_threads)``: ``kcpp`` is koboldcpp's module,
    ``worker_id`` counts from 1, ``parallel_batching_threads`` is how many worker
    threads koboldcpp started. Each thread runs its own pop loop with its own
    HTTP sessions; the thread is renamed ``horde-worker-<worker_id>`` and every
    log line carries that name.

    Blocks until koboldcpp shuts down (:meth:`KcppManners.should_stop`) or the
    loop ends (the Horde refused the API key or the declaration). Returns None;
    errors are logged, never raised, so koboldcpp's other threads carry on.
    """
    threading.current_thread().name = f"horde-worker-{worker_id}"
    configure_logging(debug=_get(args, "debugmode", 0) == 1, kcpp=kcpp)
    try:
        settings = settings_from_kcpp(kcpp, args, api_key, worker_name, parallel_batching_threads)
    except ConfigError as exc:
        log.error("worker %d: not started: %s", worker_id, exc)
        return
    if settings.model_id == INACTIVE_MODEL_NAME:
        log.error("worker %d: not started: koboldcpp has no text model loaded", worker_id)
        return
    for warning in model_id_warnings(settings.model_id):
        log.warning("worker %d: %s", worker_id, warning)
    log.info("worker %d: %s", worker_id, serving_line(settings))
    if worker_id == 1:
        hosting.say_koboldcpp_found(found_info(kcpp, settings), settings, capabilities(settings))
    manners = KcppManners(kcpp, check_busy=parallel_batching_threads <= 1)
    try:
        state = shared_state(settings)
    except ConfigError as exc:
        log.error("worker %d: not started: %s", worker_id, exc)
        return
    try:
        code = hosting.run_worker(
            settings,
            manners=manners,
            caps=capabilities(settings),
            worker_id=worker_id,
            state=state,
        )
    except Exception:
        log.exception("worker %d: stopped by an unexpected error", worker_id)
        return
    log.info("worker %d: %s", worker_id, STOPPED_BECAUSE.get(code, STOPPED_OTHERWISE))
