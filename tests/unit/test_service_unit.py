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

from koboldcpp_horde_chat.hosts.standalone_flags import (
    DEFAULT_STOP_GRACE_S,
    build_parser,
    check_flags,
)

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


#: Where the README installs the command for the unit: a virtual environment the
#: service can read (not under /home or /root, hidden by ProtectHome=yes).
VENV = "/opt/koboldcpp-horde-chat"
COMMAND = f"{VENV}/bin/koboldcpp-horde-chat"


def test_the_command_line_is_one_the_worker_takes(
    unit: dict[str, dict[str, list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = exec_start(unit)
    assert argv[0] == COMMAND
    # The name comes from the environment file (HORDE_WORKER_NAME), not a templated flag.
    assert "--hordeworkername" not in argv and not [a for a in argv if "$" in a]
    monkeypatch.setenv("HORDE_WORKER_NAME", "My Worker")
    monkeypatch.setenv("AI_HORDE_API_KEY", "k" * 22)
    values = {"%S/koboldcpp-horde-chat": "/var/lib/koboldcpp-horde-chat"}
    args = build_parser().parse_args([values.get(a, a) for a in argv[1:]])
    check_flags(args)
    assert args.hordeworkername == "My Worker" and args.journal_dir == "/var/lib/koboldcpp-horde-chat"
    assert args.stop_grace == DEFAULT_STOP_GRACE_S


def test_the_readme_installs_the_command_where_the_unit_runs_it(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    """The README's service install makes the venv the unit's ExecStart names, with the
    system's Python (a venv's python links to the Python that made it), and shows the
    drop-in for a command installed elsewhere."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### As a systemd service") :]
    section = section[: section.index("\n## ")]
    assert f"sudo /usr/bin/python3 -m venv {VENV}\n" in section
    assert f"sudo {VENV}/bin/pip install /path/to/koboldcpp-horde-chat\n" in section
    assert exec_start(unit)[0] == f"{VENV}/bin/koboldcpp-horde-chat"
    assert "ProtectHome=yes" in section
    dropin = re.search(r"```ini\n(\[Service\]\nExecStart=\nExecStart=(.+)\n)```", section)
    assert dropin, section
    other = shlex.split(dropin.group(2))
    assert other[0] == "/usr/bin/koboldcpp-horde-chat" and other[1:] == exec_start(unit)[1:]
    assert "HORDE_WORKER_NAME=My Worker" in section


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
    copy.write_text(text.replace(f"ExecStart={COMMAND} ", f"ExecStart={program} "))
    assert copy.read_text() != text
    result = subprocess.run(
        [tool, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_the_unit_as_the_readme_installs_it_verifies_where_it_is_installed() -> None:
    """On a machine where the README's service install was done (the venv in
    /opt/koboldcpp-horde-chat, the unit in /etc/systemd/system), the installed unit
    is this one and ``systemd-analyze verify`` accepts it as it is."""
    tool = shutil.which("systemd-analyze")
    installed = Path("/etc/systemd/system") / UNIT.name
    if tool is None or not installed.exists() or not Path(COMMAND).exists():
        pytest.skip(f"the README's service install is not done here ({installed}, {COMMAND})")
    assert installed.read_text(encoding="utf-8") == UNIT.read_text(encoding="utf-8")
    result = subprocess.run(
        [tool, "verify", str(installed)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
