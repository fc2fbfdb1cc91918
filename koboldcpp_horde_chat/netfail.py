"""Network failures in a few words, for the I/O edges' error messages.

Only an exception's type and the exceptions it wraps are read, never its
message, which may name connection pools or quote a URL.
"""

from __future__ import annotations

import errno
import http.client
import socket
import ssl

import requests
import urllib3.exceptions

TIMED_OUT = "timed out"
CERTIFICATE_NOT_TRUSTED = "certificate not trusted"
TLS_FAILED = "TLS failed"

#: Errors without an OSError subclass of their own (OSError(ECONNRESET, ...) makes a
#: ConnectionResetError, named below by its type).
_ERRNO_CAUSES = {errno.ENETUNREACH: "network unreachable", errno.EHOSTUNREACH: "host unreachable"}


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    queue: list[object] = [exc]
    while queue:
        item = queue.pop(0)
        if isinstance(item, BaseException) and not any(item is seen for seen in found):
            found.append(item)
            queue.extend(arg for arg in item.args if isinstance(arg, BaseException))
            queue.extend([getattr(item, "reason", None), item.__cause__, item.__context__])
    return found


#: The cause an exception names by its type, first match wins.
_CAUSES: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
    (ssl.SSLCertVerificationError, CERTIFICATE_NOT_TRUSTED),
    ((ssl.SSLError, requests.exceptions.SSLError, urllib3.exceptions.SSLError), TLS_FAILED),
    (ConnectionRefusedError, "refused"),
    # http.client.RemoteDisconnected is a ConnectionResetError
    ((ConnectionResetError, ConnectionAbortedError, BrokenPipeError), "reset"),
    # urllib3 2's NameResolutionError is raised from the socket.gaierror
    (socket.gaierror, "host name not found"),
    # a ConnectTimeoutError by inheritance only: its cause is wrapped in it
    (urllib3.exceptions.NewConnectionError, ""),
    ((requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError), TIMED_OUT),
    # urllib3's IncompleteRead and InvalidChunkLength are http.client's
    (http.client.IncompleteRead, "cut short"),
)


def _cause_of(item: BaseException) -> str:
    for kinds, found in _CAUSES:
        if isinstance(item, kinds):
            return found
    if isinstance(item, OSError) and item.errno in _ERRNO_CAUSES:
        return _ERRNO_CAUSES[item.errno]
    return ""


def cause(exc: BaseException) -> str:
    """Why a request or a read failed (``"refused"``, ``"reset"``, ``"timed out"``,
    ``"cut short"``...), or ``""``; prefixed with ``"proxy "`` when the proxy failed."""
    chain = _chain(exc)
    causes = [found for found in map(_cause_of, chain) if found]
    found = causes[0] if causes else ""  # the outermost: later ones may be stale contexts
    if found == TLS_FAILED and CERTIFICATE_NOT_TRUSTED in causes:
        found = CERTIFICATE_NOT_TRUSTED
    # requests' ProxyError always wraps urllib3's
    if any(isinstance(item, urllib3.exceptions.ProxyError) for item in chain):
        return f"proxy {found}" if found else "proxy"
    return found


def describe(exc: BaseException) -> str:
    """What went wrong, as an edge appends it to what it was doing: ``"timed out"``,
    ``"connection failed (refused)"``, ``"connection failed"``, ``"failed"``..."""
    why = cause(exc)
    if why in (TIMED_OUT, TLS_FAILED):
        return why
    if why == CERTIFICATE_NOT_TRUSTED:
        return "TLS certificate not trusted"
    if why:
        return f"connection failed ({why})"
    lost = (requests.exceptions.ConnectionError, urllib3.exceptions.ProtocolError,
            http.client.HTTPException)
    oserror = isinstance(exc, OSError) and not isinstance(exc, requests.RequestException)
    return "connection failed" if oserror or isinstance(exc, lost) else "failed"
