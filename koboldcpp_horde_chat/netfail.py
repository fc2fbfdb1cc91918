"""Network failures in a few words, for the I/O edges' error messages.

``horde/client.py``, ``koboldcpp/client.py`` and ``run/downloads.py`` describe a ``requests`` or
``urllib3`` exception with these helpers instead of its own text, which names
connection pools, retry counts and object addresses (and may quote a URL).
Only the exception's *type* and the exceptions it wraps are looked at, never
its message, so nothing the HTTP library or a proxy wrote reaches a log line.

* :func:`cause` gives the cause alone: ``"refused"``, ``"reset"``,
  ``"timed out"``, ``"host name not found"``, ``"certificate not trusted"``...
  or ``""`` when nothing more precise is known.
* :func:`describe` gives the phrase an edge puts after what it was doing:
  ``"connection failed (refused)"``, ``"timed out"``, ``"TLS certificate not
  trusted"``, ``"connection failed"``...

Seed section: "7. Fault a job" (a failure is logged in one line, without
secrets).
"""

from __future__ import annotations

import errno
import http.client
import socket
import ssl

import requests
import urllib3.exceptions

__all__ = ["cause", "describe"]

TIMED_OUT = "timed out"
CERTIFICATE_NOT_TRUSTED = "certificate not trusted"
TLS_FAILED = "TLS failed"

_CUT_SHORT: tuple[type[BaseException], ...] = (
    http.client.IncompleteRead,
    urllib3.exceptions.IncompleteRead,
    urllib3.exceptions.InvalidChunkLength,
    requests.exceptions.ChunkedEncodingError,
)
_PROXY: tuple[type[BaseException], ...] = (
    requests.exceptions.ProxyError,
    urllib3.exceptions.ProxyError,
)
_NAME_NOT_FOUND: tuple[type[BaseException], ...] = (
    socket.gaierror,
    # urllib3 2 wraps a DNS failure in this NewConnectionError subclass.
    getattr(urllib3.exceptions, "NameResolutionError", socket.gaierror),
)
_ERRNO_CAUSES = {
    errno.ECONNREFUSED: "refused",
    errno.ECONNRESET: "reset",
    errno.ECONNABORTED: "reset",
    errno.EPIPE: "reset",
    errno.ENETUNREACH: "network unreachable",
    errno.EHOSTUNREACH: "host unreachable",
}


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it wraps (causes, contexts, ``reason``, args), outer first."""
    found: list[BaseException] = []
    seen: set[int] = set()
    queue: list[object] = [exc]
    while queue:
        item = queue.pop(0)
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        found.append(item)
        queue.extend(arg for arg in item.args if isinstance(arg, BaseException))
        queue.extend([getattr(item, "reason", None), item.__cause__, item.__context__])
    return found


def _cause_of(item: BaseException) -> str:
    """The cause one exception names by its type (or errno), or ""."""
    if isinstance(item, ssl.SSLCertVerificationError):
        return CERTIFICATE_NOT_TRUSTED
    if isinstance(item, (ssl.SSLError, requests.exceptions.SSLError, urllib3.exceptions.SSLError)):
        return TLS_FAILED
    if isinstance(item, ConnectionRefusedError):
        return "refused"
    if isinstance(item, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return "reset"  # http.client.RemoteDisconnected is a ConnectionResetError
    if isinstance(item, _NAME_NOT_FOUND):
        return "host name not found"
    if isinstance(item, urllib3.exceptions.NewConnectionError):
        return ""  # a ConnectTimeoutError by inheritance only: its cause is wrapped in it
    if isinstance(
        item,
        (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError),
    ):
        return TIMED_OUT
    if isinstance(item, _CUT_SHORT):
        return "cut short"
    if isinstance(item, OSError) and item.errno in _ERRNO_CAUSES:
        return _ERRNO_CAUSES[item.errno]
    return ""


def cause(exc: BaseException) -> str:
    """Why a request or a read failed, in a few words, from ``exc``'s type and what it wraps.

    Returns one of ``"refused"``, ``"reset"`` (the other end closed the
    connection, with or without an answer), ``"timed out"``, ``"host name not
    found"``, ``"network unreachable"``, ``"host unreachable"``, ``"cut short"``
    (the answer ended early), ``"certificate not trusted"``, ``"TLS failed"``,
    or ``""``; prefixed with ``"proxy "`` (``"proxy"`` alone) when the failure
    is the proxy's. The exception's own message is never read.
    """
    chain = _chain(exc)
    causes = [found for found in map(_cause_of, chain) if found]
    found = causes[0] if causes else ""  # the outermost: later ones may be stale contexts
    if found == TLS_FAILED and CERTIFICATE_NOT_TRUSTED in causes:
        found = CERTIFICATE_NOT_TRUSTED
    if any(isinstance(item, _PROXY) for item in chain):
        return f"proxy {found}" if found else "proxy"
    return found


def describe(exc: BaseException) -> str:
    """What went wrong, as an edge appends it to what it was doing.

    ``"timed out"``, ``"TLS certificate not trusted"``, ``"TLS failed"``,
    ``"connection failed (refused)"``, ``"connection failed (reset)"``,
    ``"connection failed (host name not found)"``, ``"connection failed (proxy
    refused)"``, ``"connection failed"`` (a connection error of no known cause)
    or ``"failed"`` (anything else). Never contains the exception's own text.
    """
    why = cause(exc)
    if why == TIMED_OUT:
        return TIMED_OUT
    if why == CERTIFICATE_NOT_TRUSTED:
        return "TLS certificate not trusted"
    if why == TLS_FAILED:
        return TLS_FAILED
    if why:
        return f"connection failed ({why})"
    if isinstance(
        exc,
        (
            requests.exceptions.ConnectionError,
            urllib3.exceptions.ProtocolError,
            http.client.HTTPException,
        ),
    ) or (isinstance(exc, OSError) and not isinstance(exc, requests.RequestException)):
        return "connection failed"
    return "failed"
