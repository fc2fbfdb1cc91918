"""Bounded downloads: offloaded ``messages_url`` bodies and image URLs.

Seed sections: "Fetch offloaded messages" and "5. Serve images" (seed 000),
seed 004 ("Send chat images to workers by the transport each worker declares").

The rules every download here follows:

* **http(s) only.** Any other scheme, in the first URL or in a redirect, raises
  :class:`~koboldcpp_horde_chat.errors.FetchError` before a byte is sent.
* **No credentials.** The worker sends no ``apikey``, ``Authorization`` or
  ``Cookie`` header, and no ``.netrc`` or URL-embedded (``user:pass@``)
  credentials: a URL with a user part is refused. When the caller passes a
  ``session`` it is used for connection pooling only; those headers are removed
  from every request made through it. Proxy and CA bundle settings from the
  environment (``HTTPS_PROXY``, ``REQUESTS_CA_BUNDLE``) still apply.
* **At most 3 redirects**, each target checked again (seed 004: "following at
  most 3 redirects").
* **Bounded in time and size.** ``timeout_s`` is the whole download's budget
  (connect, headers and body), not a per-read timeout: before each read of the
  body the socket's timeout is set to what is left. The body is read raw, in
  chunks, and decoded by its ``Content-Encoding`` (identity, ``gzip``/``x-gzip``
  including several concatenated members, or ``deflate``); decoding stops as
  soon as the decoded size passes ``max_bytes``, so a small gzip bomb never
  inflates past the cap in memory. The raw bytes read are capped too.
* **Signed URLs are credentials.** Error messages and log lines name a URL as
  ``scheme://host[:port]/path`` only, never its query string. A network failure
  is said in a few words (``"messages_url https://host/path: connection failed
  (refused)"``), never in the HTTP library's own text, which quotes URLs.

* **Ended by the stop.** Fetches given a :class:`Downloads` end as soon as
  :meth:`Downloads.hang_up` is called from another thread (their sockets are
  shut down: ``inflight``'s tracked connections), whatever is left of their
  budget: a job given up at the stop's deadline hangs up its image downloads,
  whose thread pool would otherwise hold the process's exit until they end.

A failed fetch faults the job without ``fault_reason`` (seed: "A fetch that
fails is a faulted job... Send it without fault_reason").
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
import requests.auth

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


class _NoCredentials(requests.auth.AuthBase):
    """Removes credential headers from a prepared request.

    Passing an auth object also stops ``requests`` from adding ``.netrc`` or
    URL-embedded credentials.
    """

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        for name in _CREDENTIAL_HEADERS:
            r.headers.pop(name, None)
        return r


_NO_CREDENTIALS: Final = _NoCredentials()


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
    """The fetches of one step (a job's images), which another thread can end.

    Each fetch given it runs as a :class:`~koboldcpp_horde_chat.inflight.Call`
    on its own thread; :meth:`hang_up` shuts every one in flight down and keeps
    any later one from being sent. Thread-safe.
    """

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
    url: str,
    *,
    what: str,
    accept: str,
    timeout_s: float,
    max_bytes: int,
    session: requests.Session | None,
    downloads: Downloads | None = None,
) -> bytes:
    """GETs ``url`` under the module's rules and returns the decoded body (ended
    early by ``downloads``' hang-up)."""
    with downloads.call() if downloads is not None else nullcontext():
        if downloads is not None and downloads.hung_up:
            raise FetchError(f"{what} {redact_url(url)}: not fetched, the job was given up")
        return _fetch_now(url, what=what, accept=accept, timeout_s=timeout_s,
                          max_bytes=max_bytes, session=session)


def _fetch_now(
    url: str,
    *,
    what: str,
    accept: str,
    timeout_s: float,
    max_bytes: int,
    session: requests.Session | None,
) -> bytes:
    start = time.monotonic()
    deadline = start + timeout_s
    own = session is None
    sess = requests.Session() if session is None else session
    if own:
        adapter = TrackingAdapter()  # a hang-up shuts its connections down
        sess.mount("http://", adapter)
        sess.mount("https://", adapter)
    headers = {"Accept": accept, "Accept-Encoding": ACCEPT_ENCODING, "User-Agent": USER_AGENT}
    current = url
    try:
        for hop in range(MAX_REDIRECTS + 1):
            problem = _url_problem(current)
            if problem is not None:
                if current == url:
                    raise FetchError(f"{what} {redact_url(url)}: {problem}")
                raise FetchError(
                    f"{what} {redact_url(url)}: redirected to {redact_url(current)}: {problem}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchError(f"{what} {redact_url(current)}: no answer in {timeout_s:g} s")
            try:
                response = sess.get(
                    current,
                    headers=headers,
                    auth=_NO_CREDENTIALS,
                    stream=True,
                    allow_redirects=False,
                    timeout=(remaining, remaining),
                )
            except requests.exceptions.Timeout:
                raise FetchError(
                    f"{what} {redact_url(current)}: no answer in {timeout_s:g} s"
                ) from None
            except requests.exceptions.RequestException as exc:
                raise FetchError(
                    f"{what} {redact_url(current)}: {netfail.describe(exc)}"
                ) from None
            try:
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
                    raise FetchError(
                        f"{what} {redact_url(current)}: HTTP {response.status_code}"
                    )
                try:
                    body = read_body(response, max_bytes=max_bytes, deadline=deadline)
                except FetchError as exc:
                    raise FetchError(f"{what} {redact_url(current)}: {exc}") from None
                log.debug(
                    "%s %s: HTTP %d, %d bytes decoded (%s) in %.2f s",
                    what, redact_url(current), response.status_code, len(body),
                    response.headers.get("Content-Encoding", "identity")[:20],
                    time.monotonic() - start,
                )
                return body
            finally:
                response.close()
        raise AssertionError("unreachable")  # pragma: no cover
    except FetchError as exc:
        log.debug("%s failed after %.2f s: %s", what, time.monotonic() - start, exc)
        raise
    finally:
        if own:
            sess.close()


def fetch_messages(
    url: str,
    *,
    timeout_s: float,
    max_bytes: int = MESSAGES_MAX_BYTES,
    session: requests.Session | None = None,
) -> list[Any]:
    """Fetches an offloaded ``messages_url`` and returns the messages array.

    Seed "Fetch offloaded messages": the body is the JSON ``messages`` array,
    served plain or with ``Content-Encoding: gzip``; the decoded body is capped
    at 36 MiB; the URL is valid for 120 s after the pop, so fetch right away.

    Args:
        url: the payload's ``messages_url`` (http or https).
        timeout_s: the whole fetch's budget, seconds (connect, redirects, body).
        max_bytes: cap on the decoded body, bytes (36 MiB by default).
        session: optional session for connection pooling; credential headers it
            carries are never sent (see the module docstring).

    Returns:
        The decoded JSON array, e.g. ``[{"role": "user", "content": "Hi"}]``.
        Its elements are not validated here (``horde.pop.validate_messages`` does).

    Raises:
        FetchError: a non-http(s) URL or redirect, more than 3 redirects, a
            non-2xx status, a timeout, a body over ``max_bytes``, an unsupported
            or broken encoding, invalid UTF-8 or JSON, or JSON that is not an
            array. The message never contains the URL's query string.
    """
    data = _fetch(
        url,
        what="messages_url",
        accept="application/json",
        timeout_s=timeout_s,
        max_bytes=max_bytes,
        session=session,
    )
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
    url: str,
    *,
    timeout_s: float,
    max_bytes: int,
    session: requests.Session | None = None,
    downloads: Downloads | None = None,
) -> bytes:
    """Fetches an image URL (the ``url`` image transport) and returns its bytes.

    Seed "5. Serve images": bound the bytes read; the media type is to be taken
    from the bytes, not from ``Content-Type`` (this function does not look at it).

    Args:
        url: the image part's signed http(s) URL.
        timeout_s: the whole fetch's budget, seconds.
        max_bytes: cap on the decoded body, bytes.
        session: optional session for connection pooling; credential headers it
            carries are never sent.
        downloads: the step's fetches, whose hang-up ends this one (None: it
            ends by its budget only).

    Returns:
        The decoded body bytes (non-empty).

    Raises:
        FetchError: as :func:`fetch_messages` for the transfer, and for an empty body.
    """
    data = _fetch(
        url,
        what="image URL",
        accept="image/*",
        timeout_s=timeout_s,
        max_bytes=max_bytes,
        session=session,
        downloads=downloads,
    )
    if not data:
        raise FetchError(f"image URL {redact_url(url)}: empty body")
    return data
