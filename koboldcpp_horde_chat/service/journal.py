"""The job journal: the jobs in hand, on disk, so a restart can fault them (I/O edge).

When the worker process dies with a job in hand (killed for memory, a crash,
a power loss, koboldcpp closed), the Horde holds the job until its lease
ends: the client waits for nothing (150 s, up to 600 s for a trusted streamed
job) and the worker is charged a dropped job. So the worker records each job
in a small file as soon as the pop's answer carries it (and again with its
genkey before it generates), and clears it after the job's terminal action.
At the next start, before the first pop, the recovery faults every
recorded job whose lease has not ended (seed "7. Fault a job": the request
gets the job back for another worker) and aborts its local generation on
koboldcpp by genkey.

- :class:`JournalEntry`: one job in hand (id, kind, assigned ``model_id``,
  genkey, lease end in epoch seconds). No API key, no password and no
  conversation text: nothing else is written.
- where the file lives, one file per worker name: ``service.journal_paths``.
- :class:`Journal`: the file, shared by the pop loops of one worker. A write
  is a temporary file in the same directory, then ``os.replace``-d over the
  journal: a process killed at any instant leaves the old file or the new
  one whole. Only on request (``durable``) is each written ``fsync``-ed, and
  the directory too where the platform allows. A failed write never stops
  the worker: it is logged once.
- the start-up pass over what an earlier process left: ``service.recovery``.

The journal also keeps when the worker's faults the Horde counts toward
maintenance happened in the last hour (epoch seconds), so that a worker
restarted after a crash goes on counting them (``guard.MaintenanceGuard``):
a koboldcpp that crashes on a kind of job, with the worker inside it, would
otherwise start each time from an empty window. The file::

    {"version": 1, "jobs": [{"job_id": "<id>", "kind": "chat", "model_id": "<model>",
                             "genkey": "HORDEREQ_...", "lease_end": 1700000150.0}],
     "faults": [1700000100.0]}

(``faults`` is written only when there are some; a file without it has none.)

Seed sections: "7. Fault a job" (the faulted submit, the request back to the
queue), "Streaming progress" (the lease) and "Worked example: koboldcpp's
embedded worker" (abort by genkey).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("koboldcpp_horde_chat.journal")

__all__ = [
    "FILE_VERSION",
    "Journal",
    "JournalEntry",
]

#: The ``version`` written in the file; a file of another version is set aside.
FILE_VERSION: Final = 1
#: A journal file larger than this (bytes) is not one this program wrote.
MAX_FILE_BYTES: Final = 1024 * 1024

#: How long a fault is kept (seconds): the Horde's window for aborted jobs.
FAULT_WINDOW_S: Final = 3600.0
#: The most faults kept (more than the Horde's maintenance threshold ever needs).
MAX_FAULTS: Final = 100

KINDS: Final = frozenset({"chat", "text"})
GENKEY_PREFIX: Final = "HORDEREQ_"


# --------------------------------------------------------------------- entries


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
        lease_end: epoch seconds when the job's lease ends on the Horde at the
            latest (for a streamed job, the lease cap counted from the pop is a
            safe value: the Horde answers a fault after the lease with
            ``{"reward": 0}`` and counts the job once).

    Raises:
        ValueError: a field of the wrong type or value.
    """

    job_id: str
    kind: str
    model_id: str | None
    genkey: str
    lease_end: float

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
        try:
            finite = math.isfinite(lease_end)
        except OverflowError:  # an integer too large for a float
            finite = False
        if not finite:
            raise ValueError("lease_end is not a finite number")

    def to_json(self) -> dict[str, Any]:
        """The entry as a JSON object: ``{"job_id", "kind", "model_id", "genkey", "lease_end"}``."""
        return {
            "job_id": self.job_id,
            "kind": self.kind,
            "model_id": self.model_id,
            "genkey": self.genkey,
            "lease_end": float(self.lease_end),
        }

    @classmethod
    def from_json(cls, obj: object) -> JournalEntry:
        """The entry a JSON object describes (extra keys are ignored).

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
        )


# --------------------------------------------------------------------- journal


def _reason(exc: OSError) -> str:
    """An OS error in a few words (``"Permission denied"``), without a traceback."""
    return exc.strerror or type(exc).__name__


def reason(exc: OSError) -> str:
    """An OS error in a few words (``"No such file or directory"``), for a log line."""
    return _reason(exc)


def check_directory(directory: Path) -> None:
    """Make ``directory`` (mode 0o700, with its parents) and check a file can be
    written in it (a temporary file is created and removed).

    Raises:
        OSError: it cannot be made (``/proc/nope``: "No such file or
            directory"; a file in the way: "a file is in the way of its
            directory") or written ("Permission denied", "Read-only file
            system").
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of its directory") from None
    fd, probe = tempfile.mkstemp(prefix=".probe-", suffix=".tmp", dir=directory)
    os.close(fd)
    os.unlink(probe)


class Journal:
    """The journal file of one worker, shared by its pop loops (thread-safe).

    Args:
        path: the file (:func:`journal_path`); its directory is created on the
            first write, mode 0o700.

    The entries live in memory and every change rewrites the whole file (a
    few hundred bytes). :meth:`load` reads the file left by an earlier
    process; a change before :meth:`load` loads it first, so those entries are
    never overwritten unseen. No method raises for an I/O failure: a failed
    write is logged once in one line, later writes are tried again silently,
    and the first one that succeeds after a failure is logged once.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: dict[str, JournalEntry] = {}
        self._faults: list[float] = []
        self._loaded = False
        self._failing = False
        self._dirty = False
        self._written = False
        self._lock_fd: int | None = None

    def lock(self) -> int | None:
        """Take the journal for this process, for as long as it lives.

        Two processes serving the same worker name on one machine would share
        the file: the second one's start would fault (and abort) the first
        one's jobs in hand. An exclusive lock on ``<file>.lock`` (``flock``;
        ``msvcrt.locking`` on Windows), which the system drops when the process
        ends however it ends, prevents that.

        Returns:
            None when this process holds it now, else the process id the
            holder wrote in the lock file (0 when unknown).

        Raises:
            OSError: the journal cannot be kept in its directory
                (:func:`check_directory`) or its lock file cannot be opened;
                nothing is logged (the host says what it does then).
        """
        if self._lock_fd is not None:
            return None
        lock_path = self.path.with_name(self.path.name + ".lock")
        check_directory(self.path.parent)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock_file(fd)
        except OSError:
            try:
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            return int(holder) if holder.isdigit() else 0
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode("ascii"))
        except OSError:
            pass  # the lock holds; only the holder's id for the message is missing
        self._lock_fd = fd
        return None

    def unlock(self) -> None:
        """Give the journal up (the process ends, or starts its loops again)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        return f"Journal(path={str(self.path)!r})"

    # -- reading ------------------------------------------------------------------

    def load(self) -> list[JournalEntry]:
        """The entries an earlier process left, read once (later calls return :meth:`entries`).

        A missing file is an empty journal. A file that cannot be read or is
        not a journal (invalid JSON, truncated, another ``version``, over
        1 MiB) is logged in one line and set aside as
        ``<name>.unreadable-<epoch seconds>`` next to it (left in place when
        renaming fails); the journal is then empty. An entry of the wrong
        shape is skipped and logged in one line. Never raises ``OSError``.
        """
        with self._lock:
            self._load_locked()
            return list(self._entries.values())

    def entries(self) -> list[JournalEntry]:
        """What is recorded now, in the order recorded."""
        with self._lock:
            self._load_locked()
            return list(self._entries.values())

    def _load_locked(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return  # no journal yet (or no directory for one)
        except OSError as exc:
            self._set_aside(f"cannot be read ({_reason(exc)})")
            return
        if len(raw) > MAX_FILE_BYTES:
            self._set_aside(f"is over {MAX_FILE_BYTES} bytes")
            return
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            self._set_aside("is not valid JSON")
            return
        if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
            self._set_aside("is not a job journal")
            return
        if doc.get("version") != FILE_VERSION:
            self._set_aside(f"is not a version {FILE_VERSION} job journal")
            return
        for index, item in enumerate(doc["jobs"]):
            try:
                entry = JournalEntry.from_json(item)
            except (TypeError, ValueError) as exc:
                log.warning("job journal %s: entry %d skipped: %s", self.path, index, exc)
                continue
            self._entries[entry.job_id] = entry
        faults = doc.get("faults")
        if isinstance(faults, list):
            self._faults = [
                float(t)
                for t in faults[-MAX_FAULTS:]
                if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            ]

    def _set_aside(self, problem: str) -> None:
        target = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
        try:
            os.replace(self.path, target)
        except OSError as exc:
            log.warning("job journal %s %s; ignored and left in place (%s)",
                        self.path, problem, _reason(exc))
            return
        log.warning("job journal %s %s; set aside as %s", self.path, problem, target.name)

    # -- writing ------------------------------------------------------------------

    def add(self, entry: JournalEntry, *, durable: bool = False) -> None:
        """Record a job in hand (replacing an entry with the same ``job_id``).

        Returns after the file is written (the kernel keeps a killed process's
        writes: what a SIGKILL, an OOM kill or a crash must survive), or after
        the write failed (logged; never raised). ``durable`` also waits for the
        disk (``fsync``), which only a machine going down needs: the worker
        does not ask for it on a job's path.
        """
        with self._lock:
            self._load_locked()
            self._entries[entry.job_id] = entry
            self._write_locked(durable=durable)

    def remove(self, job_id: str, *, write: bool = True) -> None:
        """Clear a job after its terminal action.

        Written like :meth:`add` but never waited for on disk; with ``write``
        False not written now at all, but with the next :meth:`add` or
        :meth:`flush` (a job's path then writes the file once, at its pop). A
        removal lost in a crash only makes the next start fault a job that
        was settled, which the Horde answers with ``DuplicateGen`` (after a
        reply) or ``{"reward": 0}`` (after a fault or the job's end). A job
        that is not recorded leaves the file as it is.
        """
        with self._lock:
            self._load_locked()
            if self._entries.pop(job_id, None) is None:
                return
            if write:
                self._write_locked(durable=False)
            else:
                self._dirty = True

    def record_fault(self, at: float) -> None:
        """Keep a fault the Horde counts toward maintenance, made at epoch seconds
        ``at``; written with the next change (:meth:`add`, :meth:`remove`,
        :meth:`flush`), as a job's removal is. Faults older than
        :data:`FAULT_WINDOW_S` are dropped."""
        with self._lock:
            self._load_locked()
            self._faults = [t for t in self._faults if t > at - FAULT_WINDOW_S][-MAX_FAULTS + 1 :]
            self._faults.append(at)
            self._dirty = True

    def recent_faults(self, now: float) -> list[float]:
        """The kept faults within :data:`FAULT_WINDOW_S` before epoch seconds ``now``,
        oldest first (an earlier process's included)."""
        with self._lock:
            self._load_locked()
            return [t for t in self._faults if now - FAULT_WINDOW_S < t <= now]

    def flush(self) -> None:
        """Write removals not written yet (see :meth:`remove`); nothing when none."""
        with self._lock:
            if self._dirty:
                self._write_locked(durable=False)

    def _write_locked(self, *, durable: bool = True) -> None:
        self._dirty = False
        doc: dict[str, Any] = {
            "version": FILE_VERSION,
            "jobs": [e.to_json() for e in self._entries.values()],
        }
        if self._faults:
            doc["faults"] = [round(t, 3) for t in self._faults]
        data = json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        directory = self.path.parent
        tmp: str | None = None
        try:
            if self._failing or not self._written:
                try:
                    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "a file is in the way of its directory"
                    ) from None
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:
            self._dirty = True
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            if not self._failing:
                self._failing = True
                log.warning(
                    "job journal %s cannot be written (%s): a job in hand during a crash "
                    "would be left to expire on the Horde; trying again with each job",
                    self.path, _reason(exc),
                )
            return
        self._written = True
        if durable:
            _fsync_dir(directory)
        if self._failing:
            self._failing = False
            log.warning("job journal %s is written again", self.path)


def _lock_file(fd: int) -> None:
    """An exclusive lock on the open file ``fd`` without waiting; OSError when
    another process holds it."""
    if sys.platform == "win32":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _fsync_dir(directory: Path) -> None:
    """Flush a directory entry (the rename) to disk where the platform allows it."""
    if os.name == "nt":
        return  # directories cannot be opened for fsync on Windows
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support it
    finally:
        os.close(fd)
