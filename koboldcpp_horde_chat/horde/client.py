"""The Horde API client (seed 000 steps 1, 6, 7 and "Streaming progress").

Errors go by status and ``rc``, never by message text: a 3xx (not followed, so the
API key stays with the configured host) or another 4xx raises ``HordeRefusal``;
429, 5xx, no answer, a 2xx without a JSON object or an answer over the cap (64 MiB
for pop, which may carry base64 images; 1 MiB otherwise) ``HordeUnavailable``, with
``sent`` False when the request certainly did not leave, None when it may have.
The API key never appears in a message, a repr or a log line.
"""

from __future__ import annotations

import email.utils
import json
import logging
import threading
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from typing import Any, Final
from urllib.parse import urlsplit

import requests
import urllib3.exceptions

from .. import __version__, netfail
from ..errors import ConfigError, FetchError, HordeRefusal, HordeUnavailable
from ..httpbody import read_body, redact_url, tracked_session
from ..inflight import Call, CallDeadlines
from ..settings import MIB
from .watch import HordeWatch

log = logging.getLogger("koboldcpp_horde_chat.horde")

#: Horde URLs warned about as plain http, once per process (a worker has several clients).
_PLAIN_HTTP_WARNED: set[str] = set()
_PLAIN_HTTP_LOCK = threading.Lock()


POP_MAX_BYTES: Final = 64 * MIB
#: Cap on submit and progress answers, and on any error body.
RESPONSE_MAX_BYTES: Final = 1 * MIB
MESSAGE_MAX_CHARS: Final = 300
CLIENT_AGENT: Final = f"koboldcpp-horde-chat:{__version__}"
RETRY_AFTER_MAX_S: Final = 3600.0


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """``Retry-After`` (seconds or an HTTP date, counted from ``now``) in seconds,
    clamped to 0..3600; None when absent or invalid."""
    value = (value or "").strip()
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
    """A client for the Horde's text worker routes; one per thread.

    ``api_key`` goes as ``apikey`` to ``base_url``'s host only; ``bridge_agent`` is the
    ``User-Agent``. Its own session reads the proxy and CA bundle variables
    once, never ``.netrc``. While the worker stops, a call ends by ``deadlines``' time
    for its kind (a route's name; the key check's is ``"pop"``). Raises ConfigError for
    an unusable URL or key (never quoting it).
    """

    def __init__(self, base_url: str, api_key: str, *, bridge_agent: str,
                 connect_timeout_s: float = 10.0, deadlines: CallDeadlines | None = None,
                 watch: HordeWatch | None = None) -> None:
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
            raise ConfigError("the Horde API key contains spaces, control or non-ASCII characters")
        self._base_url = redact_url(base_url.strip()).rstrip("/")
        self._host = self._base_url.split("://", 1)[1].split("/", 1)[0]
        if parts.scheme.lower() == "http" and host not in ("127.0.0.1", "localhost", "::1"):
            with _PLAIN_HTTP_LOCK:
                if self._base_url not in _PLAIN_HTTP_WARNED:
                    _PLAIN_HTTP_WARNED.add(self._base_url)
                    log.warning("the Horde URL %s is plain http: the API key travels "
                                "unencrypted", self._base_url)
        self._api_key, self._connect_timeout_s = api_key, connect_timeout_s
        self._deadlines, self._watch, self._call = deadlines, watch, Call()
        self._session = tracked_session()  # a call in flight can be hung up at a stop
        # What requests would read from the environment on every call, read once.
        self._session.proxies.update(requests.utils.get_environ_proxies(self._base_url))
        self._headers = {
            "apikey": api_key, "Client-Agent": CLIENT_AGENT, "User-Agent": bridge_agent,
            "Content-Type": "application/json", "Accept": "application/json",
            "Accept-Encoding": "gzip, deflate",
        }

    def __repr__(self) -> str:
        return f"HordeClient(host={self._host!r})"

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> HordeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST the pop; the answer is read by ``horde.pop.parse_pop``."""
        return self._request("POST", "/api/v2/generate/text/pop", body, "pop", timeout_s,
                             POP_MAX_BYTES)

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST a submit; ``{"reward": <kudos>}``."""
        return self._request("POST", "/api/v2/generate/text/submit", body, "submit", timeout_s)

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POST a progress post; ``{"accepted_seq": n, "cancelled": false}``."""
        return self._request("POST", "/api/v2/generate/text/progress", body, "progress", timeout_s)

    def find_user(self, *, timeout_s: float) -> dict[str, Any]:
        """GET the key's owner (``id`` 0 is anonymous; an unknown key: 404 ``UserNotFound``).
        The key check ends with the pops at a stop."""
        return self._request("GET", "/api/v2/find_user", None, "pop", timeout_s)

    def _safe(self, text: str) -> str:
        """``text`` without the API key, on one line, shortened."""
        text = " ".join(text.replace(self._api_key, "***").split())
        return text if len(text) <= MESSAGE_MAX_CHARS else text[: MESSAGE_MAX_CHARS - 1] + "\u2026"

    def _request(self, method: str, route: str, body: dict[str, Any] | None, kind: str,
                 timeout_s: float, max_bytes: int = RESPONSE_MAX_BYTES) -> dict[str, Any]:
        raw_id = body.get("id") if body is not None else None
        job_id = raw_id if isinstance(raw_id, str) and raw_id else None
        data = None if body is None else json.dumps(
            body, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode("utf-8")
        watch = self._watch
        with nullcontext() if watch is None else watch.call(route.rsplit("/", 1)[-1]):
            connect_s = self._connect_timeout_s
            whole_s = connect_s + timeout_s  # the whole call, its body included
            left = self._deadlines.left(kind) if self._deadlines is not None else None
            if left is not None:
                if left <= 0:
                    raise HordeUnavailable(
                        f"{method} {route}: not sent, the worker's stop deadline has passed",
                        status=0, job_id=job_id, sent=False,
                    )
                timeout_s, connect_s = min(timeout_s, left), min(connect_s, left)
                whole_s = min(whole_s, left)
            start = time.monotonic()
            call = self._call
            cut_at_stop = (
                nullcontext() if self._deadlines is None
                else self._deadlines.until(kind, call.hang_up)
            )
            with call.running(), cut_at_stop:
                try:
                    try:
                        response = self._session.request(
                            method,
                            self._base_url + route,
                            data=data,
                            headers=self._headers,
                            timeout=(connect_s, timeout_s),
                            allow_redirects=False,
                            stream=True,
                        )
                    except requests.exceptions.RequestException as exc:
                        log.debug("%s %s: no answer after %.2f s: %s", method, route,
                                  time.monotonic() - start, netfail.describe(exc))
                        raise self._network_error(route, exc, job_id, method) from None
                    try:
                        return self._answer(route, response, job_id, max_bytes,
                                            start + whole_s, start, method)
                    finally:
                        response.close()
                except HordeUnavailable:
                    if call.hung_up:  # at the stop's deadline: it may have reached the Horde
                        raise HordeUnavailable(
                            f"{method} {route}: no answer from {self._host} by the worker's "
                            "stop deadline", status=0, job_id=job_id, sent=None,
                        ) from None
                    raise

    def _answer(self, route: str, response: requests.Response, job_id: str | None,
                max_bytes: int, deadline: float, start: float, method: str) -> dict[str, Any]:
        status = response.status_code
        ok = 200 <= status < 300
        try:
            cap = max_bytes if ok else min(max_bytes, RESPONSE_MAX_BYTES)
            raw = read_body(response, max_bytes=cap, deadline=deadline)
            unusable = "invalid JSON in the Horde's answer (expected an object)"
        except FetchError as exc:
            raw, unusable = b"", f"the Horde's answer could not be read: {exc}"
        log.debug("%s %s -> %d in %.2f s%s", method, route, status, time.monotonic() - start,
                  f" (job {job_id})" if job_id else "")
        try:
            text = raw.decode("utf-8")
            parsed = json.loads(text if ok else text.replace(self._api_key, "***"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            parsed = None
        if ok:
            if not isinstance(parsed, dict):
                raise HordeUnavailable(
                    self._safe(f"{route}: {unusable}"), status=status, job_id=job_id, sent=True
                )
            return parsed

        body: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
        rc_raw = body.get("rc")
        rc = self._safe(rc_raw) if isinstance(rc_raw, str) else ""
        message = body.get("message")
        if 300 <= status < 400:
            location = response.headers.get("Location")
            where = redact_url(location) if location else "no Location"
            message = (f"{route}: the Horde answered HTTP {status} redirecting to {where}; "
                       f"not followed, so the API key stays with {self._host}. "
                       "Set the Horde URL to the final address")
        elif not (isinstance(message, str) and message.strip()):
            message = f"{route}: HTTP {status} {response.reason or ''}".rstrip()
        if 300 <= status < 500 and status != 429:  # a redirect, not followed, or a 4xx
            raise HordeRefusal(self._safe(message), status=status, rc=rc, job_id=job_id, body=body)
        # 429, 5xx, or an odd status (1xx) not understood: try again later.
        retry_after = response.headers.get("Retry-After") if status >= 429 else None
        raise HordeUnavailable(self._safe(message), status=status, rc=rc, job_id=job_id, body=body,
                               retry_after_s=parse_retry_after(retry_after), sent=True)

    def _network_error(self, route: str, exc: requests.exceptions.RequestException,
                       job_id: str | None, method: str) -> HordeUnavailable:
        """A ``requests`` failure before any answer, said in a few words
        (``"POST /api/v2/generate/text/pop: could not connect to aihorde.net (refused)"``)."""
        inner = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else exc
        if isinstance(inner, urllib3.exceptions.MaxRetryError) and inner.reason is not None:
            inner = inner.reason
        why = netfail.cause(exc)
        because = f" ({why})" if why not in ("", netfail.TIMED_OUT, netfail.TLS_FAILED) else ""
        sent: bool | None = None  # it may have reached the Horde
        if isinstance(exc, requests.exceptions.SSLError):
            what = (f"TLS failure talking to {self._host}{because}; if a proxy or private CA "
                    "sits in between, point REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) at its CA "
                    "bundle")
        elif isinstance(exc, requests.exceptions.ConnectTimeout):
            what, sent = f"could not connect to {self._host} in time", False
        elif isinstance(exc, requests.exceptions.Timeout):
            what = f"no answer from {self._host} in time"
        elif not isinstance(exc, requests.exceptions.ConnectionError):
            what = f"request to {self._host} failed{because}"
        elif isinstance(inner, urllib3.exceptions.NewConnectionError | ConnectionRefusedError):
            what, sent = f"could not connect to {self._host}{because}", False
        else:
            what = f"connection to {self._host} lost{because}"
        return HordeUnavailable(self._safe(f"{method} {route}: {what}"), job_id=job_id, sent=sent)
