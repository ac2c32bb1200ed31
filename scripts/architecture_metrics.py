"""Architecture figures of the library code (tests, benches and examples excluded).

    python scripts/architecture_metrics.py            # a report
    python scripts/architecture_metrics.py --json     # the same figures as JSON

It measures what the contracts issue names: private names imported across modules, file-level import
cycles, the most complex functions (McCabe's count), and the largest classes assembled with their in-project bases
(``largest classes``) and with their mixins only, the public contract class they implement
(``TorchTwinkleModel``, ``Strategy`` ...; the owners in ``twinkle_core.contracts``) counted on its own
(``largest classes with mixins``).
``tests/test_architecture.py`` holds the limits the project has reached.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (distribution folder, its top-level package)
PACKAGES = (
    ("", "twinkle_core"),
    ("twinkle-backend-hf", "twinkle_backend_hf"),
    ("twinkle-backend-megatron", "twinkle_backend_megatron"),
    ("twinkle-backend-npu", "twinkle_backend_npu"),
    ("plugins/twinkle-embedding", "twinkle_embedding"),
    ("plugins/twinkle-rl", "twinkle_rl"),
    ("plugins/twinkle-vlm", "twinkle_vlm"),
)


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    is_package: bool

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass
class Library:
    modules: dict[str, Module] = field(default_factory=dict)


def load_library(root: str = ROOT) -> Library:
    library = Library()
    for folder, package in PACKAGES:
        base = os.path.join(root, folder, package)
        if not os.path.isdir(base):
            continue
        for directory, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d not in {"__pycache__", "tests"})
            for file in sorted(files):
                if not file.endswith(".py"):
                    continue
                path = os.path.join(directory, file)
                relative = os.path.relpath(path, os.path.join(root, folder))
                parts = relative[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts = parts[:-1]
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read(), filename=path)
                name = ".".join(parts)
                library.modules[name] = Module(name, os.path.relpath(path, root), tree, is_package)
    return library


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.package.split(".")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (they create no run-time dependency)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for inner in ast.walk(child):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        lines.add(inner.lineno)
    return lines


def imports(library: Library, module: Module, *, top_level_only: bool) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for each in-library import of ``module``."""
    guarded = _type_checking_only(module.tree)
    nodes = module.tree.body if top_level_only else list(ast.walk(module.tree))
    for node in nodes:
        if getattr(node, "lineno", None) in guarded:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in library.modules:
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in library.modules:
                    yield submodule, None, node.lineno
                elif target in library.modules:
                    yield target, alias.name, node.lineno


def private_imports(library: Library) -> list[str]:
    """``module: from X import _name`` for every private name (or private module) imported from another module."""
    found = []
    for module in library.modules.values():
        for target, name, line in imports(library, module, top_level_only=False):
            if target == module.name:
                continue
            private_module = any(part.startswith("_") and not part.startswith("__")
                                 for part in target.split("."))
            private_name = name is not None and name.startswith("_") and not name.startswith("__")
            if private_module or private_name:
                shown = f"{target}:{name}" if name else target
                found.append(f"{module.path}:{line} imports {shown}")
    return sorted(found)


def import_cycles(library: Library) -> list[list[str]]:
    """Strongly connected groups (more than one module) of the import graph (deferred imports inside functions
    included: they only hide a cycle from the interpreter).

    A package's ``__init__`` re-exporting its submodules is not counted as an edge into them from the
    package (``from .x import y`` in ``__init__`` makes every submodule importing the package look cyclic)."""
    graph: dict[str, set[str]] = {name: set() for name in library.modules}
    for module in library.modules.values():
        for target, _, _ in imports(library, module, top_level_only=False):
            if target == module.name:
                continue
            if module.is_package and target.startswith(module.name + "."):
                continue
            graph[module.name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(groups)


def _complexity(node: ast.AST) -> int:
    """McCabe's count as mccabe / ruff's C901 compute it: 1 + decision points (nested functions excluded)."""
    count = 1
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(child, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp)):
            count += 1
        elif isinstance(child, ast.Try):
            count += len(child.handlers) + bool(child.orelse)
        elif isinstance(child, (ast.With, ast.AsyncWith)):
            pass
        elif isinstance(child, ast.BoolOp):
            count += len(child.values) - 1
        elif isinstance(child, ast.comprehension):
            count += 1 + len(child.ifs)
        elif isinstance(child, ast.match_case):
            count += 1
        stack.extend(ast.iter_child_nodes(child))
    return count


def complexities(library: Library) -> list[tuple[int, str]]:
    result = []
    for module in library.modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                result.append((_complexity(node), f"{module.path}:{node.lineno} {node.name}"))
    return sorted(result, key=lambda item: (-item[0], item[1]))


def _class_lines(node: ast.ClassDef) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1


def contract_classes() -> set[str]:
    """Names of the public contract classes a plugin or backend implements (the owners in
    ``twinkle_core.contracts.SEAMS``: ``TwinkleModel``, ``TorchTwinkleModel``, ``Strategy``, ``Task`` ...)."""
    sys.path.insert(0, ROOT)
    try:
        from twinkle_core.contracts import SEAMS
    finally:
        sys.path.remove(ROOT)
    return {seam.owner for seam in SEAMS}


def assembled_classes(library: Library, stop_at: set[str] | None = None) -> list[tuple[int, str]]:
    """Each class's lines plus those of every in-library base it inherits (mixins included), once each.

    With ``stop_at`` (class names), a base of that name is not counted into a subclass: the public contract a
    class implements is not one of its mixins, and is reported on its own."""
    classes: dict[str, tuple[Module, ast.ClassDef]] = {}
    for module in library.modules.values():
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef):
                classes[f"{module.name}.{node.name}"] = (module, node)

    def resolve(module: Module, base: ast.expr) -> str | None:
        name = ast.unparse(base)
        if f"{module.name}.{name}" in classes:
            return f"{module.name}.{name}"
        for stmt in ast.walk(module.tree):
            if isinstance(stmt, ast.ImportFrom):
                target = _absolute(module, stmt)
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name.split(".")[0] and f"{target}.{alias.name}" in classes:
                        return f"{target}.{alias.name}"
        return None

    def lineage(key: str, seen: set[str]) -> None:
        if key in seen:
            return
        seen.add(key)
        module, node = classes[key]
        for base in node.bases:
            resolved = resolve(module, base)
            if resolved is not None and not (seen and stop_at and resolved.rsplit(".", 1)[1] in stop_at):
                lineage(resolved, seen)

    result = []
    for key, (module, node) in classes.items():
        seen: set[str] = set()
        lineage(key, seen)
        total = sum(_class_lines(classes[k][1]) for k in seen)
        result.append((total, f"{module.path}:{node.lineno} {node.name} ({len(seen)} classes)"))
    return sorted(result, key=lambda item: (-item[0], item[1]))


def report(root: str = ROOT) -> dict[str, object]:
    library = load_library(root)
    return {
        "modules": len(library.modules),
        "private_imports": private_imports(library),
        "import_cycles": import_cycles(library),
        "most_complex": [f"{score} {where}" for score, where in complexities(library)[:10]],
        "largest_classes": [f"{lines} {where}" for lines, where in assembled_classes(library)[:10]],
        "largest_classes_with_mixins": [f"{lines} {where}" for lines, where
                                        in assembled_classes(library, contract_classes())[:10]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = report()
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"library modules: {figures['modules']}")
    for key in ("private_imports", "import_cycles", "most_complex", "largest_classes",
                "largest_classes_with_mixins"):
        items = figures[key]
        print(f"\n{key.replace('_', ' ')}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
