"""The Horde client as the worker uses it: the seam a fake Horde implements
(``client.HordeClient`` over HTTP)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class HordeAPI(Protocol):
    """The Horde's text worker routes. Each call returns the decoded JSON answer and
    raises only ``errors.HordeRefusal`` (4xx, a redirect) or ``errors.HordeUnavailable``
    (429, 5xx, no or an unreadable answer); ``timeout_s``: read timeout, seconds."""

    def pop(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]: ...

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]: ...

    def progress(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class FindsUser(Protocol):
    """A Horde client that can read the API key's owner."""

    def find_user(self, *, timeout_s: float) -> dict[str, Any]: ...
