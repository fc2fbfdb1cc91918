"""A response body read in chunks, decoded and bounded within a deadline; a URL
redacted for errors and logs (I/O helpers of the three I/O edges).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import time
import zlib
from typing import Any, Final
from urllib.parse import urlsplit

import requests
import urllib3.exceptions

from . import netfail
from .errors import FetchError
from .inflight import TrackingAdapter

CHUNK_BYTES: Final = 64 * 1024  # raw bytes asked for per read


def redact_url(url: str) -> str:
    """``url`` as ``scheme://host[:port]/path``: a signed URL's signature is in its query."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return "<unparsable URL>"
    netloc = f"[{host}]" if ":" in host else host
    netloc += "" if port is None else f":{port}"
    return f"{parts.scheme}://{netloc}{parts.path}"


def tracked_session() -> requests.Session:
    """A session whose calls in flight can be hung up, reading nothing from the
    environment per call (the CA bundle once, here) and never ``.netrc``."""
    session = requests.Session()
    session.trust_env = False
    env = os.environ
    session.verify = env.get("REQUESTS_CA_BUNDLE") or env.get("CURL_CA_BUNDLE") or True
    adapter = TrackingAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


# --- bounded, decoding body reader --------------------------------------------


class _BodyDecoder:
    """Decodes a raw body incrementally, never holding more than ``max_bytes`` + 1."""

    def __init__(self, encoding: str, max_bytes: int) -> None:
        self.encoding = encoding
        self.max_bytes = max_bytes
        self.out = bytearray()
        self._decomp: Any = None  # zlib decompress object of the current member
        self._head = b""  # deflate: bytes kept until the zlib/raw sniff can run
        self._done = False  # a stream ended (deflate: no data may follow)

    def _append(self, data: bytes) -> None:
        self.out += data
        if len(self.out) > self.max_bytes:
            raise FetchError(f"decoded body exceeds {self.max_bytes} bytes")

    def _inflate(self, buf: bytes) -> bytes:
        """Feed ``buf`` to the current decompressor; its unused tail."""
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
        if self.encoding == "identity":
            self._append(data)
            return
        try:
            while data:
                if self._decomp is None:
                    data = self._start(data)
                    if self._decomp is None:
                        return
                data = self._inflate(data)
                if self._decomp.eof:
                    self._decomp = None
                    self._done = True
        except zlib.error as exc:
            raise FetchError(f"invalid {self.encoding} body ({exc})") from None

    def _start(self, data: bytes) -> bytes:
        """Start the next stream (gzip: member) when ``data`` allows; what is left of it."""
        if self.encoding == "gzip":
            data = data.lstrip(b"\0")  # between members: zero padding, skipped as gzip does
            if data:
                self._decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
            return data
        if self._done:
            raise FetchError("invalid deflate body (data after the end of the stream)")
        self._head += data
        if len(self._head) < 2:
            return b""
        b0, b1 = self._head[0], self._head[1]
        zlib_wrapped = (b0 & 0x0F) == 8 and ((b0 << 8) | b1) % 31 == 0
        # "deflate" should be zlib-wrapped; some servers send a raw stream.
        self._decomp = zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
        data, self._head = self._head, b""
        return data

    def finish(self) -> bytes:
        if self._decomp is not None or self._head:
            raise FetchError(f"truncated {self.encoding} body")
        return bytes(self.out)


#: The codings a body is read in, by its ``Content-Encoding`` without identity.
_CODINGS: Final = {"": "identity", "gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}


def _content_encoding(response: requests.Response) -> str:
    raw = response.headers.get("Content-Encoding", "")
    codings = (c.strip().lower() for c in raw.split(","))
    found = _CODINGS.get(",".join(c for c in codings if c not in ("", "identity")))
    if found is None:
        raise FetchError(f"unsupported Content-Encoding {raw[:40]!r}")
    return found


def _set_socket_timeout(response: requests.Response, seconds: float) -> None:
    sock = getattr(getattr(response.raw, "connection", None), "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.settimeout(max(seconds, 0.001))


def read_body(response: requests.Response, *, max_bytes: int, deadline: float,
              max_raw_bytes: int | None = None) -> bytes:
    """A ``stream=True`` response's body, decoded by its ``Content-Encoding``, by
    ``deadline`` (monotonic seconds).

    At most ``max_bytes`` decoded, and ``max_raw_bytes`` read off the wire (by
    default ``max_bytes`` plus 1 % and 64 KiB: compressed incompressible data is
    slightly larger). FetchError, naming no URL, over either cap, past the
    deadline, for an unsupported or invalid encoding, or a network error.
    """
    if max_raw_bytes is None:
        max_raw_bytes = max_bytes + max_bytes // 100 + 64 * 1024
    decoder = _BodyDecoder(_content_encoding(response), max_bytes)
    declared = response.headers.get("Content-Length", "")
    if declared.strip().isdigit() and int(declared) > max_raw_bytes:
        raise FetchError(f"body of {int(declared)} bytes exceeds {max_raw_bytes} bytes")
    raw = response.raw
    read = getattr(raw, "read1", None) or raw.read  # urllib3 >= 2: after one socket read
    raw_total = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FetchError(f"body not received in time ({raw_total} bytes read)")
        _set_socket_timeout(response, remaining)
        try:
            chunk = read(CHUNK_BYTES, decode_content=False)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
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
    # Read to its end: hand the connection back to the pool for keep-alive
    # (``response.close()`` would close it).
    raw.release_conn()
    return body
