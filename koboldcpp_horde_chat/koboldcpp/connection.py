"""koboldcpp's connections: a streamed answer read raw from the socket, and the
generation request in flight, which another thread can hang up.

Hanging up is how a batched generation is stopped: with ``--parallelrequests`` > 1
an abort by genkey stops nothing (it sets the single-slot flag only; koboldcpp
1.116.1 ``koboldcpp.py`` L6532-6541, ``gpttype_adapter.cpp`` L3802-3809). koboldcpp
ends a streamed generation whose client hung up (L5752-5753); a non-streamed one
runs on to its end (L5798-5812), but the worker is free at once.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import requests

from .. import netfail
from ..errors import BackendError
from ..inflight import Call

log = logging.getLogger("koboldcpp_horde_chat.backend")

#: Characters of an error body kept in an error message.
DETAIL_CHARS = 200
STREAM_READ_BYTES = 65536


class BackendStream:
    """An open ``text/event-stream`` answer from ``/v1/chat/completions``.

    koboldcpp streams over HTTP/1.0 and closes the connection at the end (1.116.1
    L5764-5768), so the body is read raw. :meth:`close` may come from another
    thread while :meth:`read_chunk` blocks: it shuts the socket down to wake it.
    """

    def __init__(self, response: requests.Response, *, password: str = "") -> None:
        self._response = response
        self._password = password
        self._closed = threading.Event()
        self._lock = threading.Lock()
        raw = response.raw
        connection = getattr(raw, "_connection", None) or getattr(raw, "connection", None)
        sock = getattr(connection, "sock", None)
        self._sock = sock if isinstance(sock, socket.socket) else None

    def read_chunk(self) -> bytes:
        """The bytes arrived (up to 64 KiB), as soon as there is one; ``b""`` at the end
        or after :meth:`close`. Raises BackendError on a read timeout or a reset."""
        if self._closed.is_set():
            return b""
        raw = self._response.raw
        try:
            read1 = getattr(raw, "read1", None)
            if read1 is not None:
                data = read1(STREAM_READ_BYTES)
            else:  # urllib3 < 2: read the http.client response directly
                fp = getattr(raw, "_fp", None)
                data = fp.read1(STREAM_READ_BYTES) if fp is not None else b""
        except Exception as exc:  # a close() from another thread races with this read
            if self._closed.is_set():
                return b""
            problem = describe_failure(exc, "reading the chat stream", self._password)
            raise BackendError(problem) from None
        if self._closed.is_set():
            return b""
        return bytes(data or b"")

    def close(self) -> None:
        """Close the connection; safe twice and from another thread."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        # Shut the socket down first: a close() alone does not wake a reader
        # blocked in recv() on another thread.
        try:
            self._response.raw.shutdown()
        except Exception:  # urllib3 < 2.3 has no shutdown(); older ones raise
            if self._sock is not None:
                with suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._response.close()
        except Exception:  # closing under a concurrent read may trip http.client
            log.debug("closing the chat stream raised", exc_info=True)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


class InFlight(Call):
    """The generation request a ``KoboldClient`` has in flight, and the last stream it
    opened; every field under ``lock``."""

    def __init__(self) -> None:
        super().__init__()
        self.stream: BackendStream | None = None

    def hang_up(self) -> bool:
        with self.lock:
            stream, self.stream = self.stream, None
        hung = super().hang_up()
        if stream is not None and not stream.closed:
            stream.close()
            hung = True
        return hung

    @contextmanager
    def generation(self, what: str, cancel: threading.Event | None) -> Iterator[None]:
        """Around one generation request on this thread, so :meth:`hang_up` can end it.
        Armed before ``cancel`` is read: a job given up is never sent or hung up."""
        with self.lock:
            self.stream = None
        with self.running():
            try:
                if cancel is not None and cancel.is_set():
                    raise BackendError(f"{what}: not sent, the job was given up")
                yield
            except BackendError:
                with self.lock:
                    hung_up = self.hung_up
                if hung_up:
                    raise BackendError(f"{what}: hung up by the worker") from None
                raise


def describe_failure(exc: BaseException, what: str, password: str) -> str:
    """``"<what> <what went wrong>"`` (``"GET /api/v1/model connection failed
    (refused)"``), never the exception's text; the password masked all the same."""
    return mask(f"{what} {netfail.describe(exc)}", password)


def mask(text: str, password: str) -> str:
    """``text`` with the password, when there is one, written ``***``."""
    return text.replace(password, "***") if password else text


def error_detail(raw: bytes) -> str:
    """A short description of an error body, led by a space (koboldcpp's
    ``detail.msg`` when present); ``""`` for an empty body."""
    if not raw.strip():
        return ""
    try:
        decoded = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return " " + repr(raw[:DETAIL_CHARS].decode("utf-8", "replace"))
    if isinstance(decoded, dict):
        detail = decoded.get("detail")
        if isinstance(detail, dict) and isinstance(detail.get("msg"), str):
            return " " + str(detail["msg"])[:DETAIL_CHARS]
        if isinstance(decoded.get("message"), str):
            return " " + str(decoded["message"])[:DETAIL_CHARS]
    return " " + json.dumps(decoded)[:DETAIL_CHARS]
