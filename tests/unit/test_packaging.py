"""What a packager relies on: the sdist carries its tests, the metadata agrees with
itself, the package has no import cycle, and the lint tests skip (or, in CI,
fail) without their pinned tools."""

from __future__ import annotations

import ast
import configparser
import os
import re
import shutil
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import pytest

import koboldcpp_horde_chat
from tests import test_static

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "koboldcpp_horde_chat"
SUPPORTED = ("3.10", "3.11", "3.12", "3.13")


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return config


# ------------------------------------------------------------------------- the sdist


def git_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist has no .git)")
    result = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    return [f for f in result.stdout.decode("utf-8").split("\0") if f]


def manifest_selects(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The files MANIFEST.in's commands select, evaluated by setuptools itself."""
    egg_info = pytest.importorskip("setuptools.command.egg_info")
    monkeypatch.chdir(ROOT)
    files = egg_info.FileList()
    files.findall(".")
    for line in (ROOT / "MANIFEST.in").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            files.process_template_line(line)
    return {os.path.normpath(f).replace(os.sep, "/") for f in files.files}


def test_the_sdist_carries_every_tracked_file_its_tests_and_docs_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every file git tracks is in the sdist (MANIFEST.in, or the package itself),
    except the CI script and .gitignore, so the unpacked sdist can run its tests."""
    tracked = git_files()
    selected = manifest_selects(monkeypatch)
    package_code = {f for f in tracked if f.startswith(f"{PACKAGE}/") and f.endswith(".py")}
    not_shipped = {".gitignore", ".ci/run"}
    missing = sorted(set(tracked) - selected - package_code - not_shipped)
    assert missing == [], f"MANIFEST.in does not ship: {missing}"
    for needed in ("tests/data/bfcl/bfcl-chat-requests.jsonl", "bench/run.py", "CHANGELOG.md"):
        assert needed in selected


def test_the_sdist_ships_no_local_results_or_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    selected = manifest_selects(monkeypatch)
    assert not [f for f in selected if "__pycache__" in f or f.endswith(".pyc")]
    assert not [f for f in selected if f.startswith("bench/results/")]


def test_the_wheel_carries_the_package_only() -> None:
    """setup.cfg finds only the package (no tests, no bench) and adds py.typed."""
    config = setup_cfg()
    assert config["options.packages.find"]["include"].split(", ") == [PACKAGE, f"{PACKAGE}.*"]
    assert config["options.package_data"][PACKAGE].strip() == "py.typed"
    assert (ROOT / PACKAGE / "py.typed").exists()


# ---------------------------------------------------------------------- the metadata


def test_python_versions_agree_everywhere() -> None:
    config = setup_cfg()
    assert config["options"]["python_requires"] == ">=3.10"
    classifiers = config["metadata"]["classifiers"].split("\n")
    versions = [
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c.strip())
    ]
    assert tuple(versions) == SUPPORTED
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'target-version = "py310"' in pyproject
    assert 'python_version = "3.10"' in pyproject


def test_the_license_is_declared_and_no_url_that_does_not_exist() -> None:
    """The package has no web page and no public source URL yet: the metadata and
    the bridge agent name none (a PyPI page that does not exist sent operators
    nowhere)."""
    meta = setup_cfg()["metadata"]
    assert meta["license"] == "MIT AND AGPL-3.0-only"
    assert "License :: OSI Approved :: MIT License" in meta["classifiers"]
    assert "project_urls" not in meta and "url" not in meta
    assert "://" not in koboldcpp_horde_chat.BRIDGE_AGENT.split(":", 2)[2]
    assert "pypi.org" not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_license_metadata_says_mit_for_the_package_and_agpl_3_0_only_for_the_patches() -> None:
    """The sdist carries the koboldcpp patches, which change koboldcpp's file and are
    under its license: the AGPL version 3, which koboldcpp grants with no "or any later
    version". The metadata says so as a valid SPDX expression and ships both texts."""
    meta = setup_cfg()["metadata"]
    assert meta["license"] == "MIT AND AGPL-3.0-only"
    assert meta["license_files"].split() == ["LICENSE", "patches/AGPL-3.0.txt"]
    classifiers = [c.strip() for c in meta["classifiers"].splitlines() if c.strip()]
    assert [c for c in classifiers if c.startswith("License ::")] == [
        "License :: OSI Approved :: MIT License",
        "License :: OSI Approved :: GNU Affero General Public License v3",
    ]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    licenses = pytest.importorskip("packaging.licenses")
    assert licenses.canonicalize_license_expression(meta["license"]) == "MIT AND AGPL-3.0-only"
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## License\n", 1)[1]
    assert "`MIT AND AGPL-3.0-only`" in readme and "so AGPL-3.0-only" in readme
    patches_readme = (ROOT / "patches" / "README.md").read_text(encoding="utf-8")
    assert "the patches are under AGPL-3.0-only" in patches_readme.split("\n## ", 1)[0]
    for text in (readme, patches_readme, (ROOT / "setup.cfg").read_text(encoding="utf-8")):
        assert "or-later" not in text and "AGPL-3.0+" not in text


DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/koboldcpp-horde-chat demo"
)
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install '.[test,lint]' && "
    "KCPP_HORDE_REQUIRE_LINT=1 .venv/bin/python -m pytest -n 4"
)


def test_the_readmes_two_commands_work_on_a_distributions_python() -> None:
    """A distribution's Python refuses a plain pip install (PEP 668's
    externally-managed-environment): both commands make and use a venv, and the
    README says which package gives Debian's python3 its venv."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)\n```", section, re.DOTALL)
    assert blocks == [DEMO_COMMAND, TEST_COMMAND]
    assert "externally-managed-environment" in section
    assert "sudo apt-get install python3-venv" in section


def test_ci_runs_the_readmes_test_command_in_a_fresh_venv() -> None:
    """.ci/run's default run is the README's test command: a venv of its own (no
    system site-packages, as the README's), the test and lint extras, -n 4, the
    lint required."""
    ci = ROOT / ".ci" / "run"
    if not ci.exists():
        pytest.skip("no .ci/run (an unpacked sdist does not ship it)")
    run_default = ci.read_text(encoding="utf-8").split("run_default() {", 1)[1].split("\n}\n", 1)[0]
    assert 'python3 -m venv "$work/venv-default"' in run_default
    assert "--system-site-packages" not in run_default
    assert '-m pip install --quiet "$root[test,lint]"' in run_default
    assert 'pytest_or_fail "$root" "$py" KCPP_HORDE_REQUIRE_LINT=1' in run_default
    assert '"$python" -m pytest -q -n 4 ' in ci.read_text(encoding="utf-8")


def test_the_metadata_names_its_authors_without_inventing_an_address() -> None:
    meta = setup_cfg()["metadata"]
    assert meta["author"] == "koboldcpp-horde-chat developers"
    assert meta["maintainer"] == "koboldcpp-horde-chat developers"
    assert "author_email" not in meta and "maintainer_email" not in meta


def test_the_sdist_ships_the_agpl_text_beside_the_agpl_patches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = (ROOT / "patches" / "AGPL-3.0.txt").read_text(encoding="utf-8")
    assert text.lstrip().startswith("GNU AFFERO GENERAL PUBLIC LICENSE\n")
    assert "Version 3, 19 November 2007" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "patches/AGPL-3.0.txt" in manifest_selects(monkeypatch)
    readme = (ROOT / "patches" / "README.md").read_text(encoding="utf-8")
    assert "`AGPL-3.0.txt`" in readme


def test_the_changelog_dates_each_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    # what changed since the last release comes first, under "Unreleased"
    releases = headings[1:] if headings[:1] and headings[0].startswith("Unreleased") else headings
    assert releases
    for heading in releases:
        assert re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", heading), heading


@pytest.mark.parametrize("patch", sorted((ROOT / "patches").glob("*.patch")), ids=lambda p: p.name)
def test_each_patch_says_its_license_before_its_diff(patch: Path) -> None:
    """The patches change koboldcpp's file, so they are under its license, AGPL-3.0-only;
    the line sits in the description, which patch and git apply skip."""
    header = patch.read_text(encoding="utf-8").split("\n--- a/", 1)[0]
    assert "License: AGPL-3.0-only, koboldcpp's own license" in header.splitlines()[1]


def test_the_changelog_has_the_current_version() -> None:
    """A release is numbered as its changelog entry; the tree between releases
    builds as a development version of the next one, which the changelog's
    "Unreleased" heading names, so a build of it and the release differ."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    version = koboldcpp_horde_chat.__version__
    first = re.findall(r"^## (.+)$", text, re.MULTILINE)[0]
    if first.startswith("Unreleased"):
        assert re.fullmatch(r"\d+\.\d+\.\d+\.dev\d+", version), version
        assert first == f"Unreleased ({version})"
        released = re.findall(r"^## (\d+\.\d+\.\d+) - ", text, re.MULTILINE)
        assert released and _release_tuple(version) > _release_tuple(released[0])
    else:
        assert first.startswith(f"{version} - "), (first, version)


def _release_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def test_the_extras_split_behaviour_tests_from_pinned_lint() -> None:
    extras = setup_cfg()["options.extras_require"]
    test = {re.split(r"[<>=]", r.strip())[0] for r in extras["test"].splitlines() if r.strip()}
    assert test == {"pytest", "pytest-xdist", "responses", "hypothesis", "jsonschema"}
    assert extras["test-gguf"].split() == ["gguf>=0.10"]
    assert test_static.lint_pins() == {
        "ruff": "0.17.6",
        "mypy": "2.4.1",
        "types-requests": "2.33.0.20261030",
    }


# ------------------------------------------------------------- the lint tests' guard


def fake_versions(monkeypatch: pytest.MonkeyPatch, **versions: str | None) -> None:
    def version(name: str) -> str:
        value = versions.get(name.replace("-", "_"))
        if value is None:
            raise metadata.PackageNotFoundError(name)
        return value

    monkeypatch.setattr(test_static.metadata, "version", version)


def test_a_missing_linter_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(test_static.REQUIRE_ENV, raising=False)
    fake_versions(monkeypatch, ruff=None)
    with pytest.raises(pytest.skip.Exception, match=r"ruff is not installed \(pinned to 0\.17\.6\)"):
        test_static.require_pinned("ruff")


def test_a_linter_at_another_version_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(test_static.REQUIRE_ENV, raising=False)
    fake_versions(monkeypatch, mypy="1.0.0", types_requests="2.33.0.20261030")
    with pytest.raises(pytest.skip.Exception, match="mypy 1.0.0 is installed, the lint is pinned to 2.4.1"):
        test_static.require_pinned("mypy", "types-requests")


def test_with_require_lint_set_a_missing_linter_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(test_static.REQUIRE_ENV, "1")
    fake_versions(monkeypatch, ruff=None)
    with pytest.raises(pytest.fail.Exception, match="KCPP_HORDE_REQUIRE_LINT is set and ruff"):
        test_static.require_pinned("ruff")


def test_the_pinned_linters_run(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_versions(monkeypatch, ruff="0.17.6", mypy="2.4.1", types_requests="2.33.0.20261030")
    test_static.require_pinned("ruff", "mypy", "types-requests")  # neither skips nor fails


# --------------------------------------------------------------------- import cycles


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules ``module`` imports at run time, at any depth of its code
    (a function's import counts; an ``if TYPE_CHECKING:`` block does not)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target in modules:
                found.add(target)
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    root = ROOT / PACKAGE
    paths: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths[name] = path
    modules = set(paths)
    return {name: imported_modules(path, name, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = walk(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return []


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.hosts.standalone" in graph[f"{PACKAGE}.cli"]
    assert f"{PACKAGE}.demo" in graph[f"{PACKAGE}.cli"]  # the subcommand, imported lazily
    assert f"{PACKAGE}.cli" not in graph[f"{PACKAGE}.demo"]
    cycle = find_cycle(graph)
    assert cycle == [], " -> ".join(cycle)


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    """The check above can fail: the circle cli and demo once made is found."""
    (tmp_path / "cli.py").write_text("def main():\n    from .demo import main\n")
    (tmp_path / "demo.py").write_text("def main():\n    from .cli import run\n")
    (tmp_path / "types_only.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .cli import main\n"
    )
    modules = {"p.cli", "p.demo", "p.types_only"}
    graph = {m: imported_modules(tmp_path / f"{m[2:]}.py", m, modules) for m in modules}
    assert graph["p.types_only"] == set()
    assert find_cycle(graph) == ["p.cli", "p.demo", "p.cli"]


def test_the_package_imports_on_this_python() -> None:
    """Every module imports in a fresh interpreter (on 3.10 too: CI runs this there)."""
    names = sorted(n for n in import_graph() if not n.endswith("__main__"))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    result = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------- koboldcpp citations

CITED_TREES = ("koboldcpp_horde_chat", "tests", "bench", "docs", "patches", "README.md")
UNSHIPPED_SHEET = re.compile("facts \N{SECTION SIGN}|koboldcpp-fact[s]|fact[ ]sheet", re.IGNORECASE)


def unshipped_sheet_citations(root: Path) -> list[str]:
    """``path:line`` of each citation of koboldcpp notes this repository does not hold
    (their sections, their file name); a koboldcpp fact is cited by version, file and
    line of koboldcpp's source instead."""
    found: list[str] = []
    for tree in CITED_TREES:
        top = root / tree
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in paths:
            if "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if UNSHIPPED_SHEET.search(line):
                    found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_koboldcpp_facts_are_cited_by_its_source_not_by_a_sheet_the_reader_lacks() -> None:
    assert unshipped_sheet_citations(ROOT) == []


def test_the_citation_check_sees_a_sheet_citation(tmp_path: Path) -> None:
    """The check above can fail: a docstring citing the sheet's section is found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("ok\nthe busy 503 (facts \N{SECTION SIGN}5.8)\n")
    (tmp_path / "README.md").write_text("koboldcpp 1.116.1 koboldcpp.py L6890\n")
    assert unshipped_sheet_citations(tmp_path) == ["docs/x.md:2"]


ROOMS = ("horde", "koboldcpp", "translate", "state", "run", "service", "hosts", "devkit")
"""The package's rooms, whose ``__init__.py`` holds only the room's docstring."""


def test_the_design_map_names_every_module_of_the_package() -> None:
    """docs/DESIGN.md is the map a maintainer reads first: a module it does not
    name (as `room/module.py`) is a room the map has lost."""
    design = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text("utf-8")
    package = Path(__file__).resolve().parents[2] / PACKAGE
    docstring_only = {"__init__.py", *(f"{room}/__init__.py" for room in ROOMS)}
    modules = sorted(
        str(p.relative_to(package)) for p in package.rglob("*.py")
    )
    missing = [m for m in modules if m not in docstring_only and f"`{m}`" not in design]
    assert missing == [], f"docs/DESIGN.md does not name: {missing}"


#: The length past which a module of the worker gets a reviewer's warning, in
#: lines: about what a maintainer reads whole before changing it. A hint, not a
#: rule: a module may pass it, never by trimming its documentation; one that does
#: is listed in MODULES_ALLOWED_LONGER with the reason, and any other draws a
#: warning in the test report. devkit (the dev Horde and the scripted koboldcpp)
#: is exempt.
MODULE_MAX_LINES = 500

#: Modules allowed past MODULE_MAX_LINES, each with why it is one room.
MODULES_ALLOWED_LONGER: dict[str, str] = {
    "state/lease_fit.py": "the lease fit as one pure model of the host: koboldcpp's figures "
    "read, the limits fitted from them, a run-out's lesson and the cool-off of raises",
    "koboldcpp/client.py": "koboldcpp's HTTP API as the worker calls it, one method per route, "
    "and the one place its calls are made, bounded and hung up",
    "horde/client.py": "the Horde's HTTP API as the worker calls it, one method per route, "
    "and the one place its calls are made, bounded, hung up and watched",
    "hosts/inside_kcpp.py": "the only module that knows koboldcpp's globals: its settings, "
    "its live state read as the loop's manners, its console, and the hook koboldcpp calls",
    "service/recovery.py": "the start-up pass over the journal: each job's plan, its "
    "attempts and their pauses until the Horde answers, the lease ends or the stop's "
    "deadline comes, and the thread that runs it before koboldcpp answers",
    "horde/progress.py": "streaming progress as one pure state machine (seq, the cap, "
    "each answer's meaning, the job's lease): its moves read in one place",
    "state/shared.py": "what a worker's loops share under one lock (jobs in hand, the "
    "stop and its deadline, the guards, the totals, the next pop's body): each method "
    "a short read or update of that one state",
    "service/loop.py": "the pop loop and the hooks its jobs call: when it pops (its "
    "own pop, the one beside a submit, the one during a long text generation) and "
    "where a job's terminal action goes (beside the next job or not)",
}


def module_sizes() -> dict[str, int]:
    """{module path relative to the package: lines} for the worker outside devkit."""
    package = ROOT / "koboldcpp_horde_chat"
    return {
        str(path.relative_to(package)): len(path.read_text(encoding="utf-8").splitlines())
        for path in package.rglob("*.py")
        if "devkit" not in path.relative_to(package).parts
    }


def test_a_module_longer_than_a_maintainer_reads_whole_draws_a_reviewers_warning() -> None:
    sizes = module_sizes()
    assert len(sizes) > 40
    assert all(reason.strip() for reason in MODULES_ALLOWED_LONGER.values())
    unknown = sorted(set(MODULES_ALLOWED_LONGER) - set(sizes))
    assert unknown == [], f"MODULES_ALLOWED_LONGER names no module: {unknown}"
    for name, lines in sorted(sizes.items()):
        if lines > MODULE_MAX_LINES and name not in MODULES_ALLOWED_LONGER:
            warnings.warn(
                f"{name} has {lines} lines (hint: {MODULE_MAX_LINES}); split it by concern "
                "or list it in MODULES_ALLOWED_LONGER with the reason",
                stacklevel=1,
            )
