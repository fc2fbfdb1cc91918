"""Incremental Server-Sent Events decoder (pure; no I/O).

koboldcpp streams ``/v1/chat/completions`` as ``text/event-stream``: each event
is ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]\\n\\n`` before
the server closes the connection (koboldcpp 1.116.1 ``koboldcpp.py`` L5348-5353,
L5746, L5767). This module turns the raw bytes of such a stream, in whatever
pieces the socket delivers them, into events. It follows the event-stream
parsing rules of the WHATWG HTML standard ("Server-sent events", "Interpreting
an event stream"):

* The stream is UTF-8. One byte order mark at the very start is dropped. Bytes
  are decoded with ``errors="replace"``, and only once a whole line is in, so a
  character split across two reads is decoded whole.
* A line ends in CR LF, LF or CR. A CR LF pair split across two reads is one
  line end: a CR at the end of a read ends the line, and an LF at the start of
  the next read is then skipped.
* A blank line dispatches the event. A line starting with ``:`` is a comment.
  Otherwise the field name is the text before the first ``:`` and the value the
  text after it, with one leading space removed (no colon: the whole line is the
  name and the value is empty).
* ``data`` appends its value to the data buffer; several ``data`` lines are
  joined with ``"\\n"``. ``event`` sets the event type (``"message"`` when unset
  or empty). ``id`` sets the last event id unless the value contains NUL; the
  last event id carries over to later events, as EventSource's ``lastEventId``
  does. ``retry`` is taken only when it is ASCII digits (milliseconds). Other
  fields are ignored.
* An event whose data buffer is empty (no ``data`` field at all) is not
  dispatched. ``data:`` with an empty value does dispatch an event with
  ``data == ""``.
* At the end of the stream (``close()``) an event that was not ended by a blank
  line is discarded, as the standard requires; ``discarded_partial`` then tells
  the caller that the stream was cut off inside an event.

Speed: lines are found with ``bytes.rfind`` over each read and split with
``str.split`` on the decoded block, never byte by byte in Python; a line that
arrives in many reads is joined once (no quadratic copying). See
``bench/bench_sse.py``.

Seed section: "Streaming progress" (the worker streams the backend's reply to
post it as progress).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import BackendError

log = logging.getLogger("koboldcpp_horde_chat.sse")

_BOM = b"\xef\xbb\xbf"
_LF = 0x0A
_CR = 0x0D
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
"""A line longer than this (bytes) makes ``feed`` raise ``BackendError``."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event.

    Attributes:
        data: the event's data lines joined with ``"\\n"`` (for koboldcpp, one
            JSON text or ``"[DONE]"``).
        event: the event type; ``"message"`` when the stream sent no ``event``.
        id: the last event id set by the stream so far (it carries over between
            events), or None when the stream never sent an ``id`` field.
        retry: the reconnection time in milliseconds from a valid ``retry`` field
            seen since the previous blank line, or None.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Turns the bytes of one event stream into :class:`SSEEvent` objects.

    Usage: call ``feed(chunk)`` with each read (``bytes``; any split, including
    inside a UTF-8 character or between the CR and LF of a line end) and handle
    the events it returns, then ``close()`` at the end of the stream.

    Attributes:
        retry_ms: the last valid ``retry`` value of the stream (milliseconds), or None.
        last_event_id: the last event id buffer (None until an ``id`` field arrives).
        discarded_partial: set by ``close()`` when the stream ended inside an
            event or a line (that event was discarded).
    """

    def __init__(self, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        """``max_line_bytes``: longest line accepted (bytes); longer raises ``BackendError``."""
        self._max_line_bytes = max_line_bytes
        self._pending: list[bytes] = []  # an unterminated line, in pieces
        self._pending_len = 0
        self._skip_lf = False  # the previous read ended in CR
        self._bom_done = False
        self._head = b""  # the first bytes while the BOM check waits for three
        self._data: list[str] = []
        self._event_type = ""
        self._event_retry: int | None = None
        self._closed = False
        self.retry_ms: int | None = None
        self.last_event_id: str | None = None
        self.discarded_partial = False

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Decode one read of the stream.

        Args:
            data: the next bytes of the stream, any length (``b""`` is allowed).

        Returns:
            The events completed by these bytes, in stream order (often empty).

        Raises:
            BackendError: a line grew past ``max_line_bytes``.
            ValueError: called after ``close()``.
        """
        if self._closed:
            raise ValueError("SSEDecoder.feed() after close()")
        if not data:
            return []
        if not self._bom_done:
            head = self._head + data
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._head = head
                return []
            self._bom_done = True
            self._head = b""
            data = head[len(_BOM) :] if head.startswith(_BOM) else head
            if not data:
                return []
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == _LF:
                data = data[1:]
                if not data:
                    return []
        end = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if end < 0:
            self._keep(data)
            return []
        if self._pending:
            self._pending.append(data[: end + 1])
            block = b"".join(self._pending)
            self._pending = []
            self._pending_len = 0
        else:
            block = data[: end + 1] if end + 1 < len(data) else data
        if end + 1 < len(data):
            self._keep(data[end + 1 :])
        elif data[end] == _CR:
            self._skip_lf = True
        text = block.decode("utf-8", "replace")
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        lines = text.split("\n")
        lines.pop()  # the block ends with a line end, so the last item is ""
        return self._lines(lines)

    def close(self) -> list[SSEEvent]:
        """End the stream.

        Returns:
            Always an empty list: per the standard an event not ended by a blank
            line is discarded (``discarded_partial`` tells whether one was).
            Calling ``close()`` twice is allowed.
        """
        if self._closed:
            return []
        self._closed = True
        if self._pending or self._data or self._event_type or self._head:
            self.discarded_partial = True
            log.debug(
                "event stream ended inside an event; discarded %d unterminated bytes "
                "and %d data lines",
                self._pending_len + len(self._head),
                len(self._data),
            )
        self._pending = []
        self._pending_len = 0
        self._data = []
        self._event_type = ""
        return []

    def _keep(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._pending_len += len(piece)
        if self._pending_len > self._max_line_bytes:
            self._pending = []
            self._pending_len = 0
            raise BackendError(
                f"event stream line longer than {self._max_line_bytes} bytes"
            )

    def _lines(self, lines: list[str]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    events.append(
                        SSEEvent(
                            "\n".join(data),
                            self._event_type or "message",
                            self.last_event_id,
                            self._event_retry,
                        )
                    )
                    data = self._data = []
                self._event_type = ""
                self._event_retry = None
                continue
            if line.startswith("data:"):
                # The common case, handled without the general field split.
                data.append(line[6:] if line.startswith("data: ") else line[5:])
                continue
            if line[0] == ":":
                continue
            colon = line.find(":")
            if colon < 0:
                field, value = line, ""
            else:
                field, value = line[:colon], line[colon + 1 :]
                if value.startswith(" "):
                    value = value[1:]
            if field == "data":
                data.append(value)
            elif field == "event":
                self._event_type = value
            elif field == "id":
                if "\x00" not in value:
                    self.last_event_id = value
            elif field == "retry":
                if value and value.isascii() and value.isdigit():
                    self._event_retry = self.retry_ms = int(value)
        return events
