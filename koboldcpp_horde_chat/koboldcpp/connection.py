"""koboldcpp's connections: a streamed answer read from the socket, and a
generation request that another thread can hang up (I/O edge, for ``koboldcpp.client``).

:class:`BackendStream` reads a Server-Sent Events answer raw and may be closed
from another thread. The tracked connection classes (``inflight``) tell the
generation call in flight (:class:`InFlight`) which connection it sends on, so that
``KoboldClient.hang_up`` can shut that socket down from another thread: with
koboldcpp batching, an abort by genkey stops nothing.

``KoboldClient.hang_up`` closes the connection of the generation request
in flight. With koboldcpp batching (``--parallelrequests`` > 1) an abort by
genkey stops nothing: ``/api/extra/abort`` only sets the single-slot abort flag,
which batched requests never check (koboldcpp 1.116.1 ``koboldcpp.py``
L6532-6541, ``gpttype_adapter.cpp`` L3802-3809 against L4443). koboldcpp ends
a batched *streamed* generation when its client hangs up (``koboldcpp.py``
L5752-5753); a non-streamed one runs on to its end whatever the client does
(no disconnect check outside streams, L5798-5812), but the hang-up still
frees the worker at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import requests

from .. import netfail
from ..errors import BackendError
from ..inflight import Call

log = logging.getLogger("koboldcpp_horde_chat.backend")

#: Characters of an error body kept in an error message.
DETAIL_CHARS = 200

STREAM_READ_BYTES = 65536
"""The most bytes one :meth:`BackendStream.read_chunk` returns."""


class BackendStream:
    """An open ``text/event-stream`` answer from ``/v1/chat/completions``.

    koboldcpp streams over HTTP/1.0 without chunked encoding and closes the
    connection at the end (1.116.1 ``koboldcpp.py`` L5764-5768), so the body is read raw:
    :meth:`read_chunk` returns whatever has arrived (up to 64 KiB) as soon as
    anything arrives, and ``b""`` at the end of the stream. Decode the bytes
    with ``sse.SSEDecoder``.

    :meth:`close` may be called from another thread while :meth:`read_chunk`
    blocks: it shuts the socket down, which wakes the reader; ``read_chunk``
    then returns ``b""``. Usable as a context manager.
    """

    def __init__(self, response: requests.Response, *, password: str = "") -> None:
        self._response = response
        self._password = password
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sock = socket_of(response)

    @property
    def status(self) -> int:
        """The HTTP status (200)."""
        return int(self._response.status_code)

    @property
    def headers(self) -> dict[str, str]:
        """The response headers (as received)."""
        return dict(self._response.headers)

    def read_chunk(self) -> bytes:
        """The next bytes of the stream, ``b""`` at its end or after :meth:`close`.

        Returns as soon as at least one byte has arrived, never waiting to fill
        a fixed size. Raises ``BackendError`` (status 0) on a read timeout (the
        client's ``read_timeout_s`` without a byte), a reset or a broken
        connection.
        """
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
        """Close the connection; safe to call twice and from another thread."""
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
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            self._response.close()
        except Exception:  # closing under a concurrent read may trip http.client
            log.debug("closing the chat stream raised", exc_info=True)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed.is_set()

    def __enter__(self) -> BackendStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class InFlight(Call):
    """The generation request a :class:`KoboldClient` has in flight (for ``hang_up``).

    A :class:`~..inflight.Call` (``active``, ``thread``, ``conn``) that also
    keeps ``stream``, the last stream :meth:`KoboldClient.open_chat_stream`
    opened. Every field is read and written under ``lock``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stream: BackendStream | None = None

    def hang_up(self) -> bool:
        """Close the connection of the generation request in flight (any thread);
        True when something was hung up (see ``KoboldClient.hang_up``)."""
        with self.lock:
            stream, self.stream = self.stream, None
        hung = super().hang_up()
        if stream is not None and not stream.closed:
            stream.close()
            hung = True
        return hung

    @contextmanager
    def generation(self, what: str, cancel: threading.Event | None) -> Iterator[None]:
        """Around one generation request on this thread: :meth:`hang_up` can end it.

        Armed before ``cancel`` is looked at, so that a job given up (``cancel``
        set, then :meth:`hang_up`) is either never sent or hung up.

        Raises:
            BackendError: ``cancel`` was set (nothing sent), or the request
                failed ("hung up by the worker" after :meth:`hang_up`).
        """
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


def socket_of(response: requests.Response) -> socket.socket | None:
    """The socket under a streamed response, when urllib3 exposes it."""
    raw = response.raw
    connection = getattr(raw, "_connection", None) or getattr(raw, "connection", None)
    sock = getattr(connection, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def describe_failure(exc: BaseException, what: str, password: str) -> str:
    """``"<what> <what went wrong>"`` in a few words, e.g. ``"GET /api/v1/model
    connection failed (refused)"`` or ``"reading the chat stream timed out"``.

    Only the exception's type and what it wraps are described
    (:func:`.netfail.describe`), never its text; the password is masked all the same.
    """
    message = f"{what} {netfail.describe(exc)}"
    if password:
        message = message.replace(password, "***")
    return message


def ca_bundle_from_env() -> str | bool:
    """What requests itself would verify with: ``REQUESTS_CA_BUNDLE`` or
    ``CURL_CA_BUNDLE`` when set and not empty, else True (its default bundle)."""
    return os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True


def error_detail(raw: bytes) -> str:
    """A short description of an error body, led by a space: koboldcpp's
    ``detail.msg`` when present; ``""`` for an empty body."""
    return f" {_detail(raw)}" if raw.strip() else ""


def _detail(raw: bytes) -> str:
    try:
        decoded = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return repr(raw[:DETAIL_CHARS].decode("utf-8", "replace"))
    if isinstance(decoded, dict):
        detail = decoded.get("detail")
        if isinstance(detail, dict) and isinstance(detail.get("msg"), str):
            return str(detail["msg"])[:DETAIL_CHARS]
        if isinstance(decoded.get("message"), str):
            return str(decoded["message"])[:DETAIL_CHARS]
    return json.dumps(decoded)[:DETAIL_CHARS]
