"""The hook inside koboldcpp: our pop loop in place of koboldcpp's embedded worker.

koboldcpp runs ``run_horde_worker`` in one daemon thread per
``--parallelrequests`` slot once the model is loaded, when ``--hordekey`` and
``--hordeworkername`` are set; the patches in ``patches/`` make it call
:func:`run_horde_worker` here with koboldcpp's module object. This is the only
module that reads koboldcpp's globals and ``args`` (1.116.1 ``koboldcpp.py``
L88-186, L11452-11472), and it never writes them. The Horde URL comes from
``AI_HORDE_URL``, else ``https://aihorde.net`` (koboldcpp hard-codes the latter).

Seed: "Worked example: koboldcpp's embedded worker"; seed 004.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Mapping

from ..errors import ConfigError
from ..horde.declaration import INACTIVE_MODEL_NAME, model_id_warnings
from ..inflight import CallDeadlines
from ..koboldcpp.api import BackendInfo
from ..koboldcpp.manners import NoManners
from ..service.recovery import Recovery
from ..settings import DEFAULT_HORDE_URL, MIB, WorkerSettings
from ..state.journal_paths import journal_dir
from ..state.shared import WorkerState
from . import hosting
from .hosting import capabilities, check_limits, check_worker_name, serving_line
from .standalone_flags import HORDE_URL_ENV, HORDE_URL_FLAG, resolve_url

log = logging.getLogger("koboldcpp_horde_chat.kcpp_hook")

#: koboldcpp's ``--maxrequestsize`` default, MB.
KCPP_DEFAULT_MAX_REQUEST_MB = 32
#: koboldcpp sets ``exitcounter`` to 999 when it shuts down; 100 and above means closing.
KCPP_SHUTDOWN_EXITCOUNTER = 100

#: koboldcpp prints ``[HH:MM:SS] text``; our lines add the worker thread and level.
LOG_FORMAT = "[%(asctime)s] %(threadName)s %(levelname)s: %(message)s"
LOG_DATEFMT = "%H:%M:%S"

STOPPED_BECAUSE = {
    0: "stopped: koboldcpp is shutting down",
    2: "stopped: the Horde refused a setting (above); koboldcpp serves on without this worker",
    3: "stopped: the Horde refused the API key (above); koboldcpp serves on without this worker",
}
# A worker thread's last line by run_worker's code: nothing exits inside koboldcpp.
STOPPED_OTHERWISE = "stopped; koboldcpp serves on without this worker"

_LOGGING_LOCK = threading.Lock()
_logging_configured = False
_SHARED_LOCK = threading.Lock()
_SHARED: dict[tuple[str, str, str], WorkerState] = {}
#: The recoveries (with their journals) :func:`start_recovery` started before the
#: model loaded, by (worker name, Horde URL), until the first worker thread takes them.
_EARLY: dict[tuple[str, str], Recovery] = {}


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            return int(str(value))
        except ValueError:
            raise ConfigError(f"koboldcpp's {what} is not an integer: {value!r}") from None
    return value


def _horde_url(environ: Mapping[str, str] | None) -> str:
    """``AI_HORDE_URL`` checked as the standalone worker checks it, else the public Horde."""
    return resolve_url(None, HORDE_URL_FLAG, HORDE_URL_ENV, DEFAULT_HORDE_URL, environ)


def kcpp_url(kcpp: types.ModuleType, args: object) -> str:
    """koboldcpp's base URL as its ``get_my_epurl`` builds it (``koboldcpp.py`` L4780-4787),
    with an IPv6 host in brackets (koboldcpp leaves them out)."""
    scheme = "https" if getattr(kcpp, "sslvalid", False) else "http"
    proxy_port = getattr(args, "proxy_port", None)  # router mode
    port = _as_int(proxy_port if proxy_port else getattr(args, "port", 5001), "port")
    host = str(getattr(args, "host", "") or "") or "localhost"
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
    """koboldcpp's globals and ``args`` as :class:`WorkerSettings`, checked as the
    standalone worker checks its flags (``--hordegenlen`` and ``--hordemaxctx``,
    which koboldcpp itself lets be negative, are refused below 0).

    ``maxrequestsize`` 0 or unset reads as 32 MB and ``genlimit`` 0 or below as
    none, as koboldcpp reads them. Raises ConfigError for a refused name, a
    negative or non-integer limit, or a bad ``AI_HORDE_URL``.
    """
    worker_name = check_worker_name(worker_name, "--hordeworkername")
    check_limits(
        _as_int(getattr(args, "hordegenlen", 0) or 0, "--hordegenlen"),
        _as_int(getattr(args, "hordemaxctx", 0) or 0, "--hordemaxctx"),
    )
    # koboldcpp.py L6424-6425
    request_mb = getattr(args, "maxrequestsize", None) or KCPP_DEFAULT_MAX_REQUEST_MB
    return WorkerSettings(
        api_key=api_key,
        worker_name=worker_name,
        model_id=str(getattr(kcpp, "friendlymodelname", INACTIVE_MODEL_NAME)),
        horde_max_context_length=max(0, _as_int(getattr(kcpp, "maxhordectx", 0), "maxhordectx")),
        backend_max_context_length=_as_int(getattr(kcpp, "maxctx", 0), "maxctx"),
        max_length=_as_int(getattr(kcpp, "maxhordelen", 1024), "maxhordelen"),
        horde_url=_horde_url(environ),
        kcpp_url=kcpp_url(kcpp, args),
        kcpp_password=str(getattr(kcpp, "password", "") or ""),
        vision=bool(getattr(args, "mmproj", "") and getattr(kcpp, "has_vision_support", False)),
        threads=max(1, _as_int(parallel_batching_threads, "parallel_batching_threads")),
        kcpp_max_request_bytes=_as_int(request_mb, "maxrequestsize") * MIB,
        kcpp_genlimit=max(0, _as_int(getattr(args, "genlimit", 0) or 0, "genlimit")),
    )


def _generating(kcpp: types.ModuleType) -> bool:
    """koboldcpp holds ``modelbusy``."""
    locked = getattr(getattr(kcpp, "modelbusy", None), "locked", None)
    return callable(locked) and bool(locked())


def _queued(kcpp: types.ModuleType) -> bool:
    queued = getattr(kcpp, "requestsinqueue", 0)
    return isinstance(queued, int) and queued > 0


class KcppManners(NoManners):
    """The loop's manners, read live from koboldcpp's module globals.

    ``check_busy`` False: ``modelbusy`` is not consulted, as koboldcpp's own
    worker does not with batching (batched requests release the lock at once,
    1.116.1 ``koboldcpp.py`` L7116-7119, L10174). A Horde request is told by its
    ``HORDEREQ_`` genkey, so the worker's own requests need no noting.
    """

    def __init__(self, kcpp: types.ModuleType, *, check_busy: bool = True) -> None:
        self._kcpp = kcpp
        self._check_busy = check_busy

    def last_local_request_time(self) -> float | None:
        """``last_non_horde_req_time`` (epoch seconds), or None when not a number."""
        value = getattr(self._kcpp, "last_non_horde_req_time", None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    def model_busy(self) -> bool:
        return self._check_busy and _generating(self._kcpp)

    def requests_queued(self) -> bool:
        return _queued(self._kcpp)

    def should_stop(self) -> bool:
        """koboldcpp is closing, the interpreter is finalising, or its main thread ended."""
        counter = getattr(self._kcpp, "exitcounter", -1)
        if isinstance(counter, int) and counter >= KCPP_SHUTDOWN_EXITCOUNTER:
            return True
        return sys.is_finalizing() or not threading.main_thread().is_alive()

    def running_genkey(self) -> str | None:
        """``currentusergenkey`` while ``modelbusy`` is held, else None."""
        if not _generating(self._kcpp):
            return None
        genkey = getattr(self._kcpp, "currentusergenkey", None)
        return genkey if isinstance(genkey, str) and genkey else None


def shared_state(settings: WorkerSettings) -> WorkerState:
    """The state koboldcpp's worker threads of one worker (by name, Horde and model)
    share in this process.

    The first thread opens the journal and starts the recovery, unless
    :func:`start_recovery` did already; nothing is aborted on koboldcpp, whose
    restart ended every earlier generation. Without a journal (one WARNING) the
    state has none; ConfigError when another process serves the same worker name.
    """
    key = (settings.worker_name, settings.horde_url, settings.model_id)
    with _SHARED_LOCK:
        state = _SHARED.get(key)
        if state is None:
            deadlines = CallDeadlines()
            recovery = _EARLY.pop(key[:2], None)  # started before the model loaded
            if recovery is None:
                recovery = hosting.start_recovery(
                    settings, journal_dir(), threading.Event(), deadlines
                )
            state = _SHARED[key] = hosting.new_state(settings, recovery, deadlines)
        return state


def start_recovery(kcpp: types.ModuleType, args: object) -> bool:
    """Start recovering the jobs the last run left unfinished now, before the model
    loads, so that their leases do not run out meanwhile; once per worker name
    and Horde.

    True when a recovery started now. Never raises: a refused name or URL, or a
    journal another process holds, is logged in one line and left to the worker
    thread, which says it again and does not start.
    """
    try:
        configure_logging(debug=getattr(args, "debugmode", 0) == 1, kcpp=kcpp)
        name = str(getattr(args, "hordeworkername", "") or "")
        early = WorkerSettings(  # what the recovery needs, before the model loads
            api_key=str(getattr(args, "hordekey", "") or ""),
            worker_name=check_worker_name(name, "--hordeworkername"),
            model_id=str(getattr(kcpp, "friendlymodelname", INACTIVE_MODEL_NAME)),
            backend_max_context_length=0,
            horde_url=_horde_url(None),
        )
        key = (early.worker_name, early.horde_url)
        if not early.api_key:
            return False
        with _SHARED_LOCK:
            if key in _EARLY or any(shared[:2] == key for shared in _SHARED):
                return False
            recovery = hosting.start_recovery(early, journal_dir(), threading.Event())
            if recovery is None:
                return False
            _EARLY[key] = recovery
        return True
    except ConfigError as exc:
        log.error("the jobs in hand at the last stop are not recovered yet: %s", exc)
    except Exception:  # never stop koboldcpp's start
        log.exception("the jobs in hand at the last stop are not recovered yet")
    return False


class ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record on a line of its own on koboldcpp's console.

    koboldcpp leaves its statistics line unterminated (``gpttype_adapter.cpp``)
    and prints progress with ``\r``, so a record starts with a newline when
    koboldcpp may have printed since the last one (``totalgens`` changed, or a
    generation was running then or is now) and before the first record.
    """

    def __init__(self, kcpp: types.ModuleType) -> None:
        super().__init__(sys.stdout)
        self._kcpp = kcpp
        self._last: tuple[object, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            busy = (  # a generation is running or waiting
                _generating(self._kcpp)
                or _queued(self._kcpp)
                or bool(getattr(self._kcpp, "currentusergenkey", ""))
            )
            mark = (getattr(self._kcpp, "totalgens", None), busy)
            last, self._last = self._last, mark
            fresh_line = last is not None and last[0] == mark[0] and not (last[1] or mark[1])
            self.stream.write(("" if fresh_line else "\n") + msg + self.terminator)
            self.flush()
        except Exception:  # logging's rule: a failing handler never raises
            self.handleError(record)


def configure_logging(*, debug: bool = False, kcpp: types.ModuleType | None = None) -> bool:
    """Print this package's logs to stdout like koboldcpp's own lines, once, when
    no logging is set up yet (koboldcpp sets none); True when it added the handler."""
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
    """What this koboldcpp is, from its globals, as the standalone worker reads it
    over HTTP (``cached_chat_template``: 1.116.1 ``koboldcpp.py`` L11694-11695)."""
    template = getattr(kcpp, "cached_chat_template", None)
    return BackendInfo(
        model_name=settings.model_id,
        max_context_length=settings.backend_max_context_length,
        vision=settings.vision,
        version=str(getattr(kcpp, "KcppVersion", "") or ""),
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
    """Serve Horde jobs in this koboldcpp worker thread (``worker_id`` from 1) until
    koboldcpp stops or the Horde refuses the key or the declaration.

    The thread is renamed ``horde-worker-<worker_id>``. Errors are logged, never
    raised, so koboldcpp's other threads carry on.
    """
    threading.current_thread().name = f"horde-worker-{worker_id}"
    configure_logging(debug=getattr(args, "debugmode", 0) == 1, kcpp=kcpp)
    try:
        settings = settings_from_kcpp(kcpp, args, api_key, worker_name, parallel_batching_threads)
        if settings.model_id == INACTIVE_MODEL_NAME:
            raise ConfigError("koboldcpp has no text model loaded")
        for warning in model_id_warnings(settings.model_id):
            log.warning("worker %d: %s", worker_id, warning)
        log.info("worker %d: %s", worker_id, serving_line(settings))
        caps = capabilities(settings)
        if worker_id == 1:
            hosting.say_koboldcpp_found(found_info(kcpp, settings), settings, caps)
        manners = KcppManners(kcpp, check_busy=parallel_batching_threads <= 1)
        state = shared_state(settings)
    except ConfigError as exc:
        log.error("worker %d: not started: %s", worker_id, exc)
        return
    try:
        code = hosting.run_worker(
            settings, manners=manners, caps=caps, worker_id=worker_id, state=state
        )
    except Exception:
        log.exception("worker %d: stopped by an unexpected error", worker_id)
        return
    log.info("worker %d: %s", worker_id, STOPPED_BECAUSE.get(code, STOPPED_OTHERWISE))
