"""The layout's rules, read from the source: which layer may import which, no import cycles, and no module
reaching into another's private names. (docs/architecture.md draws the same picture.)

- ``server.store``: plumbing; imports no other layer.
- ``server.money``: the money core; imports the store, never the hub, the worker or the tools.
- ``server.live``: what hubs and workers both do to a group's live state (events, announcing packets, the
  bot detector); imports money and the store, never the hub, the worker or the tools.
- ``server.hub``: imports live, money and the store; never the worker or the tools.
- ``worker``: imports live, money and the store; never the hub or the tools.
- ``redpacket_client`` (clients/python): the Python client, a distribution of its own; imports nothing
  of ours. Its protocol names and its fair split are the hub's too: every layer may import it.
- ``bench``: the benchmarks and the Locust load; ``launchers``: the local services they and the tests
  start (Galera, Spider, throw-away Redis servers), which import nothing of ours. Nothing of the system
  imports either; only the ``redpacket`` command (``server.cli``) starts them.
- ``server.cli``: the ``redpacket`` command, a package of one module per command; it composes
  everything, and nothing of the system imports it.
- Shared by all: ``server.settings`` (with ``server.settingfields``), ``server.errors``, ``server.text``,
  ``server.ids``, ``server.stopping`` (how background tasks stop), ``server.probe`` (a health check's
  question to a process of this machine) and ``server.core`` (the context every layer is handed).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.repofiles import ROOT

SHARED = {
    "server.settings",
    "server.settingfields",
    "server.settingdocs",
    "server.errors",
    "server.text",
    "server.ids",
    "server.signing",
    "server.durability",
    "server.stopping",
    "server.tracing",
    "server.logformat",
    "server.probe",
    "server.core",
    "server",
}
# What each layer may import besides itself and the shared modules.
MAY_IMPORT = {
    "server.store": set(),
    "server.money": {"server.store"},
    "server.live": {"server.money", "server.store"},
    "server.hub": {"server.live", "server.money", "server.store"},
    "worker": {"server.live", "server.money", "server.store"},
    "redpacket_client": set(),
    "launchers": set(),
    "bench": {
        "server.live",
        "server.money",
        "server.store",
        "server.hub",
        "worker",
        "launchers",
    },
}
# Beside the system, imported by nothing of it.
TOOLS = ("bench", "launchers")
# Ours, as every import of theirs is checked.
OURS = ("server", "worker", "bench", "launchers", "redpacket_client")
MAY_IMPORT["server.cli"] = set(MAY_IMPORT)  # the command composes every layer


def modules() -> Iterator[tuple[str, Path]]:
    found = ["server/**/*.py", "worker/**/*.py", "bench/**/*.py", "launchers/**/*.py"]
    client = ROOT / "clients" / "python"
    for path in sorted(p for pattern in found for p in ROOT.glob(pattern)) + sorted(
        client.glob("redpacket_client/**/*.py")
    ):
        parts = path.relative_to(client if client in path.parents else ROOT).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


KNOWN = dict(modules())


class _Imports(ast.NodeVisitor):
    """Every import statement, at any depth (a function's too), except those under ``if TYPE_CHECKING:``
    (for the type checker alone: they never run)."""

    def __init__(self) -> None:
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)


def imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import of our own modules in ``path``, at
    any depth (a function's import too), but not those for the type checker alone."""
    visitor = _Imports()
    visitor.visit(ast.parse(path.read_text()))
    for node in visitor.found:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            names = [a.name for a in node.names]
            # `from server.money import ledger` imports the module server.money.ledger.
            subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in KNOWN]
            yield (node.module, names, node.lineno) if not subs else (subs[0], [], node.lineno)
            for extra in subs[1:]:
                yield extra, [], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OURS:
                    yield alias.name, [], node.lineno


def layer(module: str) -> str:
    for name in MAY_IMPORT:
        if module == name or module.startswith(name + "."):
            return name
    return module


def test_each_layer_imports_only_what_it_may() -> None:
    wrong = []
    for module, path in KNOWN.items():
        mine = layer(module)
        if mine not in MAY_IMPORT:
            continue  # the shared modules
        for imported, _, line in imports(path):
            theirs = layer(imported)
            # (The client and the launchers import nothing of ours, not even the shared modules: the one
            # installs alone, the others start services for anyone.)
            alone = mine in ("redpacket_client", "launchers")
            shared = not alone and (imported in SHARED or theirs == "redpacket_client")
            if theirs == mine or shared or theirs in MAY_IMPORT[mine]:
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {imported}")
    assert wrong == []


def test_nothing_but_the_command_imports_the_tools() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {imported}"
        for module, path in KNOWN.items()
        if layer(module) not in (*TOOLS, "server.cli")
        for imported, _, line in imports(path)
        if layer(imported) in TOOLS
    ]
    assert wrong == []


def test_the_shared_modules_import_no_layer_but_the_store() -> None:
    # Core composes the store's pieces, the member cache and the send limits; settings, errors, text and ids
    # import nothing of ours but each other.
    allowed = {"server.core": {"server.store", "server.money.membership", "server.money.split"}}
    wrong = []
    for module in SHARED - {"server"}:
        for imported, _, line in imports(KNOWN[module]):
            if imported in SHARED or any(
                imported == a or layer(imported) == a for a in allowed.get(module, set())
            ):
                continue
            wrong.append(f"{module}:{line}: {imported}")
    assert wrong == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each ring of imports found by a depth-first walk, as the modules around it."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                found.append([*path[path.index(n) :], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycles() -> None:
    """Not even through an import inside a function (cli <-> hubbench was one)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]  # it finds them
    graph = {m: {i for i, _, _ in imports(p) if i in KNOWN and i != m} for m, p in KNOWN.items()}
    assert cycles(graph) == []


def test_no_module_takes_another_ones_private_names() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {name} from {imported}"
        for module, path in KNOWN.items()
        for imported, names, line in imports(path)
        for name in names
        if name.startswith("_") and imported != module
    ]
    assert wrong == []


# Rooms of a size a person can hold (issue 25): a module read in one sitting, a function on one screen.
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 100


def test_no_module_is_longer_than_one_sitting() -> None:
    long = sorted(
        (n, str(path.relative_to(ROOT)))
        for path in KNOWN.values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    )
    said = "".join(f"\n  {where}: {n} lines" for n, where in reversed(long))
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept):{said}"


def function_lengths(source: str) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, lines from ``def`` to its last) of every function and method in
    ``source``, nested ones too: each counted in its own right and within its parent."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child.lineno, (child.end_lineno or child.lineno) - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


def test_no_function_is_longer_than_a_screen() -> None:
    source = "class A:\n    async def f(self):\n        def g():\n            pass\n\n        return g\n"
    assert list(function_lengths(source)) == [("A.f", 2, 5), ("A.f.g", 3, 2)]  # it reads them
    long = sorted(
        (n, f"{path.relative_to(ROOT)}:{line} {name}")
        for path in KNOWN.values()
        for name, line, n in function_lengths(path.read_text())
        if n > MAX_FUNCTION_LINES
    )
    said = "".join(f"\n  {where}: {n} lines" for n, where in reversed(long))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):{said}"


# The tables whose rows are money, or say who may receive it.
MONEY_TABLES = ("accounts", "journal", "red_packets", "red_packet_shares", "grab_records", "credit_refusals",
                "users", "chat_groups", "group_members")  # fmt: skip
SQL_VERBS = ("SELECT", "INSERT", "UPDATE", "DELETE")


def _literal_text(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's with each ``{...}`` read as `` ? ``; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else " ? " for v in node.values)
    return None


def sql_on_money_tables(source: str) -> Iterator[tuple[int, str]]:
    """(line, statement start) of every string literal in ``source`` (f-strings too; each piece of one
    implicitly joined literal with its neighbours) that reads or writes a money table."""
    tree = ast.parse(source)
    inside = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        text = None if id(node) in inside else _literal_text(node)
        if text is not None:
            words = text.upper().replace("(", " ").replace(",", " ").split()
            if any(v in words for v in SQL_VERBS) and any(t.upper() in words for t in MONEY_TABLES):
                yield node.lineno, text[:60]


def test_sql_on_money_tables_lives_in_money_and_the_store() -> None:
    """The hub, the workers and the live layer call money functions; they write no SQL of their own on the
    money tables (issue 25, item 6)."""
    assert list(sql_on_money_tables('x = 1\nq = "SELECT id FROM red_packets WHERE id = %s"\n')) == [
        (2, "SELECT id FROM red_packets WHERE id = %s")
    ]  # it finds them
    assert list(sql_on_money_tables('q = f"SELECT {C} FROM red_packets" f" WHERE id = {i}"\n')) == [
        (1, "SELECT  ?  FROM red_packets WHERE id =  ? ")
    ]  # f-strings too, joined as Python joins them
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for module, path in KNOWN.items()
        if module.split(".")[:2] in (["server", "hub"], ["server", "live"]) or module.startswith("worker")
        for line, text in sql_on_money_tables(path.read_text())
    ]
    assert found == []


def test_the_journal_and_the_balances_have_one_writer() -> None:
    """Before (issue 44): raw ``INSERT INTO journal`` in three modules and balance updates in two more,
    while the ledger said it had one writer. Every journal row and balance change is written by
    ``server.money.journal`` (the benchmarks' raw baseline, on a throw-away database, excepted)."""
    writes = re.compile(
        r"INSERT\s+INTO\s+journal\b|UPDATE\s+journal\b|UPDATE\s+accounts\s+SET\s+balance", re.IGNORECASE
    )
    found = sorted(
        f"{path.relative_to(ROOT)}:{line}"
        for module, path in KNOWN.items()
        if layer(module) not in TOOLS
        for line, text in sql_on_money_tables(path.read_text())
        if writes.search(text)
    )
    assert found and all(f.startswith("server/money/journal.py:") for f in found), found


def test_statuses_are_named_only_by_their_enums() -> None:
    """Before (issue 44): ``'credited'`` 37 times, ``'refunded'`` 15, ``'active'`` 14 as literals in SQL,
    where a misspelt one matches nothing and says nothing. Packet and grab-record statuses are named in
    ``server.money.statuses`` alone; SQL spells them through the enums (the benchmarks excepted)."""
    literal = re.compile(r"'(active|refunding|refunded|finished|void|crediting|credited)'")
    found = sorted(
        f"{path.relative_to(ROOT)}:{n}"
        for module, path in KNOWN.items()
        if layer(module) not in TOOLS and module != "server.money.statuses"
        for n, text in enumerate(path.read_text().splitlines(), 1)
        if literal.search(text)
    )
    assert found == []
