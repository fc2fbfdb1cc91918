"""The job journal's file: its entries, its format and the clocks' mark.

The file (version 2, ASCII JSON)::

    {"version": 2,
     "jobs": [{"job_id": "<id>", "kind": "chat", "model_id": "<model>",
               "genkey": "HORDEREQ_...", "lease_end": 1700000150.0,
               "terminal": "reply_sent", "reply": {"id": "<id>", "message": ...},
               "horde": "https://aihorde.net"}],
     "faults": [1700000100.0],
     "clock": {"wall": 1700000042.5, "boot_id": "<uuid>", "boottime": 5321.25}}

``terminal`` absent means ``none``; ``reply`` only with a kept reply,
``faults`` only when there are some. The version changes whenever what an
entry means changes, so no program reads a file by other rules than it was
written by: version 1 without ``clock`` (0.1.0's: its lease ends are not the
Horde's, and it has no terminal states) and any later version are set aside
whole; version 1 with ``clock`` is read as version 2 without ``horde``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from ..httpbody import redact_url
from ..jsonbody import finite_number
from .journal_rules import REPLY_STATES, TERMINAL_STATES, ClockMark

FILE_VERSION: Final = 2
EARLIER_VERSION: Final = 1
#: A larger file is not one this program wrote (a kept reply may hold 1 MiB of reasoning).
MAX_FILE_BYTES: Final = 64 * 1024 * 1024
#: The most faults kept (more than the Horde's maintenance threshold ever needs).
MAX_FAULTS: Final = 100

GENKEY_PREFIX: Final = "HORDEREQ_"


@dataclass(frozen=True)
class JournalEntry:
    """One job in hand. ``model_id`` is the model assigned at its pop (None:
    unknown, or a text job); ``genkey`` only a ``HORDEREQ_`` key or ``""``, so a
    recovery never aborts a local user's generation; ``lease_end`` epoch
    seconds (the pop's ``ttl``, later only after an accepted progress post);
    ``reply`` the submit body, kept with ``reply_kept``/``reply_sent``;
    ``horde`` the Horde's base URL (None in a version 1 file).

    Raises:
        ValueError: a field of the wrong type or value.
    """

    job_id: str
    kind: str
    model_id: str | None
    genkey: str
    lease_end: float
    terminal: str = "none"
    reply: dict[str, Any] | None = None
    horde: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValueError("job_id is not a non-empty string")
        if not isinstance(self.kind, str) or self.kind not in ("chat", "text"):
            raise ValueError("kind is not 'chat' or 'text'")
        if self.model_id is not None and not isinstance(self.model_id, str):
            raise ValueError("model_id is not a string or null")
        if not isinstance(self.genkey, str) or (
            self.genkey and not self.genkey.startswith(GENKEY_PREFIX)
        ):
            raise ValueError(f"genkey is not '' or a {GENKEY_PREFIX} key")
        if isinstance(self.lease_end, bool) or not isinstance(self.lease_end, int | float):
            raise ValueError("lease_end is not a number")
        if finite_number(self.lease_end) is None:  # NaN, infinite, or too large for a float
            raise ValueError("lease_end is not a finite number")
        if not isinstance(self.terminal, str) or self.terminal not in TERMINAL_STATES:
            raise ValueError("terminal is not a terminal-action state")
        if self.reply is not None and not isinstance(self.reply, dict):
            raise ValueError("reply is not an object or null")
        if self.terminal in REPLY_STATES and (
            self.reply is None or self.reply.get("id") != self.job_id
        ):
            raise ValueError("reply is not this job's submit body")
        if self.horde is not None and (not isinstance(self.horde, str) or not self.horde):
            raise ValueError("horde is not a non-empty string or null")

    def to_json(self) -> dict[str, Any]:
        """The entry's object: the fields in order, those at their default left out."""
        values = {f.name: (getattr(self, f.name), f.default) for f in fields(self)}
        obj = {name: value for name, (value, default) in values.items() if value != default}
        obj["lease_end"] = float(self.lease_end)
        return obj

    @classmethod
    def from_json(cls, obj: object) -> JournalEntry:
        """The entry a JSON object describes (extra keys ignored).

        Raises:
            ValueError: naming the field, never its value.
        """
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        for key in ("job_id", "kind", "genkey", "lease_end"):
            if key not in obj:
                raise ValueError(f"{key} is missing")
        names = {f.name for f in fields(cls)}
        return cls(**{"model_id": None, **{k: v for k, v in obj.items() if k in names}})


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def clock_mark(wall: float | None = None) -> ClockMark:
    """This instant on the wall clock, with the boot id and ``CLOCK_BOOTTIME``."""
    boottime: float | None = None
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is not None:
        with contextlib.suppress(OSError):
            boottime = time.clock_gettime(clock_id)
    return ClockMark(time.time() if wall is None else wall, _boot_id(), boottime)


# --------------------------------------------------------------------- the file


class NotAJournal(ValueError):
    """Not a job journal this program wrote; the message follows the file's
    name in a log line (``"is not valid JSON"``)."""


class OtherVersion(NotAJournal):
    """A job journal of a version not read by today's rules (0.1.0's or a
    newer program's); ``jobs`` is how many entries it holds."""

    def __init__(self, message: str, version: int, jobs: int) -> None:
        super().__init__(message)
        self.version = version
        self.jobs = jobs


def horde_of(url: str) -> str:
    """A Horde's base URL as an entry names it: no user part, query, fragment
    or trailing slash; host in lower case."""
    return redact_url(url.strip()).rstrip("/")


@dataclass(frozen=True)
class JournalDocument:
    """A journal file read back: its valid entries, ``(index, why)`` of each
    skipped, its clocks' mark (None: none) and its last faults (epoch seconds
    of the writer's wall clock)."""

    entries: list[JournalEntry]
    skipped: list[tuple[int, str]]
    clock: ClockMark | None
    faults: list[float]


def read_document(raw: bytes) -> JournalDocument:
    """A journal file's bytes, read back.

    Raises:
        NotAJournal: too large, not JSON, not a journal; :class:`OtherVersion`
            for 0.1.0's file or a newer program's.
    """
    if len(raw) > MAX_FILE_BYTES:
        raise NotAJournal(f"is over {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NotAJournal("is not valid JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise NotAJournal("is not a job journal")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise NotAJournal("is not a job journal (no version)")
    if version > FILE_VERSION:
        raise OtherVersion(f"was written by a newer version of the worker (format {version}; "
                           f"this one reads up to {FILE_VERSION})", version, len(doc["jobs"]))
    if version == EARLIER_VERSION and "clock" not in doc:
        raise OtherVersion(f"was written by version 0.1.0 of the worker (format {version}: its "
                           "lease ends are not the Horde's, and it does not say which replies "
                           "were sent)", version, len(doc["jobs"]))
    if version not in (EARLIER_VERSION, FILE_VERSION):
        raise NotAJournal(f"is not a version {FILE_VERSION} job journal")
    entries: list[JournalEntry] = []
    skipped: list[tuple[int, str]] = []
    for index, item in enumerate(doc["jobs"]):
        try:
            entries.append(JournalEntry.from_json(item))
        except (TypeError, ValueError) as exc:
            skipped.append((index, str(exc)))
    faults = doc.get("faults")
    kept = faults[-MAX_FAULTS:] if isinstance(faults, list) else []
    faults = [t for t in map(finite_number, kept) if t is not None]
    return JournalDocument(entries, skipped, ClockMark.from_json(doc.get("clock")), faults)


def document_text(entries: Iterable[JournalEntry], faults: Sequence[float], mark: ClockMark) -> str:
    """The journal file's text (faults to the millisecond).

    Raises:
        ValueError: a kept reply holds a number JSON cannot carry (NaN, infinity).
    """
    doc = {"version": FILE_VERSION, "jobs": [e.to_json() for e in entries],
           "faults": [round(t, 3) for t in faults], "clock": mark.to_json()}
    if not faults:
        del doc["faults"]
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
