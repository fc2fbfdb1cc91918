"""The Horde API client: pop, submit and progress posts.

Seed sections: "1. Declare chat on pop", "6. Submit the reply", "Submit
refusals", "7. Fault a job" and "Streaming progress" (seed 000).

Errors are mapped by HTTP status and the Horde's ``rc``, never by message text:

* 2xx with a JSON object: returned as a dict. Any other 2xx body (invalid JSON,
  invalid UTF-8, an array...) raises :class:`HordeUnavailable` ("invalid JSON").
* 429 and 5xx: :class:`HordeUnavailable` with ``rc`` and ``message`` from the
  JSON body when there is one and ``retry_after_s`` from ``Retry-After``
  (seconds or an HTTP date).
* 3xx: :class:`HordeRefusal` naming the redirect, which is *not* followed (the
  ``apikey`` header goes only to the configured Horde host).
* other 4xx: :class:`HordeRefusal` with ``status``, ``rc``, ``message`` and ``body``
  (e.g. 400 ``ChatSubmitInvalid``, 404 ``ChatJobAborted``, 409
  ``ChatProgressOutOfSequence`` whose body carries ``expected_seq``).
* no answer: :class:`HordeUnavailable` with status 0 and ``sent=False`` when the
  request certainly did not leave (connection refused, DNS failure, connect
  timeout), ``sent=None`` when it may have (read timeout, reset). The message
  says what failed in a few words, never in the HTTP library's own text:
  ``"POST /api/v2/generate/text/pop: could not connect to aihorde.net
  (refused)"``, ``"... no answer from aihorde.net in time"``, ``"... connection
  to aihorde.net lost (reset)"``. A TLS failure says so and points at
  ``REQUESTS_CA_BUNDLE`` (or ``CURL_CA_BUNDLE``).
* an answer body over the cap (64 MiB for pop, which may carry base64 images;
  1 MiB for the others): :class:`HordeUnavailable`.
* while the worker stops (``deadlines``, ``inflight.CallDeadlines``): a call
  ends by the stop's deadline for its route, whatever its timeout; one still
  in flight then is hung up (:class:`HordeUnavailable`, status 0, ``sent=None``:
  "no answer from aihorde.net by the stop's deadline"), one made after it is
  not sent (``sent=False``).

The API key never appears in an exception's message or ``repr``, nor in a log
line; ``repr(client)`` shows the host only. Each call logs one debug line
(route, status, seconds), never a body.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlsplit

import requests
import urllib3.exceptions

from .. import __version__, netfail
from ..errors import ConfigError, FetchError, HordeRefusal, HordeUnavailable
from ..httpbody import read_body, redact_url
from ..inflight import Call, CallDeadlines, TrackingAdapter
from ..settings import MIB
from .watch import HordeWatch

log = logging.getLogger("koboldcpp_horde_chat.horde")

_PLAIN_HTTP_WARNED: set[str] = set()
"""Horde URLs already warned about as plain http in this process (each once)."""
_PLAIN_HTTP_LOCK = threading.Lock()


def _warn_plain_http_once(base_url: str) -> None:
    """Warn that ``base_url`` sends the API key unencrypted, once per process and URL
    (a worker makes several clients: one per loop, one for its start-up recovery)."""
    with _PLAIN_HTTP_LOCK:
        if base_url in _PLAIN_HTTP_WARNED:
            return
        _PLAIN_HTTP_WARNED.add(base_url)
    log.warning("the Horde URL %s is plain http: the API key travels unencrypted", base_url)

ROUTE_POP: Final = "/api/v2/generate/text/pop"
ROUTE_SUBMIT: Final = "/api/v2/generate/text/submit"
ROUTE_PROGRESS: Final = "/api/v2/generate/text/progress"
ROUTE_FIND_USER: Final = "/api/v2/find_user"
POP_MAX_BYTES: Final = 64 * MIB
"""Cap on a pop answer: a base64 image worker may receive megabytes inline (seed 004)."""
RESPONSE_MAX_BYTES: Final = 1 * MIB
"""Cap on submit and progress answers, and on any error body."""
MESSAGE_MAX_CHARS: Final = 300
"""Error messages are shortened to this many characters."""
CLIENT_AGENT: Final = f"koboldcpp-horde-chat:{__version__}"
ROUTE_KINDS: Final = {
    ROUTE_POP: "pop", ROUTE_SUBMIT: "submit", ROUTE_PROGRESS: "progress", ROUTE_FIND_USER: "pop",
}
"""The kind of each route, as ``inflight.CallDeadlines`` names it (the key check
at start ends by the pops' deadline)."""
RETRY_AFTER_MAX_S: Final = 3600.0
"""A ``Retry-After`` beyond an hour is clamped to an hour."""


def _shorten(text: str, limit: int = MESSAGE_MAX_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """``Retry-After`` in seconds (>= 0, at most an hour), or None when absent or invalid.

    Accepts delay-seconds (``"7"``, ``"2.5"``) or an HTTP date
    (``"Wed, 21 Oct 2015 07:28:00 GMT"``), counted from ``now`` (UTC; default: the clock).
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


class HordeClient:
    """A client for the Horde's text worker routes, with the worker's API key.

    One ``requests.Session`` per client. Sessions are not documented as
    thread-safe, so use one client per thread (koboldcpp's parallel worker
    threads each build their own).

    Args:
        base_url: the Horde, e.g. ``"https://aihorde.net"`` (http or https, no
            user part, query or fragment; a path prefix is kept).
        api_key: the worker owner's API key, sent as the ``apikey`` header on
            every call, to this host only. Printable ASCII without spaces.
        bridge_agent: sent as the ``User-Agent`` header (the pop body carries it
            as ``bridge_agent`` too; that is the caller's business). The
            ``Client-Agent`` header names this package instead: the bridge agent
            names the backend the Horde validates, the client agent the software
            making the call.
        connect_timeout_s: connect timeout of every call, seconds.
        session: a session to use (tests), as it is; by default the client makes
            one and :meth:`close` closes it. Its headers are not modified. A
            session the client makes reads the environment once, now: the proxy
            for ``base_url`` (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``,
            ``NO_PROXY``) and ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE``; it
            does not re-read them on every call (``trust_env`` off, which saves
            about 0.3 ms a call) and never uses ``.netrc`` credentials.
        pop_max_bytes, max_bytes: caps on the decoded answer body of a pop and
            of the other calls, bytes.
        deadlines: the stop's deadlines of the worker's calls (``"pop"``,
            ``"submit"``, ``"progress"``), shared by its clients; None: calls end
            by their own timeouts only. A call in flight at its deadline is hung
            up only on a session the client made (and not through a proxy).
        watch: told of every call's start and end (``watch.HordeWatch``, shared
            by a worker's clients: it says when the Horde stops answering and
            answers again); None: not watched.

    Raises:
        ConfigError: an unusable ``base_url`` or ``api_key`` (the message never
            contains the key).

    Every call sends ``apikey``, ``Client-Agent: koboldcpp-horde-chat:<version>``,
    ``User-Agent`` and ``Content-Type: application/json``, does not follow
    redirects, and raises only :class:`~koboldcpp_horde_chat.errors.HordeRefusal`
    or :class:`~koboldcpp_horde_chat.errors.HordeUnavailable` (plus ``TypeError``
    / ``ValueError`` for a body that is not JSON-serialisable, a caller bug).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        bridge_agent: str,
        connect_timeout_s: float = 10.0,
        session: requests.Session | None = None,
        pop_max_bytes: int = POP_MAX_BYTES,
        max_bytes: int = RESPONSE_MAX_BYTES,
        deadlines: CallDeadlines | None = None,
        watch: HordeWatch | None = None,
    ) -> None:
        self._watch = watch
        try:
            parts = urlsplit(base_url.strip())
            host = parts.hostname
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ConfigError("the Horde URL cannot be parsed") from None
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise ConfigError(f"the Horde URL must be http(s)://host, not {base_url[:80]!r}")
        if parts.username is not None or parts.password is not None:
            raise ConfigError("the Horde URL must not contain a user name or password")
        if parts.query or parts.fragment:
            raise ConfigError("the Horde URL must not have a query or fragment")
        if not api_key:
            raise ConfigError("the Horde API key is empty")
        if any(not 0x21 <= ord(c) <= 0x7E for c in api_key):
            raise ConfigError(
                "the Horde API key contains spaces, control or non-ASCII characters"
            )
        self._base_url = redact_url(base_url.strip()).rstrip("/")
        self._host = self._base_url.split("://", 1)[1].split("/", 1)[0]
        if parts.scheme.lower() == "http" and host not in ("127.0.0.1", "localhost", "::1"):
            _warn_plain_http_once(self._base_url)
        self._api_key = api_key
        self._connect_timeout_s = connect_timeout_s
        self._own_session = session is None
        if session is None:
            session = requests.Session()
            # What requests would read from the environment on every call, read once.
            session.proxies.update(requests.utils.get_environ_proxies(self._base_url))
            session.verify = (
                os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
            )
            session.trust_env = False  # also: no .netrc credentials, ever
            adapter = TrackingAdapter()  # a call in flight can be hung up at a stop
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self._session = session
        self._deadlines = deadlines
        self._call = Call()
        self._pop_max_bytes = pop_max_bytes
        self._max_bytes = max_bytes
        self._headers = {
            "apikey": api_key,
            "Client-Agent": CLIENT_AGENT,
            "User-Agent": bridge_agent,
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Accept-Encoding": "gzip, deflate",
        }

    def __repr__(self) -> str:
        return f"HordeClient(host={self._host!r})"

    @property
    def host(self) -> str:
        """The Horde's ``host[:port]``, the only host the API key is sent to."""
        return self._host

    def close(self) -> None:
        """Closes the session when the client made it."""
        if self._own_session:
            self._session.close()

    def __enter__(self) -> HordeClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the three routes ------------------------------------------------------

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST ``/api/v2/generate/text/pop`` (seed step 1).

        Args:
            body: the pop body with the chat declaration (``declaration.pop_body``).
            timeout_s: read timeout, seconds (also bounds reading the answer).

        Returns:
            The pop answer: ``{"id": "<job-id>" | None, "payload": {...}, "chat": true,
            "ttl": 150, "skipped": {...}, ...}``; parsing is ``horde.pop.parse_pop``'s.

        Raises:
            HordeRefusal: 4xx (e.g. 400 ``ChatDeclarationInvalid``), or a redirect.
            HordeUnavailable: 429, 5xx, network failure, invalid JSON, over 64 MiB.
        """
        return self._post(ROUTE_POP, body, timeout_s=timeout_s, max_bytes=self._pop_max_bytes)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST ``/api/v2/generate/text/submit`` (seed steps 6 and 7).

        Args:
            body: a chat submit, fault submit or text submit with ``"id"``.
            timeout_s: read timeout, seconds.

        Returns:
            The answer, ``{"reward": <kudos>}``.

        Raises:
            HordeRefusal: 4xx, e.g. 400 ``ChatSubmitInvalid``, ``ChatSubmitNonconformant``,
                ``ChatModelMismatch``, ``AbortedGen``, ``DuplicateGen``; ``job_id`` is
                ``body["id"]``.
            HordeUnavailable: 429, 5xx, network failure, invalid JSON, over 1 MiB.
        """
        return self._post(ROUTE_SUBMIT, body, timeout_s=timeout_s, max_bytes=self._max_bytes)

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST ``/api/v2/generate/text/progress`` (seed "Streaming progress").

        Args:
            body: ``{"id": "<job-id>", "seq": n, "delta": {"content": "...",
                "reasoning_content": "..."}}``.
            timeout_s: read timeout, seconds.

        Returns:
            The answer, ``{"accepted_seq": n, "cancelled": false}``.

        Raises:
            HordeRefusal: 404 ``ChatJobAborted`` / ``ChatProgressNotStreaming``,
                409 ``ChatProgressOutOfSequence`` (``body["expected_seq"]``),
                413 ``ChatProgressCapReached``.
            HordeUnavailable: 503 ``ChatProgressUnavailable``, 429, other 5xx,
                network failure, invalid JSON, over 1 MiB.
        """
        return self._post(ROUTE_PROGRESS, body, timeout_s=timeout_s, max_bytes=self._max_bytes)

    def find_user(self, *, timeout_s: float) -> dict[str, Any]:
        """GET ``/api/v2/find_user``: who the API key belongs to (the start's key check).

        Returns:
            The user's details, e.g. ``{"username": "db0#1", "id": 1, "kudos": 10.0,
            "worker_ids": [...], ...}`` (``id`` 0 is the anonymous user).

        Raises:
            HordeRefusal: 401 ``InvalidAPIKey`` (no key), 404 ``UserNotFound`` (a
                key the Horde does not know), another 4xx, or a redirect.
            HordeUnavailable: 429, 5xx, network failure, invalid JSON, over 1 MiB.
        """
        return self._request(
            "GET", ROUTE_FIND_USER, None, timeout_s=timeout_s, max_bytes=self._max_bytes
        )

    # --- internals ---------------------------------------------------------------

    def _safe(self, text: str) -> str:
        """``text`` without the API key, on one line, shortened."""
        return _shorten(text.replace(self._api_key, "***"))

    def _post(
        self, route: str, body: dict[str, Any], *, timeout_s: float, max_bytes: int
    ) -> dict[str, Any]:
        return self._request("POST", route, body, timeout_s=timeout_s, max_bytes=max_bytes)

    def _request(
        self,
        method: str,
        route: str,
        body: dict[str, Any] | None,
        *,
        timeout_s: float,
        max_bytes: int,
    ) -> dict[str, Any]:
        raw_id = body.get("id") if body is not None else None
        job_id = raw_id if isinstance(raw_id, str) and raw_id else None
        data = (
            None if body is None
            else json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        )
        kind = ROUTE_KINDS.get(route, route)
        watch = self._watch
        if watch is None:
            return self._send(method, route, data, kind, job_id, timeout_s, max_bytes)
        token = watch.started(route.rsplit("/", 1)[-1])
        try:
            answer = self._send(method, route, data, kind, job_id, timeout_s, max_bytes)
        except HordeRefusal:
            watch.answered(token)
            raise
        except BaseException:
            watch.failed(token)
            raise
        watch.answered(token)
        return answer

    def _send(
        self,
        method: str,
        route: str,
        data: str | None,
        kind: str,
        job_id: str | None,
        timeout_s: float,
        max_bytes: int,
    ) -> dict[str, Any]:
        """One call on the wire (see :meth:`_request`)."""
        connect_s = self._connect_timeout_s
        left = self._deadlines.left(kind) if self._deadlines is not None else None
        if left is not None:
            if left <= 0:
                raise HordeUnavailable(
                    f"{method} {route}: not sent, the worker's stop deadline has passed",
                    status=0, job_id=job_id, sent=False,
                )
            timeout_s, connect_s = min(timeout_s, left), min(connect_s, left)
        start = time.monotonic()
        deadline = start + connect_s + timeout_s
        if left is not None:
            deadline = min(deadline, start + left)
        call = self._call
        with call.running(), self._cut_at_stop(kind, call):
            try:
                response = self._session.request(
                    method,
                    self._base_url + route,
                    data=None if data is None else data.encode("utf-8"),
                    headers=self._headers,
                    timeout=(connect_s, timeout_s),
                    allow_redirects=False,
                    stream=True,
                )
            except requests.exceptions.RequestException as exc:
                log.debug("%s %s: no answer after %.2f s: %s",
                          method, route, time.monotonic() - start, netfail.describe(exc))
                if call.hung_up:
                    raise self._cut_error(route, job_id, method) from None
                raise self._network_error(route, exc, job_id, method) from None
            try:
                return self._answer(route, response, job_id, max_bytes, deadline, start, method)
            except HordeUnavailable:
                if call.hung_up:
                    raise self._cut_error(route, job_id, method) from None
                raise
            finally:
                response.close()

    def _cut_at_stop(self, kind: str, call: Call) -> AbstractContextManager[None]:
        """Hang the call up at the stop's deadline of its kind (when there is one)."""
        if self._deadlines is None:
            return nullcontext()
        return self._deadlines.running(kind, call)

    def _cut_error(
        self, route: str, job_id: str | None, method: str = "POST"
    ) -> HordeUnavailable:
        """The call was hung up at the stop's deadline: it may have reached the Horde."""
        return HordeUnavailable(
            f"{method} {route}: no answer from {self._host} by the worker's stop deadline",
            status=0, job_id=job_id, sent=None,
        )

    def _answer(
        self,
        route: str,
        response: requests.Response,
        job_id: str | None,
        max_bytes: int,
        deadline: float,
        start: float,
        method: str = "POST",
    ) -> dict[str, Any]:
        status = response.status_code
        ok = 200 <= status < 300
        text: str | None = None
        read_problem = ""
        try:
            raw = read_body(
                response, max_bytes=max_bytes if ok else min(max_bytes, RESPONSE_MAX_BYTES),
                deadline=deadline,
            )
            text = raw.decode("utf-8")
        except FetchError as exc:
            read_problem = str(exc)
        except UnicodeDecodeError:
            read_problem = "invalid JSON (not UTF-8)"
        log.debug("%s %s -> %d in %.2f s%s", method, route, status, time.monotonic() - start,
                  f" (job {job_id})" if job_id else "")

        parsed: Any = None
        if text is not None:
            try:
                parsed = json.loads(text if ok else text.replace(self._api_key, "***"))
            except (json.JSONDecodeError, RecursionError):
                parsed = None
        obj = parsed if isinstance(parsed, dict) else None

        if ok:
            if read_problem and not read_problem.startswith("invalid JSON"):
                raise HordeUnavailable(
                    self._safe(f"{route}: the Horde's answer could not be read: {read_problem}"),
                    status=status, job_id=job_id, sent=True,
                )
            if obj is None:
                raise HordeUnavailable(
                    f"{route}: invalid JSON in the Horde's answer (expected an object)",
                    status=status, job_id=job_id, sent=True,
                )
            return obj

        body = obj or {}
        rc_raw = body.get("rc")
        rc = self._safe(rc_raw) if isinstance(rc_raw, str) else ""
        msg_raw = body.get("message")
        if isinstance(msg_raw, str) and msg_raw.strip():
            message = self._safe(msg_raw)
        else:
            message = self._safe(f"{route}: HTTP {status} {response.reason or ''}".rstrip())

        if 300 <= status < 400:
            location = response.headers.get("Location")
            where = redact_url(location) if location else "no Location"
            raise HordeRefusal(
                self._safe(
                    f"{route}: the Horde answered HTTP {status} redirecting to {where}; "
                    f"not followed, so the API key stays with {self._host}. "
                    "Set the Horde URL to the final address"
                ),
                status=status, rc=rc, job_id=job_id, body=body,
            )
        if status == 429 or status >= 500:
            raise HordeUnavailable(
                message, status=status, rc=rc, job_id=job_id, body=body,
                retry_after_s=parse_retry_after(response.headers.get("Retry-After")),
                sent=True,
            )
        if 400 <= status < 500:
            raise HordeRefusal(message, status=status, rc=rc, job_id=job_id, body=body)
        # 1xx or another odd status: not an answer we understand, try again later.
        raise HordeUnavailable(message, status=status, rc=rc, job_id=job_id, body=body, sent=True)

    def _network_error(
        self,
        route: str,
        exc: requests.exceptions.RequestException,
        job_id: str | None,
        method: str = "POST",
    ) -> HordeUnavailable:
        """Maps a ``requests`` exception raised before any answer to HordeUnavailable.

        The message says what failed in a few words, e.g. ``"POST
        /api/v2/generate/text/pop: could not connect to aihorde.net (refused)"``;
        the exception's own text (connection pools, retries, object reprs) is
        left out.
        """
        inner: BaseException = exc
        if exc.args and isinstance(exc.args[0], BaseException):
            inner = exc.args[0]
        if isinstance(inner, urllib3.exceptions.MaxRetryError) and inner.reason is not None:
            inner = inner.reason
        why = netfail.cause(exc)
        because = f" ({why})" if why not in ("", netfail.TIMED_OUT, netfail.TLS_FAILED) else ""
        sent: bool | None
        if isinstance(exc, requests.exceptions.SSLError):
            what = (
                f"TLS failure talking to {self._host}{because}; if a proxy or private CA sits "
                "in between, point REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) at its CA bundle"
            )
            sent = None
        elif isinstance(exc, requests.exceptions.ConnectTimeout):
            what, sent = f"could not connect to {self._host} in time", False
        elif isinstance(exc, requests.exceptions.Timeout):
            what, sent = f"no answer from {self._host} in time", None
        elif isinstance(exc, requests.exceptions.ConnectionError) and isinstance(
            inner, urllib3.exceptions.NewConnectionError | ConnectionRefusedError
        ):
            what, sent = f"could not connect to {self._host}{because}", False
        elif isinstance(exc, requests.exceptions.ConnectionError):
            what, sent = f"connection to {self._host} lost{because}", None
        else:
            what, sent = f"request to {self._host} failed{because}", None
        return HordeUnavailable(
            self._safe(f"{method} {route}: {what}"), status=0, job_id=job_id, sent=sent
        )
