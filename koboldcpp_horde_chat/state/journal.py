"""The job journal: the jobs in hand on disk, so a restart can end them.

Each job is written as soon as the pop's answer carries it, with the lease the
Horde runs and its terminal-action state (a reply written before it is sent,
a fault marked before), and removed as soon as the Horde answers. At the next
start ``service.recovery`` sends kept replies again and faults the jobs
without a terminal action, never twice (each fault re-opens the request).
A write replaces the whole file (temporary file, mode 0o600, ``os.replace``),
so a kill leaves the old or the new file whole. Only a generated reply is
written, until answered; no conversation or key. The last hour's faults are
kept so a restart goes on counting them toward maintenance.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from ..errors import HordeRefusal, HordeUnavailable
from ..horde.api import HordeAPI
from .journal_format import (
    GENKEY_PREFIX,
    MAX_FAULTS,
    MAX_FILE_BYTES,
    JournalEntry,
    NotAJournal,
    OtherVersion,
    clock_mark,
    document_text,
    horde_of,
    read_document,
)
from .journal_rules import ClockMark, fault_ages_shift
from .submit_answers import Answered, Reading, read_answer

log = logging.getLogger("koboldcpp_horde_chat.journal")

__all__ = ["GENKEY_PREFIX", "clock_mark", "Journal", "JournalEntry"]

#: How long a fault is kept (seconds): the Horde's window for aborted jobs.
FAULT_WINDOW_S: Final = 3600.0


def reason(exc: OSError) -> str:
    """An OS error in a few words (``"Permission denied"``), for a log line."""
    return exc.strerror or type(exc).__name__


def _make_directory(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of its directory") from None


def check_directory(directory: Path) -> None:
    """Make ``directory`` (mode 0o700) and check a file can be written in it.

    Raises:
        OSError: it cannot be made ("a file is in the way of its directory")
            or written ("Permission denied").
    """
    _make_directory(directory)
    fd, probe = tempfile.mkstemp(prefix=".probe-", suffix=".tmp", dir=directory)
    os.close(fd)
    os.unlink(probe)


class Journal:
    """The journal file of one worker, shared by its pop loops (thread-safe).

    ``horde`` is the base URL of the Horde this process pops from, recorded in
    each entry added. The file is read before the first change, so an earlier
    process's entries are never overwritten unseen. No method raises for an
    I/O failure: a failed write is logged once, and the first one that
    succeeds after it.
    """

    def __init__(self, path: Path, horde: str | None = None) -> None:
        self.path = Path(path)
        self.horde = None if horde is None else horde_of(horde)
        self._lock = threading.Lock()
        self._entries: dict[str, JournalEntry] = {}
        self._faults: list[float] = []
        self._loaded = False
        self._failing = False
        self._dirty = False
        self._written = False
        self._lock_fd: int | None = None
        #: The clocks' mark the earlier process wrote with the file (None: none), once read.
        self.earlier_clock: ClockMark | None = None

    def lock(self) -> int | None:
        """Take the journal for this process's life (an exclusive lock on
        ``<file>.lock``, dropped by the system when the process ends): a second
        process of the same worker name would fault the first one's jobs.

        Returns:
            None when this process holds it, else the holder's process id (0:
            unknown).

        Raises:
            OSError: the directory or the lock file cannot be used (not logged).
        """
        if self._lock_fd is not None:
            return None
        check_directory(self.path.parent)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if sys.platform == "win32":
                import msvcrt

                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            else:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
            os.close(fd)
            return int(holder) if holder.isdigit() else 0
        with contextlib.suppress(OSError):  # the lock holds without the holder's id
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode("ascii"))
        self._lock_fd = fd
        return None

    def unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def serve(self, horde: str) -> None:
        """The entries added from now on record this Horde (base URL)."""
        with self._lock:
            self.horde = horde_of(horde)

    # -- reading ------------------------------------------------------------------

    def load(self) -> list[JournalEntry]:
        """What is recorded now, in the order recorded; the file an earlier
        process left is read first, once.

        A file that cannot be read or is not a journal is set aside as
        ``<name>.unreadable-<epoch seconds>``, one of another version as
        ``<name>.version-<n>-<epoch seconds>`` (a line each; the journal is then
        empty); an entry of the wrong shape is skipped with a line.
        """
        with self._read_first():
            return list(self._entries.values())

    @contextlib.contextmanager
    def _read_first(self) -> Iterator[None]:
        """Hold the lock, the file an earlier process left read first."""
        with self._lock:
            self._load_locked()
            yield

    def _load_locked(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        loaded_clock = clock_mark()
        try:
            with open(self.path, "rb") as f:
                doc = read_document(f.read(MAX_FILE_BYTES + 1))
        except (FileNotFoundError, NotADirectoryError):
            return  # no journal yet (or no directory for one)
        except OSError as exc:
            self._set_aside(f"cannot be read ({reason(exc)})")
            return
        except OtherVersion as exc:
            self._set_aside(str(exc), f"version-{exc.version}", jobs=exc.jobs)
            return
        except NotAJournal as exc:
            self._set_aside(str(exc))
            return
        for index, why in doc.skipped:
            log.warning("job journal %s: entry %d skipped: %s", self.path, index, why)
        self._entries.update((entry.job_id, entry) for entry in doc.entries)
        self.earlier_clock = doc.clock
        # The earlier run's faults on this run's wall clock, each as recent as it
        # can be (the worst for what the Horde counts: journal_rules).
        shift = fault_ages_shift(doc.clock, loaded_clock)
        self._faults = [t + shift for t in doc.faults]

    def _set_aside(self, problem: str, suffix: str = "unreadable", *, jobs: int = -1) -> None:
        target = self.path.with_name(f"{self.path.name}.{suffix}-{int(time.time())}")
        gets = " gets" if jobs == 1 else "s get"
        left = f"; its {jobs} job{gets} nothing from this start" if jobs >= 0 else ""
        try:
            os.replace(self.path, target)
        except OSError as exc:
            log.warning("job journal %s %s; ignored and left in place (%s)%s",
                        self.path, problem, reason(exc), left)
            return
        log.warning("job journal %s %s; set aside as %s%s", self.path, problem, target.name, left)

    # -- writing ------------------------------------------------------------------

    def add(self, entry: JournalEntry) -> None:
        """Record a job in hand, written before it returns (what a kill must
        survive; a plain write: only a machine going down needs ``fsync``)."""
        with self._read_first():
            if entry.horde is None and self.horde is not None:
                entry = replace(entry, horde=self.horde)
            self._entries[entry.job_id] = entry
            self._write_locked()

    def remove(self, job_id: str) -> None:
        """Clear a job whose terminal action was answered (or that ended without
        one on purpose), written at once."""
        with self._read_first():
            if self._entries.pop(job_id, None) is not None or self._dirty:
                self._write_locked()

    def _change(self, job_id: str, **changes: Any) -> bool:
        """Change a job's entry in one hold, its lease end only ever later; False
        when the job is not recorded."""
        with self._read_first():
            entry = self._entries.get(job_id)
            if entry is not None and changes.get("lease_end", math.inf) > entry.lease_end:
                self._entries[job_id] = replace(entry, **changes)
                self._write_locked()
            return entry is not None

    def keep_reply(self, job_id: str, body: dict[str, Any]) -> bool:
        """Keep a job's submit body before it is sent; a restart sends it again.
        False when the job is not recorded."""
        return self._change(job_id, terminal="reply_sent", reply=dict(body))

    def mark_fault_sent(self, job_id: str) -> bool:
        """Mark a job's fault as sent, before it goes: a restart sends it nothing
        more. False when the job is not recorded."""
        return self._change(job_id, terminal="fault_sent", reply=None)

    def mark_not_taken(self, job_id: str) -> bool:
        """The fault just sent is known not to have reached the Horde: back to
        ``none``. False when the job is not recorded."""
        return self._change(job_id, terminal="none")

    def set_lease_end(self, job_id: str, lease_end: float) -> bool:
        """Record a later lease end (epoch seconds) after an accepted progress
        post. False when the job is not recorded."""
        return self._change(job_id, lease_end=lease_end)

    def entry(self, job_id: str) -> JournalEntry | None:
        with self._read_first():
            return self._entries.get(job_id)

    def record_fault(self, at: float) -> None:
        """Keep a fault counted toward maintenance (epoch seconds), written with
        the next change."""
        with self._read_first():
            self._faults = [t for t in self._faults if t > at - FAULT_WINDOW_S][-MAX_FAULTS + 1 :]
            self._faults.append(at)
            self._dirty = True

    def recent_faults(self, now: float) -> list[float]:
        """The kept faults of the last hour before epoch ``now``, oldest first."""
        with self._read_first():
            return [t for t in self._faults if now - FAULT_WINDOW_S < t <= now]

    def flush(self) -> None:
        """Write the changes not written yet."""
        with self._lock:
            if self._dirty:
                self._write_locked()

    def _write_locked(self) -> None:
        self._dirty = False
        data = document_text(self._entries.values(), self._faults, clock_mark())
        directory = self.path.parent
        tmp: str | None = None
        try:
            if self._failing or not self._written:
                _make_directory(directory)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:
            self._dirty = True
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if not self._failing:
                self._failing = True
                log.warning("job journal %s cannot be written (%s): a job in hand during a crash "
                            "would be left to expire on the Horde; trying again with each job",
                            self.path, reason(exc))
            return
        self._written = True
        if self._failing:
            self._failing = False
            log.warning("job journal %s is written again", self.path)


def send_terminal(
    horde: HordeAPI, journal: Journal | None, job_id: str, body: dict[str, Any], *,
    fault: bool, timeout_s: float,
) -> Reading:
    """One submit of a job's reply or fault (``fault``), its answer read by
    ``read_answer``, for the live submit and the recovery alike: a fault is marked
    sent before it goes (a restart never sends a second one), and back when it
    surely did not reach the Horde (it may be sent again)."""
    if fault and journal is not None:
        journal.mark_fault_sent(job_id)
    try:
        answer: Answered = horde.submit(body, timeout_s=timeout_s)
    except (HordeRefusal, HordeUnavailable) as exc:
        answer = exc
    reading = read_answer(answer, fault=fault)
    if reading.not_taken and journal is not None:
        journal.mark_not_taken(job_id)
    return reading
