"""The layout's one rule: imports point down the layers, never up or sideways.

    tocsin    the command line: every command, the local stack, the settings docs
    api       the REST API                       (may import streams)
    streams   the scheduler    proxy   delivery  (neither imports the other)
    schema    the Cassandra and message schemas
    topics    the wire contract: pure, no I/O
    base      settings, errors, logging, clock: imports nothing of ours

Function-level imports count too: a loop dodged inside a function is still a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What each package may import besides itself.
ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "topics": frozenset({"base"}),
    "schema": frozenset({"base", "topics"}),
    "streams": frozenset({"base", "topics", "schema"}),
    "proxy": frozenset({"base", "topics", "schema"}),
    "api": frozenset({"base", "topics", "schema", "streams"}),
    "tocsin": frozenset({"base", "topics", "schema", "streams", "proxy", "api"}),
}
# The contract's modules are pure: no client library of a server.
IO_LIBRARIES = frozenset({"confluent_kafka", "aiokafka", "faust", "cassandra", "aiohttp"})


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, relative ones resolved
    against ``module``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if is_package else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # ``from package import module`` imports the module too.
            found.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out.append((".".join(parts), path))
    return out


def layer_violations(modules: list[tuple[str, Path]]) -> list[str]:
    bad: dict[tuple[str, int, str], str] = {}
    for module, path in modules:
        package = module.split(".")[0]
        source = path.read_text()
        for line, name in imported_modules(source, module, path.name == "__init__.py"):
            top = name.split(".")[0]
            if top in ALLOWED and top != package and top not in ALLOWED[package]:
                bad.setdefault((module, line, top), f"{module}:{line} imports {top} ({name})")
            if package == "topics" and top in IO_LIBRARIES:
                bad.setdefault(
                    (module, line, top), f"{module}:{line} imports {top}: topics is pure"
                )
    return sorted(bad.values())


def import_graph(modules: list[tuple[str, Path]]) -> dict[str, set[str]]:
    """Each module -> the modules of ours it imports (a name imported from a module counts
    as that module)."""
    names = {m.removesuffix(".__init__") for m, _ in modules}
    graph: dict[str, set[str]] = {}
    for module, path in modules:
        me = module.removesuffix(".__init__")
        targets = set()
        for _, name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name and name != me:
                targets.add(name)
        graph[me] = targets
    return graph


class StronglyConnected:
    """Tarjan's walk over ``graph``: ``groups`` are its strongly connected groups of more
    than one node."""

    def __init__(self, graph: dict[str, set[str]]) -> None:
        self.graph = graph
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        self.groups: list[list[str]] = []
        for v in sorted(graph):
            if v not in self.index:
                self.visit(v)

    def visit(self, v: str) -> None:
        self.index[v] = self.low[v] = len(self.index)
        self.stack.append(v)
        self.on_stack.add(v)
        for w in self.graph.get(v, ()):
            if w not in self.index:
                self.visit(w)
                self.low[v] = min(self.low[v], self.low[w])
            elif w in self.on_stack:
                self.low[v] = min(self.low[v], self.index[w])
        if self.low[v] == self.index[v]:
            self.pop_group(v)

    def pop_group(self, root: str) -> None:
        group = []
        while True:
            w = self.stack.pop()
            self.on_stack.discard(w)
            group.append(w)
            if w == root:
                break
        if len(group) > 1:
            self.groups.append(sorted(group))


def module_cycles(modules: list[tuple[str, Path]]) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph."""
    return StronglyConnected(import_graph(modules)).groups


def test_every_package_is_in_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages <= set(ALLOWED), f"a package outside the layers: {packages - set(ALLOWED)}"


def test_imports_point_down_only() -> None:
    assert layer_violations(_modules()) == []


def test_no_import_loop_between_modules() -> None:
    assert module_cycles(_modules()) == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    (tmp_path / "topics").mkdir()
    up = tmp_path / "topics" / "x.py"
    up.write_text("def f():\n    from streams.store import Store\n    import faust\n")
    side = tmp_path / "proxy.py"
    side.write_text("from streams import model\n")
    bad = layer_violations([("topics.x", up), ("proxy.y", side)])
    assert len(bad) == 3, bad


def test_the_check_sees_a_loop(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from streams import b\n")
    b.write_text("def f():\n    from . import a\n")
    assert module_cycles([("streams.a", a), ("streams.b", b)]) == [["streams.a", "streams.b"]]
