"""The koboldcpp client: the worker's only door to the local koboldcpp (seed "Worked
example: koboldcpp's embedded worker").

Every failure is raised as ``errors.BackendError`` or a subclass: 401
``BackendUnauthorized`` (``--password`` missing or wrong), 503 ``BackendBusy``
(koboldcpp's "Server is busy"), anything else that is not a JSON object within the
size cap ``BackendError`` (``status`` 0 without an answer). Messages never hold the
password nor the HTTP library's text (``"POST /v1/chat/completions connection failed
(reset)"``). The bearer goes to koboldcpp only. A session the client makes reads no
proxy and no ``.netrc`` (koboldcpp is local). One client per thread; a stream's
close and :meth:`KoboldClient.hang_up` may come from any thread.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import requests
import urllib3.exceptions

from ..errors import BackendBusy, BackendError, BackendUnauthorized, FetchError
from ..httpbody import read_body, tracked_session
from ..inflight import Call, CallDeadlines, in_generation
from ..jsonbody import encode_json
from .api import BackendInfo, Body
from .connection import BackendStream, InFlight, describe_failure, error_detail, mask
from .versions import PROPS_SINCE, at_least

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: ``/api/v1/model`` on a protected koboldcpp without the right bearer (1.116.1 L6077-6082).
PROTECTED_MODEL_NAME = "koboldcpp/protected-model"

_PROBE_TIMEOUT_S = 10.0
CHAT_PATH = "/v1/chat/completions"

_READ_ERRORS: tuple[type[BaseException], ...] = (
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    OSError,
    ValueError,
)


class KoboldClient:
    """A client for one koboldcpp at ``base_url`` (``"http://127.0.0.1:5001"``).

    ``password``: koboldcpp's ``--password``, sent as a bearer when set. Every
    call's timeout is ``(connect_timeout_s, read timeout)``; koboldcpp sends nothing
    until a generation is done, so its read timeout is its whole budget.
    ``max_body_bytes`` caps one JSON answer.
    """

    def __init__(
        self, base_url: str, password: str = "", *, connect_timeout_s: float = 10.0,
        session: requests.Session | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._password = password
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        # No proxy (koboldcpp is local); generation requests can be hung up (hang_up).
        self._session = tracked_session() if session is None else session
        self._in_flight = InFlight()
        # The stop's deadlines (kind "kcpp"), once bound.
        self.deadlines: CallDeadlines | None = None

    def __repr__(self) -> str:
        return f"KoboldClient({self.base_url!r}, protected={bool(self._password)})"

    def close(self) -> None:
        self._session.close()

    @property
    def _password_state(self) -> str:
        """How the password koboldcpp refused is: ``"wrong"`` or ``"missing"``."""
        return "wrong" if self._password else "missing"

    def ready(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
        """koboldcpp's own worker's readiness probe (1.116.1 L10104-10109); never raises."""
        try:
            body = self._call("GET", "/api/v1/info/version", None, timeout_s)
        except BackendError:
            return False
        return bool(body.get("result"))

    def info(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> BackendInfo:
        """The model name, context size and capabilities. On a protected koboldcpp the
        password is checked too (the masked model name, a tokencount's 401).

        Raises BackendUnauthorized (wrong or missing password), BackendError.
        """
        model = self._call("GET", "/api/v1/model", None, timeout_s)
        ctx = self._call("GET", "/api/extra/true_max_context_length", None, timeout_s)
        version = self._call("GET", "/api/extra/version", None, timeout_s)
        model_name = model.get("result")
        if not isinstance(model_name, str):
            raise BackendError("/api/v1/model: no model name in the answer", status=200)
        max_ctx = ctx.get("value")
        if not isinstance(max_ctx, int) or isinstance(max_ctx, bool) or max_ctx <= 0:
            raise BackendError(
                "/api/extra/true_max_context_length: no positive integer value", status=200
            )
        if version.get("protected") is True:
            if model_name == PROTECTED_MODEL_NAME:
                raise BackendUnauthorized(
                    f"koboldcpp is password protected and the password is {self._password_state} "
                    "(/api/v1/model is masked)",
                    status=200,
                )
            self.tokencount("", timeout_s=timeout_s)
        release = str(version.get("version") or "")
        return BackendInfo(
            model_name=model_name,
            max_context_length=max_ctx,
            vision=version.get("vision") is True,
            version=release,
            # An unreadable version is asked too (it costs one GET).
            chat_template=self.chat_template(timeout_s=timeout_s)
            if at_least(release, PROPS_SINCE) else None,
        )

    def chat_template(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> str | None:
        """``/props``' ``chat_template``: ``""`` when the model carries none; None when
        koboldcpp does not say (before 1.79, no text model). Never raises."""
        try:
            template = self._call("GET", "/props", None, timeout_s).get("chat_template")
        except BackendError:
            return None
        return template if isinstance(template, str) else None

    def perf(self, *, timeout_s: float = _PROBE_TIMEOUT_S) -> dict[str, Any]:
        """``/api/extra/perf``: ``idle`` (0 while generating), ``queue``, ``idletime``
        (seconds since the last generation request), ``stop_reason``..."""
        return self._call("GET", "/api/extra/perf", None, timeout_s)

    def tokencount(self, prompt: str, *, timeout_s: float) -> int:
        """Tokens of ``prompt``, BOS included. Never sends ``messages``, whose rendering
        may run a tool-choice generation (seed step 3)."""
        body = self._call("POST", "/api/extra/tokencount", {"prompt": prompt}, timeout_s)
        value = body.get("value")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BackendError("/api/extra/tokencount: no token count in the answer", status=200)
        return value

    def chat_completion(
        self, body: Body, *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        """The whole chat completion; ``body`` a JSON object or already encoded.

        :meth:`hang_up` ends it from another thread; with ``cancel`` set first,
        nothing is sent (set ``cancel``, then hang up: whichever came first wins).
        """
        with self._in_flight.generation(f"POST {CHAT_PATH}", cancel):
            return self._call("POST", CHAT_PATH, body, timeout_s)

    def open_chat_stream(
        self, body: Body, *, read_timeout_s: float, cancel: threading.Event | None = None
    ) -> BackendStream:
        """The chat completion as an open event stream (``"stream": true`` is added to
        a dict body; an encoded one must hold it). ``read_timeout_s`` bounds each wait
        for bytes, the prompt processing included. A JSON answer raises BackendError;
        ``cancel`` and :meth:`hang_up` as for :meth:`chat_completion`.
        """
        payload = {**body, "stream": True} if isinstance(body, dict) else body
        path = CHAT_PATH
        with self._in_flight.generation(f"POST {path}", cancel):
            deadline = self._deadline(read_timeout_s)
            accept = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
            response = self._request("POST", path, payload, read_timeout_s, extra_headers=accept)
            status = response.status_code
            content_type = response.headers.get("content-type", "")
            if 200 <= status < 300 and "text/event-stream" in content_type.lower():
                stream = BackendStream(response, password=self._password)
                with self._in_flight.lock:
                    self._in_flight.stream = stream
                return stream
            try:
                keys = ", ".join(sorted(self._decode(response, path, deadline))[:8])
                raise BackendError(
                    f"{path}: a whole JSON answer (keys: {keys}) instead of an event stream",
                    status=status,
                )
            finally:
                response.close()

    def abort(self, genkey: str, *, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
        """Stop the generation with ``genkey``; False when it was not running
        (``"success"`` is the string ``"true"`` in 1.116.1 L6535-6541)."""
        body = self._call("POST", "/api/extra/abort", {"genkey": genkey}, timeout_s)
        success = body.get("success")
        return success is True or success == "true"

    def generate(
        self, payload: dict[str, Any], *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        """The Kobold text generate, ``{"results": [{"text", ...}]}``; ``cancel`` and
        :meth:`hang_up` as for :meth:`chat_completion`."""
        path = "/api/v1/generate"
        with self._in_flight.generation(f"POST {path}", cancel):
            return self._call("POST", path, payload, timeout_s)

    def hang_up(self) -> bool:
        """Close the connection of the generation request in flight, from any thread:
        the call raises BackendError ("... hung up by the worker"), a stream reads
        ``b""``. koboldcpp ends a streamed generation then; a non-streamed one runs on,
        so abort it by genkey as well. False when nothing was in flight; never raises.
        On a passed-in ``session`` only an open stream is closed.
        """
        return self._in_flight.hang_up()

    def _deadline(self, timeout_s: float) -> float:
        """When a whole call must be over (connect, wait and body), monotonic seconds."""
        return time.monotonic() + self.connect_timeout_s + timeout_s

    def _call(
        self, method: str, path: str, body: dict[str, Any] | bytes | bytearray | None,
        timeout_s: float,
    ) -> dict[str, Any]:
        """One call, its answer read by its deadline. While the worker stops, a call
        that is not a generation ends by the ``"kcpp"`` deadline, hung up then."""
        deadlines = None if in_generation() else self.deadlines
        if deadlines is None:
            return self._call_once(method, path, body, timeout_s)
        left = deadlines.left("kcpp")
        if left is not None:
            if left <= 0:
                raise BackendError(f"{method} {path}: not sent, the worker's stop deadline passed")
            timeout_s = min(timeout_s, left)
        call = Call()
        with call.running(), deadlines.until("kcpp", call.hang_up):
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
        self, method: str, path: str, body: Body | None, timeout_s: float, *,
        extra_headers: dict[str, str] | None = None,
    ) -> requests.Response:
        headers: dict[str, str] = {} if method == "GET" else {"Content-Type": "application/json"}
        if self._password:
            headers["Authorization"] = f"Bearer {self._password}"
        headers.update(extra_headers or {})
        data = body
        if isinstance(body, dict):
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
        """Read the body by ``deadline`` (a trickle cannot outlast the job's lease)
        and map the status; returns the JSON object."""
        status = response.status_code
        cap = self.max_body_bytes
        try:
            raw = read_body(response, max_bytes=cap, deadline=deadline, max_raw_bytes=cap)
        except FetchError as exc:
            problem = str(exc)
            if "exceeds" in problem:
                problem = f"the answer is larger than {cap} bytes"
            elif "in time" in problem:
                problem = f"the answer was not received in time ({problem})"
            problem = mask(problem, self._password)
            raise BackendError(f"{path}: {problem}"[:500], status=status) from None
        if status == 401:
            raise BackendUnauthorized(
                f"{path}: 401{error_detail(raw)} (koboldcpp's password is {self._password_state})",
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
            kind = type(decoded).__name__
            raise BackendError(f"{path}: the answer is a JSON {kind}, not an object", status=status)
        return decoded
