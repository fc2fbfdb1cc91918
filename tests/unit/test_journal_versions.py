"""The journal's format version across releases and the Horde each job came from:
a file is read only by the rules it was written by (0.1.0's is set aside whole, a
newer program's set aside and left alone), and a start against another Horde
leaves that Horde's jobs alone, in the journal for a start against it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from koboldcpp_horde_chat.service.recovery import recover
from koboldcpp_horde_chat.state import journal as journal_mod
from koboldcpp_horde_chat.state.journal import Journal
from koboldcpp_horde_chat.state.journal_rules import ClockMark
from tests.unit.test_journal import (
    MARK,
    NOW,
    Pauses,
    RecordingBackend,
    ScriptedHorde,
    Wall,
    chat_entry,
    journal_lines,
    on_disk,
    run_recover,
    text_entry,
)

HORDE_A = "https://a.example"
HORDE_B = "https://b.example"


@pytest.fixture(autouse=True)
def _fixed_clock_mark(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(
        journal_mod, "clock_mark", lambda wall=None: ClockMark(NOW if wall is None else wall)
    )
    caplog.set_level(logging.INFO, logger="koboldcpp_horde_chat.journal")


def _released_0_1_0_file(path: Path) -> bytes:
    """A journal as 0.1.0 wrote it: version 1, no clock, no terminal; each lease end
    the pop plus the 200 s lease cap (the Horde's 150 s lease ended 50 s ago)."""
    raw = json.dumps({"version": 1, "jobs": [
        {"job_id": "old-1", "kind": "chat", "model_id": "m", "genkey": "HORDEREQ_aa",
         "lease_end": NOW + 150.0},
        {"job_id": "old-2", "kind": "text", "model_id": None, "genkey": "",
         "lease_end": NOW + 20.0},
    ], "faults": [NOW - 30.0]}).encode()
    path.write_bytes(raw)
    return raw


def test_a_journal_of_0_1_0_is_set_aside_whole_and_none_of_its_jobs_is_faulted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """0.1.0's lease ends are the lease cap, not the Horde's lease: read as today's,
    a job that already expired would be faulted (re-opening its request)."""
    path = tmp_path / "jobs.json"
    raw = _released_0_1_0_file(path)
    horde = ScriptedHorde()
    result, _ = run_recover(path, horde)
    assert horde.bodies == [] and result.total == 0
    aside = list(tmp_path.glob("jobs.json.version-1-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == raw
    assert not path.exists()
    lines = journal_lines(caplog)
    assert len(lines) == 1, lines
    assert "was written by version 0.1.0 of the worker (format 1" in lines[0]
    assert f"set aside as {aside[0].name}; its 2 jobs get nothing from this start" in lines[0]


def test_a_version_1_file_with_a_clock_is_read_by_todays_rules(tmp_path: Path) -> None:
    """The development tree wrote the true lease and the terminal action in a
    version 1 file with a clock: its kept reply is sent again as today's."""
    path = tmp_path / "jobs.json"
    reply = {"id": "job-1", "state": "ok", "message": {"role": "assistant", "content": "hi"}}
    entry = chat_entry(terminal="reply_sent", reply=reply)
    path.write_text(json.dumps({"version": 1, "jobs": [entry.to_json()], "clock": MARK}))
    horde = ScriptedHorde({"reward": 3})
    result, _ = run_recover(path, horde)
    assert horde.bodies == [reply] and result.replied == 1


def test_a_journal_of_a_newer_version_is_set_aside_and_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "jobs.json"
    raw = json.dumps({"version": 3, "jobs": [chat_entry().to_json()], "clock": MARK}).encode()
    path.write_bytes(raw)
    horde = ScriptedHorde()
    result, _ = run_recover(path, horde)
    assert horde.bodies == [] and result.total == 0
    aside = list(tmp_path.glob("jobs.json.version-3-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == raw
    lines = journal_lines(caplog)
    assert len(lines) == 1 and (
        "was written by a newer version of the worker (format 3; this one reads up to 2); "
        f"set aside as {aside[0].name}; its 1 job gets nothing from this start"
    ) in lines[0]


def test_todays_file_has_a_version_0_1_0_does_not_read(tmp_path: Path) -> None:
    """0.1.0 sets aside any file whose version is not 1 (it does not know
    ``terminal``, and would fault a job whose reply the Horde accepted)."""
    path = tmp_path / "jobs.json"
    Journal(path, horde=HORDE_A).add(chat_entry())
    assert on_disk(path)["version"] == 2


def test_each_entry_records_the_horde_it_was_popped_from(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    journal = Journal(path)
    journal.serve(HORDE_A + "/")
    journal.add(chat_entry())
    assert on_disk(path)["jobs"][0]["horde"] == HORDE_A
    assert Journal(path).load() == [chat_entry(horde=HORDE_A)]


def test_a_start_against_another_horde_leaves_those_jobs_alone_and_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "jobs.json"
    first = Journal(path, horde=HORDE_A)
    first.add(chat_entry("a-1"))
    first.add(text_entry("a-2"))
    on_b = Journal(path, horde=HORDE_B)
    horde = ScriptedHorde()
    wall = Wall()
    result = recover(on_b, horde=horde, backend=RecordingBackend(), clock=wall,
                     model_id_default="d", stop=Pauses(wall))  # type: ignore[arg-type]
    assert horde.bodies == [] and result.total == 0
    lines = journal_lines(caplog)
    assert lines == [
        f"job journal: 2 jobs popped from {HORDE_A} left alone (this start serves {HORDE_B}); "
        "kept in the journal for a start against that Horde"
    ]
    assert {e.job_id for e in Journal(path).load()} == {"a-1", "a-2"}
    # A start against their Horde ends them.
    on_a = Journal(path, horde=HORDE_A)
    result = recover(on_a, horde=horde, backend=RecordingBackend(), clock=wall,
                     model_id_default="d", stop=Pauses(wall))  # type: ignore[arg-type]
    assert result.faulted == 2 and Journal(path).load() == []
