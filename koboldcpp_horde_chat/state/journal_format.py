"""The job journal's file: its entries, its format and the clocks' mark.

What ``state.journal`` writes with each change and reads back at a start:

- :class:`JournalEntry`: one job in hand (id, kind, assigned ``model_id``,
  genkey, lease end in epoch seconds, terminal-action state, kept reply),
  checked field by field; no API key, no password and no conversation.
- :func:`document_text`: the whole file's JSON text, and
  :func:`read_document`: a file's bytes read back (its valid entries, the
  ones skipped and why, its clocks' mark, its faults), or :class:`NotAJournal`
  saying in a few words why they are not a journal.
- :func:`clock_mark`: this instant's clocks' mark (wall, boot id, time since
  boot: ``journal_rules.ClockMark``), written with each change.

The file (version 2)::

    {"version": 2,
     "jobs": [{"job_id": "<id>", "kind": "chat", "model_id": "<model>",
               "genkey": "HORDEREQ_...", "lease_end": 1700000150.0,
               "terminal": "reply_sent", "reply": {"id": "<id>", "message": ...},
               "horde": "https://aihorde.net"}],
     "faults": [1700000100.0],
     "clock": {"wall": 1700000042.5, "boot_id": "<uuid>", "boottime": 5321.25}}

(``terminal`` absent means ``none``; ``reply`` is written only with a kept
reply; ``faults`` only when there are some; ``horde`` is the base URL the job
was popped from.)

The version changes whenever what an entry means changes, so no program reads
a file by rules other than the ones it was written by:

- version 1 without ``clock``: written by 0.1.0 (and the development tree
  until the journal kept the true lease). ``lease_end`` is the pop plus the
  longest lease progress posts could reach (200 s, 600 s trusted), not the
  lease the Horde runs, and there is no ``terminal``: every entry was to be
  faulted. Read by today's rules, an expired job would be faulted (which
  re-opens its request on the real Horde). :func:`read_document` raises
  :class:`EarlierJournal`: the file is set aside whole.
- version 1 with ``clock`` (the development tree after that): ``lease_end``
  is the lease the Horde runs and ``terminal`` the terminal-action state, as
  today, but no ``horde``: read as version 2, its jobs taken as the Horde's
  this start serves.
- version 2 (today): version 1 with ``clock``, plus each entry's ``horde``.
  0.1.0 and the earlier development tree set such a file aside as not theirs
  (``<name>.unreadable-<epoch seconds>``), so they never fault a job whose
  reply the Horde accepted.
- a later version: raises :class:`NewerJournal`: the file is set aside and
  left alone.

Seed sections: "7. Fault a job" (the faulted submit), "Streaming progress"
(the lease) and "Worked example: koboldcpp's embedded worker" (abort by genkey).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..httpbody import redact_url
from ..jsonbody import finite_number
from .journal_rules import REPLY_STATES, TERMINAL_STATES, ClockMark

__all__ = [
    "FILE_VERSION",
    "GENKEY_PREFIX",
    "KINDS",
    "MAX_FAULTS",
    "MAX_FILE_BYTES",
    "JournalDocument",
    "JournalEntry",
    "NotAJournal",
    "OtherVersion",
    "EarlierJournal",
    "NewerJournal",
    "clock_mark",
    "document_text",
    "horde_of",
    "read_document",
]

#: The ``version`` written in the file (see the module docstring for what each meant).
FILE_VERSION: Final = 2
#: The version 0.1.0 wrote, read as :data:`FILE_VERSION` when it carries a ``clock``.
EARLIER_VERSION: Final = 1
#: A journal file larger than this (bytes) is not one this program wrote (a kept
#: reply may hold up to 1 MiB of reasoning beside its content, per job in hand).
MAX_FILE_BYTES: Final = 64 * 1024 * 1024
#: The most faults kept (more than the Horde's maintenance threshold ever needs).
MAX_FAULTS: Final = 100

KINDS: Final = frozenset({"chat", "text"})
GENKEY_PREFIX: Final = "HORDEREQ_"


@dataclass(frozen=True)
class JournalEntry:
    """One job in hand, as the journal records it.

    Attributes:
        job_id: the Horde's job id (non-empty).
        kind: ``"chat"`` or ``"text"``.
        model_id: the job's assigned model (the ``model_id`` declared at its
            pop), for a chat fault body; None when unknown (the worker's
            configured model is used) and for a text job.
        genkey: the ``HORDEREQ_`` genkey of the local generation, or ``""``
            before one was made. Only ``HORDEREQ_`` keys are accepted, so a
            recovery never aborts a local user's generation.
        lease_end: epoch seconds when the job's lease ends on the Horde: the
            pop's ``ttl`` from the pop's answer, later only after an accepted
            progress post (seed "Streaming progress").
        terminal: the terminal-action state, one of
            ``journal_rules.TERMINAL_STATES`` (``"none"``, ``"reply_kept"``,
            ``"reply_sent"``, ``"fault_sent"``).
        reply: the submit body of the generated reply (``reply_kept`` and
            ``reply_sent`` only), sent again by a restart as it is.
        horde: the Horde the job was popped from (:func:`horde_of` its base
            URL); None when not recorded (a version 1 file).

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
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError("kind is not 'chat' or 'text'")
        if self.model_id is not None and not isinstance(self.model_id, str):
            raise ValueError("model_id is not a string or null")
        if not isinstance(self.genkey, str) or (
            self.genkey and not self.genkey.startswith(GENKEY_PREFIX)
        ):
            raise ValueError(f"genkey is not '' or a {GENKEY_PREFIX} key")
        lease_end = self.lease_end
        if isinstance(lease_end, bool) or not isinstance(lease_end, int | float):
            raise ValueError("lease_end is not a number")
        if finite_number(lease_end) is None:  # NaN, infinite, or too large for a float
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
        """The entry as a JSON object: ``{"job_id", "kind", "model_id", "genkey",
        "lease_end"}``, with ``"terminal"`` when not ``"none"`` and ``"reply"``
        when one is kept, ``"horde"`` when recorded."""
        obj: dict[str, Any] = {
            "job_id": self.job_id,
            "kind": self.kind,
            "model_id": self.model_id,
            "genkey": self.genkey,
            "lease_end": float(self.lease_end),
        }
        if self.terminal != "none":
            obj["terminal"] = self.terminal
        if self.reply is not None:
            obj["reply"] = self.reply
        if self.horde is not None:
            obj["horde"] = self.horde
        return obj

    @classmethod
    def from_json(cls, obj: object) -> JournalEntry:
        """The entry a JSON object describes (extra keys are ignored; an entry of
        an earlier version, without ``terminal``, has none).

        Raises:
            ValueError: not an object, a key missing, or a field of the wrong
                type or value (the message names the field, never its value).
        """
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        for key in ("job_id", "kind", "genkey", "lease_end"):
            if key not in obj:
                raise ValueError(f"{key} is missing")
        return cls(
            job_id=obj["job_id"],
            kind=obj["kind"],
            model_id=obj.get("model_id"),
            genkey=obj["genkey"],
            lease_end=obj["lease_end"],
            terminal=obj.get("terminal", "none"),
            reply=obj.get("reply"),
            horde=obj.get("horde"),
        )


def _boot_id() -> str:
    """The kernel's boot id (Linux), ``""`` elsewhere or when unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return ""


_BOOT_ID: str | None = None


def clock_mark(wall: float | None = None) -> ClockMark:
    """This instant on the wall clock, with the boot id and the time since boot
    (``CLOCK_BOOTTIME`` where the platform has it): see ``journal_rules``."""
    global _BOOT_ID
    if _BOOT_ID is None:
        _BOOT_ID = _boot_id()
    boottime: float | None = None
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is not None:
        try:
            boottime = time.clock_gettime(clock_id)
        except OSError:
            boottime = None
    return ClockMark(time.time() if wall is None else wall, _BOOT_ID, boottime)


# --------------------------------------------------------------------- the file


class NotAJournal(ValueError):
    """The bytes read are not a job journal this program wrote; the message says
    why in a few words, as a log line goes on after the file's name (``"is not
    valid JSON"``)."""


class OtherVersion(NotAJournal):
    """A job journal of a version this program does not read by today's rules.

    Attributes:
        version: the file's ``version``.
        jobs: how many entries it holds.
    """

    def __init__(self, message: str, version: int, jobs: int) -> None:
        super().__init__(message)
        self.version = version
        self.jobs = jobs


class EarlierJournal(OtherVersion):
    """A version 1 file without ``clock``, written by 0.1.0: its lease ends are
    not the Horde's and it has no terminal-action states."""


class NewerJournal(OtherVersion):
    """A file of a version later than :data:`FILE_VERSION`, written by a newer
    program: this one does not know what its entries mean."""


def horde_of(url: str) -> str:
    """The Horde a journal entry names: its base URL as ``scheme://host[:port]/path``
    (host in lower case, no trailing slash, user part, query or fragment)."""
    return redact_url(url.strip()).rstrip("/")


@dataclass(frozen=True)
class JournalDocument:
    """A journal file read back (:func:`read_document`).

    Attributes:
        entries: its entries of the right shape, in the order written.
        skipped: ``(index, why)`` of each entry of the wrong shape, in order
            (``why`` names the field, never its value).
        clock: the clocks' mark it was written with; None for a file without one.
        faults: its last :data:`MAX_FAULTS` fault times that are finite numbers,
            epoch seconds on the wall clock of the process that wrote it.
    """

    entries: list[JournalEntry]
    skipped: list[tuple[int, str]]
    clock: ClockMark | None
    faults: list[float]


def read_document(raw: bytes) -> JournalDocument:
    """A journal file's bytes, read back.

    Raises:
        NotAJournal: over :data:`MAX_FILE_BYTES`, not valid JSON (UTF-8), not
            an object with a ``jobs`` list, or a ``version`` not read here
            (:class:`EarlierJournal` for 0.1.0's, :class:`NewerJournal` for a
            later one's).
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
        raise NewerJournal(
            f"was written by a newer version of the worker (format {version}; this one "
            f"reads up to {FILE_VERSION})", version, len(doc["jobs"]),
        )
    if version == EARLIER_VERSION and "clock" not in doc:
        raise EarlierJournal(
            f"was written by version 0.1.0 of the worker (format {version}: its lease ends "
            "are not the Horde's, and it does not say which replies were sent)",
            version, len(doc["jobs"]),
        )
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
    return JournalDocument(
        entries=entries,
        skipped=skipped,
        clock=ClockMark.from_json(doc.get("clock")),
        faults=[
            t for t in map(finite_number, faults[-MAX_FAULTS:]) if t is not None
        ]
        if isinstance(faults, list)
        else [],
    )


def document_text(
    entries: Iterable[JournalEntry], faults: Sequence[float], mark: ClockMark
) -> str:
    """The journal file's text (ASCII JSON, no spaces): ``version``, ``jobs``
    (:meth:`JournalEntry.to_json` each), ``faults`` (epoch seconds to the
    millisecond, only when there are some) and ``clock`` (``mark``).

    Raises:
        ValueError: a kept reply holds a number JSON cannot carry (NaN, infinity).
    """
    doc: dict[str, Any] = {
        "version": FILE_VERSION,
        "jobs": [e.to_json() for e in entries],
    }
    if faults:
        doc["faults"] = [round(t, 3) for t in faults]
    doc["clock"] = mark.to_json()
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
