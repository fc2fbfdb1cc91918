"""The systemd unit a packager ships (``contrib/koboldcpp-horde-chat.service``).

Its key settings are read from the file (always); ``systemd-analyze verify``
checks it as systemd would load it where that tool is installed (Debian's
``systemd`` package), and the test says why it skips elsewhere.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from koboldcpp_horde_chat.service.standalone import DEFAULT_STOP_GRACE_S, build_parser

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "contrib" / "koboldcpp-horde-chat.service"


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}``; comments and blank lines skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        header = re.fullmatch(r"\[(\w+)\]", line)
        if header:
            current = sections.setdefault(header.group(1), {})
            continue
        assert current is not None, f"a setting before any section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return unit_settings(UNIT.read_text(encoding="utf-8"))


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"{section}.{key}: {values}"
    return values[0]


def exec_start(unit: dict[str, dict[str, list[str]]]) -> list[str]:
    return shlex.split(one(unit, "Service", "ExecStart"))


def test_the_service_runs_as_a_user_of_its_own(unit: dict[str, dict[str, list[str]]]) -> None:
    service = unit["Service"]
    assert service.get("DynamicUser") == ["yes"] or service.get("User", ["root"])[0] != "root"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"


def test_the_journal_is_kept_in_the_state_directory_systemd_makes(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    state = one(unit, "Service", "StateDirectory")
    argv = exec_start(unit)
    assert argv[argv.index("--journal-dir") + 1] == f"%S/{state}"  # %S: /var/lib


def test_the_api_key_comes_from_an_environment_file_never_the_command_line(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    assert one(unit, "Service", "EnvironmentFile").startswith("/etc/")
    argv = exec_start(unit)
    assert "--hordekey" not in argv and "--kcpp-password" not in argv
    assert not [a for a in argv if "KEY" in a or "PASSWORD" in a]
    assert "Environment" not in unit["Service"]  # no key written into the unit either
    # The worker reads the key from AI_HORDE_API_KEY (the file's variable).
    assert "AI_HORDE_API_KEY=" in UNIT.read_text(encoding="utf-8")


def test_the_command_line_is_one_the_worker_takes(unit: dict[str, dict[str, list[str]]]) -> None:
    argv = exec_start(unit)
    assert argv[0] == "/usr/bin/koboldcpp-horde-chat"
    values = {"%S/koboldcpp-horde-chat": "/var/lib/koboldcpp-horde-chat", "${HORDE_WORKER_NAME}": "My Worker"}
    args = build_parser().parse_args([values.get(a, a) for a in argv[1:]])
    assert args.hordeworkername == "My Worker" and args.journal_dir == "/var/lib/koboldcpp-horde-chat"
    assert args.stop_grace == DEFAULT_STOP_GRACE_S


def test_systemd_waits_longer_than_the_stop_grace_before_it_kills(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    """After SIGTERM the job in hand gets --stop-grace, then its abort and fault
    (each bounded by a 2 to 10 s timeout) before the worker exits."""
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    timeout = one(unit, "Service", "TimeoutStopSec")
    assert re.fullmatch(r"\d+", timeout)
    assert int(timeout) >= DEFAULT_STOP_GRACE_S + 10


def test_a_crash_is_restarted_a_configuration_error_or_refused_key_is_not(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "RestartPreventExitStatus").split() == ["2", "3"]
    assert "network-online.target" in one(unit, "Unit", "After").split()
    assert "network-online.target" in one(unit, "Unit", "Wants").split()
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # verify checks that ExecStart's program exists: point it at a stand-in, nothing else changed.
    program = tmp_path / "bin" / "koboldcpp-horde-chat"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    text = UNIT.read_text(encoding="utf-8")
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("ExecStart=/usr/bin/koboldcpp-horde-chat ", f"ExecStart={program} "))
    assert copy.read_text() != text
    result = subprocess.run(
        [tool, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
