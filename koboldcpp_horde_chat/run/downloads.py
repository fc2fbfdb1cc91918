"""Bounded downloads of offloaded ``messages_url`` bodies and image URLs.

Seed "Fetch offloaded messages", "5. Serve images" and seed 004. Every download:

* is http(s) only, in the first URL and in each of at most 3 redirects;
* sends no credentials (no ``apikey``, ``Authorization`` or ``Cookie`` header, no
  ``.netrc`` or ``user:pass@``; a given ``session`` is for pooling only);
* is bounded in time (``timeout_s`` is the whole download's budget) and in size
  (decoding identity, gzip or deflate stops once past ``max_bytes``: no gzip bomb);
* names a URL without its query string (signed URLs are credentials), and a
  network failure in a few words, never in the HTTP library's text;
* ends at once when its :class:`Downloads` is hung up (a job given up at the stop).

A failed fetch faults the job without ``fault_reason``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Final
from urllib.parse import urljoin, urlsplit

import requests

from .. import __version__, netfail
from ..errors import FetchError
from ..httpbody import read_body, redact_url
from ..inflight import Call, TrackingAdapter
from ..settings import MIB

log = logging.getLogger("koboldcpp_horde_chat.fetch")

MESSAGES_MAX_BYTES: Final = 36 * MIB
"""Cap on a decoded ``messages_url`` body: the chat request body cap (seed)."""
MAX_REDIRECTS: Final = 3
"""Redirects followed at most, each target checked (seed 004)."""
ACCEPT_ENCODING: Final = "gzip, deflate"
"""The encodings this module decodes; sent as ``Accept-Encoding``."""
USER_AGENT: Final = f"koboldcpp-horde-chat/{__version__}"

_CREDENTIAL_HEADERS: Final = ("apikey", "authorization", "cookie", "x-api-key")


def _no_credentials(r: requests.PreparedRequest) -> requests.PreparedRequest:
    """The request's ``auth``: removes credential headers (an auth given also keeps
    ``requests`` from adding ``.netrc`` or URL-embedded credentials)."""
    for name in _CREDENTIAL_HEADERS:
        r.headers.pop(name, None)
    return r


def _url_problem(url: str) -> str | None:
    """Why ``url`` may not be fetched, or None when it may."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return "unparsable URL"
    if parts.scheme.lower() not in ("http", "https"):
        return f"only http(s) URLs are fetched, not {parts.scheme[:20]!r}"
    if not host:
        return "URL without a host"
    if parts.username is not None or parts.password is not None:
        return "URLs with credentials are refused"
    return None


class Downloads:
    """The fetches of one step (a job's images), which another thread can end
    (:meth:`hang_up`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[Call] = set()
        self.hung_up = False

    @contextmanager
    def call(self) -> Iterator[None]:
        """Around one fetch on this thread: :meth:`hang_up` ends it."""
        call = Call()
        with call.running():
            with self._lock:
                self._calls.add(call)
                if self.hung_up:
                    call.hang_up()
            try:
                yield
            finally:
                with self._lock:
                    self._calls.discard(call)

    def hang_up(self) -> None:
        """End every fetch in flight now (each raises ``FetchError``) and every later one."""
        with self._lock:
            self.hung_up = True
            calls = list(self._calls)
        for call in calls:
            call.hang_up()


def _fetch(
    url: str, what: str, accept: str, timeout_s: float, max_bytes: int,
    session: requests.Session | None,
) -> bytes:
    """GET ``url`` under the module's rules: the decoded body."""
    start = time.monotonic()
    deadline = start + timeout_s
    sess = requests.Session() if session is None else session
    if session is None:
        adapter = TrackingAdapter()  # a hang-up shuts its connections down
        sess.mount("http://", adapter)
        sess.mount("https://", adapter)
    headers = {"Accept": accept, "Accept-Encoding": ACCEPT_ENCODING, "User-Agent": USER_AGENT}
    current = url

    def failed(problem: str) -> FetchError:
        return FetchError(f"{what} {redact_url(current)}: {problem}")

    try:
        for hop in range(MAX_REDIRECTS + 1):
            problem = _url_problem(current)
            if problem is not None:
                via = "" if current == url else f"redirected to {redact_url(current)}: "
                raise FetchError(f"{what} {redact_url(url)}: {via}{problem}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise failed(f"no answer in {timeout_s:g} s")
            try:
                response = sess.get(
                    current, headers=headers, auth=_no_credentials, stream=True,
                    allow_redirects=False, timeout=(remaining, remaining),
                )
            except requests.exceptions.Timeout:
                raise failed(f"no answer in {timeout_s:g} s") from None
            except requests.exceptions.RequestException as exc:
                raise failed(netfail.describe(exc)) from None
            with response:  # closed however it ends
                target = sess.get_redirect_target(response) if response.is_redirect else None
                if target is not None:
                    nxt = urljoin(current, target).split("#", 1)[0]
                    if hop == MAX_REDIRECTS:
                        raise FetchError(
                            f"{what} {redact_url(url)}: more than {MAX_REDIRECTS} redirects"
                        )
                    log.debug(
                        "%s %s: HTTP %d redirect to %s",
                        what, redact_url(current), response.status_code, redact_url(nxt),
                    )
                    current = nxt
                    continue
                if not 200 <= response.status_code < 300:
                    raise failed(f"HTTP {response.status_code}")
                try:
                    body = read_body(response, max_bytes=max_bytes, deadline=deadline)
                except FetchError as exc:
                    raise failed(str(exc)) from None
                log.debug(
                    "%s %s: HTTP %d, %d bytes decoded (%s) in %.2f s",
                    what, redact_url(current), response.status_code, len(body),
                    response.headers.get("Content-Encoding", "identity")[:20],
                    time.monotonic() - start,
                )
                return body
        raise AssertionError("unreachable")  # pragma: no cover
    except FetchError as exc:
        log.debug("%s failed after %.2f s: %s", what, time.monotonic() - start, exc)
        raise
    finally:
        if session is None:
            sess.close()


def fetch_messages(
    url: str, *, timeout_s: float, max_bytes: int = MESSAGES_MAX_BYTES,
    session: requests.Session | None = None,
) -> list[Any]:
    """The JSON array an offloaded ``messages_url`` serves (its elements not
    validated here). The URL lives 120 s after the pop: fetch right away.

    Raises:
        FetchError: the download failed (see the module docstring), or the body
            is not UTF-8 JSON holding an array.
    """
    data = _fetch(url, "messages_url", "application/json", timeout_s, max_bytes, session)
    where = redact_url(url)
    try:
        text = data.decode("utf-8")
        del data  # free the raw body (up to 36 MiB) before parsing makes the objects
        messages = json.loads(text)
    except UnicodeDecodeError as exc:
        raise FetchError(f"messages_url {where}: body is not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise FetchError(
            f"messages_url {where}: invalid JSON at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise FetchError(f"messages_url {where}: JSON nested too deeply") from None
    if not isinstance(messages, list):
        raise FetchError(
            f"messages_url {where}: expected a JSON array, got {type(messages).__name__}"
        )
    return messages


def fetch_image(
    url: str, *, timeout_s: float, max_bytes: int, session: requests.Session | None = None,
    downloads: Downloads | None = None,
) -> bytes:
    """An image URL's bytes, non-empty (its media type is for the caller to take
    from the bytes, not from ``Content-Type``). Raises FetchError."""
    with downloads.call() if downloads is not None else nullcontext():
        if downloads is not None and downloads.hung_up:
            raise FetchError(f"image URL {redact_url(url)}: not fetched, the job was given up")
        data = _fetch(url, "image URL", "image/*", timeout_s, max_bytes, session)
    if not data:
        raise FetchError(f"image URL {redact_url(url)}: empty body")
    return data
