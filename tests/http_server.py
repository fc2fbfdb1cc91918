"""A tiny real HTTP/1.1 server on an ephemeral 127.0.0.1 port, for client tests."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Seconds between the server loop's checks for a shutdown: ``stop`` waits about this long.
POLL_S = 0.02


class LocalServer:
    """A threaded HTTP/1.1 server for GETs and POSTs, used as a context manager.

    ``script(handler, body)`` answers each request (``body``: the request body,
    ``b""`` for a GET); a peer that hangs up while it writes is ignored.
    ``seen`` records (path, lower-cased headers) of each request (a proxy's
    request names the whole URL); ``bodies`` each request's body, in the same
    order; ``connections`` counts TCP connections accepted; ``sent`` is free
    for a script to count the body bytes it wrote. With ``tls`` it serves
    https (its ``url`` then says so).
    """

    def __init__(
        self,
        script: Callable[[BaseHTTPRequestHandler, bytes], None],
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        outer = self
        self.seen: list[tuple[str, dict[str, str]]] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.sent = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def _answer(self, body: bytes) -> None:
                outer.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                outer.bodies.append(body)
                try:
                    script(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:  # noqa: N802
                self._answer(b"")

            def do_POST(self) -> None:  # noqa: N802
                self._answer(self.rfile.read(int(self.headers.get("Content-Length", "0"))))

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True
        )

    def __enter__(self) -> LocalServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def send_json(handler: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
    """Answer with ``obj`` as JSON (``Content-Type: application/json``, its length)."""
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
