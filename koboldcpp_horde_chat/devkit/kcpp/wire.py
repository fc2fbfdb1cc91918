"""The HTTP exchange as koboldcpp's server writes it: HTTP/1.0, headers in the
recorded order, JSON answers, Server-Sent Events, a reset, a client gone.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast

from koboldcpp_horde_chat.devkit.kcpp.values import _CORS_HEADERS

if TYPE_CHECKING:
    from koboldcpp_horde_chat.devkit.kcpp import ScriptedKoboldcpp

log = logging.getLogger("koboldcpp_horde_chat.devkit.kcpp")


class _ClientGone(Exception):
    """The client closed the connection during a stream."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], kcpp: ScriptedKoboldcpp) -> None:
        self.kcpp = kcpp
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server_version = "KoboldCppServer"
    sys_version = "1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        log.debug("scripted koboldcpp: " + format, *args)

    def setup(self) -> None:
        super().setup()
        server = cast(_Server, self.server)
        with server.sockets_lock:
            server.open_sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            server = cast(_Server, self.server)
            with server.sockets_lock:
                server.open_sockets.discard(self.connection)

    def _dispatch(self) -> None:
        cast(_Server, self.server).kcpp._handle(self)

    do_GET = _dispatch
    do_POST = _dispatch

    def do_OPTIONS(self) -> None:  # noqa: N802 - stdlib name
        self.send_response(200)
        for name, value in _CORS_HEADERS:
            self.send_header(name, value)
        self.send_header("content-length", "0")
        self.end_headers()


class _Exchange:
    """One request: its handler, parsed body and any injected fault mode."""

    def __init__(self, handler: _Handler, route: str, body: Any, raw: bytes) -> None:
        self.h = handler
        self.route = route
        self.body = body
        self.raw = raw
        self.cut: str | None = None  # "truncate" or "stream_cut"
        self.stream_fault: str | None = None  # "stream_error", "no_finish" or "stall:<s>"

    @property
    def sock(self) -> socket.socket:
        return cast(socket.socket, self.h.connection)

    def header(self, name: str) -> str:
        return str(self.h.headers.get(name, ""))

    def send_json(self, status: int, obj: Any) -> None:
        payload = (
            obj
            if isinstance(obj, bytes)
            else (obj.encode("utf-8") if isinstance(obj, str) else json.dumps(obj).encode("utf-8"))
        )
        h = self.h
        try:
            h.send_response(status)
            h.send_header("content-length", str(len(payload)))
            for name, value in _CORS_HEADERS:
                h.send_header(name, value)
            h.send_header("cache-control", "no-store")
            h.send_header("content-type", "application/json")
            h.end_headers()
            if self.cut is not None:
                h.wfile.write(payload[: len(payload) // 2])
                h.close_connection = True
                return
            h.wfile.write(payload)
        except OSError:
            h.close_connection = True

    def start_sse(self) -> None:
        h = self.h
        h.send_response(200)
        h.send_header("X-Accel-Buffering", "no")
        h.send_header("cache-control", "no-cache")
        h.send_header("connection", "keep-alive")
        for name, value in _CORS_HEADERS:
            h.send_header(name, value)
        h.send_header("cache-control", "no-store")
        h.send_header("content-type", "text/event-stream")
        h.end_headers()
        h.close_connection = True  # HTTP/1.0: the stream ends when the connection closes
        h.wfile.flush()

    def write(self, data: bytes) -> None:
        try:
            self.h.wfile.write(data)
            self.h.wfile.flush()
        except OSError as exc:
            raise _ClientGone() from exc

    def client_gone(self) -> bool:
        """True when the peer closed its end (checked without blocking)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def reset(self) -> None:
        """Close with a TCP reset and no answer."""
        self.h.close_connection = True
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
        except OSError:
            pass
