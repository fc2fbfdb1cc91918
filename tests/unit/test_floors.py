"""The package's rooms stack on floors: a room imports only rooms on floors below it.

docs/DESIGN.md ("The floors") draws them. The rule, checked here on the
package-level import graph:

- every import counts: a module's top-level imports, a function's imports and
  those under ``if TYPE_CHECKING:`` alike (a type a room names is knowledge of
  that room; a loop hidden behind annotations is still a loop);
- an import goes from a room to a room on a lower floor, never to a room on
  its own floor or above it; a room's own modules import each other freely;
- the entry point koboldcpp's patches import (``FORWARDERS``: ``kcpp_hook``)
  is a room of its own on the floor above the hosts it forwards to (beside
  the demo), and holds nothing but the forwarding;
- a seam's Protocol module (``api.py``) imports no implementation;
- the benchmarks import nothing from ``tests/`` (what both use lives in
  ``bench/harness/``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "koboldcpp_horde_chat"

#: The floors, lowest first; each holds rooms that know nothing of each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("foundation", "devkit"),
    ("horde", "koboldcpp"),
    ("translate",),
    ("state",),
    ("run",),
    ("service",),
    ("hosts",),
    ("demo", "kcpp_hook"),
    ("cli",),
)
#: The package's top-level modules, by room (a subpackage is a room of its own).
TOP_LEVEL_ROOMS = {
    "__init__": "foundation",  # the version and the bridge agent
    "errors": "foundation",
    "settings": "foundation",
    "jsonbody": "foundation",
    "httpbody": "foundation",
    "netfail": "foundation",
    "inflight": "foundation",
    "clock": "foundation",
    "kcpp_hook": "kcpp_hook",  # an entry point (below)
    "cli": "cli",
    "__main__": "cli",
}
#: Modules that only keep an import path the koboldcpp patches use: ``kcpp_hook``
#: for every shipped patch. Each is a room of its own.
FORWARDERS = ("kcpp_hook",)
#: The seams' Protocol modules: they import no implementation.
PROTOCOL_MODULES = ("horde.api", "koboldcpp.api")

FLOOR_OF = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def module_names(package_dir: Path) -> dict[str, Path]:
    """{dotted name under the package ("" for the package itself): path}."""
    names: dict[str, Path] = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def room_of(module: str) -> str:
    """The room a module (dotted, under the package) belongs to."""
    if not module:
        return TOP_LEVEL_ROOMS["__init__"]
    head, _, rest = module.partition(".")
    if rest or head not in TOP_LEVEL_ROOMS:
        return head
    return TOP_LEVEL_ROOMS[head]


def under(dotted: str) -> str:
    """``koboldcpp_horde_chat.state.job`` -> ``state.job``; the package itself -> ``""``."""
    return dotted[len(PACKAGE) + 1 :]


def imports(path: Path, module: str, is_package: bool, modules: set[str]) -> Iterator[tuple[int, str]]:
    """(line, imported module under the package) for every import in ``path``:
    top-level, in a function, under ``if TYPE_CHECKING:``; ``from X import y``
    names ``X.y`` when ``y`` is a module."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = [PACKAGE, *module.split(".")] if module else [PACKAGE]
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names]
            targets = [t for t in submodules if under(t) in modules]
            if len(targets) < len(submodules):
                targets.insert(0, target)  # names defined in ``target`` itself
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                if under(target) in modules:
                    yield node.lineno, under(target)


def floor_violations(package_dir: Path) -> list[str]:
    """One line per import against the floors, and per module in no known room."""
    names = module_names(package_dir)
    modules = set(names)
    found: list[str] = []
    for module, path in sorted(names.items()):
        room = room_of(module)
        if room not in FLOOR_OF:
            found.append(f"{module or PACKAGE}: room {room!r} is on no floor")
            continue
        for line, target in imports(path, module, path.name == "__init__.py", modules):
            to = room_of(target)
            if to == room or to not in FLOOR_OF:
                continue
            if FLOOR_OF[to] >= FLOOR_OF[room]:
                where = "its own floor" if FLOOR_OF[to] == FLOOR_OF[room] else "a higher floor"
                found.append(
                    f"{path.relative_to(package_dir)}:{line}: {room} imports {target or PACKAGE} "
                    f"({to}, on {where})"
                )
    return found


def package_graph(package_dir: Path) -> dict[str, set[str]]:
    """{room: the rooms it imports}, every import counted."""
    names = module_names(package_dir)
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        room = room_of(module)
        graph.setdefault(room, set())
        for _, target in imports(path, module, path.name == "__init__.py", set(names)):
            if room_of(target) != room:
                graph[room].add(room_of(target))
    return graph


def test_every_import_points_to_a_lower_floor() -> None:
    assert floor_violations(ROOT / PACKAGE) == []


def test_the_floors_name_every_room_of_the_package_once() -> None:
    rooms = [room for floor in FLOORS for room in floor]
    assert len(rooms) == len(set(rooms))
    present = set(package_graph(ROOT / PACKAGE))
    assert present == set(rooms), "a room without a floor, or a floor's room gone"


def test_the_two_sides_know_nothing_of_each_other_and_the_hosts_sit_on_top() -> None:
    graph = package_graph(ROOT / PACKAGE)
    assert "koboldcpp" not in graph["horde"] and "horde" not in graph["koboldcpp"]
    assert {"horde", "koboldcpp"} <= graph["translate"]
    assert {"service", "state"} <= graph["hosts"]
    above_hosts = [room for room, imported in graph.items() if "hosts" in imported]
    assert sorted(above_hosts) == ["cli", "demo", "kcpp_hook"]
    assert graph["kcpp_hook"] == {"hosts"}


def test_a_forwarder_holds_only_the_forwarding() -> None:
    """A forwarder keeps a patch's import path; code that grows in it is code on
    the wrong floor."""
    names = module_names(ROOT / PACKAGE)
    for module in FORWARDERS:
        tree = ast.parse(names[module].read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring
            if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]:
                continue
            assert isinstance(node, ast.FunctionDef), f"{module}: {ast.dump(node)[:80]}"
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            assert len(body) == 1 and isinstance(body[0], (ast.Expr, ast.Return)), module
            assert isinstance(body[0].value, ast.Call), module


def test_a_seams_protocol_module_imports_no_implementation() -> None:
    names = module_names(ROOT / PACKAGE)
    seams = sorted(m for m in names if m.rpartition(".")[2] == "api")
    assert seams == sorted(PROTOCOL_MODULES)
    for module in PROTOCOL_MODULES:
        path = names[module]
        imported = {t for _, t in imports(path, module, False, set(names))}
        assert {room_of(t) for t in imported} <= {"foundation"}, (module, imported)


def test_the_benchmarks_import_nothing_from_the_tests() -> None:
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "tests"]
    assert found == []


# ----------------------------------------------------------- the check can fail


def write(root: Path, files: dict[str, str]) -> Path:
    package = root / PACKAGE
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for folder in {p.parent for p in package.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return package


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # a side importing the other side: both on floor 1
        ({"horde/pop.py": "from ..koboldcpp.answers import x\n", "koboldcpp/answers.py": ""},
         ["horde/pop.py:1: horde imports koboldcpp.answers (koboldcpp, on its own floor)"]),
        # a function-level import to a higher floor
        ({"state/job.py": "def f():\n    from ..service import loop\n", "service/loop.py": ""},
         ["state/job.py:2: state imports service.loop (service, on a higher floor)"]),
        # an import only under TYPE_CHECKING still counts
        ({"run/chat.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
          "    from koboldcpp_horde_chat.hosts.hosting import X\n", "hosts/hosting.py": ""},
         ["run/chat.py:3: run imports hosts.hosting (hosts, on a higher floor)"]),
        # the foundation importing a side
        ({"errors.py": "import koboldcpp_horde_chat.horde.codes\n", "horde/codes.py": ""},
         ["errors.py:1: foundation imports horde.codes (horde, on a higher floor)"]),
        # a new room nobody put on a floor
        ({"extra/x.py": ""}, ["extra: room 'extra' is on no floor", "extra.x: room 'extra' is on no floor"]),
        # downward imports and a room's own modules are fine
        ({"run/chat.py": "from ..state.job import J\nfrom .submit import S\nfrom .. import errors\n",
          "state/job.py": "", "run/submit.py": "", "errors.py": ""}, []),
    ],
)
def test_the_floor_check_sees_each_kind_of_wrong_import(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    assert floor_violations(write(tmp_path, files)) == expected
