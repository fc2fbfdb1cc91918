"""The job journal: on disk before generating, read back after a restart, recovered.

Seed sections: "7. Fault a job" (the fault bodies), "Streaming progress" (the lease).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from koboldcpp_horde_chat.errors import BackendError, ConfigError, HordeRefusal, HordeUnavailable
from koboldcpp_horde_chat.hosts import hosting
from koboldcpp_horde_chat.inflight import CallDeadlines
from koboldcpp_horde_chat.service.recovery import RecoveryResult, recover
from koboldcpp_horde_chat.settings import WorkerSettings
from koboldcpp_horde_chat.state import journal as journal_mod
from koboldcpp_horde_chat.state.journal import Journal, JournalEntry
from koboldcpp_horde_chat.state.journal_paths import APP_DIR_NAME, default_state_dir, journal_path
from koboldcpp_horde_chat.state.journal_rules import ClockMark

NOW = 1_700_000_000.0
MODEL = "koboldcpp/Qwen3-8B-Q4_K_M"
API_KEY = "horde-api-key-0123456789"
SECRET_TEXT = "my bank password is hunter2"


def chat_entry(job_id: str = "job-1", *, lease_left_s: float = 150.0, **over: Any) -> JournalEntry:
    fields: dict[str, Any] = {
        "job_id": job_id,
        "kind": "chat",
        "model_id": MODEL,
        "genkey": "HORDEREQ_0a1b2c3d4e5f",
        "lease_end": NOW + lease_left_s,
    }
    fields.update(over)
    return JournalEntry(**fields)


def text_entry(job_id: str = "job-t", *, lease_left_s: float = 150.0) -> JournalEntry:
    return JournalEntry(job_id, "text", None, "HORDEREQ_ffeeddccbbaa", NOW + lease_left_s)


def on_disk(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text("utf-8")))


#: The clocks' mark the journal writes in these tests: the fixed NOW, no boot clock.
MARK = {"wall": NOW, "boot_id": "", "boottime": None}


@pytest.fixture(autouse=True)
def _fixed_clock_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal's clocks read as the tests' fixed wall clock (NOW), with no boot clock."""
    monkeypatch.setattr(
        journal_mod, "clock_mark", lambda wall=None: ClockMark(NOW if wall is None else wall)
    )


@pytest.fixture(autouse=True)
def _journal_logs_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """The operator's log: INFO and above, whatever level an earlier test left behind."""
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat.journal")


def journal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The journal's log lines at INFO and above (debug lines are not the operator's)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "koboldcpp_horde_chat.journal" and r.levelno >= logging.INFO
    ]


# --- entries --------------------------------------------------------------------------


def test_an_entry_round_trips_through_json() -> None:
    for entry in (chat_entry(), text_entry(), chat_entry(genkey="", model_id=None)):
        assert JournalEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry


def test_an_entry_as_json_holds_the_five_fields_only() -> None:
    assert chat_entry().to_json() == {
        "job_id": "job-1",
        "kind": "chat",
        "model_id": MODEL,
        "genkey": "HORDEREQ_0a1b2c3d4e5f",
        "lease_end": NOW + 150.0,
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"job_id": ""}, "job_id"),
        ({"job_id": 7}, "job_id"),
        ({"kind": "image"}, "kind"),
        ({"kind": ["chat"]}, "kind"),
        ({"model_id": 3}, "model_id"),
        ({"genkey": "KCPP_1234"}, "genkey"),
        ({"genkey": None}, "genkey"),
        ({"lease_end": "soon"}, "lease_end"),
        ({"lease_end": True}, "lease_end"),
        ({"lease_end": float("inf")}, "lease_end"),
        ({"lease_end": float("nan")}, "lease_end"),
        ({"lease_end": 10**400}, "lease_end"),
    ],
)
def test_an_entry_of_the_wrong_shape_is_refused_naming_the_field(
    change: dict[str, Any], field: str
) -> None:
    obj = {**chat_entry().to_json(), **change}
    with pytest.raises(ValueError, match=field):
        JournalEntry.from_json(obj)


@pytest.mark.parametrize("missing", ["job_id", "kind", "genkey", "lease_end"])
def test_an_entry_missing_a_field_is_refused(missing: str) -> None:
    obj = chat_entry().to_json()
    del obj[missing]
    with pytest.raises(ValueError, match=missing):
        JournalEntry.from_json(obj)


def test_an_entry_without_model_id_reads_as_none_and_extra_keys_are_ignored() -> None:
    obj = chat_entry().to_json()
    del obj["model_id"]
    obj["later_field"] = {"x": 1}
    assert JournalEntry.from_json(obj).model_id is None


# --- paths ------------------------------------------------------------------------------


HOME = Path("/home/ann")


def test_linux_uses_xdg_state_home_when_absolute() -> None:
    got = default_state_dir(platform="linux", environ={"XDG_STATE_HOME": "/var/xdg"}, home=HOME)
    assert got == Path("/var/xdg") / APP_DIR_NAME


@pytest.mark.parametrize("environ", [{}, {"XDG_STATE_HOME": ""}, {"XDG_STATE_HOME": "rel/state"}])
def test_linux_falls_back_to_local_state_under_home(environ: dict[str, str]) -> None:
    got = default_state_dir(platform="linux", environ=environ, home=HOME)
    assert got == HOME / ".local" / "state" / "koboldcpp-horde-chat"


def test_other_unix_follows_the_linux_rules() -> None:
    assert default_state_dir(platform="freebsd14", environ={}, home=HOME) == (
        HOME / ".local" / "state" / APP_DIR_NAME
    )
    assert default_state_dir(
        platform="freebsd14", environ={"XDG_STATE_HOME": "/x"}, home=HOME
    ) == Path("/x") / APP_DIR_NAME


def test_macos_uses_application_support_and_ignores_xdg() -> None:
    got = default_state_dir(platform="darwin", environ={"XDG_STATE_HOME": "/var/xdg"}, home=HOME)
    assert got == HOME / "Library" / "Application Support" / "koboldcpp-horde-chat"


def test_windows_uses_localappdata() -> None:
    local = "C:\\Users\\ann\\AppData\\Local"
    got = default_state_dir(platform="win32", environ={"LOCALAPPDATA": local}, home=HOME)
    assert got == Path(local) / APP_DIR_NAME


@pytest.mark.parametrize("environ", [{}, {"LOCALAPPDATA": ""}, {"LOCALAPPDATA": "relative\\dir"}])
def test_windows_falls_back_to_appdata_local_under_home(environ: dict[str, str]) -> None:
    got = default_state_dir(platform="win32", environ=environ, home=HOME)
    assert got == HOME / "AppData" / "Local" / APP_DIR_NAME


def test_without_home_the_users_home_is_used() -> None:
    got = default_state_dir(platform="linux", environ={})
    assert got == Path.home() / ".local" / "state" / APP_DIR_NAME


def test_journal_path_is_a_readable_slug_and_a_hash_of_the_exact_name(tmp_path: Path) -> None:
    path = journal_path("My Worker", tmp_path)
    assert path.parent == tmp_path
    name = path.name
    assert name.startswith("jobs-My_Worker-") and name.endswith(".json")
    digest = name[len("jobs-My_Worker-") : -len(".json")]
    assert len(digest) == 8 and all(c in "0123456789abcdef" for c in digest)
    assert journal_path("My Worker", tmp_path) == path  # stable


def test_distinct_names_get_distinct_paths(tmp_path: Path) -> None:
    names = ["My Worker", "my_worker", "My_Worker", "my worker", "My Worker ", "Ünïcode", "x" * 300,
             "x" * 301, "../../etc/passwd", "", "   "]
    paths = [journal_path(n, tmp_path) for n in names]
    assert len(set(paths)) == len(names)
    assert len({p.name.lower() for p in paths}) == len(names)  # case-insensitive file systems too
    for p in paths:
        assert p.parent == tmp_path
        assert all(c.isascii() and (c.isalnum() or c in "._-") for c in p.name), p.name
        assert len(p.name) <= len("jobs--12345678.json") + 40


# --- the journal file ---------------------------------------------------------------------


def test_add_returns_with_the_entry_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "state" / "jobs.json"
    journal = Journal(path)
    journal.add(chat_entry())
    assert on_disk(path) == {"version": 2, "jobs": [chat_entry().to_json()], "clock": MARK}
    journal.add(text_entry())
    assert [j["job_id"] for j in on_disk(path)["jobs"]] == ["job-1", "job-t"]
    journal.remove("job-1")
    assert on_disk(path)["jobs"] == [text_entry().to_json()]
    assert journal.load() == [text_entry()]


def test_an_add_on_a_jobs_path_is_a_plain_write_that_a_killed_process_leaves_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a SIGKILL must survive the kernel keeps: the job's path waits for no disk."""
    path = tmp_path / "jobs.json"
    order: list[str] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        order.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", lambda fd: order.append("fsync"))
    monkeypatch.setattr(os, "replace", replace)
    Journal(path).add(chat_entry())
    assert order == ["replace"]
    assert on_disk(path) == {"version": 2, "jobs": [chat_entry().to_json()], "clock": MARK}


def test_the_directory_is_made_on_the_first_write_private(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "jobs.json"
    journal = Journal(path)
    journal.load()
    assert not path.parent.exists()  # reading creates nothing
    journal.add(chat_entry())
    assert path.exists()
    if os.name != "nt":
        assert path.parent.stat().st_mode & 0o777 == 0o700


def test_adding_the_same_job_again_replaces_its_entry(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "jobs.json")
    journal.add(chat_entry(genkey=""))
    journal.add(chat_entry(lease_left_s=600.0))
    assert journal.load() == [chat_entry(lease_left_s=600.0)]
    assert len(on_disk(journal.path)["jobs"]) == 1


def test_removing_an_unknown_job_writes_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "jobs.json")
    journal.remove("nobody")
    assert not journal.path.exists()


def test_a_restart_loads_what_the_last_process_recorded(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    first = Journal(path)
    first.add(chat_entry("a"))
    first.add(text_entry("b"))
    first.add(chat_entry("c"))
    first.remove("c")
    assert Journal(path).load() == [chat_entry("a"), text_entry("b")]


def test_a_change_before_load_keeps_the_last_process_entries(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    Journal(path).add(chat_entry("old"))
    journal = Journal(path)
    journal.add(chat_entry("new"))
    assert [e.job_id for e in Journal(path).load()] == ["old", "new"]


def test_a_missing_file_is_an_empty_journal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat.journal")
    assert Journal(tmp_path / "none.json").load() == []
    assert [r for r in caplog.records if r.name == "koboldcpp_horde_chat.journal"] == []


def test_the_file_holds_no_key_password_or_conversation_text(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "jobs.json")
    journal.add(chat_entry())
    journal.add(text_entry())
    raw = journal.path.read_text("utf-8")
    assert API_KEY not in raw and SECRET_TEXT not in raw
    for job in on_disk(journal.path)["jobs"]:
        assert set(job) == {"job_id", "kind", "model_id", "genkey", "lease_end"}


def test_two_threads_adding_and_removing_leave_a_consistent_file(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    journal = Journal(path)
    journal.load()
    errors: list[BaseException] = []

    def ids_on_disk() -> set[str]:
        return {j["job_id"] for j in on_disk(path)["jobs"]}

    def loop(prefix: str) -> None:
        try:
            for i in range(60):
                job_id = f"{prefix}-{i}"
                journal.add(chat_entry(job_id))
                # The other thread never touches this job: the file must show each change.
                assert job_id in ids_on_disk(), f"{job_id} not on disk after add"
                if i % 3:
                    journal.remove(job_id)
                    assert job_id not in ids_on_disk(), f"{job_id} on disk after remove"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(p,)) for p in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    expected = {f"{p}-{i}" for p in ("a", "b") for i in range(60) if i % 3 == 0}
    assert {e.job_id for e in journal.load()} == expected
    assert {e.job_id for e in Journal(path).load()} == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.json"]


# --- unreadable files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage \x00\xff",
        b'{"version": 1, "jobs": [{"job_id": "a", "kind": "chat"',  # cut short by a crash
        b"[]",
        b'{"version": 1}',
        b'{"version": 1, "jobs": {}}',
        b'{"version": 0, "jobs": []}',
        b"[" * 100_000,
        b" " * (1024 * 1024 + 1),
    ],
    ids=["empty", "garbage", "partial", "array", "no-jobs", "jobs-object", "version-0", "deep",
         "huge"],
)
def test_an_unreadable_file_is_set_aside_in_one_line_and_not_fatal(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat.journal")
    path = tmp_path / "jobs.json"
    path.write_bytes(content)
    journal = Journal(path)
    assert journal.load() == []
    aside = list(tmp_path.glob("jobs.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert not path.exists()
    lines = journal_lines(caplog)
    assert len(lines) == 1 and "set aside" in lines[0] and "\n" not in lines[0]
    assert "Traceback" not in caplog.text
    journal.add(chat_entry())  # the worker keeps journaling
    assert Journal(path).load() == [chat_entry()]


def test_an_unreadable_file_that_cannot_be_moved_is_left_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "jobs.json"
    path.write_bytes(b"not json")

    def refuse(src: Any, dst: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    assert Journal(path).load() == []
    lines = journal_lines(caplog)
    assert len(lines) == 1 and "left in place" in lines[0]
    assert path.read_bytes() == b"not json"


def test_entries_of_the_wrong_shape_are_skipped_and_the_rest_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "jobs.json"
    bad = {**chat_entry("bad").to_json(), "genkey": "sk-" + API_KEY}
    huge = {**chat_entry("huge").to_json(), "lease_end": 10**400}
    path.write_text(json.dumps({"version": 2, "jobs": [
        chat_entry("a").to_json(), "text", bad, {"job_id": "b"}, huge, text_entry("c").to_json(),
    ]}))
    assert Journal(path).load() == [chat_entry("a"), text_entry("c")]
    lines = journal_lines(caplog)
    assert len(lines) == 4
    assert all("skipped" in line for line in lines)
    assert API_KEY not in caplog.text  # the value is never logged
    assert path.exists()  # a readable file is not set aside


# --- write failures ----------------------------------------------------------------------------


@pytest.mark.skipif(os.name == "nt" or os.geteuid() == 0, reason="needs POSIX permissions, not root")
def test_a_read_only_directory_logs_one_line_and_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        journal = Journal(directory / "jobs.json")
        for i in range(5):
            journal.add(chat_entry(f"j{i}"))
            journal.remove(f"j{i}")
        lines = journal_lines(caplog)
        assert len(lines) == 1 and "cannot be written" in lines[0]
    finally:
        directory.chmod(0o700)


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("replace", OSError(errno.EROFS, "Read-only file system")),
        ("mkstemp", PermissionError(errno.EACCES, "Permission denied")),
    ],
)
def test_a_failing_write_is_logged_once_retried_and_its_recovery_logged_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
    error: OSError,
) -> None:
    import tempfile

    path = tmp_path / "jobs.json"
    journal = Journal(path)
    journal.add(chat_entry("before"))
    target: Any = tempfile if where == "mkstemp" else os
    real = getattr(target, where)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(target, where, fail)
    for i in range(5):
        journal.add(chat_entry(f"during-{i}"))  # never raises
    lines = journal_lines(caplog)
    assert len(lines) == 1
    assert "cannot be written" in lines[0] and error.strerror in lines[0]
    assert "Traceback" not in caplog.text and "\n" not in lines[0]
    assert [j["job_id"] for j in on_disk(path)["jobs"]] == ["before"]  # the last good file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.json"]  # no temp file left

    monkeypatch.setattr(target, where, real)
    journal.add(chat_entry("after"))
    journal.add(chat_entry("after-2"))
    lines = journal_lines(caplog)
    assert len(lines) == 2 and "written again" in lines[1]
    assert [e.job_id for e in Journal(path).load()] == [
        "before", "during-0", "during-1", "during-2", "during-3", "during-4", "after", "after-2",
    ]


def test_a_state_dir_that_is_a_file_is_a_write_failure_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the directory should be")
    journal = Journal(blocker / "jobs.json")
    journal.add(chat_entry())
    assert journal.load() == [chat_entry()]
    lines = journal_lines(caplog)
    assert len(lines) == 1 and "a file is in the way of its directory" in lines[0]


# --- recovery -------------------------------------------------------------------------------


class Wall:
    """The recovery's clock (``clock.Clock``), still until a pause or a test moves it:
    epoch and monotonic seconds are both ``now``."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def timer(self, seconds: float, action: Any, *, name: str) -> Any:
        raise AssertionError("the recovery sets no timer")


class ScriptedHorde:
    """Answers each submit with the next scripted item: a dict, or an exception to raise."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.bodies: list[dict[str, Any]] = []
        self.timeouts: list[float] = []

    def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        self.bodies.append(json.loads(json.dumps(body)))
        self.timeouts.append(timeout_s)
        item = self.script.pop(0) if self.script else {"reward": 0}
        if isinstance(item, BaseException):
            raise item
        return dict(item)


class RecordingBackend:
    def __init__(self, fail: bool = False) -> None:
        self.aborts: list[tuple[str, float]] = []
        self.fail = fail

    def abort(self, genkey: str, *, timeout_s: float) -> bool:
        self.aborts.append((genkey, timeout_s))
        if self.fail:
            raise BackendError("connection refused")
        return True


class Pauses:
    """The recovery's stop (``recovery.RecoveryStop``) that never comes; its pauses
    move the wall clock."""

    def __init__(self, wall: Wall) -> None:
        self.wall = wall
        self.waited: list[float] = []

    def pause(self, seconds: float) -> None:
        self.waited.append(seconds)
        self.wall.now += seconds

    def last_attempt_at(self) -> float | None:
        return None


def journal_with(tmp_path: Path, *entries: JournalEntry) -> Path:
    path = tmp_path / "jobs.json"
    first = Journal(path)
    for entry in entries:
        first.add(entry)
    return path


def run_recover(
    path: Path, horde: ScriptedHorde, backend: RecordingBackend | None = None,
    wall: Wall | None = None,
) -> tuple[RecoveryResult, Pauses]:
    wall = wall or Wall()
    pauses = Pauses(wall)
    result = recover(
        Journal(path), horde=horde, backend=backend or RecordingBackend(), clock=wall,
        model_id_default="koboldcpp/default", submit_timeout_s=7.0, abort_timeout_s=1.5,
        stop=pauses,  # type: ignore[arg-type]
    )
    return result, pauses


def job_lines(caplog: pytest.LogCaptureFixture, job_id: str) -> list[str]:
    return [line for line in journal_lines(caplog) if f"job={job_id} " in line]


def test_a_chat_job_in_lease_is_aborted_and_faulted_after_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = journal_with(tmp_path, chat_entry())
    horde, backend = ScriptedHorde({"reward": 0}), RecordingBackend()
    result, _ = run_recover(path, horde, backend)
    assert result == RecoveryResult(faulted=1)
    assert backend.aborts == [("HORDEREQ_0a1b2c3d4e5f", 1.5)]
    assert horde.bodies == [{"id": "job-1", "state": "faulted", "model_id": MODEL}]
    assert horde.timeouts == [7.0]
    lines = job_lines(caplog, "job-1")
    assert len(lines) == 1 and "faulted after a restart" in lines[0]
    assert Journal(path).load() == []


def test_a_text_job_is_faulted_in_its_own_shape(tmp_path: Path) -> None:
    path = journal_with(tmp_path, text_entry())
    horde = ScriptedHorde()
    result, _ = run_recover(path, horde)
    assert result.faulted == 1
    assert horde.bodies == [{"id": "job-t", "generation": "", "state": "faulted"}]


def test_a_chat_entry_without_model_id_faults_with_the_default(tmp_path: Path) -> None:
    path = journal_with(tmp_path, chat_entry(model_id=None, genkey=""))
    horde, backend = ScriptedHorde(), RecordingBackend()
    run_recover(path, horde, backend)
    assert horde.bodies == [{"id": "job-1", "state": "faulted", "model_id": "koboldcpp/default"}]
    assert backend.aborts == []  # no generation was started: nothing to abort


def test_the_fault_bodies_and_the_abort_carry_no_api_key(tmp_path: Path) -> None:
    path = journal_with(tmp_path, chat_entry("a"), text_entry("b"))
    horde, backend = ScriptedHorde(), RecordingBackend()
    run_recover(path, horde, backend)
    assert API_KEY not in json.dumps(horde.bodies)
    for body in horde.bodies:
        assert not {"apikey", "api_key", "key"} & set(body)
    assert [genkey for genkey, _ in backend.aborts] == ["HORDEREQ_0a1b2c3d4e5f", "HORDEREQ_ffeeddccbbaa"]


@pytest.mark.parametrize(
    "answer",
    [
        HordeRefusal("This job has ended.", status=400, rc="AbortedGen"),
        HordeRefusal("Already submitted.", status=400, rc="DuplicateGen"),
        HordeRefusal("No job with this id.", status=404, rc="InvalidJobID"),
    ],
    ids=["AbortedGen", "DuplicateGen", "404"],
)
def test_a_job_the_horde_already_ended_is_settled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: HordeRefusal
) -> None:
    caplog.set_level(logging.INFO)
    path = journal_with(tmp_path, chat_entry())
    horde = ScriptedHorde(answer)
    result, _ = run_recover(path, horde)
    assert result == RecoveryResult(settled=1)
    assert len(horde.bodies) == 1  # never sent again
    lines = job_lines(caplog, "job-1")
    assert len(lines) == 1 and "already settled" in lines[0]
    assert Journal(path).load() == []


def test_an_unavailable_horde_is_tried_again_within_the_lease(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault the Horde did not take (503, a refused connection) goes again."""
    caplog.set_level(logging.INFO)
    path = journal_with(tmp_path, chat_entry())
    horde = ScriptedHorde(
        HordeUnavailable("submit: HTTP 503", status=503),
        HordeUnavailable("submit: connection refused", status=0, sent=False),
        {"reward": 0},
    )
    result, pauses = run_recover(path, horde)
    assert result == RecoveryResult(faulted=1)
    assert len(horde.bodies) == 3 and horde.bodies[0] == horde.bodies[2]
    assert pauses.waited == [1.0, 2.0]
    lines = job_lines(caplog, "job-1")
    assert len(lines) == 1 and "faulted after a restart" in lines[0]


def test_retry_after_sets_the_pause_up_to_thirty_seconds(tmp_path: Path) -> None:
    path = journal_with(tmp_path, chat_entry())
    horde = ScriptedHorde(
        HordeUnavailable("429", status=429, retry_after_s=3.0),
        HordeUnavailable("429", status=429, retry_after_s=600.0),
    )
    result, pauses = run_recover(path, horde)
    assert result.faulted == 1
    assert pauses.waited == [3.0, 30.0]


def test_an_unavailable_horde_past_the_lease_leaves_the_job_to_expire(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = journal_with(tmp_path, chat_entry(lease_left_s=8.5))
    horde = ScriptedHorde(*[HordeUnavailable("submit: HTTP 503", status=503)] * 5)
    result, pauses = run_recover(path, horde)
    assert result == RecoveryResult(failed=1)
    # 3.5 s of lease beyond the fault's 5 s margin: the pause after the third
    # attempt (4 s) would end past it.
    assert len(horde.bodies) == 3
    assert pauses.waited == [1.0, 2.0]
    lines = job_lines(caplog, "job-1")
    assert len(lines) == 1 and "left to expire" in lines[0]
    assert Journal(path).load() == []


def test_three_503s_at_start_do_not_give_a_recoverable_job_up(tmp_path: Path) -> None:
    """The Horde answers 503 three times, then takes the fault: tried until it answers."""
    path = journal_with(tmp_path, chat_entry(lease_left_s=150.0))
    horde = ScriptedHorde(*[HordeUnavailable("submit: HTTP 503", status=503)] * 5, {"reward": 0})
    result, pauses = run_recover(path, horde)
    assert result == RecoveryResult(faulted=1)
    assert len(horde.bodies) == 6
    assert pauses.waited == [1.0, 2.0, 4.0, 8.0, 16.0]


@pytest.mark.parametrize(
    "lost",
    [
        HordeUnavailable("submit: no answer in time", status=0),
        HordeUnavailable("submit: connection lost", status=0, sent=None),
        HordeUnavailable("submit: HTTP 502", status=502, sent=True),
        HordeUnavailable("submit: HTTP 504", status=504, sent=True),
    ],
    ids=["timeout", "reset", "502", "504"],
)
def test_a_fault_whose_answer_was_lost_is_not_sent_again(
    tmp_path: Path, lost: HordeUnavailable
) -> None:
    """The Horde may have taken it: a second fault would re-open the request again."""
    path = journal_with(tmp_path, chat_entry(lease_left_s=600.0))
    horde = ScriptedHorde(lost, {"reward": 0})
    result, pauses = run_recover(path, horde)
    assert result == RecoveryResult(failed=1)
    assert len(horde.bodies) == 1 and pauses.waited == []
    assert Journal(path).load() == []


def test_another_refusal_of_the_fault_leaves_the_job_to_expire(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = journal_with(tmp_path, chat_entry(), chat_entry("job-2"))
    horde = ScriptedHorde(HordeRefusal("Bad request.", status=400, rc="BadRequest"))
    result, _ = run_recover(path, horde)
    assert result == RecoveryResult(faulted=1, failed=1)
    assert len(job_lines(caplog, "job-1")) == 1 and "left to expire" in job_lines(caplog, "job-1")[0]
    assert Journal(path).load() == []


@pytest.mark.parametrize(
    "refusal",
    [
        HordeRefusal("No user matching sent API Key.", status=401, rc="InvalidAPIKey"),
        HordeRefusal("Wrong credentials.", status=403, rc="WrongCredentials"),
    ],
    ids=["401", "403"],
)
def test_a_refused_key_stops_the_recovery_and_keeps_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, refusal: HordeRefusal
) -> None:
    path = journal_with(
        tmp_path, chat_entry("old", lease_left_s=-5.0), chat_entry("a"), text_entry("b")
    )
    horde = ScriptedHorde(refusal)
    result, _ = run_recover(path, horde)
    assert result == RecoveryResult(expired=1, kept=2, key_refused=True)
    assert [b["id"] for b in horde.bodies] == ["a"]  # nothing sent after the refusal
    assert [e.job_id for e in Journal(path).load()] == ["a", "b"]
    for job_id in ("old", "a", "b"):
        assert len(job_lines(caplog, job_id)) == 1
    assert "refused the API key" in job_lines(caplog, "a")[0]


def test_an_expired_entry_is_dropped_without_sending_anything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = journal_with(tmp_path, chat_entry(lease_left_s=-30.0), text_entry(lease_left_s=0.0))
    horde, backend = ScriptedHorde(), RecordingBackend()
    result, _ = run_recover(path, horde, backend)
    assert result == RecoveryResult(expired=2)
    assert horde.bodies == [] and backend.aborts == []
    lines = job_lines(caplog, "job-1")
    assert len(lines) == 1 and "expired" in lines[0] and "30 s ago" in lines[0]
    assert len(job_lines(caplog, "job-t")) == 1
    assert Journal(path).load() == []


def test_a_failing_abort_does_not_stop_the_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="koboldcpp_horde_chat.journal")
    path = journal_with(tmp_path, chat_entry())
    horde, backend = ScriptedHorde(), RecordingBackend(fail=True)
    result, _ = run_recover(path, horde, backend)
    assert result.faulted == 1
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "abort" in r.getMessage()]
    assert len(debug) == 1


def test_each_job_is_removed_as_it_is_processed(tmp_path: Path) -> None:
    path = journal_with(tmp_path, chat_entry("a"), chat_entry("b"))
    seen: list[list[str]] = []

    class Watching(ScriptedHorde):
        def submit(self, body: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
            seen.append([j["job_id"] for j in on_disk(path)["jobs"]])
            return super().submit(body, timeout_s=timeout_s)

    run_recover(path, Watching())
    assert seen == [["a", "b"], ["b"]]
    assert on_disk(path)["jobs"] == []


def test_an_empty_journal_recovers_nothing_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    horde = ScriptedHorde()
    result, _ = run_recover(tmp_path / "jobs.json", horde)
    assert result == RecoveryResult() and result.total == 0
    assert horde.bodies == [] and journal_lines(caplog) == []


def test_a_mixed_journal_gets_one_summary_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = journal_with(
        tmp_path, chat_entry("a"), chat_entry("b"), chat_entry("c", lease_left_s=-1.0)
    )
    horde = ScriptedHorde({"reward": 0}, HordeRefusal("ended", status=400, rc="AbortedGen"))
    result, _ = run_recover(path, horde)
    assert result == RecoveryResult(faulted=1, settled=1, expired=1)
    assert result.total == 3
    summary = [line for line in journal_lines(caplog) if "job=" not in line]
    assert summary == [
        "jobs in hand at the last stop: 1 faulted, 1 already settled, 1 expired, "
        "0 left to expire, 0 kept in the journal"
    ]


def test_only_one_journal_object_at_a_time_holds_a_journal_file(tmp_path: Path) -> None:
    """Two processes serving one worker name would fault each other's jobs at start:
    the second cannot take the journal while the first holds it."""
    path = tmp_path / "state" / "jobs.json"
    first, second = Journal(path), Journal(path)
    assert first.lock() is None
    assert first.lock() is None  # taking it again is a no-op
    assert second.lock() == os.getpid()
    other = Journal(tmp_path / "state" / "jobs-other.json")
    assert other.lock() is None  # another worker name is another journal


@pytest.mark.parametrize(
    ("where", "reason"),
    [("a file in the way", "a file is in the way of its directory"),
     ("/proc/nope", "No such file or directory")],
)  # fmt: skip
def test_a_journal_whose_directory_cannot_be_used_is_not_claimed_and_the_host_is_told_why(
    where: str, reason: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The host decides: exit 2 for a directory the operator named, else crash recovery off."""
    if where == "a file in the way":
        (tmp_path / "state").write_text("a file where the directory should be")
        directory = tmp_path / "state"
    else:
        directory = Path(where)
    with pytest.raises(OSError) as raised:
        Journal(directory / "jobs.json").lock()
    assert journal_mod.reason(raised.value) == reason
    assert caplog.records == []  # the host says it, once


def test_the_host_runs_without_a_journal_when_its_directory_cannot_be_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = WorkerSettings(
        api_key="k", worker_name="w", model_id="m", backend_max_context_length=4096,
        horde_url="http://127.0.0.1:9", kcpp_url="http://127.0.0.1:9",
    )  # fmt: skip
    stop = threading.Event()
    recovery = hosting.start_recovery(settings, Path("/proc/nope"), stop, journal_setting="--journal-dir")
    state = hosting.new_state(settings, recovery, CallDeadlines(), stop)
    assert state.journal is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "job journal directory /proc/nope cannot be used (No such file or directory): crash "
            "recovery is off, so a job in hand when the worker dies is left to expire on the "
            "Horde; point --journal-dir at a writable directory to turn it on",
        )
    ]


def test_an_explicit_journal_directory_that_cannot_be_used_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as raised:
        hosting.check_journal_dir(Path("/proc/nope"), "--journal-dir")
    assert str(raised.value) == (
        "--journal-dir /proc/nope: the job journal cannot be kept there (No such file or directory)"
    )
    hosting.check_journal_dir(tmp_path / "new" / "dir", "--journal-dir")  # made, and writable
    assert (tmp_path / "new" / "dir").is_dir() and list((tmp_path / "new" / "dir").iterdir()) == []


def test_a_fault_not_written_now_goes_out_with_the_next_flush(tmp_path: Path) -> None:
    """A fault counted rides along with the next write, or with a flush when the loop is idle."""
    path = tmp_path / "jobs.json"
    journal = Journal(path)
    journal.add(chat_entry("a"))
    journal.record_fault(NOW)
    assert "faults" not in on_disk(path)  # not written yet
    journal.flush()
    assert on_disk(path)["faults"] == [NOW]
    mtime = path.stat().st_mtime_ns
    journal.flush()  # nothing pending: no write
    assert path.stat().st_mtime_ns == mtime


# --- the faults the Horde counts toward maintenance, kept for the next process -------------


def test_faults_are_kept_for_an_hour_and_read_by_the_next_process(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    first = Journal(path)
    first.record_fault(NOW - 4000.0)
    first.record_fault(NOW - 60.0)
    first.add(chat_entry())  # written with the next change, as a removal is
    assert on_disk(path)["faults"] == [NOW - 60.0]  # the one over an hour old is dropped
    later = Journal(path)
    assert later.recent_faults(NOW) == [NOW - 60.0]
    assert later.recent_faults(NOW + 3600.0) == []  # an hour after it, the Horde forgot it too


def test_a_journal_without_faults_writes_none_and_bad_ones_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    Journal(path).add(chat_entry())
    assert "faults" not in on_disk(path)  # the file as before, when nothing faulted
    path.write_text(
        json.dumps({"version": 2, "jobs": [], "faults": ["x", True, None, NOW - 5, 1e999]})
    )
    assert Journal(path).recent_faults(NOW) == [NOW - 5]


@pytest.mark.parametrize(
    ("entry", "answer", "counted"),
    [
        (chat_entry(), {"reward": 0}, 1),  # faulted: an aborted job on the Horde
        (chat_entry(lease_left_s=-10.0), {"reward": 0}, 1),  # expired while down: aborted too
        (chat_entry(), HordeRefusal("This job has ended.", status=400, rc="AbortedGen"), 0),
    ],
    ids=["faulted", "expired", "settled"],
)
def test_the_recovery_keeps_the_jobs_the_horde_counts_as_aborted(
    tmp_path: Path, entry: JournalEntry, answer: Any, counted: int
) -> None:
    path = journal_with(tmp_path, entry)
    run_recover(path, ScriptedHorde(answer))
    assert len(Journal(path).recent_faults(NOW)) == counted
