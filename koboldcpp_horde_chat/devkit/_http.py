"""A tiny threaded HTTP server for the devkit's fake services (stdlib only).

The dev Horde and the scripted koboldcpp both run one of these on 127.0.0.1. A
server takes one handler, ``handler(request: Request) -> Response``, called on
the connection's own thread for every request (any method). The handler does
its own routing and locking; it may sleep (to script a slow answer) without
blocking other connections.

A :class:`Response` is sent in one of four ways:

* plain: ``status``, ``headers`` and ``body`` with a ``Content-Length``
  (``Response.json(status, obj)`` builds a compact JSON one);
* ``reset=True``: the connection is closed without any answer, so the client
  sees the remote end disconnect;
* ``truncate=True``: the headers and the first half of ``body`` are sent with
  a ``Content-Length`` of that half, so the exchange is well formed HTTP but the
  body is cut (half a JSON document);
* ``chunks`` set: an iterable of byte strings written and flushed one by one,
  without ``Content-Length`` and with ``Connection: close``; the body ends when
  the connection closes (as koboldcpp's HTTP/1.0 event streams do). The iterable
  may sleep between items. When the client goes away the write fails, the
  iterator is closed (``GeneratorExit`` inside a generator) and ``on_disconnect``
  is called.

Stopping the server also closes every open keep-alive connection, so a client
sees a stopped server as gone even on a pooled connection.

Example::

    def handler(req: Request) -> Response:
        if req.method == "GET" and req.path == "/ping":
            return Response.json(200, {"ok": True})
        return Response.json(404, {"message": "not found"})

    with JSONServer(handler, name="demo") as srv:
        requests.get(srv.url + "/ping").json()  # {"ok": True}
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

__all__ = ["Handler", "JSONServer", "Request", "Response"]

_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass
class Request:
    """One HTTP request as the handler sees it.

    Attributes:
        method: ``"GET"``, ``"POST"``...
        path: the URL path without the query string (``"/api/v2/generate/text/pop"``).
        query: the parsed query string (``{"sig": ["ab12"]}``).
        raw_query: the query string as sent, without ``?`` (``""`` when none).
        headers: the request headers, names lower-cased (``{"apikey": "..."}``).
        body: the raw request body (``b""`` when none).
        client: the peer address ``(host, port)``.
    """

    method: str
    path: str
    query: dict[str, list[str]]
    raw_query: str
    headers: dict[str, str]
    body: bytes
    client: tuple[str, int] = ("", 0)

    def json(self) -> Any:
        """Decode the body as JSON (UTF-8). Raises ``ValueError`` when it is not JSON."""
        return json.loads(self.body.decode("utf-8"))

    def query_value(self, name: str) -> str | None:
        """The first value of query parameter ``name``, or None."""
        values = self.query.get(name)
        return values[0] if values else None


@dataclass
class Response:
    """What the handler answers. See the module docstring for the four modes.

    Attributes:
        status: HTTP status code.
        body: the body bytes (plain and truncated answers).
        headers: extra response headers (``Content-Length`` is set by the server).
        reset: close the connection without answering.
        truncate: send only the first half of ``body``.
        chunks: stream these byte strings, then close the connection.
        on_disconnect: called (no arguments) when the client went away mid-stream.
    """

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    reset: bool = False
    truncate: bool = False
    chunks: Iterable[bytes] | None = None
    on_disconnect: Callable[[], None] | None = None

    @classmethod
    def json(
        cls, status: int, obj: Any, headers: dict[str, str] | None = None
    ) -> Response:
        """A compact JSON answer with ``Content-Type: application/json``."""
        hdrs = {"Content-Type": "application/json"}
        hdrs.update(headers or {})
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return cls(status=status, body=body, headers=hdrs)

    @classmethod
    def close_without_answer(cls) -> Response:
        """The connection is closed and nothing is sent."""
        return cls(status=0, reset=True)


Handler = Callable[[Request], Response]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], handler_cls: type[BaseHTTPRequestHandler], app: Handler
    ) -> None:
        self.app = app
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(address, handler_cls)

    def close_open_sockets(self) -> None:
        with self.sockets_lock:
            socks = list(self.open_sockets)
            self.open_sockets.clear()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _RequestHandler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        try:  # answers go out as headers then body: without this, delayed ACKs cost 40 ms
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        with self.server.sockets_lock:
            self.server.open_sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            with self.server.sockets_lock:
                self.server.open_sockets.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        log.debug("%s %s", self.address_string(), format % args)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            total = 0
            while True:
                size_line = self.rfile.readline(1024)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > _MAX_BODY_BYTES:
                    raise ValueError("request body too large")
                parts.append(self.rfile.read(size))
                self.rfile.readline(1024)
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY_BYTES:
            raise ValueError("request body too large")
        return self.rfile.read(length) if length > 0 else b""

    def _handle(self) -> None:
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            self._send_plain(Response.json(400, {"message": "Unreadable request body."}))
            return
        split = urlsplit(self.path)
        client = self.client_address
        req = Request(
            method=self.command,
            path=split.path,
            query=parse_qs(split.query),
            raw_query=split.query,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
            client=(str(client[0]), int(client[1])),
        )
        try:
            resp = self.server.app(req)
        except Exception:
            log.exception("devkit handler failed on %s %s", req.method, req.path)
            resp = Response.json(500, {"message": "Internal error in the devkit server."})
        if resp.reset:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if resp.chunks is not None:
            self._send_stream(resp)
            return
        self._send_plain(resp)

    def _send_plain(self, resp: Response) -> None:
        body = resp.body
        if resp.truncate:
            body = body[: len(body) // 2]
        try:
            self.send_response(resp.status)
            for name, value in resp.headers.items():
                if name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _send_stream(self, resp: Response) -> None:
        self.close_connection = True
        chunks = resp.chunks
        assert chunks is not None
        iterator = iter(chunks)
        try:
            self.send_response(resp.status)
            for name, value in resp.headers.items():
                if name.lower() not in ("content-length", "connection"):
                    self.send_header(name, value)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            for chunk in iterator:
                if chunk:
                    self.wfile.write(chunk)
                    self.wfile.flush()
        except OSError:
            log.debug("devkit stream client went away on %s", self.path)
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
            if resp.on_disconnect is not None:
                resp.on_disconnect()

    do_GET = _handle
    do_POST = _handle
    do_PUT = _handle
    do_DELETE = _handle
    do_PATCH = _handle
    do_HEAD = _handle


class JSONServer:
    """A threaded HTTP server on ``host:port`` (port 0: an ephemeral port).

    Args:
        handler: ``handler(Request) -> Response``, called on the connection's thread.
        host: the address to bind, ``"127.0.0.1"`` by default.
        port: the port, 0 for an ephemeral one (read it back from ``.port``).
        name: a label for logs and the serving thread.
        protocol_version: ``"HTTP/1.1"`` (keep-alive) or ``"HTTP/1.0"`` (one
            request per connection, as koboldcpp answers).

    ``start()`` binds and serves on a daemon thread; ``stop()`` shuts down, closes
    open connections and joins. Usable as a context manager. ``start()`` after
    ``stop()`` binds again (a new ephemeral port when ``port`` was 0).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "devkit",
        protocol_version: str = "HTTP/1.1",
    ) -> None:
        self._handler = handler
        self._host = host
        self._port = port
        self._name = name
        self._protocol_version = protocol_version
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve in a daemon thread. Raises ``OSError`` if the bind fails."""
        if self._server is not None:
            return
        handler_cls = type(
            "_BoundHandler", (_RequestHandler,), {"protocol_version": self._protocol_version}
        )
        server = _Server((self._host, self._port), handler_cls, self._handler)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name=f"{self._name}-http",
            daemon=True,
        )
        self._thread.start()
        log.info("%s listening on %s", self._name, self.url)

    def stop(self) -> None:
        """Stop serving, close open connections and the listening socket."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = None
        self._thread = None
        server.shutdown()
        server.close_open_sockets()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
        log.info("%s stopped", self._name)

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        return self._server is not None

    @property
    def port(self) -> int:
        """The bound port. Raises ``RuntimeError`` before ``start()``."""
        if self._server is None:
            raise RuntimeError(f"{self._name} is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` without a trailing slash. Raises ``RuntimeError`` before start."""
        return f"http://{self._host}:{self.port}"

    def __enter__(self) -> JSONServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
