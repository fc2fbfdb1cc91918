"""Incremental Server-Sent Events decoder (pure), for koboldcpp's chat stream
(``data: <json>`` events, ``data: [DONE]`` last; 1.116.1 L5348-5353).

It follows the WHATWG "Interpreting an event stream" rules: UTF-8 with one leading
BOM dropped, decoded a whole line at a time; CR LF, LF or CR end a line (also a CR
LF split across reads); a blank line dispatches the event, unless no ``data`` came;
``:`` starts a comment; ``id`` carries over between events; ``retry`` only as ASCII
digits; an event not ended by a blank line is discarded at ``close()``. Lines are
found with ``rfind`` and ``split`` over each read, never byte by byte
(``bench/bench_sse.py``).
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


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event; ``retry`` in milliseconds, from this event's fields."""

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Turns the bytes of one event stream, split anywhere, into :class:`SSEEvent`
    objects: ``feed`` each read, then ``close()``. ``discarded_partial`` tells that
    the stream ended inside an event. A line over ``max_line_bytes`` raises
    ``BackendError``."""

    def __init__(self, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self._max_line_bytes = max_line_bytes
        self._pending = bytearray()  # an unterminated line
        self._skip_lf = False  # the previous read ended in CR
        # The first bytes while the BOM check waits for three (None: checked).
        self._head: bytes | None = b""
        self._data: list[str] = []
        self._event_type = ""
        self._event_retry: int | None = None
        self._closed = False
        self.retry_ms: int | None = None
        self.last_event_id: str | None = None
        self.discarded_partial = False

    def feed(self, data: bytes) -> list[SSEEvent]:
        """The events these bytes complete, in order. ValueError after ``close()``."""
        if self._closed:
            raise ValueError("SSEDecoder.feed() after close()")
        if self._head is not None:
            head = self._head + data
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._head = head
                return []
            self._head = None
            data = head.removeprefix(_BOM)
        if self._skip_lf and data:
            self._skip_lf = False
            if data[0] == _LF:
                data = data[1:]
        if not data:
            return []
        end = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if end < 0:
            self._keep(data)
            return []
        block: bytes | bytearray = data[: end + 1]  # the whole read when it ends a line
        if self._pending:
            block, self._pending = self._pending + block, bytearray()
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
        """End the stream (twice is allowed); always ``[]``, as the standard discards
        an unended event."""
        if self._closed:
            return []
        self._closed = True
        if self._pending or self._data or self._event_type or self._head:
            self.discarded_partial = True
            log.debug(
                "event stream ended inside an event; discarded %d unterminated bytes "
                "and %d data lines",
                len(self._pending) + len(self._head or b""),
                len(self._data),
            )
        return []

    def _keep(self, piece: bytes) -> None:
        self._pending += piece
        if len(self._pending) > self._max_line_bytes:
            self._pending = bytearray()
            raise BackendError(f"event stream line longer than {self._max_line_bytes} bytes")

    def _lines(self, lines: list[str]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    kind, retry = self._event_type or "message", self._event_retry
                    events.append(SSEEvent("\n".join(data), kind, self.last_event_id, retry))
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
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "data":
                data.append(value)
            elif field == "event":
                self._event_type = value
            elif field == "id" and "\x00" not in value:
                self.last_event_id = value
            elif field == "retry" and value and value.isascii() and value.isdigit():
                self._event_retry = self.retry_ms = int(value)
        return events
