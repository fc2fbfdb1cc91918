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

A failed fetch faults the job without ``fault_reason`` (seed: "A fetch that
fails is a faulted job... Send it without fault_reason").
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import zlib
from typing import Any, Final
from urllib.parse import urljoin, urlsplit

import requests
import requests.auth
import urllib3.exceptions

from .. import __version__, netfail
from ..errors import FetchError

log = logging.getLogger("koboldcpp_horde_chat.fetch")

MIB: Final = 1024 * 1024
MESSAGES_MAX_BYTES: Final = 36 * MIB
"""Cap on a decoded ``messages_url`` body: the chat request body cap (seed)."""
MAX_REDIRECTS: Final = 3
"""Redirects followed at most, each target checked (seed 004)."""
CHUNK_BYTES: Final = 64 * 1024
"""Raw bytes asked for per read."""
ACCEPT_ENCODING: Final = "gzip, deflate"
"""The encodings this module decodes; sent as ``Accept-Encoding``."""
USER_AGENT: Final = f"koboldcpp-horde-chat/{__version__}"

_CREDENTIAL_HEADERS: Final = ("apikey", "authorization", "cookie", "x-api-key")


def redact_url(url: str) -> str:
    """``url`` as ``scheme://host[:port]/path``, without user part, query or fragment.

    A signed URL carries its signature in the query string, so this is the only
    form of a URL that goes into error messages and log lines.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    return f"{parts.scheme}://{netloc}{parts.path}"


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


# --- bounded, decoding body reader --------------------------------------------


class _BodyDecoder:
    """Decodes a raw body incrementally, never holding more than ``max_bytes`` + 1."""

    def __init__(self, encoding: str, max_bytes: int) -> None:
        self.encoding = encoding
        self.max_bytes = max_bytes
        self.out = bytearray()
        self._decomp: Any = None  # zlib decompress object of the current member
        self._members = 0
        self._head = b""  # deflate: bytes kept until the zlib/raw sniff can run
        self._done = False  # deflate: the stream ended

    def _append(self, data: bytes) -> None:
        self.out += data
        if len(self.out) > self.max_bytes:
            raise FetchError(f"decoded body exceeds {self.max_bytes} bytes")

    def _inflate(self, buf: bytes) -> bytes:
        """Feeds ``buf`` to the current decompressor; returns its unused tail."""
        d = self._decomp
        while True:
            room = self.max_bytes - len(self.out) + 1
            self._append(d.decompress(buf, room))
            if d.eof:
                return bytes(d.unused_data)
            buf = d.unconsumed_tail
            if not buf:
                return b""

    def feed(self, data: bytes) -> None:
        """Decodes one raw chunk; raises FetchError when over the cap or invalid."""
        try:
            if self.encoding == "identity":
                self._append(data)
            elif self.encoding == "gzip":
                self._feed_gzip(data)
            else:
                self._feed_deflate(data)
        except zlib.error as exc:
            raise FetchError(f"invalid {self.encoding} body ({exc})") from None

    def _feed_gzip(self, buf: bytes) -> None:
        while buf:
            if self._decomp is None:
                # Between members: skip zero padding, as gzip readers do.
                buf = buf.lstrip(b"\0")
                if not buf:
                    return
                self._decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._members += 1
            buf = self._inflate(buf)
            if self._decomp.eof:
                self._decomp = None

    def _feed_deflate(self, data: bytes) -> None:
        if self._done:
            if data:
                raise FetchError("invalid deflate body (data after the end of the stream)")
            return
        if self._decomp is None:
            self._head += data
            if len(self._head) < 2:
                return
            b0, b1 = self._head[0], self._head[1]
            zlib_wrapped = (b0 & 0x0F) == 8 and ((b0 << 8) | b1) % 31 == 0
            # "deflate" should be zlib-wrapped; some servers send a raw stream.
            self._decomp = zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
            data, self._head = self._head, b""
        rest = self._inflate(data)
        if self._decomp.eof:
            self._done = True
            if rest:
                raise FetchError("invalid deflate body (data after the end of the stream)")

    def finish(self) -> bytes:
        """The decoded body; raises FetchError when a compressed stream was cut short."""
        if self.encoding == "gzip" and self._decomp is not None:
            raise FetchError("truncated gzip body")
        if self.encoding == "deflate" and not self._done and (self._decomp or self._head):
            raise FetchError("truncated deflate body")
        return bytes(self.out)


def _content_encoding(response: requests.Response) -> str:
    """``identity``, ``gzip`` or ``deflate``; FetchError for anything else."""
    raw = response.headers.get("Content-Encoding", "")
    codings = [c.strip().lower() for c in raw.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return "identity"
    if len(codings) == 1:
        coding = codings[0]
        if coding in ("gzip", "x-gzip"):
            return "gzip"
        if coding == "deflate":
            return "deflate"
    raise FetchError(f"unsupported Content-Encoding {raw[:40]!r}")


def _set_socket_timeout(response: requests.Response, seconds: float) -> None:
    """Sets the timeout of the socket under ``response`` for the next read, if reachable."""
    conn = getattr(response.raw, "connection", None)
    sock = getattr(conn, "sock", None)
    settimeout = getattr(sock, "settimeout", None)
    if settimeout is not None:
        try:
            settimeout(max(seconds, 0.001))
        except OSError:
            pass


def read_body(
    response: requests.Response,
    *,
    max_bytes: int,
    deadline: float,
    max_raw_bytes: int | None = None,
) -> bytes:
    """Reads a streamed response's body, decoded, within a size cap and a deadline.

    Shared by :func:`fetch_messages`, :func:`fetch_image` and ``horde.py``.

    Args:
        response: a response from a ``stream=True`` request, not read yet.
        max_bytes: the most decoded bytes accepted.
        deadline: ``time.monotonic()`` value after which reading stops.
        max_raw_bytes: the most bytes read off the wire; by default ``max_bytes``
            plus 1 % and 64 KiB (compressed incompressible data is slightly larger).

    Returns:
        The body decoded by its ``Content-Encoding`` (identity, gzip with one or
        more members, or deflate).

    Raises:
        FetchError: over either cap (``Content-Length`` alone can tell), past the
            deadline, an unsupported or invalid encoding, or a network error
            while reading. Messages name no URL.
    """
    if max_raw_bytes is None:
        max_raw_bytes = max_bytes + max_bytes // 100 + 64 * 1024
    encoding = _content_encoding(response)
    declared = response.headers.get("Content-Length", "")
    if declared.strip().isdigit() and int(declared) > max_raw_bytes:
        raise FetchError(f"body of {int(declared)} bytes exceeds {max_raw_bytes} bytes")
    decoder = _BodyDecoder(encoding, max_bytes)
    raw = response.raw
    read1 = getattr(raw, "read1", None)  # urllib3 >= 2: returns after one socket read
    raw_total = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FetchError(f"body not received in time ({raw_total} bytes read)")
        _set_socket_timeout(response, remaining)
        try:
            if read1 is not None:
                chunk = read1(CHUNK_BYTES, decode_content=False)
            else:  # pragma: no cover - urllib3 1.26
                chunk = raw.read(CHUNK_BYTES, decode_content=False)
        except (
            urllib3.exceptions.HTTPError,
            requests.exceptions.RequestException,
            http.client.HTTPException,
            OSError,
        ) as exc:
            if isinstance(exc, urllib3.exceptions.ReadTimeoutError | TimeoutError):
                raise FetchError(f"body not received in time ({raw_total} bytes read)") from None
            raise FetchError(f"body read failed: {netfail.describe(exc)}") from None
        if not chunk:
            break
        raw_total += len(chunk)
        if raw_total > max_raw_bytes:
            raise FetchError(f"body exceeds {max_raw_bytes} bytes on the wire")
        decoder.feed(chunk)
    if time.monotonic() > deadline:
        raise FetchError(f"body not received in time ({raw_total} bytes read)")
    body = decoder.finish()
    # The body was read to its end: hand the connection back to the pool for
    # keep-alive (``response.close()`` would close it, since requests did not
    # consume the content itself).
    release = getattr(raw, "release_conn", None)
    if release is not None:
        release()
    return body


# --- fetches --------------------------------------------------------------------


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


def _fetch(
    url: str,
    *,
    what: str,
    accept: str,
    timeout_s: float,
    max_bytes: int,
    session: requests.Session | None,
) -> bytes:
    """GETs ``url`` under the module's rules and returns the decoded body."""
    start = time.monotonic()
    deadline = start + timeout_s
    own = session is None
    sess = requests.Session() if session is None else session
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
        Its elements are not validated here (``jobs.validate_messages`` does).

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
    )
    if not data:
        raise FetchError(f"image URL {redact_url(url)}: empty body")
    return data
