"""The job journal: the jobs in hand, on disk, so a restart can end them (I/O edge).

When the worker process dies with a job in hand (killed for memory, a crash,
a power loss, koboldcpp closed), the Horde holds the job until its lease
ends: the client waits for nothing (150 s, up to 600 s for a trusted streamed
job) and the worker is charged a dropped job. So the worker records each job
in a small file as soon as the pop's answer carries it, and the file tells
the truth at every instant of the job's life:

- the lease the Horde really runs: the pop's ``ttl`` from the pop's answer,
  moved later only after an accepted progress post (seed "Streaming
  progress");
- the job's terminal-action state (``state.journal_rules``): ``none`` yet,
  ``reply_kept`` (the generated reply, kept in the entry), ``reply_sent`` or
  ``fault_sent`` (sent, the answer not known). A reply is written before it
  is sent, a fault is marked before it is sent;
- answered: the job's removal is written as soon as the Horde answers its
  terminal action, before anything else happens (the next pop's job, a
  pause, an exit path).

At the next start, as soon as the Horde answers and before the first pop,
the recovery (``service.recovery``) sends each kept reply again (a reply the
Horde had stored is answered ``DuplicateGen`` at no cost), faults each job
without a terminal action whose lease surely runs (seed "7. Fault a job"),
and never sends a second fault: on the real Horde every faulted submit
re-opens the request (``wp.n += 1``), also for a job that already ended.

- :class:`JournalEntry` (``state.journal_format``): one job in hand (id,
  kind, assigned ``model_id``, genkey, lease end in epoch seconds,
  terminal-action state, kept reply). No API key, no password and no
  conversation: the only text written is the generated reply, and only until
  the Horde answers it.
- where the file lives, one file per worker name: ``state.journal_paths``.
- :class:`Journal`: the file, shared by the pop loops of one worker. A write
  is a temporary file (mode 0o600) in the same directory, then
  ``os.replace``-d over the journal: a process killed at any instant leaves
  the old file or the new one whole. Only on request (``durable``) is each
  written ``fsync``-ed, and the directory too where the platform allows. A
  failed write never stops the worker: it is logged once.
- the start-up pass over what an earlier process left: ``service.recovery``.

The journal also keeps when the worker's faults the Horde counts toward
maintenance happened in the last hour (epoch seconds), so that a worker
restarted after a crash goes on counting them (``guard.MaintenanceGuard``):
a koboldcpp that crashes on a kind of job, with the worker inside it, would
otherwise start each time from an empty window. Each write carries the
clocks' mark (wall, boot id, time since boot: ``journal_rules.ClockMark``),
so a restart reads the earlier run's times on its own clock, whatever the
wall clock did meanwhile. The file's format: ``state.journal_format``.

Seed sections: "7. Fault a job" (the faulted submit, the request back to the
queue), "Streaming progress" (the lease), "Check the completed reply"
(``DuplicateGen``) and "Worked example: koboldcpp's embedded worker" (abort
by genkey).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from .journal_format import (
    FILE_VERSION,
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

log = logging.getLogger("koboldcpp_horde_chat.journal")

__all__ = [
    "FILE_VERSION",
    "GENKEY_PREFIX",
    "clock_mark",
    "Journal",
    "JournalEntry",
]

#: How long a fault is kept (seconds): the Horde's window for aborted jobs.
FAULT_WINDOW_S: Final = 3600.0


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
        horde: the base URL of the Horde this process pops from (or later
            :meth:`serve`): each entry added records it (``JournalEntry.horde``).

    The entries live in memory and every change rewrites the whole file (a
    few hundred bytes). :meth:`load` reads the file left by an earlier
    process; a change before :meth:`load` loads it first, so those entries are
    never overwritten unseen. No method raises for an I/O failure: a failed
    write is logged once in one line, later writes are tried again silently,
    and the first one that succeeds after a failure is logged once.
    """

    def __init__(self, path: Path, horde: str | None = None) -> None:
        self.path = Path(path)
        #: The Horde this process serves (``journal_format.horde_of``), or None.
        self.horde = None if horde is None else horde_of(horde)
        self._lock = threading.Lock()
        self._entries: dict[str, JournalEntry] = {}
        self._faults: list[float] = []
        self._loaded = False
        self._failing = False
        self._dirty = False
        self._written = False
        self._lock_fd: int | None = None
        #: The clocks' mark the earlier process wrote with the file (None: none).
        self._earlier_clock: ClockMark | None = None
        #: This process's mark when it read the file.
        self._loaded_clock: ClockMark | None = None

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

    def serve(self, horde: str) -> None:
        """This process pops from the Horde at base URL ``horde``: the entries
        added from now on record it, and the recovery leaves alone the entries
        of another Horde."""
        with self._lock:
            self.horde = horde_of(horde)

    # -- reading ------------------------------------------------------------------

    def load(self) -> list[JournalEntry]:
        """The entries an earlier process left, read once (later calls return :meth:`entries`).

        A missing file is an empty journal. A file that cannot be read or is
        not a journal (invalid JSON, truncated, over 64 MiB) is logged in one
        line and set aside as ``<name>.unreadable-<epoch seconds>`` next to
        it (left in place when renaming fails); one of a version not read by
        today's rules (0.1.0's, or a newer program's:
        ``journal_format``) as ``<name>.version-<n>-<epoch seconds>``, left
        alone; the journal is then empty. An entry of the wrong
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

    def clocks(self) -> tuple[ClockMark | None, ClockMark]:
        """(the clocks' mark the earlier process wrote with the file, None for a
        file without one; this process's mark when it read the file), for
        ``journal_rules.plan``."""
        with self._lock:
            self._load_locked()
            assert self._loaded_clock is not None
            return self._earlier_clock, self._loaded_clock

    def _load_locked(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        self._loaded_clock = clock_mark()
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return  # no journal yet (or no directory for one)
        except OSError as exc:
            self._set_aside(f"cannot be read ({_reason(exc)})")
            return
        try:
            doc = read_document(raw)
        except OtherVersion as exc:
            self._set_aside(str(exc), f"version-{exc.version}", jobs=exc.jobs)
            return
        except NotAJournal as exc:
            self._set_aside(str(exc))
            return
        for index, why in doc.skipped:
            log.warning("job journal %s: entry %d skipped: %s", self.path, index, why)
        for entry in doc.entries:
            self._entries[entry.job_id] = entry
        self._earlier_clock = doc.clock
        # The earlier run's faults on this run's wall clock, each as recent as it
        # can be (the worst for what the Horde counts: journal_rules).
        shift = fault_ages_shift(self._earlier_clock, self._loaded_clock)
        self._faults = [t + shift for t in doc.faults]

    def _set_aside(self, problem: str, suffix: str = "unreadable", *, jobs: int = -1) -> None:
        """Move the file aside as ``<name>.<suffix>-<epoch seconds>``, whole and
        never read again, saying so in one line (with ``jobs`` >= 0: how many
        jobs it holds, which this process sends nothing)."""
        target = self.path.with_name(f"{self.path.name}.{suffix}-{int(time.time())}")
        left = (
            f"; its {jobs} job{' gets' if jobs == 1 else 's get'} nothing from this start"
            if jobs >= 0 else ""
        )
        try:
            os.replace(self.path, target)
        except OSError as exc:
            log.warning("job journal %s %s; ignored and left in place (%s)%s",
                        self.path, problem, _reason(exc), left)
            return
        log.warning("job journal %s %s; set aside as %s%s", self.path, problem, target.name, left)

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
            if entry.horde is None and self.horde is not None:
                entry = replace(entry, horde=self.horde)
            self._entries[entry.job_id] = entry
            self._write_locked(durable=durable)

    def remove(self, job_id: str, *, write: bool = True) -> None:
        """Clear a job whose terminal action the Horde answered (or that ended
        without one on purpose).

        Written at once, like :meth:`add` but never waited for on disk, so
        that no restart can send the job anything more; with ``write`` False
        (a caller batching several changes) written with the next write or
        :meth:`flush`. A job that is not recorded leaves the file as it is.
        """
        with self._lock:
            self._load_locked()
            if self._entries.pop(job_id, None) is None:
                if write and self._dirty:
                    self._write_locked(durable=False)
                return
            if write:
                self._write_locked(durable=False)
            else:
                self._dirty = True

    def _change(self, job_id: str, **changes: Any) -> bool:
        """Replace fields of a recorded entry and write the file; False when the
        job is not recorded (nothing written)."""
        with self._lock:
            self._load_locked()
            entry = self._entries.get(job_id)
            if entry is None:
                return False
            self._entries[job_id] = replace(entry, **changes)
            self._write_locked(durable=False)
            return True

    def keep_reply(self, job_id: str, body: dict[str, Any], *, sent: bool = True) -> bool:
        """Keep a job's generated reply (its submit body) before it is sent:
        ``reply_sent`` (the default: the caller sends it next, so its answer
        may be lost) or ``reply_kept`` (``sent`` False: not sent yet). A
        restart sends it again, not a fault, while the lease may run.
        Returns False when the job is not recorded."""
        return self._change(
            job_id, terminal="reply_sent" if sent else "reply_kept", reply=dict(body)
        )

    def mark_fault_sent(self, job_id: str) -> bool:
        """Mark a job's fault as sent, before it is sent: a restart then sends
        the job nothing more (at most one fault per job). Drops a kept reply
        (the Horde refused it). Returns False when the job is not recorded."""
        return self._change(job_id, terminal="fault_sent", reply=None)

    def mark_not_taken(self, job_id: str) -> bool:
        """The terminal action just sent is known not to have reached the Horde
        (``journal_rules.known_not_taken``): a fault goes back to ``none``
        (a restart may fault the job), a reply to ``reply_kept``. Returns
        False when the job is not recorded."""
        with self._lock:
            self._load_locked()
            entry = self._entries.get(job_id)
        if entry is None:
            return False
        if entry.terminal == "fault_sent":
            return self._change(job_id, terminal="none")
        if entry.terminal == "reply_sent":
            return self._change(job_id, terminal="reply_kept")
        return True

    def set_lease_end(self, job_id: str, lease_end: float) -> bool:
        """Record a job's new lease end (epoch seconds), after an accepted progress
        post extended it; an earlier end than recorded is ignored. Returns False
        when the job is not recorded."""
        with self._lock:
            self._load_locked()
            entry = self._entries.get(job_id)
            if entry is None or lease_end <= entry.lease_end:
                return entry is not None
            self._entries[job_id] = replace(entry, lease_end=lease_end)
            self._write_locked(durable=False)
            return True

    def entry(self, job_id: str) -> JournalEntry | None:
        """The recorded entry of ``job_id``, or None."""
        with self._lock:
            self._load_locked()
            return self._entries.get(job_id)

    def record_fault(self, at: float) -> None:
        """Keep a fault the Horde counts toward maintenance, made at epoch seconds
        ``at``; written with the next change (:meth:`add`, :meth:`remove`,
        :meth:`mark_fault_sent`, :meth:`flush`). Faults older than
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
        """Write changes not written yet (see :meth:`remove`, :meth:`record_fault`);
        nothing when none."""
        with self._lock:
            if self._dirty:
                self._write_locked(durable=False)

    def _write_locked(self, *, durable: bool = True) -> None:
        self._dirty = False
        data = document_text(self._entries.values(), self._faults, clock_mark())
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
