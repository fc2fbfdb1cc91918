"""The koboldcpp client: the worker's only door to the local koboldcpp (I/O edge).

:class:`KoboldClient` wraps koboldcpp's HTTP API: readiness and capability
probes, ``/api/extra/perf``, tokencount, chat completions (whole or as a raw
Server-Sent Events byte stream), abort by genkey and the Kobold text generate.
Every ``requests`` or ``urllib3`` exception and every unwanted HTTP status is
translated into :class:`~koboldcpp_horde_chat.errors.BackendError` or a
subclass here, so none escapes:

* 401 -> :class:`~koboldcpp_horde_chat.errors.BackendUnauthorized` (the
  ``--password`` is missing or wrong);
* 503 -> :class:`~koboldcpp_horde_chat.errors.BackendBusy` (koboldcpp's
  "Server is busy", 1.116.1 ``koboldcpp.py`` L6890-6897);
* any other non-2xx, a body that is not a JSON object, a body over the size
  cap, a connection failure, a timeout or a reset -> ``BackendError``
  (``status`` 0 when no response arrived).

``Authorization: Bearer <password>`` is sent only when a password is set, and
only to koboldcpp; the Horde API key is never sent here. Error messages never
contain the password, nor the HTTP library's own text: a failure without an
answer reads ``"POST /v1/chat/completions connection failed (reset)"``,
``"... timed out"``, ``"... connection failed (refused)"``.

One :class:`requests.Session` per client, one client per thread (a
:class:`BackendStream` may be closed, and :meth:`KoboldClient.hang_up` called,
from another thread: ``koboldcpp.connection``). A session the client makes itself
does not read the environment on each call: no proxy (koboldcpp is local), no
``.netrc``; ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE`` is read once.
Request bodies are encoded by :func:`jsonbody.encode_json`.

Seed section: "Worked example: koboldcpp's embedded worker" (the worker
generates through koboldcpp's local ``/v1/chat/completions`` and
``/api/v1/generate``, aborts by genkey, and yields to local users).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import requests
import requests.adapters
import urllib3.exceptions

from ..errors import BackendBusy, BackendError, BackendUnauthorized, FetchError
from ..httpbody import read_body
from ..inflight import Call, CallDeadlines, TrackingAdapter, in_generation
from ..jsonbody import RAW_STRING_MIN_CHARS, encode_json
from .api import BackendInfo
from .connection import (
    BackendStream,
    InFlight,
    ca_bundle_from_env,
    describe_failure,
    error_detail,
)
from .versions import has_props_route

log = logging.getLogger("koboldcpp_horde_chat.backend")

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "PROTECTED_MODEL_NAME",
    "RAW_STRING_MIN_CHARS",
    "BackendInfo",
    "BackendStream",
    "KoboldClient",
    "encode_json",
]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""The most bytes read from one JSON answer (64 MiB)."""

PROTECTED_MODEL_NAME = "koboldcpp/protected-model"
"""What ``/api/v1/model`` says on a protected koboldcpp without the right bearer
(koboldcpp 1.116.1 ``koboldcpp.py`` L6077-6082)."""


_PROBE_TIMEOUT_S = 10.0

# Exceptions that reading a response body may raise besides requests' own.
_READ_ERRORS: tuple[type[BaseException], ...] = (
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    OSError,
    ValueError,
)


class KoboldClient:
    """A client for one koboldcpp at ``base_url`` (e.g. ``"http://127.0.0.1:5001"``).

    Args:
        base_url: koboldcpp's base URL, without a trailing path.
        password: koboldcpp's ``--password``; "" for an open instance. Sent as
            ``Authorization: Bearer <password>`` only when set.
        connect_timeout_s: the connect timeout of every call, seconds.
        session: a ``requests.Session`` to use, as it is. Otherwise the client
            makes one that ignores proxy variables and ``.netrc`` (``trust_env``
            off) and verifies TLS with ``REQUESTS_CA_BUNDLE`` or
            ``CURL_CA_BUNDLE`` when set, read now (else requests' default).
        max_body_bytes: the most bytes read from one JSON answer.

    Every call uses a ``(connect_timeout_s, read timeout)`` pair; the read
    timeout bounds each wait for bytes (koboldcpp sends nothing until a whole
    generation is done, so a generation's read timeout is its whole budget).
    One client per thread; :meth:`hang_up` may come from any thread.
    """

    def __init__(
        self,
        base_url: str,
        password: str = "",
        *,
        connect_timeout_s: float = 10.0,
        session: requests.Session | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._password = password
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        if session is None:
            session = requests.Session()
            # requests would otherwise re-read proxies, .netrc and the CA bundle from
            # the environment on every call (about 0.3 ms each); koboldcpp is local.
            session.trust_env = False
            session.verify = ca_bundle_from_env()
            # Generation requests can then be hung up from another thread (hang_up).
            adapter = TrackingAdapter()
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self._session = session
        self._in_flight = InFlight()
        #: The stop's deadlines (``inflight.CallDeadlines``, kind ``"kcpp"``), once bound.
        self.deadlines: CallDeadlines | None = None

    def __repr__(self) -> str:
        return f"KoboldClient({self.base_url!r}, protected={bool(self._password)})"

    def close(self) -> None:
        """Close the session's pooled connections."""
        self._session.close()

    # --------------------------------------------------------------- probes

    def ready(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
        """True when ``GET /api/v1/info/version`` answers JSON with a truthy ``result``.

        koboldcpp's own worker uses this probe (1.116.1 ``koboldcpp.py``
        L10104-10109). Never raises.
        """
        try:
            body = self._get("/api/v1/info/version", timeout_s)
        except BackendError:
            return False
        return bool(body.get("result"))

    def info(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> BackendInfo:
        """Read the model name, context size and capabilities.

        Calls ``GET /api/v1/model``, ``/api/extra/true_max_context_length``,
        ``/api/extra/version`` and, on a koboldcpp 1.79 or later, ``/props``
        for the chat template (:meth:`chat_template`). On a protected koboldcpp it also checks the
        password: the model name reads ``"koboldcpp/protected-model"`` without
        the right bearer (``koboldcpp.py`` L6077-6082), and ``POST /api/extra/tokencount`` of
        ``""`` answers 401.

        Raises:
            BackendUnauthorized: koboldcpp is protected and the password is
                missing or wrong.
            BackendError: koboldcpp does not answer, or answers unexpectedly.
        """
        model = self._get("/api/v1/model", timeout_s)
        ctx = self._get("/api/extra/true_max_context_length", timeout_s)
        version = self._get("/api/extra/version", timeout_s)
        model_name = model.get("result")
        if not isinstance(model_name, str):
            raise BackendError("/api/v1/model: no model name in the answer", status=200)
        max_ctx = ctx.get("value")
        if not isinstance(max_ctx, int) or isinstance(max_ctx, bool) or max_ctx <= 0:
            raise BackendError(
                "/api/extra/true_max_context_length: no positive integer value", status=200
            )
        protected = version.get("protected") is True
        if protected:
            if model_name == PROTECTED_MODEL_NAME:
                raise BackendUnauthorized(
                    "koboldcpp is password protected and the password is "
                    + ("wrong" if self._password else "missing")
                    + " (/api/v1/model is masked)",
                    status=200,
                )
            self.tokencount("", timeout_s=timeout_s)
        release = str(version.get("version") or "")
        return BackendInfo(
            model_name=model_name,
            max_context_length=max_ctx,
            vision=version.get("vision") is True,
            version=release,
            protected=protected,
            jinja=version.get("jinja") is True,
            chat_template=self.chat_template(timeout_s=timeout_s)
            if has_props_route(release) else None,
        )

    def chat_template(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> str | None:
        """``GET /props`` ``chat_template`` (1.116.1 ``koboldcpp.py`` L6316-6335):
        the model's chat template, ``""`` when it carries none; None when
        koboldcpp does not say (no ``/props`` before 1.79, no text model, an
        answer without the key). Never raises."""
        try:
            template = self._get("/props", timeout_s).get("chat_template")
        except BackendError:
            return None
        return template if isinstance(template, str) else None

    def perf(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> dict[str, Any]:
        """``GET /api/extra/perf``: koboldcpp's statistics (1.116.1 ``koboldcpp.py`` L6112-6157).

        Keys include ``idle`` (0 while generating), ``queue`` (requests
        waiting), ``idletime`` (seconds since the last generation request),
        ``total_gens``, ``stop_reason``. Raises ``BackendError``.
        """
        return self._get("/api/extra/perf", timeout_s)

    # ----------------------------------------------------------- generation

    def tokencount(self, prompt: str, *, timeout_s: float) -> int:
        """Tokens of ``prompt`` by koboldcpp's tokenizer, BOS included (``koboldcpp.py`` L6479).

        Sends ``POST /api/extra/tokencount {"prompt": prompt}`` and nothing else:
        never ``messages``, whose rendering may run a tool-choice generation
        (seed step 3: the fit check must not run side effects).

        Raises ``BackendUnauthorized``, ``BackendError`` (also for a missing or
        negative ``value``).
        """
        body = self._post("/api/extra/tokencount", {"prompt": prompt}, timeout_s)
        value = body.get("value")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BackendError("/api/extra/tokencount: no token count in the answer", status=200)
        return value

    def chat_completion(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/chat/completions`` and return the decoded JSON object.

        ``body`` is sent as it is (``stream`` should be false or absent): a JSON
        object, or one already encoded (by :func:`encode_json`), sent unchanged.
        ``timeout_s`` bounds the wait for the answer, seconds: koboldcpp sends
        nothing until the generation ends. A generation request: :meth:`hang_up`
        ends it from another thread; with ``cancel`` set before it was sent,
        nothing is sent (set ``cancel``, then call :meth:`hang_up`, and the call
        ends whichever came first).

        Raises ``BackendUnauthorized`` (401), ``BackendBusy`` (503),
        ``BackendError`` (other statuses, invalid JSON, a non-object, a body
        over the cap, network failures and timeouts, a hang-up).
        """
        path = "/v1/chat/completions"
        with self._in_flight.generation(f"POST {path}", cancel):
            return self._post(path, body, timeout_s)

    def open_chat_stream(
        self,
        body: dict[str, Any] | bytes | bytearray,
        *,
        read_timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> BackendStream:
        """``POST /v1/chat/completions`` with ``"stream": true`` and return the open stream.

        ``body`` is a JSON object (``"stream": true`` is added to a copy), or one
        already encoded (by :func:`encode_json`), sent unchanged: it must then
        hold ``"stream": true`` itself.
        ``read_timeout_s`` bounds each wait for bytes, including the prompt
        processing before the first token, when koboldcpp sends only headers
        (1.116.1 ``koboldcpp.py`` L5380-5384). The answer's status and
        ``content-type`` are checked: a JSON answer where a stream was asked for
        raises ``BackendError``.

        A generation request: :meth:`hang_up` ends it from another thread, while
        it opens and once it is open (``cancel`` as for :meth:`chat_completion`).

        Raises ``BackendUnauthorized`` (401), ``BackendBusy`` (503),
        ``BackendError`` (other statuses, not an event stream, network failures,
        a hang-up).
        """
        payload: dict[str, Any] | bytes | bytearray
        if isinstance(body, dict):
            payload = dict(body)
            payload["stream"] = True
        else:
            payload = body
        path = "/v1/chat/completions"
        with self._in_flight.generation(f"POST {path}", cancel):
            return self._open_stream(path, payload, read_timeout_s)

    def _open_stream(
        self, path: str, payload: dict[str, Any] | bytes | bytearray, read_timeout_s: float
    ) -> BackendStream:
        deadline = self._deadline(read_timeout_s)
        response = self._request(
            "POST",
            path,
            payload,
            read_timeout_s,
            extra_headers={"Accept": "text/event-stream", "Accept-Encoding": "identity"},
        )
        status = response.status_code
        content_type = response.headers.get("content-type", "")
        if 200 <= status < 300 and "text/event-stream" in content_type.lower():
            stream = BackendStream(response, password=self._password)
            with self._in_flight.lock:
                self._in_flight.stream = stream
            return stream
        try:
            if not 200 <= status < 300:
                self._decode(response, path, deadline)  # raises the mapped error
            decoded = self._decode(response, path, deadline)
            keys = ", ".join(sorted(decoded)[:8])
            raise BackendError(
                f"{path}: a whole JSON answer (keys: {keys}) instead of an event stream",
                status=status,
            )
        finally:
            response.close()

    def abort(self, genkey: str, *, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
        """``POST /api/extra/abort {"genkey"}``: stop the generation with this genkey.

        True when koboldcpp answers ``"success": "true"`` (a string,
        1.116.1 ``koboldcpp.py`` L6535-6541; a boolean true is accepted too). False
        means the genkey was not running (or was remembered as a pending abort:
        ``"done": "false"``).
        Raises ``BackendUnauthorized``, ``BackendError``.
        """
        body = self._post("/api/extra/abort", {"genkey": genkey}, timeout_s)
        success = body.get("success")
        return success is True or success == "true"

    def generate(
        self,
        payload: dict[str, Any],
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> dict[str, Any]:
        """``POST /api/v1/generate`` (Kobold API) and return the decoded JSON object.

        The answer is ``{"results": [{"text", "finish_reason", ...}]}``
        (1.116.1 ``koboldcpp.py`` L5341). A generation request, which :meth:`hang_up` ends
        (``cancel`` as for :meth:`chat_completion`). Raises like
        :meth:`chat_completion`.
        """
        path = "/api/v1/generate"
        with self._in_flight.generation(f"POST {path}", cancel):
            return self._post(path, payload, timeout_s)

    def hang_up(self) -> bool:
        """Close the connection of this client's generation request in flight.

        Callable from any thread. The blocked :meth:`chat_completion`,
        :meth:`generate` or :meth:`open_chat_stream` returns at once, raising
        ``BackendError`` ("... hung up by the worker"), and a stream it opened is
        closed (its reader gets ``b""``). koboldcpp ends a streamed generation
        whose client hung up, batched or not; a non-streamed one runs on inside
        koboldcpp (see the module docstring), so abort it by genkey as well.

        Returns True when something was hung up; False, doing nothing, when no
        generation request is in flight (a request that had ended, a stream
        already closed). Never raises. Only on a session the client made
        itself: with a ``session`` passed in, only an open stream is closed.
        """
        return self._in_flight.hang_up()

    # -------------------------------------------------------------- helpers

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._password:
            headers["Authorization"] = f"Bearer {self._password}"
        return headers

    def _deadline(self, timeout_s: float) -> float:
        """When a whole call must be over: connect, wait and body, on the monotonic clock."""
        return time.monotonic() + self.connect_timeout_s + timeout_s

    def _get(self, path: str, timeout_s: float) -> dict[str, Any]:
        return self._call("GET", path, None, timeout_s)

    def _post(
        self, path: str, body: dict[str, Any] | bytes | bytearray, timeout_s: float
    ) -> dict[str, Any]:
        return self._call("POST", path, body, timeout_s)

    def _call(
        self, method: str, path: str, body: dict[str, Any] | bytes | bytearray | None,
        timeout_s: float,
    ) -> dict[str, Any]:
        """One call, its answer read by its deadline. While the worker stops, a call
        that is not a generation (given up at the stop's deadline on its own) ends
        by the ``"kcpp"`` deadline of ``deadlines``: its timeout cut to it, hung up then."""
        deadlines = None if in_generation() else self.deadlines
        if deadlines is None:
            return self._call_once(method, path, body, timeout_s)
        left = deadlines.left("kcpp")
        if left is not None:
            if left <= 0:
                raise BackendError(f"{method} {path}: not sent, the worker's stop deadline passed")
            timeout_s = min(timeout_s, left)
        call = Call()
        with call.running(), deadlines.running("kcpp", call):
            try:
                return self._call_once(method, path, body, timeout_s)
            except BackendError as exc:
                if call.hung_up:
                    cut = f"{method} {path}: cut at the worker's stop deadline"
                    raise BackendError(cut) from exc
                raise

    def _call_once(
        self, method: str, path: str, body: dict[str, Any] | bytes | bytearray | None,
        timeout_s: float,
    ) -> dict[str, Any]:
        deadline = self._deadline(timeout_s)
        response = self._request(method, path, body, timeout_s)
        try:
            return self._decode(response, path, deadline)
        finally:
            response.close()

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | bytes | bytearray | None,
        timeout_s: float,
        *,
        extra_headers: dict[str, str] | None = None,
    ) -> requests.Response:
        headers = self._headers()
        if method == "GET":
            headers.pop("Content-Type")
        headers.update(extra_headers or {})
        data: bytes | bytearray | None = None
        if isinstance(body, bytes | bytearray):
            data = body
        elif body is not None:
            try:
                data = encode_json(body)
            except (TypeError, ValueError, RecursionError) as exc:
                raise BackendError(f"{path}: the request body is not JSON: {exc}") from None
        try:
            return self._session.request(
                method,
                self.base_url + path,
                # A bytearray goes out with its Content-Length, as one buffer.
                data=data,  # type: ignore[arg-type]
                headers=headers,
                timeout=(self.connect_timeout_s, timeout_s),
                stream=True,
                allow_redirects=False,
            )
        except _READ_ERRORS as exc:
            raise BackendError(describe_failure(exc, f"{method} {path}", self._password)) from None

    def _decode(self, response: requests.Response, path: str, deadline: float) -> dict[str, Any]:
        """Read a capped body by ``deadline`` and map the status; returns the JSON object."""
        status = response.status_code
        raw = self._read_capped(response, path, deadline)
        if status == 401:
            raise BackendUnauthorized(
                f"{path}: 401{error_detail(raw)} (koboldcpp's password is "
                + ("wrong" if self._password else "missing")
                + ")",
                status=401,
            )
        if status == 503:
            raise BackendBusy(f"{path}: 503{error_detail(raw)}", status=503)
        if not 200 <= status < 300:
            raise BackendError(f"{path}: HTTP {status}{error_detail(raw)}", status=status)
        try:
            decoded = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise BackendError(f"{path}: the answer is not JSON", status=status) from None
        if not isinstance(decoded, dict):
            raise BackendError(
                f"{path}: the answer is a JSON {type(decoded).__name__}, not an object",
                status=status,
            )
        return decoded

    def _read_capped(self, response: requests.Response, path: str, deadline: float) -> bytes:
        """The body, at most ``max_body_bytes`` decoded, read by ``deadline``.

        The read timeout bounds each wait for bytes; the deadline bounds the
        whole call, so an answer that trickles in cannot outlast the job's lease.
        """
        cap = self.max_body_bytes
        try:
            return read_body(response, max_bytes=cap, deadline=deadline, max_raw_bytes=cap)
        except FetchError as exc:
            problem = str(exc)
            if "exceeds" in problem:
                problem = f"the answer is larger than {cap} bytes"
            elif "in time" in problem:
                problem = f"the answer was not received in time ({problem})"
            if self._password:
                problem = problem.replace(self._password, "***")
            raise BackendError(f"{path}: {problem}"[:500], status=response.status_code) from None
