"""Every error our production code defines belongs to the one tree (base.errors)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("base", "topics", "schema", "streams", "proxy", "api", "tocsin")
# Builtin roots a class may not derive from directly: it must derive from TocsinError (or
# from another of ours). ValueError subclasses are parse errors of pure helpers, caught and
# translated by their callers at the edge.
OUTSIDE = frozenset({"Exception", "BaseException", "RuntimeError", "OSError", "LookupError"})


def errors_outside_the_tree(paths: list[Path]) -> list[str]:
    """Public classes deriving from a builtin error root and from none of the tree (a class
    may also derive from a builtin when a library needs that type, e.g. OSError)."""
    classes = [
        (path, node)
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    tree = {"TocsinError"}
    grew = True
    while grew:
        grew = False
        for _, node in classes:
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if node.name not in tree and bases & tree:
                tree.add(node.name)
                grew = True
    bad = []
    for path, node in classes:
        bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
        if node.name.startswith("_") or node.name in tree:
            continue
        if bases & OUTSIDE:
            bad.append(f"{path.name}:{node.lineno} {node.name}")
    return bad


def test_every_public_error_is_a_tocsin_error() -> None:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert errors_outside_the_tree(paths) == []


def test_the_check_sees_an_error_outside(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "class TocsinError(Exception): ...\n"
        "class Lost(Exception): ...\n"
        "class _Private(Exception): ...\n"
        "class Kept(OSError, TocsinError): ...\n"
        "class Child(Kept): ...\n"
    )
    assert errors_outside_the_tree([module]) == ["m.py:2 Lost"]
